"""The conformance kit's state_layout check: a layout with no fields (an attention-only model) conforms; a
field that holds no bytes, or something that is not a StateImageLayout, is named as the failure."""

from __future__ import annotations

import sys
import types

import pytest

from ninfer import ArchitectureSpec, hookimpl
from ninfer.contract import StateField, StateImageLayout
from ninfer.plugins import make_plugin_host
from ninfer.testing import ConformanceError, check_architecture

LAYOUTS = {
    "attention_only": StateImageLayout(fields=()),
    "recurrent": StateImageLayout(fields=[StateField(name="s", dtype="float32", shape=(4, 8), layers=2)]),
    "zero_extent": StateImageLayout(fields=[StateField(name="conv", dtype="float32", shape=(4, 0), layers=2)]),
    "not_a_layout": {"fields": ()},
}


@pytest.fixture
def host_with(monkeypatch):
    """A plugin host holding one architecture ``arch_<kind>`` whose state_layout slot returns LAYOUTS[kind]."""
    def make(kind: str):
        mod = types.ModuleType(f"fake_conformance_{kind}")
        mod.parse_config = lambda raw: dict(raw)
        mod.state_layout = lambda config: LAYOUTS[kind]

        @hookimpl
        def ninfer_register_architectures(register):
            register(ArchitectureSpec(name=f"arch_{kind}", handles=(f"Fake{kind}",),
                                      config=f"{mod.__name__}:parse_config",
                                      state_layout=f"{mod.__name__}:state_layout"))

        mod.ninfer_register_architectures = ninfer_register_architectures
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        host = make_plugin_host(autoload=False)
        host.register_module(mod, mod.__name__)
        return host
    return make


@pytest.mark.parametrize("kind", ["attention_only", "recurrent"])
def test_a_layout_with_no_fields_or_with_real_fields_conforms(host_with, kind):
    check_architecture(f"arch_{kind}", sample_config={}, host=host_with(kind))


@pytest.mark.parametrize(("kind", "message"), [
    ("zero_extent", r"fields \['conv'\] hold no bytes"),
    ("not_a_layout", "not a StateImageLayout"),
])
def test_a_layout_that_holds_nothing_or_is_not_a_layout_is_named(host_with, kind, message):
    with pytest.raises(ConformanceError, match=message):
        check_architecture(f"arch_{kind}", sample_config={}, host=host_with(kind))


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
