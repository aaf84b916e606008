"""Failures inside the context cache's work, a pause or a resume end that request alone (issue 42, item 1).

The same cases as ``test_engine_failures.py`` (``ninfer.testing.faults.stage_fails_alone``) where the failure
comes after a partial step: a sequence bound before its save points were planned, a checkpoint slot taken
before its copy, a lease taken before the manager's update, saves published before their adoption, a host copy
begun at an eviction, a paused state made before the release, a slot bound before a restore. What each bound
must be freed (or kept consistent), or the ledger check turns one request's failure into a dead engine.
"""

from __future__ import annotations

import attrs
import pytest

from ninfer.contract.events import FinishReason
from ninfer.testing.faults import (
    AFTER,
    CPU_OOM,
    NEIGHBOUR,
    TARGET,
    Fault,
    all_free,
    faulty_engine,
    instance,
    prefix_of,
    pressure,
    req,
    stage_fails_alone,
)
from ninfer.testing.scheduling import submit_together

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

def _checkpoint_of(t):
    """Whether the store's checkpoint ``cid`` is of the target's prompt."""
    return lambda store, cid: prefix_of(t)(store.checkpoint(cid).tokens)


def _saves_of(t):  # the context cache's manager is given checkpoints of the target's prompt
    return lambda m, infos, **k: any(prefix_of(t)(i.tokens) for i in infos)


def _target_record(t):  # a SequenceRecord of the target's prompt
    return lambda kv, seq, length: tuple(seq.ledger[:len(t)]) == t


def _target_id(t):  # the id of a sequence of the target's prompt, in the sequence table
    return lambda table, seq: tuple(table.get(seq).ledger[:len(t)]) == t


