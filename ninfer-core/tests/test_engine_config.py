"""Typed configuration: EngineConfig / StartupOptions validate once with errors naming the field, one
default per rule, and a plugin's Startup always receives the typed options (no signature probing)."""

from __future__ import annotations

import re
import sys
import types

import attrs
import pytest

import ninfer
from ninfer import ArchitectureSpec, hookimpl
from ninfer.contract import (
    EngineConfig,
    Frontend,
    ModelInstance,
    ModelProfile,
    Program,
    ProgramCapacity,
    StartupFeatures,
    StartupOptions,
    WeightPlacement,
)
from ninfer.contract.config import MAX_CONCURRENCY, MODEL_KNOBS, default_prefill_chunk
from ninfer.engine.startup import build_instance
from ninfer.plugins import make_plugin_host

BAD = [
    ("max_concurrency", 0), ("max_concurrency", MAX_CONCURRENCY + 1), ("max_concurrency", 64),
    ("max_concurrency", True), ("max_concurrency", "4"), ("max_queue", -1), ("max_model_len", 1),
    ("prefill_chunk", 0), ("bypass_limit", -1), ("pause_mode", "sometimes"), ("device", "gpu"),
    ("device", "cuda:x"), ("verify", "yes"), ("features", {"vision": True}), ("device_budget_bytes", 0),
    ("host_budget_bytes", -1), ("dtype", "fp8"), ("page_size", 0), ("num_pages", 0), ("cuda_graphs", None),
    ("pdl", "auto"), ("chat_template", 5), ("special_tokens_in_content", 1),
]


@pytest.mark.parametrize("field,value", BAD)
def test_a_bad_value_is_a_clear_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be .*, got {re.escape(repr(value))}$"):
        EngineConfig(**{field: value})
    if field in attrs.fields_dict(StartupOptions):
        with pytest.raises(ValueError, match=rf"^{field} must be"):
            StartupOptions(**{"device": "cpu", field: value})


def test_max_concurrency_is_one_to_eight_everywhere():
    for n in range(1, MAX_CONCURRENCY + 1):
        assert EngineConfig(max_concurrency=n).max_concurrency == StartupOptions(device="cpu", max_concurrency=n)\
            .max_concurrency == n
    with pytest.raises(ValueError, match="max_concurrency must be in 1..8, got 9"):
        StartupOptions(device="cpu", max_concurrency=9)


def test_startup_options_are_the_engine_config_fields_with_the_same_defaults():
    engine = attrs.fields_dict(EngineConfig)
    for f in attrs.fields(StartupOptions):
        if f.name != "device":
            assert engine[f.name].default == f.default, f.name
    assert set(MODEL_KNOBS) < set(engine) and "device" not in MODEL_KNOBS
    config = EngineConfig(max_concurrency=3, max_model_len=99, dtype="float32", page_size=8, num_pages=5,
                          cuda_graphs=False, pdl=True, chat_template="{{ x }}", special_tokens_in_content=True,
                          host_budget_bytes=7, device_budget_bytes=11, features=StartupFeatures(vision=True))
    options = config.for_device("cpu").startup_options()
    assert attrs.asdict(options, recurse=False) == {f.name: getattr(config, f.name) if f.name != "device" else "cpu"
                                                   for f in attrs.fields(StartupOptions)}
    with pytest.raises(ValueError, match="need a device"):
        config.startup_options()


def test_one_prefill_chunk_rule_and_max_model_len_rule():
    for device in ("cpu", "cuda", "cuda:1"):
        assert EngineConfig().for_device(device).prefill_chunk == default_prefill_chunk(device)
    assert EngineConfig(prefill_chunk=7).for_device("cuda").prefill_chunk == 7
    assert EngineConfig().for_model(300).max_model_len == 300
    assert EngineConfig(max_model_len=64).for_model(300).max_model_len == 64
    with pytest.raises(ValueError, match="max_model_len 400 exceeds the model's limit 300"):
        EngineConfig(max_model_len=400).for_model(300)
    assert EngineConfig(max_concurrency=3).bypass_limit == 3 and EngineConfig(bypass_limit=0).bypass_limit == 0


def test_engine_takes_one_config():
    model = ninfer.default_model_path()
    with pytest.raises(TypeError, match="max_queue"):
        ninfer.Engine(model, EngineConfig(device="cpu"), max_queue=3)
    with pytest.raises(ValueError, match="max_concurrency must be in 1..8, got 9"):
        ninfer.Engine(model, EngineConfig(max_concurrency=9, device="cpu"))
    with pytest.raises(TypeError, match="EngineConfig"):
        ninfer.Engine(model, {"device": "cpu"})
    with ninfer.Engine(model, EngineConfig(device="cpu", max_concurrency=2, max_model_len=64)) as engine:
        assert (engine.config.max_concurrency, engine.max_model_len, engine.config.prefill_chunk) == (2, 64, 512)
        assert engine.instance.program.max_concurrency == 2 and engine.instance.program.max_model_len == 64


