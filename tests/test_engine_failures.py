"""A failure while serving one request ends that request alone; the engine keeps serving (issue 42, item 1).

On the embedded model in fp32 on the CPU. Failures are injected by wrapping the real Program, OutputSession and
response channel (``FaultyProgram``, ``FaultySession``), and the context cache's manager and the storage a resume
restores into (``FaultyPart``): one call, for one request's sequence, raises. For every
stage of a request (docs/engine.md, "Failure"): the failing request ends with an error naming the stage (503 kind
``memory_exhausted`` when memory ran out, else ``request_failed``); a concurrent neighbour finishes with exactly
the greedy tokens it produces alone; a request submitted afterwards succeeds; the engine never fails; every page,
slot and byte is free afterwards. A device error or a broken invariant still fails the engine, cleanly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import attrs
import pytest
import torch

import ninfer
from ninfer.contract.config import EngineConfig, StartupFeatures
from ninfer.contract.constraint import RegexConstraint
from ninfer.contract.events import FinishReason, GenerationResult, OutputDelta
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine
from ninfer.engine.errors import (
    EngineFailed,
    InvariantBroken,
    MemoryExhausted,
    RequestFailed,
    is_device_error,
    is_fatal,
    is_memory_exhaustion,
    request_failure,
)
from ninfer.engine.startup import build_instance
from ninfer.testing.scheduling import submit_together

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TARGET = "ROMEO: I dream'd a dream to-night."
NEIGHBOUR = "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him."
AFTER = "Now is the winter of our discontent"
TOKENS = 8
CPU_OOM = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate"


# -- the wrappers ------------------------------------------------------------------------------------------
@attrs.define
class Fault:
    """Raise ``exc`` at the first ``times`` calls of ``where`` for which ``when`` holds (``after``: once the real
    call has run); or, with ``result`` set, return it instead of calling."""

    where: str
    exc: BaseException | None = None
    when: Callable[..., bool] = lambda p, *a, **k: True
    times: int = 1
    after: bool = False
    result: object = None


class FaultyProgram:
    """The real Program, one call of which fails; it knows which sequences (and ResumeStates) each prompt has.
    Without PipelinedDecode (the engine calls ``decode``); ``FaultyPipelinedProgram`` has it."""

    def __init__(self, program, faults: list[Fault]) -> None:
        self._program = program
        self._faults = faults
        self.fired: list[str] = []
        self.tried: list[tuple[str, tuple]] = []  # (method, prompt) of every call about a known prompt
        self.prompt_of: dict[object, tuple] = {}  # sequence id or id(ResumeState) -> prompt
        self.live: set[int] = set()

    def __getattr__(self, name):
        if name in ("launch_decode", "collect"):
            raise AttributeError(name)
        return getattr(self._program, name)

    def seqs(self, prompt: tuple) -> set[int]:
        return {k for k, v in self.prompt_of.items() if v == prompt and k in self.live}

    def alone(self, ids, prompt: tuple) -> bool:
        return len(ids) == 1 and self.prompt_of.get(ids[0]) == prompt

    def _call(self, method: str, key, *args, **kw):
        self.tried.append((method, self.prompt_of.get(key) if not isinstance(key, tuple) else key))
        real = getattr(self._program, method)
        for f in self._faults:
            if f.where == f"program.{method}" and f.times > 0 and f.when(self, *args, **kw):
                f.times -= 1
                self.fired.append(method)
                if f.exc is None:
                    return f.result
                if f.after:
                    real(*args, **kw)
                raise f.exc
        return real(*args, **kw)

    def _bound(self, prompt, seq):
        if seq is not None:
            self.prompt_of[seq] = tuple(prompt.token_ids)
            self.live.add(seq)
        return seq

    def open_sequence(self, prompt, sampling):
        return self._bound(prompt, self._call("open_sequence", tuple(prompt.token_ids), prompt, sampling))

    def open_cached(self, prompt, sampling, checkpoint_id):
        return self._bound(prompt, self._call("open_cached", tuple(prompt.token_ids), prompt, sampling,
                                              checkpoint_id))

    def plan_saves(self, sequence_id, positions):
        return self._call("plan_saves", sequence_id, sequence_id, positions)

    def reserve_units(self, sequence_id, tokens):
        return self._call("reserve_units", sequence_id, sequence_id, tokens)

    def prefill(self, sequence_id, max_tokens, *, masks=None):
        return self._call("prefill", sequence_id, sequence_id, max_tokens, masks=masks)

    def decode(self, sequence_ids, *, masks=None):
        return self._call("decode", sequence_ids[0], sequence_ids, masks=masks)

    def commit(self, batch, decisions):
        ids = batch.sequence_ids()
        return self._call("commit", ids[0] if ids else None, batch, decisions)

    def pause(self, sequence_id, mode):
        state = self._call("pause", sequence_id, sequence_id, mode)
        self.prompt_of[id(state)] = self.prompt_of.get(sequence_id)
        self.live.discard(sequence_id)
        return state

    def resume(self, resume_state):
        seq = self._call("resume", id(resume_state), resume_state)
        if seq is not None:
            self.prompt_of[seq] = self.prompt_of.get(id(resume_state))
            self.live.add(seq)
        return seq

    def save_continuation(self, sequence_id, kind):
        return self._call("save_continuation", sequence_id, sequence_id, kind)

    def release(self, sequence_id):
        self._call("release", sequence_id, sequence_id)
        self.live.discard(sequence_id)


class FaultyPipelinedProgram(FaultyProgram):
    def launch_decode(self, sequence_ids, *, after=None, masks=None):
        return self._call("launch_decode", sequence_ids[0], sequence_ids, after=after, masks=masks)

    def collect(self, unit):
        return self._call("collect", unit.sequence_ids[0] if unit.sequence_ids else None, unit)


class FaultyPart:
    """A part below the Program's or the engine's surface (the context cache's manager, the slots and pages a
    resume binds), one call of which fails: ``where`` is ``"<name>.<method>"``, ``when`` gets the real part."""

    def __init__(self, part, name: str, faults: list[Fault]) -> None:
        self._part = part
        self._name = name
        self._faults = faults

    def __getattr__(self, attr):
        real = getattr(self._part, attr)
        if not any(f.where == f"{self._name}.{attr}" for f in self._faults):
            return real

        def call(*args, **kw):
            for f in self._faults:
                if f.where == f"{self._name}.{attr}" and f.times > 0 and f.when(self._part, *args, **kw):
                    f.times -= 1
                    raise f.exc
            return real(*args, **kw)
        return call


class FaultySession:
    def __init__(self, session, faults: list[Fault]) -> None:
        self._session = session
        self._faults = faults

    def __getattr__(self, name):
        return getattr(self._session, name)

    def _call(self, method: str, *args, **kw):
        for f in self._faults:
            if f.where == f"session.{method}" and f.times > 0:
                f.times -= 1
                raise f.exc
        return getattr(self._session, method)(*args, **kw)

    def fill_token_mask(self, out, drafts=()):
        return self._call("fill_token_mask", out, drafts)

    def preview(self, tokens, *, at_length_limit=False):
        return self._call("preview", tokens, at_length_limit=at_length_limit)

    def commit(self, preview):
        return self._call("commit", preview)

    def finish(self, reason):
        return self._call("finish", reason)


class FaultyFrontend:
    """The real Frontend; the target prompt's OutputSession is a FaultySession. ``close`` leaves it open (shared)."""

    def __init__(self, frontend, target: tuple, faults: list[Fault]) -> None:
        self._frontend = frontend
        self._target = target
        self._faults = faults

    def __getattr__(self, name):
        return getattr(self._frontend, name)

    def open_session(self, prompt, sampling, constraint=None):
        session = self._frontend.open_session(prompt, sampling, constraint)
        return FaultySession(session, self._faults) if tuple(prompt.token_ids) == self._target else session

    def close(self) -> None:
        pass


