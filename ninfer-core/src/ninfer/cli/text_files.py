"""Text read from a file named by an option (``--prompt-file``, ``--file``, ``--grammar-file``, ...)."""

from __future__ import annotations

import sys


def read_text_file(path: str, option: str) -> str:
    """The UTF-8 text of ``path`` (``-``: stdin) for ``option``; a missing or non-UTF-8 file is a ValueError."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{option}: file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{option}: {path} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise ValueError(f"{option}: cannot read {path}: {exc.strerror or exc}") from None
