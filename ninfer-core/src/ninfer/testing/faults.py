"""Failure injection for the engine's failure tests (docs/engine.md, "Failure").

The real Program, OutputSession and the parts below them are wrapped so that one call, for one request,
raises: ``FaultyProgram`` (the Program's surface), ``FaultySession`` / ``FaultyFrontend`` (the target
prompt's OutputSession) and ``FaultyPart`` (a part below: the context cache's manager, its store and
index, the sequence table, the checkpoint store's KV and pool, the slots and pages a resume binds).
``faulty_engine`` builds an Engine over an instance with all of them in place; ``stage_fails_alone``
runs one failure case: the target ends with the stage's error, a neighbour and a later request finish
with the tokens they produce alone, the engine stays up and everything is free afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import attrs

from ninfer.contract.config import EngineConfig, StartupFeatures
from ninfer.contract.constraint import RegexConstraint
from ninfer.contract.events import FinishReason, OutputDelta
from ninfer.contract.prompt import TextInput
from ninfer.contract.request import GenerationRequest, SamplingParams
from ninfer.engine.engine import Engine
from ninfer.engine.errors import MemoryExhausted, RequestFailed

TARGET = "ROMEO: I dream'd a dream to-night."
NEIGHBOUR = "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him."
AFTER = "Now is the winter of our discontent"
TOKENS = 8
CPU_OOM = "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate"


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
    """A part below the Program's or the engine's surface, one call of which fails: ``where`` is
    ``"<name>.<method>"``, ``when`` gets the real part and the call's arguments."""

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

    def __iter__(self):
        return iter(self._part)

    def __contains__(self, item) -> bool:
        return item in self._part


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

    def open_session(self, prompt, sampling, constraint=None, *, cancel=None):
        session = self._frontend.open_session(prompt, sampling, constraint, cancel=cancel)
        return FaultySession(session, self._faults) if tuple(prompt.token_ids) == self._target else session

    def close(self) -> None:
        pass


# -- instances and engines ---------------------------------------------------------------------------------
def instance(features: StartupFeatures | None = None, **config):
    """The embedded model in fp32 on the CPU (``config``: more EngineConfig fields, e.g. ``checkpoint_slots``)."""
    import ninfer
    from ninfer.engine.startup import build_instance

    options = EngineConfig(device="cpu", dtype="float32", max_concurrency=2, num_pages=256,
                           features=features or StartupFeatures(), **config).for_device("cpu")
    inst, _, artifact = build_instance(ninfer.default_model_path(), options.startup_options())
    artifact.close()
    return inst


def req(text: str, **sampling) -> GenerationRequest:
    sampling.setdefault("max_tokens", TOKENS)
    return GenerationRequest(input=TextInput(text=text),
                             sampling=SamplingParams(temperature=0.0, ignore_eos=True, **sampling))


@attrs.frozen
class Prompts:
    """An instance, the prompts' token ids and each prompt's greedy tokens run alone."""

    inst: object
    tokens: dict[str, tuple[int, ...]]
    alone: dict[str, tuple[int, ...]]


def prompts_alone(inst) -> Prompts:
    texts = (TARGET, NEIGHBOUR, AFTER)
    tokens = {text: tuple(inst.frontend.prepare(TextInput(text=text)).token_ids) for text in texts}
    with faulty_engine(inst, []) as eng:
        alone = {text: eng.generate(req(text), timeout=120).token_ids for text in texts}
    return Prompts(inst, tokens, alone)


# (owner path from the Program, attribute, the FaultyPart's name)
_PROGRAM_PARTS = ((("paused",), "states", "resume_states"), (("paused",), "kv", "resume_kv"),
                  (("checkpoints",), "kv", "checkpoint_kv"), (("checkpoints",), "pool", "checkpoint_pool"),
                  ((), "sequences", "sequences"))


@contextlib.contextmanager
def faulty_engine(inst, faults: list[Fault], *, target: tuple = (), pipelined: bool = True,
                  pause_mode: str = "auto") -> Iterator[Engine]:
    """An engine over ``inst`` with its Program and Frontend wrapped, and the parts below them (``FaultyPart``:
    ``resume_states`` / ``resume_kv``, the slots and pages a resume binds; ``checkpoint_kv`` /
    ``checkpoint_pool``, the checkpoint store's; ``sequences``, the sequence table; ``cache``, the context
    cache's manager, with its ``cache_store`` and ``cache_index``). Faults added to ``faults`` later apply too.
    On exit the parts are put back and the context cache is emptied (the Program outlives the engine, its cache
    index does not)."""
    program = (FaultyPipelinedProgram if pipelined else FaultyProgram)(inst.program, faults)
    frontend = FaultyFrontend(inst.frontend, target, faults)
    swapped = []
    for path, attr, name in _PROGRAM_PARTS:
        owner = inst.program
        for step in path:
            owner = getattr(owner, step)
        real = getattr(owner, attr)
        setattr(owner, attr, FaultyPart(real, name, faults))
        swapped.append((owner, attr, real))
    config = EngineConfig(max_concurrency=2, device="cpu", prefill_chunk=8, context_cache=True, pause_mode=pause_mode)
    eng = Engine.from_instance(attrs.evolve(inst, program=program, frontend=frontend), config)
    reuse = eng._core.reuse
    if reuse.manager is not None:  # before any request: the worker has none yet
        manager = reuse.manager
        manager.store = FaultyPart(manager.store, "cache_store", faults)
        manager._index = FaultyPart(manager._index, "cache_index", faults)
        reuse.manager = FaultyPart(manager, "cache", faults)
    try:
        yield eng
    finally:
        for owner, attr, real in reversed(swapped):
            setattr(owner, attr, real)
        if not eng.failed:
            eng.clear_context_cache()
        eng.close()