# -- fixtures and helpers --------------------------------------------------------------------------------
def _instance(features: StartupFeatures | None = None):
    config = EngineConfig(device="cpu", dtype="float32", max_concurrency=2, num_pages=256,
                          features=features or StartupFeatures()).for_device("cpu")
    inst, _, artifact = build_instance(ninfer.default_model_path(), config.startup_options())
    artifact.close()
    return inst


@pytest.fixture(scope="module")
def plain(one_cpu_thread):
    """One Qwen3.5 instance shared by the request-level tests (each leaves it all free), with the prompts'
    token ids and each prompt's greedy tokens run alone."""
    inst = _instance()
    tokens = {text: tuple(inst.frontend.prepare(TextInput(text=text)).token_ids)
              for text in (TARGET, NEIGHBOUR, AFTER)}
    with _engine(inst, []) as eng:
        alone = {text: eng.generate(req(text), timeout=120).token_ids for text in (TARGET, NEIGHBOUR, AFTER)}
    yield inst, tokens, alone
    inst.frontend.close()


@pytest.fixture(scope="module")
def speculative(one_cpu_thread):
    inst = _instance(StartupFeatures(speculative="mtp", num_draft_tokens=2))
    yield inst
    inst.frontend.close()


@contextlib.contextmanager
def _engine(inst, faults: list[Fault], *, target: tuple = (), pipelined: bool = True,
            pause_mode: str = "auto") -> Iterator[Engine]:
    """An engine over ``inst`` with its Program and Frontend wrapped, and the parts below them (``FaultyPart``:
    ``cache``, the context cache's manager; ``resume_states`` / ``resume_kv``, the slots and pages a resume
    binds); on exit the context cache is emptied (the Program outlives the engine, its cache index does not)."""
    program = (FaultyPipelinedProgram if pipelined else FaultyProgram)(inst.program, faults)
    frontend = FaultyFrontend(inst.frontend, target, faults)
    paused = inst.program.paused
    real_states, real_kv = paused.states, paused.kv
    paused.states, paused.kv = FaultyPart(real_states, "resume_states", faults), FaultyPart(real_kv, "resume_kv",
                                                                                              faults)
    eng = Engine.from_instance(attrs.evolve(inst, program=program, frontend=frontend), max_concurrency=2,
                               device="cpu", prefill_chunk=8, context_cache=True, pause_mode=pause_mode)
    reuse = eng._core.reuse
    if reuse.manager is not None:  # before any request: the worker has none yet
        reuse.manager = FaultyPart(reuse.manager, "cache", faults)
    try:
        yield eng
    finally:
        paused.states, paused.kv = real_states, real_kv
        if not eng.failed:
            eng.clear_context_cache()
        eng.close()


