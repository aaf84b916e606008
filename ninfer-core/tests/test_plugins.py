"""Plugin loader: ordering, failures by name, conflicts, allowlist, extra modules."""

import importlib.metadata as md
import sys
import types

import pytest

from ninfer import ArchitectureSpec, hookimpl
from ninfer.plugins import PluginConflict, PluginError, UnknownArchitecture, make_plugin_host


def _module(name: str, arch: str | None = None, handles=("X",)) -> types.ModuleType:
    mod = types.ModuleType(name)
    if arch is not None:
        @hookimpl
        def ninfer_register_architectures(register):
            register(ArchitectureSpec(name=arch, handles=handles))
        mod.ninfer_register_architectures = ninfer_register_architectures
    sys.modules[name] = mod
    return mod


@pytest.fixture
def fake_modules():
    names = []

    def make(name, arch=None, handles=("X",)):
        names.append(name)
        return _module(name, arch, handles)

    yield make
    for n in names:
        sys.modules.pop(n, None)


def _ep(name, value):
    return md.EntryPoint(name=name, value=value, group="ninfer")


def test_loads_in_sorted_order_and_reports_broken_plugin_by_name(fake_modules, monkeypatch):
    monkeypatch.delenv("NINFER_PLUGINS", raising=False)
    fake_modules("fake_b", "arch_b", ("B",))
    fake_modules("fake_a", "arch_a", ("A",))
    eps = [_ep("zeta", "fake_b"), _ep("broken", "ninfer_no_such_module_xyz"), _ep("alpha", "fake_a")]
    host = make_plugin_host(entry_points=eps, strict=False)
    assert [p.name for p in host.loaded] == ["alpha", "zeta"]
    assert [f.name for f in host.failures] == ["broken"]
    assert "ninfer_no_such_module_xyz" in host.failures[0].error
    assert list(host.architectures()) == ["arch_a", "arch_b"]
    assert host.architecture("B").spec.name == "arch_b"


def test_strict_mode_raises_naming_the_plugin(fake_modules):
    with pytest.raises(PluginError, match="'broken'"):
        make_plugin_host(entry_points=[_ep("broken", "ninfer_no_such_module_xyz")], strict=True)


def test_duplicate_architecture_names_both_plugins(fake_modules):
    fake_modules("fake_one", "same", ("One",))
    fake_modules("fake_two", "same", ("Two",))
    host = make_plugin_host(entry_points=[_ep("one", "fake_one"), _ep("two", "fake_two")], strict=True)
    with pytest.raises(PluginConflict) as info:
        host.architectures()
    assert "'one'" in str(info.value) and "'two'" in str(info.value)


def test_duplicate_hf_architecture_is_rejected(fake_modules):
    fake_modules("fake_one", "first", ("SharedForCausalLM",))
    fake_modules("fake_two", "second", ("SharedForCausalLM",))
    host = make_plugin_host(entry_points=[_ep("one", "fake_one"), _ep("two", "fake_two")], strict=True)
    with pytest.raises(PluginConflict, match="SharedForCausalLM.*'one'.*'two'"):
        host.architectures()


def test_allowlist_environment_variable(fake_modules, monkeypatch):
    fake_modules("fake_a", "arch_a", ("A",))
    fake_modules("fake_b", "arch_b", ("B",))
    eps = [_ep("a", "fake_a"), _ep("b", "fake_b")]
    monkeypatch.setenv("NINFER_PLUGINS", "b")
    assert [p.name for p in make_plugin_host(entry_points=eps).loaded] == ["b"]
    monkeypatch.setenv("NINFER_PLUGINS", "")
    assert make_plugin_host(entry_points=eps).loaded == []
    monkeypatch.setenv("NINFER_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("NINFER_PLUGINS")
    assert make_plugin_host(entry_points=eps).loaded == []


def test_extra_plugins_without_metadata(fake_modules, monkeypatch):
    fake_modules("fake_extra", "extra_arch", ("Extra",))
    monkeypatch.setenv("NINFER_EXTRA_PLUGINS", "fake_extra")
    host = make_plugin_host(entry_points=[])
    assert "extra_arch" in host.architectures()


def test_unknown_architecture_lists_known(fake_modules):
    fake_modules("fake_a", "arch_a", ("A",))
    host = make_plugin_host(entry_points=[_ep("a", "fake_a")])
    with pytest.raises(UnknownArchitecture, match="arch_a"):
        host.architecture("Nope")


def test_spec_rejects_malformed_targets():
    with pytest.raises(ValueError, match="startup"):
        ArchitectureSpec(name="x", handles=("X",), startup="no_colon_here")
    with pytest.raises(NotImplementedError, match="provides no startup"):
        ArchitectureSpec(name="x", handles=("X",)).load("startup")
    with pytest.raises(ValueError, match="unknown contract slot 'program'"):
        ArchitectureSpec(name="x", handles=("X",)).load("program")
