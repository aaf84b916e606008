"""Models named by Hugging Face id, offline: a tiny checkpoint laid out as a Hugging Face cache (blobs, snapshot
links, refs/main) under ``HF_HUB_CACHE`` with ``HF_HUB_OFFLINE=1``. ``generate`` / ``inspect`` / ``serve`` take the
id, the first start converts it into ``NINFER_CACHE_DIR`` and later ones convert nothing; a changed snapshot
converts again; concurrent pulls convert once; an uncached id and a core-only install each answer in one line.

huggingface_hub reads its environment when imported, so every command runs in a subprocess, as a user runs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ninfer_qwen35")
pytest.importorskip("ninfer_convert")
pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")

from ninfer import env  # noqa: E402

REPO = "tiny-org/tiny-qwen"
DEVICE = env.get("NINFER_SERVE_TEST_DEVICE")
CONVERTING = f"ninfer: converting {REPO} (commit "  # the line a conversion starts with


def publish(hub: Path, repo: str, commit: str, files: dict[str, bytes]) -> Path:
    """Lay ``files`` out as huggingface_hub does: content-named blobs, a snapshot of links to them, refs/main."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(blob, snapshot))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return snapshot


def commit_id(n: int) -> str:
    return hashlib.sha1(f"commit {n}".encode()).hexdigest()


@pytest.fixture(scope="module")
def checkpoint_files(tmp_path_factory) -> dict[str, bytes]:
    from ninfer_qwen35.testing.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("hf_src") / "ckpt", mtp=False, seed=11)
    return {p.name: p.read_bytes() for p in sorted(ckpt.iterdir())}


@pytest.fixture
def place(tmp_path, checkpoint_files):
    """A fresh Hugging Face cache holding REPO at commit 1, an empty ninfer cache, and the environment for both."""
    hub, cache = tmp_path / "hf", tmp_path / "ninfer-cache"
    publish(hub, REPO, commit_id(1), checkpoint_files)
    environ = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "NINFER_CACHE_DIR": str(cache),
               "HF_HUB_DISABLE_TELEMETRY": "1"}
    return hub, cache, environ


def ninfer(environ: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer", *argv], capture_output=True, text=True, env=environ,
                          timeout=300)


