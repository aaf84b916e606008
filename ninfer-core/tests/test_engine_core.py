"""Engine lifecycle and scheduler tests on a ledger Program and token Frontend (plain data).

The "model" is a deterministic function of the accepted history (and the request's seed), so any
correct pause/resume/batching yields exactly the tokens of running the request alone. Pages, slots
and host bytes are accounted exactly, every Program call is checked to run on one thread (the
engine worker), and every ResumeState must be resumed or discarded exactly once. End-to-end tests
through the real Qwen3.5 Program live in tests/test_engine_*.py.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from collections.abc import Sequence

import attrs
import pytest

from ninfer.contract.batch import PendingBatch, PendingRow, RowDecision
from ninfer.contract.constraint import ConstraintError
from ninfer.contract.events import FinishReason, GenerationResult, GenerationStart, OutputDelta, ToolCall
from ninfer.contract.model import ModelInstance, Preview, ResourceUsage, SnapshotCost
from ninfer.contract.prompt import ChatInput, PreparedPrompt, TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.contract.state import KVPoolSpec, StateField, StateImageLayout

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


def ledger_instance(**program_kw) -> ModelInstance:
    return ModelInstance(architecture="ledger", config=None, model=None, parameters=None,
                         frontend=TokenFrontend(), program=LedgerProgram(**program_kw))


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


# == tests ==========================================================================================
from ninfer.contract import EngineConfig  # noqa: E402
from ninfer.engine.engine import Engine  # noqa: E402
from ninfer.engine.errors import (  # noqa: E402
    EngineClosed,
    EngineFailed,
    InputTooLong,
    Overloaded,
    QueueTimeout,
    Unrepresentable,
)
from ninfer.testing.scheduling import submit_together  # noqa: E402


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


def _wait_until(cond, timeout=60.0):
    """Poll ``cond`` until it holds; the timeout is only a hang guard (a correct engine gets there)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def drained(engine: Engine) -> None:
    _wait_until(lambda: engine.metrics().outstanding == 0)  # abandoned handles are released by the worker
    u = engine.usage()
    assert u.all_free, u
    assert engine.metrics().outstanding == 0
    prog = engine.instance.program
    assert prog.free_pages == prog.total_pages and not prog.seqs and prog.host_used == 0
    assert all(r.settled for r in prog.resumes), "a ResumeState was neither resumed nor discarded"
    assert len(prog.threads) <= 1, "the Program was called from more than one thread"


def test_single_request_event_order_and_settlement():
    with make_engine() as eng:
        h = eng.submit(req([5, 6, 7], max_tokens=6))
        events = list(h)
        assert isinstance(events[0], GenerationStart) and events[0].prompt_tokens == 3
        assert isinstance(events[-1], GenerationResult)
        assert all(not isinstance(e, (GenerationStart, GenerationResult)) for e in events[1:-1])
        res = events[-1]
        expect = reference_tokens([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))
        assert list(res.token_ids) == expect
        assert [t for e in events[1:-1] for t in e.token_ids] == expect
        assert res.usage.completion_tokens == len(expect) and res.usage.prompt_tokens == 3
        assert res.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert res.timings.end_to_end_s >= res.timings.time_to_first_token_s >= 0  # structure, not speed
        drained(eng)


class ToolCallSession(TokenSession):
    """Streams one tool call as fragments: the first names the call, later ones append argument text."""

    def commit(self, preview: Preview) -> OutputDelta:
        delta = super().commit(preview)
        frags = tuple(ToolCall(index=0, id="call_0" if len(self.committed) == n + 1 else "",
                               name="lookup" if len(self.committed) == n + 1 else "", arguments=f"{t},")
                      for n, t in zip(range(len(self.committed) - len(delta.token_ids), len(self.committed)),
                                      delta.token_ids, strict=True))
        return attrs.evolve(delta, tool_calls=frags)


def test_final_result_merges_streamed_tool_call_fragments():
    with make_engine() as eng:
        eng.frontend.open_session = lambda prompt, sampling, constraint=None, cancel=None: ToolCallSession(sampling)
        h = eng.submit(req([5, 6, 7], max_tokens=6))
        events = list(h)
        res = events[-1]
        frags = [c for e in events[1:-1] for c in e.tool_calls]
        assert len(frags) == len(res.token_ids) > 1
        assert res.tool_calls == (ToolCall(index=0, id="call_0", name="lookup",
                                           arguments="".join(f"{t}," for t in res.token_ids)),)
        drained(eng)