# (id, the fault, the stage the error names, its kind); t / n: the target's / the neighbour's prompt.
# "admission-restore*": the context cache holds the target's prompt first, its admission restores.
STAGES = [
    ("admission-restore", lambda t, n: [Fault("program.open_cached", RuntimeError(CPU_OOM), lambda p, prompt, *a:
                                              tuple(prompt.token_ids) == t)], "admission", "memory_exhausted"),
    # The sequence is bound (fresh, or restored) when planning its save points fails.
    ("admission-plan-saves", lambda t, n: [Fault("program.plan_saves", MemoryError(), lambda p, seq, points:
                                                 p.prompt_of.get(seq) == t)], "admission", "memory_exhausted"),
    ("admission-restore-plan-saves", lambda t, n: [Fault("program.plan_saves", RuntimeError("bad save points"),
                                                         lambda p, seq, points: p.prompt_of.get(seq) == t)],
     "admission", "request_failed"),
    ("admission-save-points", lambda t, n: [Fault("cache.save_points", MemoryError(), lambda m, tokens, *a, **k:
                                                  tuple(tokens) == t)], "admission", "memory_exhausted"),
    # A bug in the save points is the server's failure (500), not an unrepresentable request (400).
    ("admission-save-points-bug", lambda t, n: [Fault("cache.save_points", ValueError("a point past the prompt"),
                                                      lambda m, tokens, *a, **k: tuple(tokens) == t)],
     "admission", "request_failed"),
    # The store leased the checkpoint, the manager's update of it fails: the lease must be given back.
    ("admission-restore-lease", lambda t, n: [Fault("cache_index.add", MemoryError(), lambda idx, info, **k:
                                                    prefix_of(t)(info.tokens))], "admission", "memory_exhausted"),
    # A save point's checkpoint took its slot, its KV prefix fails: the slot must not stay taken.
    ("prefill-save", lambda t, n: [Fault("checkpoint_kv.save_prefix", MemoryError(), _target_record(t))], "prefill",
     "memory_exhausted"),
    # The prefill's save points were published, adopting them fails: they must not stay in the store, unknown.
    ("prefill-adopt", lambda t, n: [Fault("cache.adopt", MemoryError(), _saves_of(t))], "prefill",
     "memory_exhausted"),
    # The unit fails once its save was published; retiring that save at the neighbour's next unit fails once:
    # the neighbour goes on and the save is retired later.
    ("prefill-unadopted", lambda t, n: [
        Fault("program.prefill", MemoryError(), lambda p, seq, *a, **k: p.prompt_of.get(seq) == t, after=True),
        Fault("cache_store.retire", RuntimeError("retire failed"), _checkpoint_of(t))], "prefill", "memory_exhausted"),
    ("pause", lambda t, n: [
        pressure(t, n),
        Fault("program.pause", MemoryError(), times=2, when=lambda p, seq, mode: p.prompt_of.get(seq) == t)],
     "pause", "memory_exhausted"),
    # The paused state is made, releasing the sequence fails (Snapshot, then the Replay retry): no state is held.
    ("pause-release", lambda t, n: [
        pressure(t, n), Fault("sequences.release", RuntimeError("row is pending"), _target_id(t), times=2)],
     "pause", "request_failed"),
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


@pytest.mark.parametrize(("case", "faults", "stage", "kind"), STAGES, ids=[s[0] for s in STAGES])
def test_a_failure_in_the_cache_a_pause_or_a_resume_ends_that_request_alone(fault_model, case, faults, stage, kind):
    pause_mode = "replay" if case.endswith("replay") else "auto"
    m = stage_fails_alone(fault_model, case, faults, stage, kind, warm=TARGET if case.startswith(
        "admission-restore") else None, older_neighbour=case.startswith(("pause", "resume")), pause_mode=pause_mode)
    if case.startswith("resume-restore"):
        assert (m.preemptions_snapshot, m.preemptions_replay) == ((0, 1) if pause_mode == "replay" else (1, 0))


@pytest.fixture(scope="module")
def one_slot(one_cpu_thread):
    """The embedded model with one checkpoint slot: every save evicts the checkpoint before it."""
    inst = instance(checkpoint_slots=1)
    yield inst
    inst.frontend.close()


def test_a_failed_host_copy_at_an_eviction_leaves_the_checkpoint_on_the_device(fault_model, one_slot):
    """The session's continuation holds the only slot; the target's first save evicts it to the host, where
    the allocation fails: the target ends, the continuation stays as it was (no host copy it lacks), and the
    neighbour's save evicts it to the host after all."""
    def faults(t, n):
        return [Fault("checkpoint_pool.read_to_host", MemoryError())]

    m = stage_fails_alone(fault_model, "evict-to-host", faults, "prefill", "memory_exhausted", inst=one_slot,
                          warm=AFTER, session="chat")
    assert m.cache_evictions["host"] == 1


def test_a_failed_snapshot_pauses_by_replay_and_the_output_stays_exact(fault_model):
    t, n = fault_model.tokens[TARGET], fault_model.tokens[NEIGHBOUR]
    faults = [pressure(t, n), Fault("program.pause", MemoryError(), when=lambda p, seq, mode: p.prompt_of.get(seq) == t
                                    and mode == "snapshot")]
    with faulty_engine(fault_model.inst, faults, target=t) as eng:
        neighbour, target = [h.result(timeout=120) for h in submit_together(eng, [req(NEIGHBOUR), req(TARGET)])]
        assert eng._core.program.fired.count("pause") == 1 and eng.metrics().preemptions_replay == 1
        assert target.finish_reason is FinishReason.LENGTH and target.token_ids == fault_model.alone[TARGET]
        assert target.timings.preemptions == 1
        assert neighbour.token_ids == fault_model.alone[NEIGHBOUR] and not eng.failed
        all_free(eng)


def _finals_of(t: tuple):
    """Whether the context cache's manager is given the target's continuation (kept at its finish)."""
    def finals(m, *args, **k):
        infos = args[2:3] if len(args) > 1 else args[0]  # bind_session(key, order, info) or adopt(infos)
        return any(i.kind == "final" and i.tokens[:len(t)] == t for i in infos)
    return finals


# Saving it fails, or the manager's adoption of what the store saved (the continuation must not stay unknown).
KEEPS = [("save", "program.save_continuation", None), ("adopt", "cache.adopt", None),
         ("bind-session", "cache.bind_session", "conversation")]


@pytest.mark.parametrize(("where", "session_key"), [k[1:] for k in KEEPS], ids=[k[0] for k in KEEPS])
def test_the_context_cache_failing_to_keep_a_finish_still_finishes_it(fault_model, where, session_key):
    t = fault_model.tokens[TARGET]
    when = (lambda p, seq, kind: p.prompt_of.get(seq) == t) if where.startswith("program") else _finals_of(t)
    faults = [Fault(where, MemoryError(), when)]
    with faulty_engine(fault_model.inst, faults, target=t) as eng:
        target, neighbour = [h.result(timeout=120) for h in submit_together(
            eng, [attrs.evolve(req(TARGET), session_key=session_key), req(NEIGHBOUR)])]
        assert faults[0].times == 0
        assert target.finish_reason is FinishReason.LENGTH and target.token_ids == fault_model.alone[TARGET]
        assert neighbour.token_ids == fault_model.alone[NEIGHBOUR] and not eng.failed
        all_free(eng)