def listed(environ: dict[str, str]) -> list[dict]:
    proc = ninfer(environ, "list", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_generate_by_id_converts_once_and_names_the_model_by_it(place):
    hub, cache, environ = place
    first = ninfer(environ, "generate", REPO, "--prompt", "Hello", "--max-tokens", "3", "--ignore-eos",
                   "--temperature", "0", "--device", "cpu")
    assert first.returncode == 0, first.stderr
    assert f"{CONVERTING}{commit_id(1)[:12]})" in first.stderr
    assert "converting tiny-org/tiny-qwen: 100%" in first.stderr and "ninfer: converted " in first.stderr
    [entry] = listed(environ)
    assert entry["id"] == REPO and entry["commit"] == commit_id(1) and entry["revision"] == "main"
    assert Path(entry["path"]) == cache / "models" / "tiny-org--tiny-qwen" / commit_id(1) / "model.ninfer"
    assert entry["bytes"] == Path(entry["path"]).stat().st_size
    mtime = Path(entry["path"]).stat().st_mtime_ns

    again = ninfer(environ, "generate", REPO, "--prompt", "Hello", "--max-tokens", "3", "--ignore-eos",
                   "--temperature", "0", "--device", "cpu")
    assert again.returncode == 0, again.stderr
    assert CONVERTING not in again.stderr and again.stdout == first.stdout
    assert Path(entry["path"]).stat().st_mtime_ns == mtime

    shown = ninfer(environ, "inspect", REPO, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["metadata"]["name"] == REPO  # the id is the model's name
    table = ninfer(environ, "list")
    assert table.stdout.splitlines()[0].split() == ["ID", "REVISION", "COMMIT", "SIZE", "PATH"]
    assert table.stdout.splitlines()[1].split()[:3] == [REPO, "main", commit_id(1)[:12]]


def converted_commits(cache: Path) -> list[str]:
    from ninfer_convert.hub_cache import cached_models

    return [e.commit for e in cached_models(cache)]


def test_a_new_commit_converts_beside_the_old_one(place, checkpoint_files):
    hub, cache, environ = place
    pulled = ninfer(environ, "pull", REPO)
    assert pulled.returncode == 0 and CONVERTING in pulled.stderr, pulled.stderr
    publish(hub, REPO, commit_id(2), dict(checkpoint_files, **{"generation_config.json": b'{"temperature": 0.5}'}))
    pulled = ninfer(environ, "pull", REPO)
    assert pulled.returncode == 0, pulled.stderr
    assert f"{CONVERTING}{commit_id(2)[:12]})" in pulled.stderr
    assert pulled.stdout.strip().endswith(f"{commit_id(2)}/model.ninfer")
    assert converted_commits(cache) == [commit_id(1), commit_id(2)]
    old = ninfer(environ, "pull", f"{REPO}@{commit_id(1)}")  # a revision by commit: the first, converted already
    assert old.returncode == 0 and CONVERTING not in old.stderr and commit_id(1) in old.stdout, old.stderr


def test_a_changed_file_converts_again_and_the_hugging_face_copy_may_go(place, checkpoint_files):
    hub, cache, environ = place
    assert ninfer(environ, "pull", REPO).stderr.count(CONVERTING) == 1
    # The same commit with a file's content changed (a re-download, a repaired blob): converted again in place.
    publish(hub, REPO, commit_id(1), dict(checkpoint_files, **{"generation_config.json": b'{"temperature": 0.7}'}))
    assert ninfer(environ, "pull", REPO).stderr.count(CONVERTING) == 1
    assert converted_commits(cache) == [commit_id(1)]

    # Once converted, the Hugging Face copy may go: offline, the artifact of the revision asked for is used.
    shutil.rmtree(hub)
    shown = ninfer(environ, "inspect", REPO, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["file"] == str(cache / "models" / "tiny-org--tiny-qwen" / commit_id(1) /
                                                   "model.ninfer")


def test_concurrent_pulls_convert_once(place):
    from filelock import FileLock

    hub, cache, environ = place
    directory = cache / "models" / "tiny-org--tiny-qwen" / commit_id(1)
    directory.mkdir(parents=True)
    (directory / "model.ninfer").write_bytes(b"half")  # what a killed conversion could not leave: no record
    logs = [directory.parent / f"pull{i}.log" for i in range(2)]
    with FileLock(str(directory / ".lock")):  # as if a third start were converting now
        procs = [subprocess.Popen([sys.executable, "-m", "ninfer", "pull", REPO], env=environ,
                                  stdout=subprocess.DEVNULL, stderr=log.open("w")) for log in logs]
        end = time.monotonic() + 240  # a hang guard: both must be waiting for the lock before it is released
        while not all("waiting for it" in log.read_text() for log in logs):
            assert time.monotonic() < end and all(p.poll() is None for p in procs), [log.read_text() for log in logs]
            time.sleep(0.2)
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert sum(log.read_text().count(CONVERTING) for log in logs) == 1
    assert converted_commits(cache) == [commit_id(1)]
    assert (directory / "model.ninfer").stat().st_size > 4 and ninfer(environ, "inspect", REPO, "--verify").returncode == 0


def test_serve_names_the_model_by_its_id(place):
    from ninfer_serve.testing import ServerProcess

    hub, cache, environ = place
    with ServerProcess(REPO, "--device", DEVICE, "--no-warmup", "--dtype", "float32", env=environ) as srv:
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]] == [REPO]
        r = httpx.post(srv.url + "/v1/completions", json={"model": REPO, "prompt": "Hi", "max_tokens": 2},
                       timeout=120)
        assert r.status_code == 200 and r.json()["model"] == REPO
        assert f"serving {REPO} on" in srv.log()


def test_an_uncached_id_offline_is_one_line(place):
    hub, cache, environ = place
    proc = ninfer(environ, "generate", "tiny-org/absent", "--prompt", "Hi")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"ninfer generate: tiny-org/absent is not in the Hugging Face cache ({hub}) and HF_HUB_OFFLINE is set: "
        f"fetch it once with the network (ninfer pull tiny-org/absent)"]
    pulled = ninfer(environ, "pull", "tiny-org/absent", "not an id")
    assert pulled.returncode == 2 and pulled.stderr.splitlines() == [
        "ninfer pull: not a Hugging Face model id (org/name or org/name@revision): 'not an id'"]
    assert not cache.exists()  # nothing converted, nothing half made


def test_a_core_only_install_says_what_to_install(place):
    hub, cache, environ = place
    proc = ninfer({**environ, "NINFER_PLUGINS": ""}, "inspect", REPO)  # no plugin loads: what core alone does
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"ninfer inspect: no file {REPO} here, and using Hugging Face model ids "
                                        f"needs ninfer-convert: pip install ninfer-convert (or pass the path of a "
                                        f".ninfer artifact)"]
    missing = ninfer(environ, "inspect", "out/absent.ninfer")  # a relative path is never taken for an id
    assert missing.stderr.splitlines() == ["ninfer inspect: model file not found: out/absent.ninfer"]
    assert not cache.exists()