@pytest.mark.parametrize("concurrency", [1, 2, 8])
def test_concurrent_residents_match_running_alone(concurrency):
    rng = random.Random(concurrency)
    ps = prompts(concurrency * 2, rng, 1, 40)
    with make_engine(max_concurrency=concurrency) as eng:
        handles = [eng.submit(req(p, max_tokens=rng.randint(1, 20))) for p in ps]
        results = [h.result(timeout=30) for h in handles]
        for p, h, r in zip(ps, handles, results, strict=True):
            sp = SamplingParams(max_tokens=r.usage.completion_tokens, temperature=0.0)
            assert list(r.token_ids) == reference_tokens(p, sp)[:len(r.token_ids)], h.request_id
            assert r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        drained(eng)


def _run_workload(eng, ps, sampling_list):
    handles = submit_together(eng, [req(p, **s) for p, s in zip(ps, sampling_list, strict=True)])
    return [h.result(timeout=60) for h in handles]


@pytest.mark.parametrize("mode", ["snapshot", "replay", "auto"])
@pytest.mark.parametrize("seeded", [False, True])
def test_forced_preemption_gives_identical_outputs(mode, seeded):
    rng = random.Random(7)
    ps = prompts(8, rng, 3, 20)
    samp = [dict(max_tokens=rng.randint(10, 30), ignore_eos=True, **(
        dict(temperature=0.8, seed=rng.randrange(1000)) if seeded else {})) for _ in ps]
    with make_engine(max_concurrency=4, pages=400) as eng:
        calm = _run_workload(eng, ps, samp)
        assert eng.metrics().preemptions == 0
        drained(eng)
    # 14 pages of 4 positions cannot hold 4 residents of up to 50 positions: pauses are forced.
    host = 1 << 30 if mode != "auto" else 3 * PAGE_BYTES * 6
    with make_engine(max_concurrency=4, pages=14, pause_mode=mode, host_bytes=host) as eng:
        tight = _run_workload(eng, ps, samp)
        m = eng.metrics()
        drained(eng)
    assert m.preemptions > 0
    if mode == "snapshot":
        assert m.preemptions_snapshot == m.preemptions
    if mode == "replay":
        assert m.preemptions_replay == m.preemptions
    for a, b in zip(calm, tight, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert b.usage.completion_tokens == len(b.token_ids)
    assert sum(r.timings.preemptions for r in tight) == m.preemptions


def test_rejections_name_the_problem():
    with make_engine(max_concurrency=1) as eng:
        with pytest.raises(InputTooLong, match="context limit"):
            eng.submit(req(list(range(1, 50)) * 6))
        assert eng.metrics().requests_rejected == {"too_long": 1}
    with long_engine(max_concurrency=1, max_queue=0) as eng:
        with pytest.raises(Unrepresentable, match="token ids only"):
            eng.submit(GenerationRequest(input=TextInput(text="hello")))
        with pytest.raises(Unrepresentable, match="GenerationRequest"):
            eng.submit("hello")
        h = eng.submit(req([1, 2, 3], max_tokens=10**6, ignore_eos=True))  # ends when cancelled
        with pytest.raises(Overloaded) as info:
            eng.submit(req([1, 2]))
        assert info.value.kind == "overload" and info.value.http_status == 429
        h.cancel()
        assert h.result(timeout=10).finish_reason is FinishReason.CANCELLED
        m = eng.metrics()
        assert m.requests_rejected == {"invalid": 2, "overload": 1}
        drained(eng)


def test_queue_timeout_ends_the_handle_with_an_error():
    with long_engine(max_concurrency=1) as eng:
        blocker = eng.submit(req([1, 2, 3], max_tokens=10**6, ignore_eos=True))  # ends when cancelled
        late = eng.submit(GenerationRequest(input=TextInput(token_ids=(4, 5)), queue_timeout_s=0.05))
        res = late.result(timeout=10)
        assert res.finish_reason is FinishReason.ERROR and res.extra["error_kind"] == "queue_timeout"
        assert isinstance(late.exception(), QueueTimeout)
        assert res.usage.completion_tokens == 0
        blocker.cancel()
        assert blocker.result(timeout=10).finish_reason is FinishReason.CANCELLED
        drained(eng)


def test_deadline_stops_a_running_request_and_keeps_its_output():
    with long_engine(max_concurrency=2) as eng:
        h = eng.submit(GenerationRequest(input=TextInput(token_ids=(1, 2, 3)), deadline_s=0.2,
                                         sampling=SamplingParams(max_tokens=10**6, ignore_eos=True)))
        events = list(h)
        res = events[-1]
        assert res.finish_reason is FinishReason.DEADLINE and res.error is None
        published = [t for e in events[1:-1] for t in e.token_ids]
        assert list(res.token_ids) == published and len(published) == res.usage.completion_tokens
        drained(eng)


def test_abandoned_handle_cancels_and_releases_capacity():
    with long_engine(max_concurrency=1, max_queue=1) as eng:
        h = eng.submit(req([1, 2, 3], max_tokens=10**5, ignore_eos=True))
        assert eng.metrics().outstanding == 1
        del h  # abandonment: cancellation + consumer released
        drained(eng)
        # A handle whose response is done but never read still holds its place until released.
        h2 = eng.submit(req([1, 2], max_tokens=2))
        _wait_until(lambda: h2.done)
        assert eng.metrics().outstanding == 1
        h2.close()
        assert eng.metrics().outstanding == 0
        drained(eng)


def test_async_iteration():
    import asyncio

    async def main(eng):
        h = eng.submit(req([9, 8, 7], max_tokens=5))
        evs = [ev async for ev in h]
        return evs

    with make_engine() as eng:
        evs = asyncio.run(main(eng))
        assert isinstance(evs[0], GenerationStart) and isinstance(evs[-1], GenerationResult)
        assert list(evs[-1].token_ids) == reference_tokens([9, 8, 7], SamplingParams(max_tokens=5, temperature=0.0))
        drained(eng)


@pytest.mark.parametrize("where", ["decode", "commit", "prefill"])
def test_engine_failure_completes_every_response_and_refuses_work(where):
    eng = long_engine(max_concurrency=3)
    handles = [eng.submit(req([1, 2, 3 + i], max_tokens=10**6, ignore_eos=True)) for i in range(2)]
    assert isinstance(handles[0].next_event(timeout=10), GenerationStart)  # the engine is running
    eng.instance.program.fail_on = where
    for i in range(2, 5):
        try:
            handles.append(eng.submit(req([1, 2, 3 + i], max_tokens=10**6, ignore_eos=True)))
        except EngineFailed:  # the failure may already have happened: new work is refused
            break
    results = [h.result(timeout=10) for h in handles]
    assert all(r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "engine_failed" for r in results)
    assert all(isinstance(h.exception(), EngineFailed) for h in handles)
    with pytest.raises(EngineFailed):
        eng.submit(req([1]))
    assert eng.failed and eng.metrics().failed and eng.metrics().outstanding == 0
    eng.instance.program.fail_on = None
    assert eng.usage().all_free  # cleanup released what the residents held
    eng.close()


def test_close_ends_in_flight_requests_and_waits_for_the_worker():
    eng = long_engine(max_concurrency=1)
    running = eng.submit(req([1, 2], max_tokens=10**5, ignore_eos=True))
    waiting = eng.submit(req([3, 4], max_tokens=3))
    eng.close()
    assert not eng._core.thread.is_alive()
    for h in (running, waiting):
        r = h.result(timeout=1)
        assert r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "closed"
    with pytest.raises(EngineClosed):
        eng.submit(req([1]))
    assert eng.usage().all_free


def test_close_with_drain_finishes_work():
    eng = make_engine(max_concurrency=2)
    hs = [eng.submit(req([i + 1, 2], max_tokens=5)) for i in range(5)]
    eng.close(drain=True)
    assert all(h.result(timeout=1).finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for h in hs)
    assert eng.usage().all_free


def test_metrics_count_tokens_and_latencies():
    with make_engine(max_concurrency=2) as eng:
        rs = [eng.generate(req([1 + i, 2, 3], max_tokens=4, ignore_eos=True), timeout=10) for i in range(3)]
        m = eng.metrics()
        assert m.prompt_tokens == 9 and m.generated_tokens == sum(r.usage.completion_tokens for r in rs) == 12
        assert m.ttft.count == 3 and m.end_to_end.count == 3 and m.queue_time.count == 3
        assert m.inter_token.count == 9
        assert m.requests_finished == {"length": 3}
        assert m.queue_depth == 0 and m.running == 0 and m.paused == 0 and m.kv_pages_total == 256
        drained(eng)


@pytest.mark.parametrize("seed", range(12))
def test_randomized_lifecycle(seed):
    """Arrivals, cancellations at every state, deadlines and tiny KV budgets forcing pauses."""
    rng = random.Random(seed)
    conc = rng.choice([1, 2, 3, 4, 8])
    pages = rng.choice([17, 20, 26, 40])  # 17 pages hold one request's longest history (24 + 40 positions)
    host = rng.choice([0, 6 * PAGE_BYTES, 1 << 20])  # 0: every pause is a Replay
    eng = make_engine(max_concurrency=conc, pages=pages, host_bytes=host, prefill_chunk=rng.choice([1, 3, 8]),
                      bypass_limit=rng.choice([0, 1, 2]))
    specs, handles, expected = [], [], []
    for _ in range(24):
        p = [rng.randrange(1, 47) for _ in range(rng.randint(1, 24))]
        s = dict(max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.7)
        if rng.random() < 0.3:
            s.update(temperature=0.7, seed=rng.randrange(100))
        deadline = rng.choice([None, None, None, rng.uniform(0.001, 0.05)])
        r = GenerationRequest(input=TextInput(token_ids=tuple(p)), sampling=SamplingParams(**s), deadline_s=deadline,
                              queue_timeout_s=rng.choice([None, None, 0.02]))
        handles.append(eng.submit(r))
        specs.append((p, s))
        expected.append(reference_tokens(p, SamplingParams(**{**s, "temperature": s.get("temperature", 0.0)})))
        if rng.random() < 0.25:
            rng.choice(handles).cancel()  # any state: waiting, prefill, decode, paused, finished
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0, 0.004))
    results = []
    for h in handles:
        evs = list(h)
        finals = [e for e in evs if isinstance(e, GenerationResult)]
        assert len(finals) == 1 and evs[-1] is finals[0], "exactly one terminal result, last"
        starts = [e for e in evs if isinstance(e, GenerationStart)]
        assert len(starts) <= 1 and (not starts or evs[0] is starts[0])
        results.append(finals[0])
    for (_p, s), res, exp, h in zip(specs, results, expected, handles, strict=True):
        assert res.finish_reason is not FinishReason.ERROR or res.extra["error_kind"] in ("queue_timeout",), res
        # Whatever was published is a prefix of running alone; complete requests equal it.
        assert list(res.token_ids) == exp[:len(res.token_ids)], (h.request_id, res)
        if res.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            if s["ignore_eos"]:
                assert len(res.token_ids) == s["max_tokens"] or exp[len(res.token_ids) - 1] == EOS
            else:
                assert list(res.token_ids) == exp
    drained(eng)
    assert eng._core.scheduler.max_bypass_seen <= eng._core.scheduler.bypass_limit
    eng.close()


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_fresh_admission_bypasses_a_paused_request_at_most_the_bound(limit):
    """A paused request that cannot resume yet is overtaken by at most ``limit`` fresh admissions."""
    eng = make_engine(max_concurrency=4, pages=62, host_bytes=0, bypass_limit=limit)
    prog = eng.instance.program
    prog.gate.clear()  # hold the worker at A's first decode until B is submitted too
    prog.close_gate_on_pause = True
    a = eng.submit(req([1, 2, 3, 4], max_tokens=200, ignore_eos=True))   # grows to 51 pages
    # B is paused for A near position 140 and needs ~37 pages to resume: not before A ends.
    b = eng.submit(req(list(range(1, 41)), max_tokens=200, ignore_eos=True))
    prog.gate.set()
    assert prog.paused_once.wait(10)
    fresh = [eng.submit(req([40 + i, 41], max_tokens=2, ignore_eos=True)) for i in range(3)]
    prog.gate.set()
    results = [h.result(timeout=20) for h in (a, b, *fresh)]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert results[1].timings.preemptions == 1
    order = [entry for entry in prog.log]
    b_resumed = order.index(("resume", tuple(range(1, 41))))
    fresh_opened = [order.index(("open", (40 + i, 41))) for i in range(3)]
    assert sum(pos < b_resumed for pos in fresh_opened) == limit  # exactly the bound overtook B
    assert eng._core.scheduler.max_bypass_seen == limit
    drained(eng)
    eng.close()


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("snapshots", [1, 2])
def test_host_pressure_revokes_paused_snapshots_and_outputs_stay_exact(seeded, snapshots):
    rng = random.Random(7)
    ps = prompts(8, rng, 3, 20)
    samp = [dict(max_tokens=rng.randint(10, 30), ignore_eos=True, **(
        dict(temperature=0.8, seed=rng.randrange(1000)) if seeded else {})) for _ in ps]
    expected = [reference_tokens(p, SamplingParams(**{"temperature": 0.0, **s})) for p, s in zip(ps, samp, strict=True)]
    # 14 pages force pauses; the host holds about `snapshots` Snapshots, so later pauses compete for it.
    with make_engine(max_concurrency=4, pages=14, host_bytes=snapshots * 6 * PAGE_BYTES) as eng:
        core, prog = eng._core, eng.instance.program
        decisions = []
        revoke = core.policy.revoke_snapshots

        def watched(need):  # runs on the worker: the host shortfall, and what the engine revoked for it
            u, before = prog.usage(), len(prog.demoted)
            revoke(need)
            revoked = prog.demoted[before:]
            decisions.append((need, u.host_bytes_used + need.host_bytes - u.host_bytes_total, revoked))
            if revoked:  # the pause that revoked keeps its own Snapshot
                assert prog.host_used + need.host_bytes <= prog.host_limit

        core.policy.revoke_snapshots = watched
        handles = submit_together(eng, [req(p, **s) for p, s in zip(ps, samp, strict=True)])
        events = [list(h) for h in handles]
        m = eng.metrics()
        drained(eng)
    for evs, exp in zip(events, expected, strict=True):
        assert sum(isinstance(e, GenerationResult) for e in evs) == 1 and isinstance(evs[-1], GenerationResult)
        assert evs[-1].finish_reason is FinishReason.LENGTH and list(evs[-1].token_ids) == exp
    assert m.snapshots_revoked == len(prog.demoted) > 0
    for need, shortfall, revoked in decisions:
        if revoked:  # it made room, and lost less replay than the new Snapshot saves
            assert sum(c.host_bytes for c in revoked) >= shortfall > 0
            assert sum(c.replay_positions for c in revoked) < need.replay_positions


