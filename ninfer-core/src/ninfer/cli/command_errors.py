"""How a command ends on bad input: one line on stderr and status 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def run_reporting_errors(command: str, body: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``body(args)``'s exit status; bad input (a ValueError, a file that cannot be read, ...) is one line
    ``ninfer COMMAND: ...`` on stderr and status 2, Ctrl-C status 130, never a traceback."""
    try:
        return body(args)
    except KeyboardInterrupt:
        print(f"\nninfer {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise  # the reader of stdout left: ninfer.cli.main ends quietly
    except (OSError, ValueError, TypeError, LookupError, RuntimeError) as exc:
        print(f"ninfer {command}: {exc}", file=sys.stderr)
        return 2