def req(text: str, **sampling) -> GenerationRequest:
    sampling.setdefault("max_tokens", TOKENS)
    return GenerationRequest(input=TextInput(text=text),
                             sampling=SamplingParams(temperature=0.0, ignore_eos=True, **sampling))


def _all_free(eng: Engine) -> None:
    assert eng.metrics().outstanding == 0
    assert eng.usage().idle, eng.usage()
    eng.clear_context_cache()
    assert eng.usage().all_free, eng.usage()


def _publishes_then(handle, on_delta: Callable[[object], None]) -> None:
    """Wrap the handle's response channel (on the worker, before its next cycle): ``on_delta(channel)`` runs
    at its first OutputDelta, before the delta is published."""
    ch = handle._channel
    real = ch.publish
    seen = []

    def publish(event):
        if isinstance(event, OutputDelta) and not seen:
            seen.append(event)
            on_delta(ch)
        return real(event)

    ch.publish = publish


def _raise(exc: BaseException) -> Callable[[object], None]:
    def fail(channel):
        raise exc
    return fail


def _cancel(channel) -> None:
    channel.cancel()


# -- every stage of a request ------------------------------------------------------------------------------
# (id, the fault, the stage the error names, its kind); T / N: the target's / the neighbour's prompt.
def _stages():
    def resident_target(p, t):
        return bool(p.seqs(t))

    def pressure(t, n):  # the neighbour's reservation is refused until the (younger) target is paused for it
        return Fault("program.reserve_units", result=False, times=99, when=lambda p, seq, k: p.prompt_of.get(seq) == n
                     and resident_target(p, t) and ("pause", t) not in p.tried)

    def saves_of(t):  # the context cache's manager is given checkpoints of the target's prompt
        return lambda m, infos, **k: any(i.tokens == t[:len(i.tokens)] for i in infos)

    return [
        ("admission", lambda t, n: [Fault("program.open_sequence", MemoryError(), lambda p, prompt, s: tuple(
            prompt.token_ids) == t)], "admission", "memory_exhausted"),
        ("admission-restore", lambda t, n: [Fault("program.open_cached", RuntimeError(CPU_OOM), lambda p, prompt, *a:
                                                  tuple(prompt.token_ids) == t)], "admission", "memory_exhausted"),
        # With the context cache: the sequence is bound (fresh, or restored) when planning its save points fails.
        ("admission-plan-saves", lambda t, n: [Fault("program.plan_saves", MemoryError(), lambda p, seq, points:
                                                     p.prompt_of.get(seq) == t)], "admission", "memory_exhausted"),
        ("admission-restore-plan-saves", lambda t, n: [Fault("program.plan_saves", RuntimeError("bad save points"),
                                                             lambda p, seq, points: p.prompt_of.get(seq) == t)],
         "admission", "request_failed"),
        ("admission-save-points", lambda t, n: [Fault("cache.save_points", MemoryError(), lambda m, tokens, *a, **k:
                                                      tuple(tokens) == t)], "admission", "memory_exhausted"),
        ("unit-reservation", lambda t, n: [Fault("program.reserve_units", ValueError("no page table"),
                                                 lambda p, seq, k: p.prompt_of.get(seq) == t
                                                 and p._program.input_remaining(seq) == 0)],
         "unit reservation", "request_failed"),
        ("prefill", lambda t, n: [Fault("program.prefill", torch.OutOfMemoryError("CUDA out of memory"),
                                        lambda p, seq, *a, **k: p.prompt_of.get(seq) == t)],
         "prefill", "memory_exhausted"),
        # The prefill's save points were published, adopting them fails: they must not stay in the store, unknown.
        ("prefill-adopt", lambda t, n: [Fault("cache.adopt", MemoryError(), saves_of(t))], "prefill",
         "memory_exhausted"),
        ("decode-launch", lambda t, n: [Fault("program.launch_decode", MemoryError(),
                                              lambda p, ids, **k: p.alone(ids, t))], "decode launch",
         "memory_exhausted"),
        ("decode-collect", lambda t, n: [Fault("program.collect", RuntimeError("readback failed"),
                                               lambda p, unit: p.alone(unit.sequence_ids, t))], "decode collect",
         "request_failed"),
        ("decode-plain", lambda t, n: [Fault("program.decode", MemoryError(), lambda p, ids, **k: p.alone(ids, t))],
         "decode", "memory_exhausted"),
        ("decode-speculative", lambda t, n: [Fault("program.launch_decode", MemoryError(),
                                                   lambda p, ids, **k: p.alone(ids, t))], "decode launch",
         "memory_exhausted"),
        ("program-commit", lambda t, n: [Fault("program.commit", MemoryError(),
                                               lambda p, batch, d: p.alone(batch.sequence_ids(), t))],
         "Program.commit", "memory_exhausted"),
        ("mask-fill", lambda t, n: [Fault("session.fill_token_mask", MemoryError())], "token mask fill",
         "memory_exhausted"),
        ("session-preview", lambda t, n: [Fault("session.preview", ValueError("matcher rejected its state"))],
         "OutputSession.preview", "request_failed"),
        ("session-commit", lambda t, n: [Fault("session.commit", MemoryError())], "OutputSession.commit",
         "memory_exhausted"),
        ("session-finish", lambda t, n: [Fault("session.finish", RuntimeError("flush failed"))],
         "OutputSession.finish", "request_failed"),
        ("publication", lambda t, n: [], "publication", "memory_exhausted"),
        ("cancellation", lambda t, n: [Fault("session.finish", RuntimeError("flush failed"))], "OutputSession.finish",
         "request_failed"),
        ("pause", lambda t, n: [
            pressure(t, n),
            Fault("program.pause", MemoryError(), times=2, when=lambda p, seq, mode: p.prompt_of.get(seq) == t)],
         "pause", "memory_exhausted"),
        ("resume", lambda t, n: [
            pressure(t, n),
            Fault("program.resume", MemoryError(), when=lambda p, state: p.prompt_of.get(id(state)) == t)],
         "resume", "memory_exhausted"),
        # Inside Program.resume, once its slot (and pages) are bound: restoring the Snapshot's state, or the
        # Replay's pages, fails. Only the target is ever paused.
        ("resume-restore-snapshot", lambda t, n: [pressure(t, n), Fault("resume_states.restore", MemoryError())],
         "resume", "memory_exhausted"),
        ("resume-restore-replay", lambda t, n: [pressure(t, n), Fault("resume_kv.append_fresh", MemoryError())],
         "resume", "memory_exhausted"),
    ]