def test_frontend_failure_ends_only_that_request():
    rng = random.Random(3)
    with make_engine(max_concurrency=4) as eng:
        # Find prompts whose greedy output reaches UNREADABLE (fragile) and ones that do not.
        fragile = next(p for p in prompts(200, rng, 1, 8)
                       if UNREADABLE in reference_tokens(p, SamplingParams(max_tokens=30, ignore_eos=True))
                       and REJECTED_BY_PROGRAM not in p)
        healthy = [[1, 2, 3], [4, 5]]
        hs = [eng.submit(req(fragile, max_tokens=30, ignore_eos=True, stop=("fragile",)))]
        hs += [eng.submit(req(p, max_tokens=20, ignore_eos=True)) for p in healthy]
        bad, *good = [h.result(timeout=10) for h in hs]
        assert bad.finish_reason is FinishReason.ERROR and bad.extra["error_kind"] == "request_failed"
        assert "UnicodeDecodeError" in bad.error
        assert UNREADABLE not in bad.token_ids  # the failing row accepted nothing
        for p, r in zip(healthy, good, strict=True):
            assert list(r.token_ids) == reference_tokens(p, SamplingParams(max_tokens=20, ignore_eos=True))
        assert not eng.failed
        drained(eng)


def test_program_validation_at_binding_is_a_request_error():
    with make_engine(max_concurrency=1) as eng:
        h = eng.submit(req([1, REJECTED_BY_PROGRAM, 2]))
        ok = eng.submit(req([1, 2]))
        r = h.result(timeout=10)
        assert r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "invalid"
        assert "vocabulary" in r.error and not eng.failed
        assert ok.result(timeout=10).finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        drained(eng)