def test_options_are_declared_once():
    """Each option is one EngineConfig field: the Engine takes the config, not the options again, and the
    model-side fields are StartupOptions' own (one declaration, inherited)."""
    import inspect

    from ninfer.contract.config import _ModelOptions

    assert set(inspect.signature(ninfer.Engine.__init__).parameters) == {"self", "model", "config", "purpose"}
    assert set(inspect.signature(ninfer.Engine.from_instance).parameters) == {"instance", "config", "name"}
    for cls in (StartupOptions, EngineConfig):
        assert set(attrs.fields_dict(_ModelOptions)) <= set(attrs.fields_dict(cls))
        assert not set(vars(cls).get("__annotations__", {})) & set(attrs.fields_dict(_ModelOptions)), cls


def test_contract_declares_what_the_engine_reads():
    assert {"max_concurrency", "max_model_len", "state_layout", "kv_pools"} <= set(Program.__annotations__)
    assert callable(Frontend.token_text)


# -- the Startup receives typed options -----------------------------------------------------------------
class _RecordingPlugin:
    """Claims the embedded model's architecture; its Startup records what each step received."""

    def __init__(self, module: str, arch: str, attr: str = "RecordingStartup") -> None:
        self.module, self.arch, self.attr = module, arch, attr

    @hookimpl
    def ninfer_register_architectures(self, register):
        register(ArchitectureSpec(name="recorded", handles=(self.arch,), startup=f"{self.module}:{self.attr}"))


class _RecordedProgram:
    """What the runtime's startup reads of a Program (a direct fake: the recorder runs no sequence)."""

    graph_error = None

    def __init__(self, capacity: ProgramCapacity) -> None:
        self.capacity, self.max_model_len = capacity, capacity.max_model_len

    def backing_bytes(self) -> int:
        return 0


@pytest.fixture
def recording_host(monkeypatch):
    from ninfer.artifact import open_artifact

    with open_artifact(ninfer.default_model_path()) as art:
        arch = art.metadata.architecture
    seen: list = []

    class RecordingStartup:  # exactly the contract's parameters: nothing to probe
        def profile(self, artifact, options):
            seen.append(("profile", artifact, options))
            return ModelProfile(architecture="recorded", dtype="float32", features=("text",),
                                placements=(WeightPlacement(name="all-device", device_bytes=1024),),
                                state_slot_bytes=0, kv_page_bytes=256, page_size=options.page_size,
                                workspace_bytes=0, model_limit=4096, layers=1)

        def load(self, artifact, options, placement):
            seen.append(("load", artifact, options, placement))
            return artifact

        def instance(self, loaded, options, capacity):
            seen.append(("instance", loaded, options, capacity))
            return ModelInstance(architecture="recorded", config=None, model=None, parameters=None, frontend=None,
                                 program=_RecordedProgram(capacity))

    mod = types.ModuleType("_ninfer_recording_startup")
    mod.RecordingStartup = RecordingStartup
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.delenv("NINFER_EXTRA_PLUGINS", raising=False)  # only the recorder claims the architecture
    host = make_plugin_host(autoload=False)
    host.register_module(_RecordingPlugin(mod.__name__, arch), "recorder")
    return host, seen


def test_the_startup_always_receives_the_typed_options(recording_host):
    host, seen = recording_host
    for options in (StartupOptions(device="cpu"), StartupOptions(device="cpu", max_model_len=77, dtype="float16",
                                                                 pdl=False, num_pages=3)):
        seen.clear()
        instance, name, artifact = build_instance(ninfer.default_model_path(), options, host=host)
        assert [step[0] for step in seen] == ["profile", "load", "instance"]  # no graph calibration on the CPU
        assert all(step[2] is options for step in seen)
        assert seen[0][1] is artifact and seen[1][1] is artifact and seen[2][1] is artifact  # load's result
        assert seen[1][3].name == "all-device"
        capacity = seen[2][3]
        assert isinstance(capacity, ProgramCapacity) and not capacity.calibration
        if options.num_pages is not None:
            assert (capacity.kv_pages, capacity.max_model_len) == (3, 3 * options.page_size)
        assert instance.architecture == "recorded" and name == artifact.metadata.name
        assert instance.memory is not None and instance.memory.kv_pages == capacity.kv_pages
        artifact.close()
    with pytest.raises(TypeError, match="StartupOptions"):
        build_instance(ninfer.default_model_path(), {"device": "cpu"}, host=host)


def test_a_startup_slot_naming_a_function_is_refused_by_name(monkeypatch):
    from ninfer.artifact import open_artifact

    with open_artifact(ninfer.default_model_path()) as art:
        arch = art.metadata.architecture
    mod = types.ModuleType("_ninfer_one_step_startup")
    mod.build = lambda artifact, options: None  # the old one-step contract
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.delenv("NINFER_EXTRA_PLUGINS", raising=False)
    host = make_plugin_host(autoload=False)
    host.register_module(_RecordingPlugin(mod.__name__, arch, attr="build"), "one-step")
    with pytest.raises(TypeError, match="lacks profile, load, instance of ninfer.contract.Startup"):
        build_instance(ninfer.default_model_path(), StartupOptions(device="cpu"), host=host)