STAGES = _stages()


@pytest.mark.parametrize(("case", "faults", "stage", "kind"), STAGES, ids=[s[0] for s in STAGES])
def test_a_failure_at_each_stage_ends_that_request_alone(plain, speculative, case, faults, stage, kind):
    inst, tokens, alone = plain
    if case == "decode-speculative":
        inst = speculative
    t, n = tokens[TARGET], tokens[NEIGHBOUR]
    armed = faults(t, n)
    older_neighbour = case.startswith(("pause", "resume"))  # the row under pressure pauses a younger resident
    pause_mode = "replay" if case.endswith("replay") else "auto"
    with _engine(inst, [], target=t, pipelined=case != "decode-plain", pause_mode=pause_mode) as eng:
        prog = eng._core.program
        if case.startswith("admission-restore"):  # the context cache holds the target's prompt: its admission restores
            assert eng.generate(req(TARGET), timeout=120).token_ids == alone[TARGET]
        prog._faults.extend(armed)
        eng.frontend._faults.extend(armed)
        target = req(TARGET)
        if case == "mask-fill":
            target = attrs.evolve(target, constraint=RegexConstraint(pattern="[a-z ]{4,40}"))
        order = [req(NEIGHBOUR), target] if older_neighbour else [target, req(NEIGHBOUR)]

        def submit():
            handles = [eng.submit(r) for r in order]
            h = handles[order.index(target)]
            if case == "publication":
                _publishes_then(h, _raise(MemoryError()))
            elif case == "cancellation":
                _publishes_then(h, _cancel)
            return handles

        handles = eng._core.on_worker(submit)
        failed_handle = handles[order.index(target)]
        neighbour_handle = handles[1 - order.index(target)]
        failed = failed_handle.result(timeout=120)
        neighbour = neighbour_handle.result(timeout=120)
        after = eng.generate(req(AFTER), timeout=120)

        assert all(f.times == 0 for f in armed if f.exc is not None)  # every armed failure happened
        assert failed.finish_reason is FinishReason.ERROR, failed
        err = failed_handle.exception()
        assert isinstance(err, RequestFailed) and err.stage == stage, err
        assert failed.extra["error_kind"] == kind and stage in failed.error, failed.error
        assert isinstance(err, MemoryExhausted) == (kind == "memory_exhausted")
        assert neighbour.finish_reason is FinishReason.LENGTH and neighbour.token_ids == alone[NEIGHBOUR]
        assert after.finish_reason is FinishReason.LENGTH and after.token_ids == alone[AFTER]
        assert not eng.failed and not eng.metrics().failed
        if case.startswith("resume-restore"):
            m = eng.metrics()
            assert (m.preemptions_snapshot, m.preemptions_replay) == ((0, 1) if pause_mode == "replay" else (1, 0))
        _all_free(eng)