def test_a_request_that_can_never_fit_ends_with_a_capacity_error():
    with make_engine(max_concurrency=2, pages=2, prefill_chunk=16) as eng:
        first_chunk_too_big = eng.submit(req(list(range(1, 13))))  # 12 positions > 2 pages of 4
        grows_too_big = eng.submit(req([1, 2], max_tokens=40, ignore_eos=True))  # outgrows 8 positions
        r1, r2 = first_chunk_too_big.result(timeout=10), grows_too_big.result(timeout=10)
        assert r1.extra["error_kind"] == "capacity" and r1.usage.completion_tokens == 0
        assert r2.extra["error_kind"] == "capacity" and 1 <= r2.usage.completion_tokens <= 7
        drained(eng)


def test_a_closed_consumer_loop_does_not_hurt_the_engine():
    import asyncio

    with long_engine(max_concurrency=1) as eng:
        h = eng.submit(req([1, 2, 3], max_tokens=10**6, ignore_eos=True))

        async def first_then_leave():
            it = h.__aiter__()
            await it.__anext__()  # GenerationStart
            h._channel.events.clear()
            h._channel._waiters.append((asyncio.get_running_loop(), asyncio.get_running_loop().create_future()))

        asyncio.run(first_then_leave())  # the loop closes with a waiter registered
        _wait_until(lambda: not h._channel._waiters)  # the worker published and woke the dead loop's waiter
        h.cancel()
        assert h.result(timeout=10).finish_reason is FinishReason.CANCELLED
        assert not eng.failed
        drained(eng)


