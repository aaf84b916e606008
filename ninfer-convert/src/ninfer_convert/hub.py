"""Models named by Hugging Face id: ``org/name`` or ``org/name@revision`` found in the local Hugging Face cache,
downloaded through huggingface_hub where the network allows.

huggingface_hub decides where its cache is and whether it may go online (``HF_HOME``, ``HF_HUB_CACHE``,
``HF_HUB_OFFLINE``, ``HF_TOKEN``); only the files a conversion reads are fetched.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import attrs

from ninfer import looks_like_model_id

# What the converter reads: config, tokenizer and generation JSON, the weights, a chat template file.
CHECKPOINT_FILES = ("*.json", "*.safetensors", "*.jinja")


def is_checkpoint_file(relative_name: str) -> bool:
    return any(fnmatch.fnmatch(relative_name, pattern) for pattern in CHECKPOINT_FILES)


@attrs.frozen
class ModelId:
    repo: str                   # org/name
    revision: str | None = None  # a branch, tag or commit; None: the default branch

    @classmethod
    def parse(cls, text: str) -> ModelId:
        if not looks_like_model_id(text):
            raise ValueError(f"not a Hugging Face model id (org/name or org/name@revision): {text!r}")
        repo, _, revision = text.partition("@")
        return cls(repo, revision or None)

    @property
    def ref(self) -> str:
        """The revision as huggingface_hub resolves it."""
        return self.revision or "main"

    def __str__(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"


@attrs.frozen
class Snapshot:
    """One commit of a model repository, as a folder of the Hugging Face cache."""

    model: ModelId
    commit: str
    path: Path


class NotInCache(ValueError):
    """Offline, or the Hub cannot be reached, and the Hugging Face cache does not hold the snapshot."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _refusal(model: ModelId, exc: Exception) -> ValueError | None:
    """The one-line message for the Hub's answers that no cache can mend (no such repository, revision or access)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, GatedRepoError):
        return ValueError(f"{model.repo} is gated on Hugging Face: accept its terms on huggingface.co, then log in "
                          f"(hf auth login, or set HF_TOKEN)")
    if isinstance(exc, RepositoryNotFoundError):
        return ValueError(f"no Hugging Face model {model.repo} (if it is private, log in: hf auth login, or set "
                          f"HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return ValueError(f"Hugging Face model {model.repo} has no revision {model.revision!r}")
    return None


def _need_hub() -> None:
    try:
        import huggingface_hub  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"Hugging Face model ids need huggingface_hub ({exc}): pip install huggingface_hub") from None


def hub_commit(model: ModelId) -> str | None:
    """The commit ``model``'s revision names on the Hub now; None when offline or the Hub cannot be asked."""
    _need_hub()
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        return None
    if re.fullmatch(r"[0-9a-f]{40}", model.ref):
        return model.ref
    try:
        return HfApi().repo_info(model.repo, revision=model.revision).sha
    except Exception as exc:  # connection and Hub errors (httpx or requests, by version): the cache decides
        refusal = _refusal(model, exc)
        if refusal is not None:
            raise refusal from None
        return None


def snapshot_cached(repo: str, commit: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of ``repo`` at ``commit``."""
    _need_hub()
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    return (folder / "snapshots" / commit).is_dir()


def fetch_snapshot(model: ModelId) -> Snapshot:
    """The cached snapshot of ``model``, downloading what is missing or newer when the Hub can be reached.
    Raises NotInCache, or ValueError for the other failures, each with a one-line message."""
    _need_hub()
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(model.repo, revision=model.revision, allow_patterns=list(CHECKPOINT_FILES)))
    except LocalEntryNotFoundError:
        where = f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
        if constants.HF_HUB_OFFLINE:
            raise NotInCache(f"{model} is not in {where} and HF_HUB_OFFLINE is set: fetch it once with the "
                             f"network (ninfer pull {model})") from None
        raise NotInCache(f"{model} is not in {where} and the Hugging Face Hub cannot be reached") from None
    except Exception as exc:  # any other huggingface_hub error (HTTP, proxy, an incomplete snapshot), disk errors
        refusal = _refusal(model, exc)
        raise refusal or ValueError(f"cannot fetch {model} from Hugging Face: {_first_line(exc)}") from None
    return Snapshot(model, path.name, path)