def test_a_failed_snapshot_pauses_by_replay_and_the_output_stays_exact(plain):
    inst, tokens, alone = plain
    t, n = tokens[TARGET], tokens[NEIGHBOUR]
    faults = [Fault("program.reserve_units", result=False, times=99, when=lambda p, seq, k: p.prompt_of.get(seq) == n
                    and bool(p.seqs(t)) and ("pause", t) not in p.tried),
              Fault("program.pause", MemoryError(), when=lambda p, seq, mode: p.prompt_of.get(seq) == t
                    and mode == "snapshot")]
    with _engine(inst, faults, target=t) as eng:
        neighbour, target = [h.result(timeout=120) for h in submit_together(eng, [req(NEIGHBOUR), req(TARGET)])]
        assert eng._core.program.fired.count("pause") == 1 and eng.metrics().preemptions_replay == 1
        assert target.finish_reason is FinishReason.LENGTH and target.token_ids == alone[TARGET]
        assert target.timings.preemptions == 1
        assert neighbour.token_ids == alone[NEIGHBOUR] and not eng.failed
        _all_free(eng)


def _finals_of(t: tuple) -> Callable[..., bool]:
    """Whether the context cache's manager is given the target's continuation (kept at its finish)."""
    def finals(m, *args, **k):
        infos = args[2:3] if len(args) > 1 else args[0]  # bind_session(key, order, info) or adopt(infos)
        return any(i.kind == "final" and i.tokens[:len(t)] == t for i in infos)
    return finals