def test_cancellation_in_every_state():
    eng = long_engine(max_concurrency=2, prefill_chunk=1)
    prog = eng.instance.program
    # Decode, cancelled while its PendingBatch is provisional: the row accepts zero tokens.
    prog.gate.clear()
    decoding = eng.submit(req([1, 2], max_tokens=10**6, ignore_eos=True))
    assert prog.in_unit.wait(10)
    prog.in_unit.clear()
    decoding.cancel()
    prog.gate.set()
    r = decoding.result(timeout=10)
    assert r.finish_reason is FinishReason.CANCELLED and prog.cancelled_rows == 1
    assert len(r.token_ids) == 1  # only the prefill's first token was committed and published
    # Waiting behind two long residents, then Prefill (held inside a chunk), then finished (no effect).
    blockers = [eng.submit(req([3, 4], max_tokens=10**6, ignore_eos=True)) for _ in range(2)]
    waiting = eng.submit(req([5, 6], max_tokens=4))
    waiting.cancel()
    r = waiting.result(timeout=10)
    assert r.finish_reason is FinishReason.CANCELLED and r.usage.completion_tokens == 0
    assert r.timings.time_to_first_token_s is None
    for b in blockers:
        b.cancel()
        assert b.result(timeout=10).finish_reason is FinishReason.CANCELLED
    prog.prefill_gate.clear()
    prefilling = eng.submit(req(list(range(1, 40)), max_tokens=4))
    assert prog.in_unit.wait(10)
    prefilling.cancel()
    prog.prefill_gate.set()
    r = prefilling.result(timeout=10)
    assert r.finish_reason is FinishReason.CANCELLED and r.usage.completion_tokens == 0
    done = eng.submit(req([7], max_tokens=2))
    assert done.result(timeout=10).finish_reason is FinishReason.LENGTH
    done.cancel()  # after the end: nothing happens
    drained(eng)
    eng.close()


