"""PrefixIndex: the shared index of known checkpoints by the token ids they cover.

A checkpoint of length ``L = k * block + r`` sits at the node of its first ``k`` full blocks, named by a
chained digest (the digest of block ``k`` covers every token before it), under its tail length ``r`` and
the digest of its partial tail. A lookup walks the query's full blocks only while some checkpoint passes
through them, then checks the candidates deepest first. Digests only narrow the candidates: a hit is
confirmed by comparing the token ids themselves, so a digest collision can never give a wrong hit.

Media placeholder tokens share one token id, so a block's digest also takes, for each run of placeholders in
it, the item's digest and the rows the run takes (``MediaRun``), and a hit is confirmed on the runs too: the
same image at the same place hits, a different image (even of the same size) never does.

Every checkpoint belongs to a cache scope, the salt of the request that saved it
(``GenerationRequest.cache_salt``; None: the shared scope). The chain starts from the scope's root digest, so
one scope's nodes never meet another's and a lookup costs what it did; a hit is confirmed on the salt itself
too, so no collision crosses scopes either.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import struct
import sys
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from ninfer.contract.context import CheckpointInfo, MediaRun, clip_runs

DIGEST_BYTES = 16
_ROOT = b""  # the chain digest of the empty prefix in the shared scope (requests without a salt)
_TOKEN_BYTES = 4

if array("i").itemsize != _TOKEN_BYTES:  # pragma: no cover - every platform ninfer supports has 4-byte C int
    raise ImportError("the prefix index needs a 4-byte array('i') for int32 token ids")


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as int32 little-endian bytes, the same in every process and on every host."""
    try:
        packed = array("i", tokens)
    except OverflowError as exc:
        raise ValueError("token ids must fit in int32") from exc
    if sys.byteorder == "big":  # pragma: no cover - ninfer runs on little-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _digest(prefix_digest: bytes, data: bytes | memoryview) -> bytes:
    """The chained digest of ``data`` following the prefix named by ``prefix_digest``."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(prefix_digest)
    h.update(data)
    return h.digest()


@functools.lru_cache(maxsize=1024)
def scope_root(salt: str | None) -> bytes:
    """The chain digest of the empty prefix in the scope of ``salt``: the shared root for None, otherwise a
    digest of the salt (never empty, so never the shared root)."""
    if salt is None:
        return _ROOT
    return _digest(b"ninfer.cache_salt\0", salt.encode("utf-8", "surrogatepass"))


class MediaIdentity:
    """The media runs of one token sequence, as bytes per range of positions (nothing for text)."""

    def __init__(self, runs: Sequence[MediaRun]) -> None:
        self.runs = sorted(runs, key=lambda r: r.start)
        self._ends = [r.start + r.length for r in self.runs]

    def between(self, lo: int, hi: int) -> bytes:
        """Each run's part inside positions lo..hi: its place, length, first row and item digest."""
        out = []
        for r in self.runs[bisect.bisect_right(self._ends, lo):]:
            if r.start >= hi:
                break
            a, b = max(r.start, lo), min(r.start + r.length, hi)
            if a >= b:  # an empty range (a tail of no tokens)
                continue
            digest = r.digest.encode()
            out.append(struct.pack("<4i", a - lo, b - a, r.offset + a - r.start, len(digest)) + digest)
        return b"".join(out)


_Node = tuple[int, bytes]  # (full blocks k, chain digest of the first k blocks)