# Saving it fails, or the manager's adoption of what the store saved (the continuation must not stay unknown).
KEEPS = [("save", "program.save_continuation", None), ("adopt", "cache.adopt", None),
         ("bind-session", "cache.bind_session", "conversation")]


@pytest.mark.parametrize(("where", "session_key"), [k[1:] for k in KEEPS], ids=[k[0] for k in KEEPS])
def test_the_context_cache_failing_to_keep_a_finish_still_finishes_it(plain, where, session_key):
    inst, tokens, alone = plain
    t = tokens[TARGET]
    when = (lambda p, seq, kind: p.prompt_of.get(seq) == t) if where.startswith("program") else _finals_of(t)
    faults = [Fault(where, MemoryError(), when)]
    with _engine(inst, faults, target=t) as eng:
        target, neighbour = [h.result(timeout=120) for h in submit_together(
            eng, [attrs.evolve(req(TARGET), session_key=session_key), req(NEIGHBOUR)])]
        assert faults[0].times == 0
        assert target.finish_reason is FinishReason.LENGTH and target.token_ids == alone[TARGET]
        assert neighbour.token_ids == alone[NEIGHBOUR] and not eng.failed
        _all_free(eng)


def test_a_failed_shared_decode_ends_every_row_of_its_unit(plain):
    """Which row of a shared forward failed is unknown: both rows end; the engine goes on."""
    inst, tokens, alone = plain
    t = tokens[TARGET]
    faults = [Fault("program.launch_decode", MemoryError(), lambda p, ids, **k: len(ids) == 2)]
    with _engine(inst, faults, target=t) as eng:
        a, b = [h.result(timeout=120) for h in submit_together(eng, [req(TARGET), req(AFTER)])]
        assert eng._core.program.fired == ["launch_decode"]
        for r in (a, b):
            assert r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "memory_exhausted"
            assert "decode launch" in r.error and r.usage.completion_tokens < TOKENS
        assert eng.generate(req(NEIGHBOUR), timeout=120).token_ids == alone[NEIGHBOUR]
        assert not eng.failed
        _all_free(eng)


# -- what still fails the engine ------------------------------------------------------------------------------
FATAL = [
    ("invariant", [Fault("program.launch_decode", InvariantBroken("two requests hold one sequence"))]),
    ("device-error", [Fault("program.prefill", RuntimeError("CUDA error: an illegal memory access was encountered"))]),
    # A recoverable failure whose rollback fails: the Program cannot free the failed request's sequence.
    ("rollback", [Fault("program.launch_decode", MemoryError()),
                  Fault("program.release", RuntimeError("sequence is pending"))]),
    # Binding raised after it bound a sequence: the Program holds one the engine cannot name.
    ("ledger", [Fault("program.open_sequence", MemoryError(), after=True)]),
]


@pytest.mark.parametrize(("case", "faults"), FATAL, ids=[f[0] for f in FATAL])
def test_a_device_error_or_broken_invariant_still_fails_the_engine_cleanly(case, faults):
    inst = _instance()  # its own Program: a failed engine's state is not reused
    try:
        with _engine(inst, faults) as eng:
            handles = submit_together(eng, [req(TARGET, max_tokens=64), req(NEIGHBOUR, max_tokens=64)])
            results = [h.result(timeout=120) for h in handles]  # every response ends: nothing hangs
            assert eng._core.program.fired
            kinds = [r.extra["error_kind"] for r in results if r.finish_reason is FinishReason.ERROR]
            assert len(kinds) == len(results) and "engine_failed" in kinds, results
            # Binding failed before the ledger check found what it left: that request had ended already.
            assert set(kinds) == ({"engine_failed", "memory_exhausted"} if case == "ledger" else {"engine_failed"})
            assert eng.failed and eng.metrics().failed and eng.metrics().outstanding == 0
            with pytest.raises(EngineFailed):
                eng.submit(req(AFTER))
    finally:
        inst.frontend.close()