def test_cancellation_while_paused_discards_the_resume_state():
    eng = make_engine(max_concurrency=4, pages=62, host_bytes=1 << 20)
    prog = eng.instance.program
    prog.gate.clear()
    prog.close_gate_on_pause = True
    a = eng.submit(req([1, 2, 3, 4], max_tokens=200, ignore_eos=True))
    b = eng.submit(req(list(range(1, 41)), max_tokens=200, ignore_eos=True))
    prog.gate.set()
    assert prog.paused_once.wait(10)  # B is paused (Snapshot: host room allows) and the worker is held
    published = b._channel.events.copy()
    b.cancel()
    prog.gate.set()
    rb, ra = b.result(timeout=10), a.result(timeout=10)
    assert rb.finish_reason is FinishReason.CANCELLED and rb.timings.preemptions == 1
    assert ra.finish_reason is FinishReason.LENGTH
    assert [t for e in published if hasattr(e, "token_ids") and not isinstance(e, GenerationResult)
            for t in e.token_ids] == list(rb.token_ids)  # nothing published after the pause
    assert prog.resumes and all(r.settled for r in prog.resumes) and prog.host_used == 0
    drained(eng)
    eng.close()


def test_worker_binds_an_explicit_cuda_ordinal_only(monkeypatch):
    import torch

    from ninfer.engine.core import bind_device

    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(d))
    for device in (None, "cpu", "cuda", "cuda:1"):
        bind_device(device)
    assert seen == [torch.device("cuda:1")]


