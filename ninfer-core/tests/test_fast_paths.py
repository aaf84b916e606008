"""The optional fast paths of a CUDA start (ninfer.fast_paths): `ninfer env` lists them, and a start on CUDA
logs one line for each that is missing (the check forced here: this machine has no GPU)."""

from __future__ import annotations

import logging

import pytest

from ninfer import fast_paths
from ninfer.cli import main


@pytest.fixture
def fla_missing(monkeypatch):
    real = fast_paths._import_problem

    def problem(module: str, package: str) -> str | None:
        return "fla-core is not installed" if package == "fla-core" else real(module, package)

    monkeypatch.setattr(fast_paths, "_import_problem", problem)


def test_env_lists_every_fast_path_with_its_status(capsys, monkeypatch):
    monkeypatch.delenv("NINFER_OPS", raising=False)
    monkeypatch.delenv("NINFER_OPS_OFF", raising=False)
    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for path in fast_paths.FAST_PATHS:
        line = next(x for x in lines if x.startswith(path.name))
        assert fast_paths.status(path).text() in line
    assert {p.package for p in fast_paths.FAST_PATHS} == {"triton", "fla-core"}


def test_a_missing_fast_path_is_one_warning_at_a_cuda_start(fla_missing, caplog, monkeypatch):
    monkeypatch.delenv("NINFER_OPS", raising=False)
    monkeypatch.delenv("NINFER_OPS_OFF", raising=False)
    with caplog.at_level(logging.WARNING, logger="ninfer.fast_paths"):
        assert fast_paths.log_unavailable("cpu") == []  # the CPU runs the torch paths anyway: nothing to say
        assert not caplog.records
        missing = fast_paths.log_unavailable("cuda:0")
    assert [s.path for s in missing] == [fast_paths.GDN_PREFILL] and not fast_paths.fla_available()
    gdn = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GDN prefill")]
    assert gdn == ["GDN prefill: fla-core is not installed; the torch path runs instead, much slower on long "
                   "prompts; pip install 'ninfer-core[cuda]'"]


def test_env_shows_the_forced_missing_path_with_the_install_hint(fla_missing, capsys, monkeypatch):
    monkeypatch.delenv("NINFER_OPS", raising=False)
    monkeypatch.delenv("NINFER_OPS_OFF", raising=False)
    assert main(["env"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("GDN prefill"))
    assert "fla-core is not installed" in line and "pip install 'ninfer-core[cuda]'" in line


@pytest.mark.parametrize(("variable", "value"), [("NINFER_OPS", "torch"), ("NINFER_OPS_OFF", "gdn.gdn_prefill")])
def test_a_path_turned_off_on_purpose_is_off_not_missing(fla_missing, caplog, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    assert fast_paths.status(fast_paths.GDN_PREFILL).state == "off"
    with caplog.at_level(logging.WARNING, logger="ninfer.fast_paths"):
        fast_paths.log_unavailable("cuda")
    assert not [r for r in caplog.records if r.getMessage().startswith("GDN prefill")]


def test_the_gdn_kernels_ask_the_one_check():
    pytest.importorskip("triton")
    from ninfer.ops.triton import gdn

    assert gdn.fla_available is fast_paths.fla_available


def test_an_engine_start_reports_the_fast_paths_of_its_device(monkeypatch):
    import ninfer
    from ninfer.contract.config import EngineConfig

    asked = []
    monkeypatch.setattr(fast_paths, "log_unavailable", asked.append)
    with ninfer.Engine(ninfer.default_model_path(), config=EngineConfig(device="cpu", max_concurrency=1)):
        pass
    assert asked == ["cpu"]