# -- the gateway ------------------------------------------------------------------------------------------------
def test_the_gateway_answers_503_for_memory_and_health_stays_ok(plain):
    from starlette.testclient import TestClient

    from ninfer_serve.app import create_app

    inst, _, _ = plain
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0.0}
    faults = [Fault("program.prefill", MemoryError())]  # the first prefill: the first request's
    with _engine(inst, faults) as eng, TestClient(create_app(eng)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.headers["Retry-After"], r.text
        error = r.json()["error"]
        assert error["code"] == "memory_exhausted" and "prefill" in error["message"] and "retry" in error["message"]
        assert c.get("/health").json() == {"status": "ok"}
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert c.get("/health").status_code == 200
        _all_free(eng)


def test_an_unexpected_failure_answers_500_without_its_text(plain):
    from starlette.testclient import TestClient

    from ninfer_serve.app import create_app

    inst, _, _ = plain
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0.0}
    faults = [Fault("program.prefill", ValueError("secret internal detail"))]
    with _engine(inst, faults) as eng, TestClient(create_app(eng)) as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed", r.text
        assert "secret" not in r.text
        assert c.get("/health").status_code == 200
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        _all_free(eng)


# -- how failures are sorted ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("exc", "memory", "fatal"), [
    (MemoryError(), True, False),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True, False),
    (RuntimeError(CPU_OOM), True, False),
    (RuntimeError("CUDA error: out of memory"), True, False),
    (RuntimeError("CUDA error: device-side assert triggered"), False, True),
    (InvariantBroken("settled twice"), False, True),
    (AssertionError("lane overflow"), False, True),
    (KeyboardInterrupt(), False, True),
    (ValueError("the matcher's state is gone"), False, False),
    (RuntimeError("shape mismatch"), False, False),
])
def test_failures_are_sorted_into_fatal_memory_and_request_level(exc, memory, fatal):
    assert is_memory_exhaustion(exc) is memory
    assert is_fatal(exc) is fatal
    assert not (memory and is_device_error(exc))
    err = request_failure("r1", "prefill", exc)
    assert isinstance(err, MemoryExhausted) is memory and err.stage == "prefill" and err.__cause__ is exc
    assert "r1" in str(err) and "prefill" in str(err) and type(exc).__name__ in str(err)
    assert err.http_status == (503 if memory else 500)


def test_the_final_result_is_the_last_event_even_when_publishing_it_fails(plain):
    """A failure while publishing the final result still ends the response (a bare error result)."""
    inst, tokens, alone = plain
    with _engine(inst, []) as eng:
        def submit():
            h = eng.submit(req(AFTER))
            ch, real, failed = h._channel, h._channel.publish, []

            def publish(event):
                if isinstance(event, GenerationResult) and not failed:
                    failed.append(event)
                    raise MemoryError()
                return real(event)

            ch.publish = publish
            return h

        h = eng._core.on_worker(submit)
        r = h.result(timeout=120)
        assert r.finish_reason is FinishReason.ERROR and r.extra["error_kind"] == "memory_exhausted"
        assert "publication" in r.error
        assert eng.generate(req(AFTER), timeout=120).token_ids == alone[AFTER] and not eng.failed
        _all_free(eng)


def test_a_final_result_with_the_memory_kind_maps_to_503_with_retry_after():
    from ninfer_serve.errors import from_error_result

    err = from_error_result("request r ended at decode launch: the server ran out of memory (MemoryError); retry "
                            "later", "memory_exhausted", request_id="r")
    assert err.status == 503 and err.headers["Retry-After"] and err.code == "memory_exhausted"
    assert "decode launch" in err.message