def test_many_threads_submit_consume_cancel_and_abandon():
    import concurrent.futures

    eng = make_engine(max_concurrency=3, pages=30, host_bytes=4 * PAGE_BYTES, max_queue=8)
    overloaded = []

    def client(seed):
        rng = random.Random(seed)
        outcomes = []
        for _ in range(12):
            p = [rng.randrange(1, 47) for _ in range(rng.randint(1, 12))]
            try:
                h = eng.submit(req(p, max_tokens=rng.randint(1, 20), ignore_eos=True))
            except Overloaded:
                overloaded.append(seed)
                continue
            action = rng.random()
            if action < 0.2:
                h.cancel()
                outcomes.append(h.result(timeout=30).finish_reason)
            elif action < 0.35:
                del h  # abandoned mid-flight
            else:
                evs = list(h)
                assert isinstance(evs[-1], GenerationResult)
                exp = reference_tokens(p, SamplingParams(max_tokens=evs[-1].usage.completion_tokens or 1,
                                                         ignore_eos=True, temperature=0.0))
                assert list(evs[-1].token_ids) == exp[:len(evs[-1].token_ids)]
                outcomes.append(evs[-1].finish_reason)
        return outcomes

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outcomes = [o for f in [pool.submit(client, s) for s in range(6)] for o in f.result()]
    assert FinishReason.ERROR not in outcomes
    import gc

    gc.collect()
    drained(eng)
    eng.close()


def test_an_engine_over_a_built_instance_takes_the_devices_prefill_chunk():
    """One prefill_chunk rule for Engine(model) and Engine.from_instance: on a CUDA device both take
    default_prefill_chunk("cuda") (from_instance used to take 512 everywhere)."""
    from ninfer.contract.config import default_prefill_chunk

    inst = ledger_instance(slots=1, pages=1000, max_model_len=4096)
    chunks = []
    prefill = inst.program.prefill

    def recorded(sequence_id, max_tokens, *, masks=None):
        chunks.append(max_tokens)
        return prefill(sequence_id, max_tokens, masks=masks)

    inst.program.prefill = recorded
    prompt = [1 + i % 46 for i in range(1500)]
    # "cuda" alone binds no ordinal, so the ledger Program runs on any machine; only the default differs.
    with Engine.from_instance(inst, EngineConfig(max_concurrency=1, device="cuda")) as eng:
        assert eng.config.prefill_chunk == default_prefill_chunk("cuda") == 2048
        assert eng.generate(req(prompt, max_tokens=1, ignore_eos=True)).usage.completion_tokens == 1
    assert chunks == [1500]


def test_startup_options_do_not_apply_to_a_built_instance():
    from ninfer.contract.config import EngineConfig

    with pytest.raises(ValueError, match="already built; startup options dtype, num_pages do not apply"):
        Engine.from_instance(ledger_instance(), config=EngineConfig(device="cpu", dtype="float32",
                                                                    num_pages=3))


# -- speculative decoding's counters ------------------------------------------------------------------
class DraftingLedger(LedgerProgram):
    """Decodes like a speculative Program: each decode row verifies ``DRAFTS`` draft tokens and yields the
    next ``accept(position) + 1`` tokens of the reference chain, so the output is the reference and only the
    tokens per step vary. It writes one position per decode (``decode_span`` 1) and reports the other
    accepted tokens as input to rebuild. ``verified`` logs (drafted, produced) of every row it committed
    uncancelled: the Program's own account the engine's counters must match."""

    DRAFTS = 2

    def __init__(self, *, accept=lambda position: position % 3, **kw) -> None:
        super().__init__(**kw)
        self.accept = accept
        self.verified: list[tuple[int, int]] = []

    def decode(self, sequence_ids: Sequence[int], *, masks=None) -> PendingBatch:
        batch = super().decode(sequence_ids, masks=masks)
        rows = []
        for row in batch.rows:
            s = self.seqs[row.sequence_id]
            history, tokens = [*s.inputs, *row.tokens], list(row.tokens)
            for _ in range(self.accept(len(s.inputs))):
                tokens.append(next_token(history, s.sampling, self.vocab))
                history.append(tokens[-1])
            rows.append(PendingRow(sequence_id=row.sequence_id, tokens=tuple(tokens), drafted=self.DRAFTS))
        return PendingBatch(kind="decode", rows=rows, native=batch.native)

    def commit(self, batch: PendingBatch, decisions: Sequence[RowDecision]) -> None:
        self.verified += [(row.drafted, row.produced) for row, d in zip(batch.rows, decisions, strict=True)
                          if row.drafted and not d.cancelled]
        super().commit(batch, decisions)


def drafting_engine(**program_kw) -> Engine:
    program = DraftingLedger(slots=4, **program_kw)
    inst = ModelInstance(architecture="ledger", config=None, model=None, parameters=None, frontend=TokenFrontend(),
                         program=program)
    return Engine.from_instance(inst, EngineConfig(max_concurrency=4, max_model_len=program.max_model_len,
                                                   prefill_chunk=8, device="cpu"))


