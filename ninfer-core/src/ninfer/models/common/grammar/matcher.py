"""TokenMatcher: one request's position in its compiled grammar (an xgrammar GrammarMatcher).

The OutputSession previews tokens by accepting them and rolling back (a refused token leaves the state
unchanged), and commits by accepting them again; masks are written for the committed state, or for the
committed state followed by draft tokens (speculative verification), which are rolled back afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TokenMatcher:
    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the grammar does not allow it."""
        return self._m.accept_token(int(token))

    def accept_prefix(self, tokens: Sequence[int]) -> tuple[int, bool]:
        """Advance by the longest allowed prefix of ``tokens``, stopping after a terminating (stop) token:
        (tokens advanced, whether the grammar ended)."""
        n = 0
        for t in tokens:
            if not self._m.accept_token(int(t)):
                return n, False
            n += 1
            if self._m.is_terminated():
                return n, True
        return n, False

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    @property
    def completed(self) -> bool:
        """The text so far is a complete sentence of the grammar (a stop token may follow)."""
        return self._m.is_completed()

    @property
    def terminated(self) -> bool:
        """A stop token ended the grammar: nothing more may follow."""
        return self._m.is_terminated()

    def fill(self, out: Any, drafts: Sequence[int] = ()) -> None:
        """Row 0 of ``out`` (int32 [1 + len(drafts), words]): the tokens allowed now; row j: after drafts[:j].
        Rows after a refused draft, or after a stop token, are zeroed; the state is unchanged afterwards."""
        self._m.fill_next_token_bitmask(out, 0)
        advanced = 0
        for j, t in enumerate(drafts, start=1):
            if not self._m.accept_token(int(t)):
                out[j:].zero_()
                break
            advanced += 1
            if self._m.is_terminated():
                out[j:].zero_()
                break
            self._m.fill_next_token_bitmask(out, j)
        self.rollback(advanced)