class PrefixIndex:
    """Checkpoints by exact token prefix within their scope. Of several checkpoints with identical tokens (in
    one scope) the newest added wins."""

    def __init__(self, block: int) -> None:
        if block < 1:
            raise ValueError(f"the prefix index block must be at least one token, got {block}")
        self.block = block
        self._infos: dict[int, CheckpointInfo] = {}
        self._salts: dict[int, str | None] = {}  # id -> the scope it was saved in
        self._placed: dict[int, tuple[list[_Node], int, bytes]] = {}  # id -> (nodes passed, tail r, tail digest)
        self._through: Counter[_Node] = Counter()  # checkpoints reaching each node with k >= 1
        self._ends: dict[_Node, dict[int, dict[bytes, list[int]]]] = {}  # node -> r -> tail digest -> ids, oldest first

    # -- registry --------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._infos)

    def __contains__(self, checkpoint_id: object) -> bool:
        return checkpoint_id in self._infos

    def __iter__(self) -> Iterator[CheckpointInfo]:
        return iter(list(self._infos.values()))

    def get(self, checkpoint_id: int) -> CheckpointInfo | None:
        return self._infos.get(checkpoint_id)

    def salt(self, checkpoint_id: int) -> str | None:
        """The scope an indexed checkpoint belongs to (KeyError when it is not indexed)."""
        return self._salts[checkpoint_id]

    def add(self, info: CheckpointInfo, *, salt: str | None = None) -> None:
        """Index ``info`` in the scope of ``salt``; a known id only takes the new info (its tokens and scope
        cannot change)."""
        known = self._infos.get(info.id)
        if known is not None:
            if known.tokens != info.tokens:
                raise ValueError(f"checkpoint {info.id} changed its tokens ({known.length} -> {info.length})")
            if self._salts[info.id] != salt:
                raise ValueError(f"checkpoint {info.id} cannot change its cache scope")
            self._infos[info.id] = info
            return
        buf, media = memoryview(token_bytes(info.tokens)), MediaIdentity(info.media)
        chain = self._chain(buf, media, info.length // self.block, scope_root(salt), known_only=False)
        nodes = list(enumerate(chain))
        k, r = divmod(info.length, self.block)
        tail = self._tail_digest(buf, media, chain[k], k, r)
        self._through.update(nodes[1:])
        self._ends.setdefault(nodes[k], {}).setdefault(r, {}).setdefault(tail, []).append(info.id)
        self._infos[info.id] = info
        self._salts[info.id] = salt
        self._placed[info.id] = (nodes, r, tail)

    def remove(self, checkpoint_id: int) -> CheckpointInfo:
        """Forget a checkpoint; KeyError when it is not indexed."""
        info = self._infos.pop(checkpoint_id)
        del self._salts[checkpoint_id]
        nodes, r, tail = self._placed.pop(checkpoint_id)
        self._through.subtract(nodes[1:])
        for node in nodes[1:]:
            if self._through[node] <= 0:
                del self._through[node]
        ends = self._ends[nodes[-1]]
        ids = ends[r][tail]
        ids.remove(checkpoint_id)
        if not ids:
            del ends[r][tail]
            if not ends[r]:
                del ends[r]
                if not ends:
                    del self._ends[nodes[-1]]
        return info

    # -- lookup ----------------------------------------------------------------------------------------
    def longest(self, tokens: Sequence[int], limit: int, *, exclude: int | None = None,
                media: Sequence[MediaRun] = (), salt: str | None = None) -> CheckpointInfo | None:
        """The checkpoint of the scope ``salt`` with the largest length <= ``limit`` whose tokens are exactly
        ``tokens[:length]`` and whose media runs are ``media``'s there (leaving out the checkpoint ``exclude``),
        or None."""
        limit = min(limit, len(tokens))
        if limit < 0:
            return None
        query, identity = tuple(tokens[:limit]), MediaIdentity(media)
        buf = memoryview(token_bytes(query))
        chain = self._chain(buf, identity, limit // self.block, scope_root(salt), known_only=True)
        for k in reversed(range(len(chain))):
            ends = self._ends.get((k, chain[k]))
            if not ends:
                continue
            for r in sorted(ends, reverse=True):
                if k * self.block + r <= limit:
                    found = self._exact(query, buf, identity, k, chain[k], r, exclude, salt)
                    if found is not None:
                        return found
        return None

    def present(self, tokens: Sequence[int], lengths: Iterable[int], *,
                media: Sequence[MediaRun] = (), salt: str | None = None) -> set[int]:
        """Those of ``lengths`` at which a checkpoint of the scope ``salt`` holding exactly ``tokens[:length]``
        (and ``media`` there) is indexed."""
        wanted = sorted({n for n in lengths if 0 <= n <= len(tokens)})
        if not wanted:
            return set()
        query, identity = tuple(tokens[:wanted[-1]]), MediaIdentity(media)
        buf = memoryview(token_bytes(query))
        chain = self._chain(buf, identity, wanted[-1] // self.block, scope_root(salt), known_only=True)
        found = set()
        for n in wanted:
            k, r = divmod(n, self.block)
            if k < len(chain) and self._exact(query, buf, identity, k, chain[k], r, None, salt) is not None:
                found.add(n)
        return found

    # -- digests ---------------------------------------------------------------------------------------
    def _chain(self, buf: memoryview, media: MediaIdentity, blocks: int, root: bytes, *,
               known_only: bool) -> list[bytes]:
        """Chain digests of the first 0..m full blocks (m <= ``blocks``) from the scope's ``root``;
        ``known_only`` stops before the first node that no indexed checkpoint reaches, since nothing deeper can
        match."""
        chain = [root]
        for k in range(1, blocks + 1):
            d = self._block_digest(chain[-1], buf, media, (k - 1) * self.block, self.block)
            if known_only and (k, d) not in self._through:
                break
            chain.append(d)
        return chain

    def _tail_digest(self, buf: memoryview, media: MediaIdentity, chain_k: bytes, k: int, r: int) -> bytes:
        return self._block_digest(chain_k, buf, media, k * self.block, r)

    @staticmethod
    def _block_digest(prefix_digest: bytes, buf: memoryview, media: MediaIdentity, start: int, n: int) -> bytes:
        """The digest of tokens start..start+n after ``prefix_digest``: their ids, then their media identity."""
        ids = buf[start * _TOKEN_BYTES:(start + n) * _TOKEN_BYTES]
        runs = media.between(start, start + n) if media.runs else b""
        return _digest(prefix_digest, ids if not runs else bytes(ids) + runs)

    def _exact(self, query: tuple[int, ...], buf: memoryview, media: MediaIdentity, k: int, chain_k: bytes, r: int,
               exclude: int | None, salt: str | None) -> CheckpointInfo | None:
        """The newest checkpoint of the scope ``salt`` whose tokens are exactly ``query[:k * block + r]``, with
        the same media there."""
        by_tail = self._ends.get((k, chain_k), {}).get(r)
        if not by_tail:
            return None
        ids = by_tail.get(self._tail_digest(buf, media, chain_k, k, r), ())
        length = k * self.block + r
        runs = None
        for cid in reversed(ids):
            info = self._infos[cid]
            if cid != exclude and info.length == length and self._salts[cid] == salt \
                    and info.tokens == query[:length]:
                runs = clip_runs(media.runs, length) if runs is None else runs
                if tuple(info.media) == runs:
                    return info
        return None


def common_prefix(a: Sequence[int], a_media: Sequence[MediaRun], b: Sequence[int],
                  b_media: Sequence[MediaRun]) -> int:
    """How many leading tokens two sequences share: equal token ids, and the same media on every placeholder."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    if not a_media and not b_media:
        return i
    rows_a, rows_b = _placeholder_rows(a_media, i), _placeholder_rows(b_media, i)
    return min((p for p in rows_a.keys() | rows_b.keys() if rows_a.get(p) != rows_b.get(p)), default=i)


def _placeholder_rows(runs: Sequence[MediaRun], n: int) -> dict[int, tuple[str, int]]:
    return {r.start + j: (r.digest, r.offset + j) for r in clip_runs(runs, n) for j in range(r.length)}
