"""``ninfer plan``: the startup plan of the embedded model from its header alone. A CUDA plan needs no GPU here
(``--vram-budget`` is the GPU planned for), a budget too small is refused with its numbers (exit 1, not a
traceback), ``--json`` is machine-readable, and no weight byte is read."""

import json

import pytest
import torch

from ninfer.artifact.reader import Artifact
from ninfer.cli import main
from ninfer.engine.memory_report import GIB, MIB


@pytest.fixture(autouse=True)
def no_gpu_here(monkeypatch):
    """The plan a machine without a GPU makes (also on the GPU machine), with no budget from the environment."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("NINFER_VRAM_BUDGET_MIB", raising=False)


def plan(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_cuda_plan_from_the_budget_alone_fits(capsys):
    rc, out, err = plan(capsys, "--vram-budget", "2048")
    assert rc == 0, err
    assert out.rstrip().endswith("fits")
    for words in ("on cuda", "bound: budget 2.00 GiB", "weights", "StateImages", "workspace",
                  "CUDA graphs (estimate)", "headroom                   1.00 GiB", "KV pages", "total",
                  "KV: 2,048 pages x 16 = 32,768 tokens", "context: 2,048 of the model's 2,048"):
        assert words in out, words


def test_a_budget_too_small_is_refused_with_its_numbers(capsys):
    rc, out, err = plan(capsys, "--vram-budget", "1024")
    assert rc == 1, err
    assert "does not fit" in out and "short by" in out and "the budget allows 1.00 GiB" in out
    assert "Traceback" not in out + err


def test_json_is_machine_readable(capsys):
    rc, out, _ = plan(capsys, "--vram-budget", "2048", "--json")
    assert rc == 0
    r = json.loads(out)
    assert r["fits"] is True and r["error"] is None and r["device"] == "cuda"
    assert r["budget_bytes"] == r["available_bytes"] == 2048 * MIB
    assert r["categories"]["headroom"] == GIB and r["categories"]["CUDA graphs (estimate)"] > 0
    assert r["needed_bytes"] == sum(r["categories"].values())
    assert r["unused_bytes"] == 2048 * MIB - r["needed_bytes"]
    assert r["kv_tokens"] == r["kv_pages"] * r["page_size"]
    assert r["categories"]["KV pages"] == r["kv_pages"] * r["page_size"] * r["kv_bytes_per_token"]
    rc, out, _ = plan(capsys, "--vram-budget", "1024", "--json")
    assert rc == 1
    r = json.loads(out)
    assert r["fits"] is False and "short by" in r["error"]


def test_speculative_plans_charge_verify_records(capsys):
    _, out, _ = plan(capsys, "--vram-budget", "2048", "--json")
    plain = json.loads(out)
    rc, out, _ = plan(capsys, "--vram-budget", "2048", "--json", "--speculative", "mtp", "--num-draft-tokens", "3")
    assert rc == 0
    mtp = json.loads(out)
    assert mtp["features"] == ["text", "mtp"] and plain["features"] == ["text"]
    assert plain["categories"]["verify records"] == 0 < mtp["categories"]["verify records"]
    assert mtp["categories"]["CUDA graphs (estimate)"] > plain["categories"]["CUDA graphs (estimate)"]


def test_options_reach_the_plan(capsys):
    rc, out, _ = plan(capsys, "--vram-budget", "2048", "--json", "--max-concurrency", "2", "--context", "1024",
                      "--page-size", "32", "--no-context-cache", "--dtype", "float32")
    assert rc == 0
    r = json.loads(out)
    assert r["max_concurrency"] == 2 and r["page_size"] == 32 and r["dtype"] == "float32"
    assert r["context"] == 1024 and r["categories"]["checkpoint slots"] == 0
    assert r["kv_pages"] == 2 * 1024 // 32  # what two sequences of the full context can use, no cache pool
    assert r["host"]["cache_budget_bytes"] == 0


def test_a_context_the_kv_pool_cannot_hold_does_not_fit(capsys):
    rc, out, _ = plan(capsys, "--vram-budget", "2048", "--num-pages", "64", "--context", "2048")
    assert rc == 1
    assert "context 2,048 needs more KV than the pool holds (1,024 tokens); short by 1,024 tokens (64 pages" in out
    assert out.rstrip().endswith("does not fit: " + out.split("does not fit: ", 1)[1].rstrip())


def test_the_cpu_plans_without_a_budget_and_without_graphs_or_headroom(capsys):
    rc, out, _ = plan(capsys, "--device", "cpu", "--json")
    assert rc == 0
    r = json.loads(out)
    assert r["budget_bytes"] is None and r["unused_bytes"] is None
    assert r["categories"]["CUDA graphs (estimate)"] == r["categories"]["headroom"] == 0


def test_the_environment_budget_is_a_budget(capsys, monkeypatch):
    monkeypatch.setenv("NINFER_VRAM_BUDGET_MIB", "3072")
    rc, out, _ = plan(capsys, "--json")
    assert rc == 0 and json.loads(out)["budget_bytes"] == 3072 * MIB


@pytest.mark.parametrize("args,words,code", [
    ([], "no CUDA device here to plan against: give --vram-budget MIB", 2),
    (["--vram-budget", "2048", "--context", "4096"], "--context 4096 exceeds the model's limit 2048", 2),
    (["--vram-budget", "2048", "--num-draft-tokens", "2"], "--num-draft-tokens needs --speculative", 2),
    (["missing.ninfer", "--vram-budget", "2048"], "model file not found: missing.ninfer", 2),
    (["--vram-budget", "2048", "--placement", "host-experts"],
     "placement 'host-experts' is not one of this model's: all-device", 2),
])
def test_bad_input_is_one_clear_line(capsys, args, words, code):
    rc, out, err = plan(capsys, *args)
    assert rc == code
    assert out == "" and err.startswith("ninfer plan: ") and words in err


@pytest.mark.parametrize("value,words", [("0", "must be >= 1, got 0"), ("2G", "expected a whole number of MiB")])
def test_a_bad_budget_is_refused_by_the_parser(capsys, value, words):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--vram-budget", value])
    assert exc.value.code == 2
    assert f"argument --vram-budget: {words}" in capsys.readouterr().err


def test_the_plan_reads_no_weight_byte(capsys, monkeypatch):
    read = []

    def refuse(original):
        def guarded(self, obj, *args):
            obj = self.objects[obj] if isinstance(obj, str) else obj
            if obj.feature != "frontend":
                read.append(obj.id)
                raise AssertionError(f"the plan read object {obj.id!r}")
            return original(self, obj, *args)
        return guarded

    monkeypatch.setattr(Artifact, "read_into", refuse(Artifact.read_into))
    monkeypatch.setattr(Artifact, "object_buffer", refuse(Artifact.object_buffer))
    for extra in ([], ["--speculative", "mtp"]):
        rc, out, err = plan(capsys, "--vram-budget", "2048", *extra)
        assert rc == 0, err
    assert read == []


@pytest.mark.parametrize("args,bound,words", [
    (["--vram-budget", "2048"], "sequences", "all that 4 sequence(s) of 2,048 tokens can use, x 4 for the context"),
    (["--vram-budget", "2048", "--no-context-cache", "--max-concurrency", "2"], "sequences",
     "all that 2 sequence(s) of 2,048 tokens can use; more needs"),
    (["--vram-budget", "1100"], "room", "what the budget leaves after the other categories"),
    (["--device", "cpu", "--num-pages", "50"], "num_pages", "as --num-pages asks"),
    (["--device", "cpu"], "cpu_default", "the CPU's default KV budget (1.0 MiB)"),
])
def test_the_plan_says_what_stops_the_kv_pool(capsys, monkeypatch, args, bound, words):
    from ninfer.core import device_plan

    monkeypatch.setattr(device_plan, "CPU_KV_BUDGET", MIB)  # the embedded model's sequences fit in the real one
    rc, out, err = plan(capsys, *args)
    assert rc == 0, err
    kv_line = out.splitlines().index(next(line for line in out.splitlines() if line.startswith("  KV: ")))
    assert words in out.splitlines()[kv_line + 1]  # the line under the KV pages says why they stop there
    assert json.loads(plan(capsys, *args, "--json")[1])["kv_bound"] == bound
