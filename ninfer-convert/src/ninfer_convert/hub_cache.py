"""The ninfer model cache: each Hugging Face snapshot converted once into a .ninfer artifact.

Layout: ``<root>/models/<org>--<name>/<commit>/model.ninfer`` with ``source.json`` beside it (the id, the
revision asked for, the commit, what the source files were, the converter version, the artifact's size).
An artifact is current while source.json's files match the snapshot's: a cached snapshot file is a link to a
blob named by its content hash, so the link target (for a plain file: its size and modification time) tells a
changed file without reading it. The converter writes the artifact atomically and source.json follows it, so
a killed conversion leaves nothing that looks done; a file lock makes concurrent starts convert once (the
others wait, then find it done).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

import attrs

from ninfer import env
from ninfer.core.sizes import format_bytes
from ninfer_convert import __version__
from ninfer_convert.hub import ModelId, Snapshot, is_checkpoint_file

ARTIFACT = "model.ninfer"
RECORD = "source.json"


def cache_root() -> Path:
    """``NINFER_CACHE_DIR``, else ninfer under ``XDG_CACHE_HOME``, else ``~/.cache/ninfer``."""
    configured = env.get("NINFER_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ninfer"


def entry_dir(repo: str, commit: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "models" / repo.replace("/", "--") / commit


@attrs.frozen(kw_only=True)
class CachedModel:
    """One converted snapshot (what ``ninfer list`` shows)."""

    id: str
    revision: str
    commit: str
    bytes: int
    path: str
    converted_at: str

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def source_files(snapshot: Path) -> list[list[Any]]:
    """What each checkpoint file of a snapshot is: [name, blob or modification time, size], sorted by name."""
    out: list[list[Any]] = []
    for path in sorted(p for p in snapshot.rglob("*") if p.is_file()):
        name = path.relative_to(snapshot).as_posix()
        if not is_checkpoint_file(name):
            continue
        stat = path.stat()
        identity = Path(os.readlink(path)).name if path.is_symlink() else stat.st_mtime_ns
        out.append([name, identity, stat.st_size])
    return out


def _read_record(directory: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((directory / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _entry(directory: Path, record: dict[str, Any]) -> CachedModel | None:
    artifact = directory / ARTIFACT
    try:
        size = artifact.stat().st_size
        entry = CachedModel(id=record["id"], revision=record["revision"], commit=record["commit"], bytes=size,
                            path=str(artifact), converted_at=record["converted_at"])
    except (OSError, KeyError, TypeError):
        return None
    return entry if size == record.get("bytes") else None


def _current(directory: Path, files: list[list[Any]]) -> CachedModel | None:
    record = _read_record(directory)
    if record is None or record.get("files") != files:
        return None
    return _entry(directory, record)


def _write_record(directory: Path, record: dict[str, Any]) -> None:
    part = directory / f".{RECORD}.{os.getpid()}.part"
    part.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(part, directory / RECORD)


class _StepLines:
    """Conversion progress as a line at each quarter (a log or a pipe gets no carriage returns)."""

    def __init__(self, label: str, stream: TextIO) -> None:
        self.label, self.stream, self.shown = label, stream, 0

    def update(self, done: int, total: int) -> None:
        quarter = 4 * done // total if total else 4
        if quarter > self.shown:
            self.shown = quarter
            print(f"{self.label}: {25 * quarter}% of {format_bytes(total)}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


def _convert(snapshot: Snapshot, directory: Path, files: list[list[Any]], stream: TextIO) -> CachedModel:
    from ninfer_convert.convert import convert_checkpoint
    from ninfer_convert.progress import ProgressLine

    repo = snapshot.model.repo
    print(f"ninfer: converting {repo} (commit {snapshot.commit[:12]}) into {directory}", file=stream, flush=True)
    label = f"ninfer: converting {repo}"
    progress = ProgressLine(label, stream) if stream.isatty() else _StepLines(label, stream)
    try:
        summary = convert_checkpoint(snapshot.path, directory / ARTIFACT, name=repo, progress=progress.update)
    finally:
        progress.close()
    record = {"id": repo, "revision": snapshot.model.ref, "commit": snapshot.commit, "files": files,
              "bytes": (directory / ARTIFACT).stat().st_size, "converter_version": __version__,
              "converted_at": datetime.now().astimezone().isoformat(timespec="milliseconds")}
    _write_record(directory, record)
    print(f"ninfer: converted {repo} in {summary.seconds:.1f} s: {directory / ARTIFACT}", file=stream, flush=True)
    entry = _entry(directory, record)
    assert entry is not None  # just written
    return entry


def converted(snapshot: Snapshot, *, stream: TextIO | None = None) -> CachedModel:
    """The cache's artifact for ``snapshot``, converting it first unless a current one is there. Raises
    ValueError (a conversion error, a cache folder that cannot be written) with a one-line message."""
    from filelock import FileLock, Timeout

    stream = stream or sys.stderr
    directory = entry_dir(snapshot.model.repo, snapshot.commit)
    files = source_files(snapshot.path)
    if not files:
        raise ValueError(f"the Hugging Face snapshot of {snapshot.model} holds no checkpoint files: {snapshot.path}")
    entry = _current(directory, files)
    if entry is not None:
        return entry
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(directory / ".lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"ninfer: another process is converting {snapshot.model.repo} into {directory}; waiting for it",
                  file=stream, flush=True)
            lock.acquire()
        try:
            return _current(directory, files) or _convert(snapshot, directory, files, stream)
        finally:
            lock.release()
    except OSError as exc:
        raise ValueError(f"cannot convert {snapshot.model} into {directory}: {exc}") from None
    except ValueError as exc:  # the converter's ConversionError and ArtifactError name the problem
        raise ValueError(f"cannot convert {snapshot.model}: {exc}") from None


def cached_models(root: Path | None = None) -> list[CachedModel]:
    """Every converted snapshot under the cache, by id then conversion time."""
    found: list[CachedModel] = []
    for record_path in sorted((root or cache_root()).glob(f"models/*/*/{RECORD}")):
        record = _read_record(record_path.parent)
        entry = _entry(record_path.parent, record) if record is not None else None
        if entry is not None:
            found.append(entry)
    return sorted(found, key=lambda e: (e.id, e.converted_at))


def find_converted(model: ModelId, commit: str | None = None) -> CachedModel | None:
    """The newest converted artifact of ``model``: of ``commit`` when given, else of the revision it names."""
    for entry in reversed(cached_models()):
        if entry.id == model.repo and (entry.commit == commit if commit else model.ref in (entry.revision,
                                                                                          entry.commit)):
            return entry
    return None


def resolve(name: str, *, stream: TextIO | None = None) -> CachedModel:
    """The converted artifact of a Hugging Face id, converting its snapshot first when need be. Once converted,
    the Hugging Face copy may go: an artifact of the commit the Hub names now (or, offline, of the revision asked
    for) is used without it."""
    from ninfer_convert.hub import NotInCache, fetch_snapshot, hub_commit, snapshot_cached

    model = ModelId.parse(name)
    commit = hub_commit(model)
    if commit is not None and not snapshot_cached(model.repo, commit):
        entry = find_converted(model, commit)
        if entry is not None:
            return entry
    try:
        snapshot = fetch_snapshot(model)
    except NotInCache:
        entry = find_converted(model) if commit is None else None
        if entry is None:
            raise
        return entry
    return converted(snapshot, stream=stream)
