"""What the CLI says about plugins a user may not have: ``ninfer archs`` lists the repository's example and test
plugins' architectures only with ``--all``, and a command that one of the project's own plugins adds answers
with the package to install (or the plugin's load error) when that plugin is absent, not argparse's
"invalid choice"."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from ninfer.cli import main
from ninfer.plugins import PluginHost, make_plugin_host

pytest.importorskip("ninfer_example_arch")
pytest.importorskip("ninfer_qwen35")


def host_with(*plugins: tuple[str, str, str]) -> PluginHost:
    """A host that loaded the installed plugins named (entry-point name, module, distribution)."""
    host = make_plugin_host(autoload=False)
    for name, module, distribution in plugins:
        host.register_module(importlib.import_module(module), name, distribution)
    return host


QWEN35 = ("qwen35", "ninfer_qwen35.plugin", "ninfer-qwen35")
EXAMPLE = ("example_arch", "ninfer_example_arch.plugin", "ninfer-example-arch")


def test_archs_hides_example_plugins_unless_asked(capsys):
    host = host_with(QWEN35, EXAMPLE)
    assert main(["archs"], host=host) == 0
    out = capsys.readouterr().out
    assert "qwen35 " in out and "example_arch " not in out.split("(")[0]
    assert out.splitlines()[-1] == "(1 example and test architecture(s) not shown: example_arch; --all lists them)"
    assert main(["archs", "--all"], host=host) == 0
    out = capsys.readouterr().out
    assert "example_arch from plugin example_arch handles ExampleForCausalLM  (example)" in out
    assert "not shown" not in out

    assert main(["archs", "--json"], host=host) == 0
    assert [a["name"] for a in json.loads(capsys.readouterr().out)] == ["qwen35", "qwen35_moe"]
    assert main(["archs", "--json", "--all"], host=host) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {a["name"]: a["example"] for a in rows} == {"example_arch": True, "qwen35": False, "qwen35_moe": False}


@pytest.mark.parametrize("argv,words", [
    (["serve", "--port", "0"], "'serve' comes with ninfer-serve, which is not installed: pip install ninfer-serve"),
    (["convert", "a", "b"], "'convert' comes with ninfer-convert, which is not installed: pip install ninfer-convert"),
    (["pull", "Qwen/Qwen3.5-0.8B"], "'pull' comes with ninfer-convert"),
    (["list"], "'list' comes with ninfer-convert"),
    (["tiny-checkpoint", "out"], "'tiny-checkpoint' comes with ninfer-qwen35, which is not installed: "
                                 "pip install 'ninfer-qwen35[test]'"),
])
def test_a_core_only_install_names_the_package_a_command_needs(capsys, argv, words):
    assert main(argv, host=make_plugin_host(autoload=False)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ninfer: {words}") and err.count("\n") == 1, err


def test_a_plugin_that_failed_to_load_is_named_with_its_error(capsys):
    host = make_plugin_host(autoload=False)
    broken = importlib.metadata.EntryPoint(name="serve", value="ninfer_no_such_module.plugin", group="ninfer")
    host.load_entry_points([broken], allow=None, strict=False)
    assert main(["serve"], host=host) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer: 'serve' comes with the serve plugin, which failed to load: ModuleNotFoundError")


def test_unknown_commands_stay_argparse_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"], host=make_plugin_host(autoload=False))
    assert info.value.code == 2 and "invalid choice" in capsys.readouterr().err