def expected_speculative(verified: list[tuple[int, int]]):
    from ninfer.contract.config import MAX_DRAFT_TOKENS
    from ninfer.engine.metrics import SpeculativeStats

    accepted = [produced - 1 for _, produced in verified]
    return SpeculativeStats(drafts=len(verified), draft_tokens=sum(d for d, _ in verified),
                            accepted_tokens=sum(accepted),
                            accepted_per_position=tuple(sum(a > i for a in accepted) for i in range(MAX_DRAFT_TOKENS)))


def test_drafted_rows_count_as_verify_steps_and_accepted_drafts():
    with drafting_engine() as eng:
        handles = [eng.submit(req(p, max_tokens=20)) for p in ([5, 6, 7], [9, 3], [11])]
        for p, h in zip(([5, 6, 7], [9, 3], [11]), handles, strict=True):
            assert list(h.result(timeout=60).token_ids) == reference_tokens(
                p, SamplingParams(max_tokens=20, temperature=0.0))
        verified = eng.instance.program.verified
        assert {p - 1 for _, p in verified} == {0, 1, 2}  # rejections, partial and full acceptance all occur
        spec = eng.metrics().speculative
        assert spec == expected_speculative(verified)
        assert spec.mean_acceptance_length == 1 + spec.accepted_tokens / spec.drafts
        assert spec.acceptance_rate == spec.accepted_tokens / spec.draft_tokens
        drained(eng)


def test_drafts_accepted_past_a_stop_still_count():
    """Verification accepted both drafts; the stop inside the span ends the request, the counters keep both."""
    sampling = SamplingParams(max_tokens=20, temperature=0.0)
    ref = reference_tokens([5, 6, 7], sampling)
    assert ref[2] not in ref[:2]
    with drafting_engine(accept=lambda position: 2) as eng:
        result = eng.generate(req([5, 6, 7], max_tokens=20, stop_token_ids=(ref[2],)), timeout=60)
        assert result.finish_reason is FinishReason.STOP and list(result.token_ids) == ref[:3]
        assert eng.instance.program.verified == [(2, 3)]  # one verify row: 3 tokens, of which the stop keeps 2
        assert eng.metrics().speculative == expected_speculative([(2, 3)])
        assert eng.metrics().speculative.accepted_per_position == (1, 1, 0)
        drained(eng)


def test_a_cancelled_drafted_row_is_not_counted():
    with drafting_engine(accept=lambda position: 2) as eng:
        prog = eng.instance.program
        prog.gate.clear()  # hold the first decode until the request is cancelled
        h = eng.submit(req([1, 2], max_tokens=50, ignore_eos=True))
        assert prog.in_unit.wait(10)
        h.cancel()
        prog.gate.set()
        assert h.result(timeout=10).finish_reason is FinishReason.CANCELLED
        assert prog.cancelled_rows == 1 and prog.verified == []
        assert eng.metrics().speculative == expected_speculative([])
        drained(eng)


def test_the_recorder_counts_each_position_a_row_accepted():
    from ninfer.engine.metrics import MetricsRecorder

    rec = MetricsRecorder()
    assert rec.snapshot(queue_depth=0, running=0, paused=0, outstanding=0, kv_pages_used=0, kv_pages_total=1,
                        failed=False).speculative.mean_acceptance_length is None
    for drafted, accepted in ((3, 3), (3, 0), (2, 1), (1, 1)):
        rec.drafts_verified(drafted, accepted)
    spec = rec.snapshot(queue_depth=0, running=0, paused=0, outstanding=0, kv_pages_used=0, kv_pages_total=1,
                        failed=False).speculative
    assert (spec.drafts, spec.draft_tokens, spec.accepted_tokens, spec.accepted_per_position) == (4, 9, 5, (3, 1, 1))
    assert spec.mean_acceptance_length == 1 + 5 / 4 and spec.acceptance_rate == 5 / 9
    rec.drafts_verified(5, 5)  # a drafter longer than the per-position series: its first positions are counted
    spec = rec.snapshot(queue_depth=0, running=0, paused=0, outstanding=0, kv_pages_used=0, kv_pages_total=1,
                        failed=False).speculative
    assert spec.accepted_per_position == (4, 2, 2) and spec.accepted_tokens == 10
