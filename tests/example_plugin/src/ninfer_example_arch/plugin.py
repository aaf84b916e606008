"""An out-of-tree architecture plugin: registers one architecture (its name and the checkpoints it handles)."""

from ninfer import ArchitectureSpec, hookimpl


@hookimpl
def ninfer_register_architectures(register):
    register(ArchitectureSpec(
        name="example_arch",
        handles=("ExampleForCausalLM",),
        description="test-only third-party architecture",
    ))
