"""A ledger Program and a token Frontend: the engine's contracts on plain data, for engine tests without a model.

The "model" is a deterministic function of the accepted history (and the request's seed), so any correct
pause/resume/batching yields exactly the tokens of running the request alone (``reference_tokens``). Pages, slots
and host bytes are accounted exactly, every Program call is checked to run on one thread (the engine worker), and
every ResumeState must be resumed or discarded exactly once (``drained`` checks all of it after a test).
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from collections.abc import Sequence

import attrs

from ninfer.contract import EngineConfig
from ninfer.contract.batch import PendingBatch, PendingRow, RowDecision
from ninfer.contract.constraint import ConstraintError
from ninfer.contract.events import FinishReason, OutputDelta
from ninfer.contract.model import ModelInstance, Preview, ResourceUsage, SnapshotCost
from ninfer.contract.prompt import ChatInput, PreparedPrompt, TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.contract.state import KVPoolSpec, StateField, StateImageLayout
from ninfer.engine.engine import Engine

EOS = 0
REJECTED_BY_PROGRAM = 48   # the ledger Program refuses prompts holding this id (validation at binding)
UNREADABLE = 47            # the token Frontend's OutputSession cannot interpret this id
PAGE_BYTES = 64


def next_token(history: Sequence[int], sampling: SamplingParams, vocab: int) -> int:
    """Greedy: a hash of the recent history; sampled: seeded per (seed, position), never from neighbours."""
    key = f"{tuple(history[-3:])}|{len(history)}"
    if sampling.temperature:
        if sampling.seed is None:
            return random.randrange(vocab)
        key += f"|{sampling.seed}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "little") % vocab


@attrs.define
class Seq:
    inputs: list[int]          # prompt + accepted generated tokens
    prompt_len: int
    sampling: SamplingParams
    frontier: int = 0          # positions whose model state is built
    reserved_to: int = 0       # positions reserved (frontier..reserved_to)
    pages: int = 0

    @property
    def generated(self) -> int:
        return len(self.inputs) - self.prompt_len

    @property
    def feed_len(self) -> int:
        """Positions to build before a decode: the whole prompt, or all but the last (unfed) token."""
        return len(self.inputs) - (1 if self.generated else 0)


@attrs.define
class Resume:
    mode: str
    seq: Seq
    host_bytes: int
    settled: bool = False


class LedgerProgram:
    state_layout = StateImageLayout(fields=[StateField(name="s", dtype="float32", shape=(4,), layers=1)])
    kv_pools = (KVPoolSpec(name="main", layers=1, kv_heads=1, head_dim=8, page_size=4),)
    decode_span = 1

    def __init__(self, *, slots: int = 8, pages: int = 256, page_size: int = 4, host_bytes: int = 1 << 30,
                 vocab: int = 50, max_model_len: int = 256) -> None:
        self.slots, self.total_pages, self.page_size = slots, pages, page_size
        self.host_limit, self.vocab, self.max_model_len = host_bytes, vocab, max_model_len
        self.max_concurrency = slots
        self.seqs: dict[int, Seq] = {}
        self.next_id = 100
        self.free_pages = pages
        self.host_used = 0
        self.resumes: list[Resume] = []
        self.threads: set[int] = set()
        self.fail_on: str | None = None  # "decode"/"prefill"/"commit": raise a device error (fatal) there
        self.log: list[tuple[str, tuple[int, ...]]] = []  # binding order: ("open"|"resume", prompt)
        self.gate = threading.Event()  # decode waits here; pause() may close it to let a test act
        self.gate.set()
        self.close_gate_on_pause = False
        self.paused_once = threading.Event()
        self.prefill_gate = threading.Event()  # prefill waits here (open unless a test closes it)
        self.prefill_gate.set()
        self.in_unit = threading.Event()       # set while a prefill/decode unit waits at its gate
        self.cancelled_rows = 0                # rows committed with a cancelled decision
        self.recovering: set[int] = set()      # resumed sequences without a new token yet
        self.demoted: list[SnapshotCost] = []  # Snapshots revoked to Replay, in order

    def _call(self, name: str) -> None:
        self.threads.add(threading.get_ident())
        if self.fail_on == name:
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered (simulated in {name})")

    def _pages_for(self, positions: int) -> int:
        return math.ceil(positions / self.page_size)

    def _grow(self, s: Seq, upto: int) -> bool:
        need = self._pages_for(upto) - s.pages
        if need > self.free_pages:
            return False
        if need > 0:
            self.free_pages -= need
            s.pages += need
        s.reserved_to = max(s.reserved_to, upto)
        return True

    def _trim(self, s: Seq) -> None:
        s.reserved_to = s.frontier
        keep = self._pages_for(s.frontier)
        self.free_pages += s.pages - keep
        s.pages = keep

    # -- Program protocol ----------------------------------------------------------------------------
    def open_sequence(self, prompt: PreparedPrompt, sampling: SamplingParams) -> int:
        self._call("open_sequence")
        if REJECTED_BY_PROGRAM in prompt.token_ids:
            raise ValueError(f"token {REJECTED_BY_PROGRAM} is outside this Program's vocabulary")
        assert len(self.seqs) < self.slots, "no free state slot"
        sid, self.next_id = self.next_id, self.next_id + 1
        self.seqs[sid] = Seq(inputs=list(prompt.token_ids), prompt_len=len(prompt), sampling=sampling)
        self.log.append(("open", tuple(prompt.token_ids)))
        return sid

    def reserve_units(self, sequence_id: int, tokens: int) -> bool:
        self._call("reserve_units")
        s = self.seqs[sequence_id]
        return self._grow(s, s.frontier + tokens)

    def input_remaining(self, sequence_id: int) -> int:
        s = self.seqs[sequence_id]
        return s.feed_len - s.frontier

    def prefill(self, sequence_id: int, max_tokens: int, *, masks=None) -> PendingBatch | None:
        assert masks is None, "the token frontend opens no constrained session"
        self._call("prefill")
        if not self.prefill_gate.is_set():
            self.in_unit.set()
            self.prefill_gate.wait()
        s = self.seqs[sequence_id]
        n = min(max_tokens, s.feed_len - s.frontier)
        assert n > 0 and s.frontier + n <= s.reserved_to, "prefill without reservation"
        s.frontier += n
        if s.frontier == s.feed_len and s.generated == 0:
            tok = next_token(s.inputs, s.sampling, self.vocab)
            return PendingBatch(kind="prefill", rows=[PendingRow(sequence_id=sequence_id, tokens=(tok,))],
                                native=[(sequence_id, s.frontier)])
        return None

    def decode(self, sequence_ids: Sequence[int], *, masks=None) -> PendingBatch:
        assert masks is None, "the token frontend opens no constrained session"
        self._call("decode")
        if not self.gate.is_set():
            self.in_unit.set()
            self.gate.wait()
        assert len(set(sequence_ids)) == len(sequence_ids)
        rows, native = [], []
        for sid in sequence_ids:
            s = self.seqs[sid]
            assert s.frontier == s.feed_len and s.generated > 0, "decode of a sequence that is not decode-ready"
            assert s.frontier + 1 <= s.reserved_to, "decode without reservation"
            native.append((sid, s.frontier))
            s.frontier += 1
            rows.append(PendingRow(sequence_id=sid, tokens=(next_token(s.inputs, s.sampling, self.vocab),)))
        return PendingBatch(kind="decode", rows=rows, native=native)

    def commit(self, batch: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        self._call("commit")
        batch.take(decisions)
        for (sid, before), row, d in zip(batch.native, batch.rows, decisions, strict=True):
            s = self.seqs[sid]
            if d.cancelled:
                self.cancelled_rows += 1
                s.frontier = before if batch.kind == "decode" else s.frontier
            else:
                s.inputs.extend(row.tokens[:d.accepted])
                self.recovering.discard(sid)
            self._trim(s)

    def abort_pending(self, batch: PendingBatch) -> None:
        batch.take(None)
        for sid, before in batch.native:
            if sid in self.seqs and batch.kind == "decode":
                self.seqs[sid].frontier = before

    def can_snapshot(self, sequence_id: int) -> bool:
        return self.host_used + self.snapshot_cost(sequence_id).host_bytes <= self.host_limit

    def snapshot_cost(self, sequence_id: int) -> SnapshotCost:
        s = self.seqs[sequence_id]  # a pause keeps the pages of the built frontier (the reservation is freed)
        return SnapshotCost(host_bytes=self._pages_for(s.frontier) * PAGE_BYTES, replay_positions=s.frontier)

    def demote(self, r: Resume) -> Resume:
        self._call("demote")
        assert not r.settled and r.mode == "snapshot", "demote of a ResumeState that holds no live Snapshot"
        self.host_used -= r.host_bytes
        r.settled = True
        self.demoted.append(SnapshotCost(host_bytes=r.host_bytes, replay_positions=r.seq.frontier))
        r.seq.frontier = 0  # Replay rebuilds the accepted history from the start
        replay = Resume(mode="replay", seq=r.seq, host_bytes=0)
        self.resumes.append(replay)
        return replay

    def pause(self, sequence_id: int, mode: str) -> Resume:
        self._call("pause")
        s = self.seqs.pop(sequence_id)
        self.recovering.discard(sequence_id)
        self._trim(s)
        self.free_pages += s.pages
        host = 0
        if mode == "snapshot":
            host = s.pages * PAGE_BYTES
            assert self.host_used + host <= self.host_limit
            self.host_used += host
        else:
            s.frontier = 0
        s.pages = s.reserved_to = 0
        r = Resume(mode=mode, seq=s, host_bytes=host)
        self.resumes.append(r)
        if self.close_gate_on_pause:
            self.gate.clear()
        self.paused_once.set()
        return r

    def resume(self, r: Resume) -> int | None:
        self._call("resume")
        assert not r.settled, "ResumeState used twice"
        if len(self.seqs) >= self.slots:
            return None
        s = r.seq
        target = (s.frontier if r.mode == "snapshot" else s.feed_len) + 1  # rebuild + first new unit
        if not self._grow(s, target):
            return None
        self.host_used -= r.host_bytes
        r.settled = True
        sid, self.next_id = self.next_id, self.next_id + 1
        self.seqs[sid] = s
        self.log.append(("resume", tuple(s.inputs[:s.prompt_len])))
        assert not self.recovering, "a second protected recovery started before the first made progress"
        self.recovering.add(sid)
        return sid

    def discard(self, r: Resume) -> None:
        self._call("discard")
        assert not r.settled, "ResumeState discarded twice"
        self.host_used -= r.host_bytes
        r.settled = True

    def release(self, sequence_id: int) -> None:
        self._call("release")
        self.recovering.discard(sequence_id)
        s = self.seqs.pop(sequence_id)
        self.free_pages += s.pages

    def usage(self) -> ResourceUsage:
        reserved = sum(self._pages_for(s.reserved_to) - self._pages_for(s.frontier) for s in self.seqs.values())
        return ResourceUsage(state_slots_total=self.slots, state_slots_used=len(self.seqs),
                             kv_pages_total=self.total_pages, kv_pages_used=self.total_pages - self.free_pages,
                             host_bytes_used=self.host_used, reserved_pages=max(0, reserved),
                             host_bytes_total=self.host_limit)


class TokenSession:
    constrained = False

    def __init__(self, sampling: SamplingParams) -> None:
        self.stops = {EOS, *sampling.stop_token_ids} - ({EOS} if sampling.ignore_eos else set())
        self.committed: list[int] = []
        self.fragile = sampling.stop == ("fragile",)  # tests ask for a session that fails on UNREADABLE

    def preview(self, tokens: Sequence[int], *, at_length_limit: bool = False) -> Preview:
        if self.fragile and UNREADABLE in tokens:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        for i, t in enumerate(tokens):
            if t in self.stops:
                return Preview(accepted=i + 1, finish_reason=FinishReason.STOP,
                               delta=OutputDelta(content=_text(tokens[:i]), token_ids=tuple(tokens[:i + 1])))
        return Preview(accepted=len(tokens), finish_reason=FinishReason.LENGTH if at_length_limit else None,
                       delta=OutputDelta(content=_text(tokens), token_ids=tuple(tokens)))

    def commit(self, preview: Preview) -> OutputDelta:
        self.committed.extend(preview.delta.token_ids)
        return preview.delta

    def finish(self, reason: FinishReason) -> OutputDelta:
        return OutputDelta()


def _text(tokens: Sequence[int]) -> str:
    return "".join(f"<{t}>" for t in tokens)


class TokenFrontend:
    def prepare(self, input: TextInput | ChatInput | PreparedPrompt, *, max_tokens: int | None = None
                ) -> PreparedPrompt:
        if isinstance(input, PreparedPrompt):
            return input
        if isinstance(input, TextInput) and input.token_ids is not None:
            return PreparedPrompt(token_ids=input.token_ids)
        raise ValueError("the token frontend takes token ids only")

    def sampling_defaults(self) -> SamplingParams:
        return SamplingParams(temperature=0.0)

    def open_session(self, prompt: PreparedPrompt, sampling: SamplingParams, constraint=None, *,
                     cancel=None) -> TokenSession:
        if constraint is not None:
            raise ConstraintError("the token frontend compiles no constraints")
        return TokenSession(sampling)

    eos_token_ids = ()

    def token_text(self, token_id: int) -> str:
        return str(token_id)

    def decode(self, token_ids) -> str:
        return _text(token_ids)

    def close(self) -> None:
        pass


def ledger_instance(program: LedgerProgram | None = None, **program_kw) -> ModelInstance:
    """The token Frontend over ``program`` (a LedgerProgram of ``program_kw`` when None)."""
    return ModelInstance(architecture="ledger", config=None, model=None, parameters=None,
                         frontend=TokenFrontend(), program=program or LedgerProgram(**program_kw))


def reference_tokens(prompt: Sequence[int], sampling: SamplingParams, *, vocab: int = 50,
                     max_model_len: int = 256) -> list[int]:
    """What one request alone must produce (greedy or seeded), ignoring any scheduling."""
    hist, out = list(prompt), []
    stops = {EOS, *sampling.stop_token_ids} - ({EOS} if sampling.ignore_eos else set())
    limit = min(sampling.max_tokens or 10**9, max_model_len - len(prompt))
    while len(out) < limit:
        t = next_token(hist, sampling, vocab)
        hist.append(t)
        out.append(t)
        if t in stops:
            break
    return out




def make_engine(*, max_concurrency=4, max_queue=64, prefill_chunk=8, pause_mode="auto", bypass_limit=None,
                **program_kw) -> Engine:
    program_kw.setdefault("slots", max_concurrency)
    inst = ledger_instance(**program_kw)
    return Engine.from_instance(inst, EngineConfig(max_concurrency=max_concurrency, max_queue=max_queue,
                                                   max_model_len=inst.program.max_model_len,
                                                   prefill_chunk=prefill_chunk, pause_mode=pause_mode,
                                                   bypass_limit=max_concurrency if bypass_limit is None
                                                   else bypass_limit, device="cpu"))


def long_engine(**kw) -> Engine:
    """An engine whose requests can run (practically) forever, to hold a lane while a test acts."""
    return make_engine(max_model_len=10**7, pages=10**7, **kw)


def req(prompt, **sampling) -> GenerationRequest:
    sampling.setdefault("max_tokens", 12)
    sampling.setdefault("ignore_eos", False)
    return GenerationRequest(input=TextInput(token_ids=tuple(prompt)), sampling=SamplingParams(**sampling))


def prompts(n, rng, lo=1, hi=30):
    return [[rng.randrange(1, 47) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def wait_until(cond, timeout=60.0):
    """Poll ``cond`` until it holds; the timeout is only a hang guard (a correct engine gets there)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def drained(engine: Engine) -> None:
    wait_until(lambda: engine.metrics().outstanding == 0)  # abandoned handles are released by the worker
    u = engine.usage()
    assert u.all_free, u
    assert engine.metrics().outstanding == 0
    prog = engine.instance.program
    assert prog.free_pages == prog.total_pages and not prog.seqs and prog.host_used == 0
    assert all(r.settled for r in prog.resumes), "a ResumeState was neither resumed nor discarded"
    assert len(prog.threads) <= 1, "the Program was called from more than one thread"