def all_free(eng: Engine) -> None:
    assert eng.metrics().outstanding == 0
    assert eng.usage().idle, eng.usage()
    eng.clear_context_cache()
    assert eng.usage().all_free, eng.usage()


def publishes_then(handle, on_delta: Callable[[object], None]) -> None:
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


def raising(exc: BaseException) -> Callable[[object], None]:
    def fail(channel):
        raise exc
    return fail


def cancel(channel) -> None:
    channel.cancel()


# -- one failure case --------------------------------------------------------------------------------------------
def pressure(t: tuple, n: tuple) -> Fault:
    """The neighbour's reservation is refused until the (younger) target has been paused for it."""
    return Fault("program.reserve_units", result=False, times=99, when=lambda p, seq, k: p.prompt_of.get(seq) == n
                 and bool(p.seqs(t)) and ("pause", t) not in p.tried)


def prefix_of(t: tuple) -> Callable[[tuple], bool]:
    return lambda tokens: tuple(tokens) == t[:len(tokens)]


def stage_fails_alone(model: Prompts, case: str, faults: Callable[[tuple, tuple], list[Fault]], stage: str,
                      kind: str, *, inst=None, warm: str | None = None, session: str | None = None,
                      older_neighbour: bool = False, pause_mode: str = "auto", pipelined: bool = True):
    """Run the target and a neighbour together with ``faults(target, neighbour)`` armed, then a later request.
    The target ends with ``stage``'s error of ``kind``; the others finish with their tokens alone; the engine
    stays up; everything is free afterwards. ``warm``: a prompt run first, with the session key ``session`` (what it leaves in the
    context cache: the target's prompt, and its admission restores); ``older_neighbour``: the neighbour is submitted first. Returns the engine's metrics at the end."""
    inst = inst if inst is not None else model.inst
    t, n = model.tokens[TARGET], model.tokens[NEIGHBOUR]
    armed: list[Fault] = []
    with faulty_engine(inst, armed, target=t, pipelined=pipelined, pause_mode=pause_mode) as eng:
        if warm is not None:
            first = eng.generate(attrs.evolve(req(warm), session_key=session), timeout=120)
            assert first.token_ids == model.alone[warm]
        armed.extend(faults(t, n))
        target = req(TARGET)
        if case == "mask-fill":
            target = attrs.evolve(target, constraint=RegexConstraint(pattern="[a-z ]{4,40}"))
        order = [req(NEIGHBOUR), target] if older_neighbour else [target, req(NEIGHBOUR)]

        def submit():
            handles = [eng.submit(r) for r in order]
            h = handles[order.index(target)]
            if case == "publication":
                publishes_then(h, raising(MemoryError()))
            elif case == "cancellation":
                publishes_then(h, cancel)
            return handles

        handles = eng._core.on_worker(submit)
        failed_handle = handles[order.index(target)]
        neighbour_handle = handles[1 - order.index(target)]
        failed = failed_handle.result(timeout=120)
        neighbour = neighbour_handle.result(timeout=120)
        after = eng.generate(req(AFTER), timeout=120)

        assert all(f.times == 0 for f in armed if f.exc is not None), armed  # every armed failure happened
        assert failed.finish_reason is FinishReason.ERROR, failed
        err = failed_handle.exception()
        assert isinstance(err, RequestFailed) and err.stage == stage, err
        assert failed.extra["error_kind"] == kind and stage in failed.error, failed.error
        assert isinstance(err, MemoryExhausted) == (kind == "memory_exhausted")
        assert neighbour.finish_reason is FinishReason.LENGTH and neighbour.token_ids == model.alone[NEIGHBOUR]
        assert after.finish_reason is FinishReason.LENGTH and after.token_ids == model.alone[AFTER]
        assert not eng.failed and not eng.metrics().failed
        all_free(eng)
        return eng.metrics()
