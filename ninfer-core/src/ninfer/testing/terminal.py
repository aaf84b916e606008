"""A command on a pseudo-terminal, for tests of interactive commands (``ninfer chat``).

The command sees a terminal on stdin, stdout and stderr, as its controlling terminal: Ctrl-C typed into it
(``send("\\x03")``) interrupts it as a real terminal's would. ``expect`` waits for a pattern in what the
terminal shows (escape sequences and carriage returns removed), from where the last match ended, so a test
reads the session in order, with a generous deadline and no fixed sleep.
"""

from __future__ import annotations

import codecs
import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Mapping, Sequence

ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|[@-Z\\-_])|\r")
UNFINISHED_ESCAPE = re.compile(r"\x1b(\[[0-9;?]*[ -/]*)?$")
# Run in the child: make the terminal on fd 0 its controlling terminal (a new session), give Ctrl-C its default
# meaning back (a test process may have inherited or set SIGINT ignored or blocked, and an ignored SIGINT stays
# ignored across exec: Python then installs no KeyboardInterrupt handler), then become the command.
LAUNCHER = ("import os, signal, sys; os.login_tty(0); signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "signal.pthread_sigmask(signal.SIG_SETMASK, []); os.execv(sys.argv[1], sys.argv[1:])")


class Terminal:
    """``argv`` run on a new pseudo-terminal of ``rows`` x ``columns``. Use as a context manager: leaving kills
    the command if it still runs."""

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, rows: int = 40,
                 columns: int = 200) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, *argv], stdin=slave, stdout=slave,
                                         stderr=slave, env=None if env is None else dict(env))
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        self.fd = master
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.raw = ""  # everything the terminal showed, as written
        self.mark = 0  # where in ``text`` the next ``expect`` starts looking

    @property
    def text(self) -> str:
        """What the terminal showed, without escape sequences or carriage returns (an escape sequence still
        arriving is left out until it is whole)."""
        unfinished = UNFINISHED_ESCAPE.search(self.raw)
        return ESCAPE.sub("", self.raw if unfinished is None else self.raw[:unfinished.start()])

    def send(self, text: str) -> None:
        """Type ``text`` (``\\n`` ends a line, ``\\x03`` is Ctrl-C, ``\\x04`` Ctrl-D)."""
        os.write(self.fd, text.encode())

    def expect(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """The first match of ``pattern`` after the previous match, waiting up to ``timeout`` seconds for it;
        an AssertionError showing the terminal's recent text when it does not come (or the command ended)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.text, self.mark)
            if match is not None:
                self.mark = match.end()
                return match
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(left):
                raise AssertionError(f"{pattern!r} did not show within {timeout} s (exit status "
                                     f"{self.proc.poll()}); the terminal shows after the last match:\n"
                                     f"{self.text[self.mark:][-3000:]}")

    def expect_output(self, chars: int, timeout: float = 60.0) -> str:
        """Wait until at least ``chars`` more non-blank characters have shown; returns what showed."""
        return self.expect(rf"(?:\s*\S){{{chars}}}", timeout).group(0)

    def _read(self, timeout: float) -> bool:
        """Read what is there within ``timeout`` seconds; False once the command closed the terminal."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: every process holding the terminal has ended
            return False
        if not data:
            return False
        self.raw += self._decoder.decode(data)
        return True

    def wait(self, timeout: float = 60.0) -> int:
        """The command's exit status, reading what it still shows until it ends."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if not self._read(min(0.5, max(0.0, deadline - time.monotonic()))):
                break
        return self.proc.wait(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
