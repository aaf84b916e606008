"""The conformance kit: the source mapping a sample config.json makes has every member the converter and the
loader call (what lacks one is named), and the startup slot names a class of the three-step Startup shape."""

from __future__ import annotations

import sys
import types

import pytest

from ninfer import ArchitectureSpec, hookimpl
from ninfer.plugins import CONTRACT_SLOTS, make_plugin_host
from ninfer.testing import ConformanceError, check_architecture


class _Mapping:
    validated_features = ("text",)

    def __init__(self, config: dict) -> None:
        self.config = config

    def canonical_name(self, source_name): ...

    def stacked_sources(self, source_names):
        return ()

    def configured_features(self):
        return ("text",)

    def expected_parameters(self, features):
        return {}

    def fused_parents(self):
        return ()

    def shared_uses(self, bound, features):
        return ()

    def embedding_vocab(self):
        return 8


# a mapping written against an older contract: every member but embedding_vocab
_NoVocab = type("_NoVocab", (), {k: v for k, v in vars(_Mapping).items() if k != "embedding_vocab"})


MAPPINGS = {"complete": _Mapping, "no_vocab": _NoVocab}


@pytest.fixture
def host_with(monkeypatch):
    """A plugin host holding one architecture ``arch_<kind>`` whose source_mapping slot makes MAPPINGS[kind]."""
    def make(kind: str):
        mod = types.ModuleType(f"fake_conformance_{kind}")
        mod.source_mapping = MAPPINGS[kind]

        @hookimpl
        def ninfer_register_architectures(register):
            register(ArchitectureSpec(name=f"arch_{kind}", handles=(f"Fake{kind}",),
                                      source_mapping=f"{mod.__name__}:source_mapping"))

        mod.ninfer_register_architectures = ninfer_register_architectures
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        host = make_plugin_host(autoload=False)
        host.register_module(mod, mod.__name__)
        return host
    return make


def test_the_slots_are_what_the_runtime_loads():
    assert CONTRACT_SLOTS == ("startup", "source_mapping")


def test_a_complete_source_mapping_conforms(host_with):
    check_architecture("arch_complete", sample_config={}, host=host_with("complete"))


def test_a_source_mapping_that_lacks_a_member_is_named(host_with):
    with pytest.raises(ConformanceError, match=r"arch_no_vocab\.source_mapping returned _NoVocab, which lacks "
                                               r"\['embedding_vocab'\]"):
        check_architecture("arch_no_vocab", sample_config={}, host=host_with("no_vocab"))


def test_a_sample_config_needs_a_source_mapping(host_with_startup):
    with pytest.raises(ConformanceError, match="provides no source_mapping"):
        check_architecture("startup_complete", sample_config={}, host=host_with_startup("complete"))


# -- the startup slot: a class of the three-step Startup shape, made with no arguments ----------------------------
class _Complete:
    def profile(self, artifact, options): ...

    def load(self, artifact, options, placement): ...

    def instance(self, loaded, options, capacity): ...


class _NoInstance:
    def profile(self, artifact, options): ...

    def load(self, artifact, options, placement): ...


class _NeedsArguments(_Complete):
    def __init__(self, device): ...


def _build(artifact, options): ...  # the old one-step contract


STARTUPS = {"complete": _Complete, "no_instance": _NoInstance, "needs_arguments": _NeedsArguments,
            "function": _build}


@pytest.fixture
def host_with_startup(monkeypatch):
    """A plugin host holding one architecture ``startup_<kind>`` whose startup slot names STARTUPS[kind]."""
    def make(kind: str):
        mod = types.ModuleType(f"fake_conformance_startup_{kind}")
        mod.Startup = STARTUPS[kind]

        @hookimpl
        def ninfer_register_architectures(register):
            register(ArchitectureSpec(name=f"startup_{kind}", handles=(f"FakeStartup{kind}",),
                                      startup=f"{mod.__name__}:Startup"))

        mod.ninfer_register_architectures = ninfer_register_architectures
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        host = make_plugin_host(autoload=False)
        host.register_module(mod, mod.__name__)
        return host
    return make


def test_a_startup_class_with_the_three_steps_conforms(host_with_startup):
    check_architecture("startup_complete", host=host_with_startup("complete"))


@pytest.mark.parametrize(("kind", "message"), [
    ("no_instance", r"startup_no_instance\.startup _NoInstance lacks \['instance'\] of Startup"),
    ("needs_arguments", "cannot be made with no arguments: missing a required argument: 'device'"),
    ("function", r"is a function, not a class: the slot names a class of the ninfer\.contract\.Startup shape "
                 r"\(instance, load, profile\)"),
])
def test_a_startup_that_is_not_a_three_step_class_is_named(host_with_startup, kind, message):
    with pytest.raises(ConformanceError, match=message):
        check_architecture(f"startup_{kind}", host=host_with_startup(kind))
