"""An out-of-tree architecture plugin: registers one architecture with a real config parser."""

from ninfer import ArchitectureSpec, hookimpl


@hookimpl
def ninfer_register_architectures(register):
    register(ArchitectureSpec(
        name="example_arch",
        handles=("ExampleForCausalLM",),
        description="test-only third-party architecture",
        config="ninfer_example_arch.config:parse_config",
    ))
