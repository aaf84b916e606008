"""EngineCore: the one worker that owns request state, the Scheduler and the Program.

Where a request's token goes, from the Program to the consumer:

1. ``Program.decode`` / ``prefill`` (or ``launch_decode`` + ``collect``) returns a PendingBatch: each
   row holds a sequence's provisional tokens (this module runs the units).
2. ``commit.BatchCommit.consume`` takes the batch whole: the request's ``OutputSession.preview`` decides
   how many tokens it keeps and whether they end it; ``Program.commit`` takes every row's decision at
   once; then per row the budget and timing accounting, ``OutputSession.commit`` and
   ``RequestRecord.publish_output``, which appends the delta to the request's ``ResponseChannel``.
3. The consumer's ``GenerationHandle`` (``handle.py``) reads the channel: ``OutputDelta`` events, then
   the ``GenerationResult`` that ``settlement.Settlement.finish`` publishes once the request ends.

The parts, one concept each: ``ingress.Ingress`` (what other threads touch: submissions, wake-ups,
outstanding places, calls onto the worker), ``policy.CyclePolicy`` (resume, unit permits and pressure,
fresh admission, pipelined-decode steadiness), ``commit.BatchCommit`` (PendingBatch consumption and
publication), ``settlement.Settlement`` (finish, complete, cancellations, shutdown, failure), and
``worker_state.WorkerState`` (what they share). Only the worker thread runs the last four.

One worker cycle (design document, "worker cycle"):
1. take new submissions; settle cancellations, deadlines and queue timeouts at this stable boundary;
2. on a capacity event, try the oldest paused request's full resume (one protected recovery at a time);
3. unit permits per resident row, protected recovery first, then ticket order; pressure pauses the
   youngest resident (Snapshot when host room allows, possibly after revoking cheaper paused
   Snapshots, else Replay);
4. fresh admission in submission order with what is left (bounded bypass of paused requests);
5. one compact decode batch of the actual B, then one prefill/Replay chunk.

A step that raises ends the requests it serves, not the engine (``Settlement.recover``; design document,
"Failure"): a unit's rows end with a request-level error naming the step, its pending work aborted. Only a
device error, a broken invariant or a failed rollback fails the engine (every response ends, new work
is refused).
"""

from __future__ import annotations

import logging
import threading
import time

from ninfer import fast_paths
from ninfer.contract.config import EngineConfig
from ninfer.contract.model import Frontend, PipelinedDecode, Program
from ninfer.engine import exit_hook
from ninfer.engine.commit import BatchCommit
from ninfer.engine.errors import EngineClosed, is_fatal
from ninfer.engine.ingress import Ingress
from ninfer.engine.metrics import EngineMetrics, MetricsRecorder
from ninfer.engine.policy import CyclePolicy
from ninfer.engine.request import RequestRecord, RequestState
from ninfer.engine.reuse import Reuse
from ninfer.engine.scheduler import Scheduler
from ninfer.engine.settlement import Settlement
from ninfer.engine.token_masks import SessionMasks
from ninfer.engine.worker_state import WorkerState

log = logging.getLogger(__name__)

OBSERVE_INTERVAL_S = 0.05


class EngineCore:
    def __init__(self, program: Program, frontend: Frontend, config: EngineConfig) -> None:
        """``config`` is resolved: ``device``, ``prefill_chunk`` and ``max_model_len`` fixed."""
        if config.device is None or config.prefill_chunk is None or config.max_model_len is None:
            raise ValueError("EngineCore needs a resolved EngineConfig (for_device, then for_model)")
        fast_paths.log_unavailable(config.device)  # a missing one costs speed, not results: say it at start
        self.program = program
        self.frontend = frontend
        self.config = config
        self.metrics = MetricsRecorder()
        self.scheduler = Scheduler(max_concurrency=config.max_concurrency, bypass_limit=config.bypass_limit)
        self.reuse = Reuse(program, self.metrics, enabled=config.context_cache,
                           grid=config.checkpoint_grid or config.prefill_chunk)
        self.state = WorkerState(program=program, scheduler=self.scheduler, metrics=self.metrics, reuse=self.reuse,
                                 device=config.device)
        self.ingress = Ingress(outstanding_limit=config.max_queue + config.max_concurrency, metrics=self.metrics)
        self.settlement = Settlement(self.state)
        self.commit = BatchCommit(self.state, self.settlement, max_model_len=config.max_model_len,
                                  token_text=frontend.token_text)
        self.policy = CyclePolicy(self.state, self.settlement, self.ingress, prefill_chunk=config.prefill_chunk,
                                  pause_mode=config.pause_mode, max_model_len=config.max_model_len)
        self.masks = SessionMasks(self.state.by_seq)
        self.pipelined = isinstance(program, PipelinedDecode)
        self.kv_pages = self._kv_pages()
        self._next_observe = 0.0
        self.thread = threading.Thread(target=self._run, name="ninfer-engine-worker", daemon=True)
        self.ingress.worker = self.thread
        exit_hook.track(self)  # interpreter exit closes it: a daemon worker frozen inside torch aborts the exit
        self.thread.start()

    # == any thread ==================================================================================
    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        self.ingress.request_close(drain=drain)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def on_worker(self, fn, timeout: float | None = 30.0):
        """Run ``fn()`` on the worker between cycles (the Program is worker-only) and return its result."""
        return self.ingress.on_worker(fn, timeout)

    def snapshot_metrics(self) -> EngineMetrics:
        s = self.scheduler
        used, cached, total = self.kv_pages  # as of the worker's last cycle: /metrics never waits for a unit
        inbox, outstanding, failed = self.ingress.counts()
        return self.metrics.snapshot(queue_depth=len(s.waiting) + inbox, running=len(s.residents),
                                     paused=len(s.paused), outstanding=outstanding, kv_pages_used=used,
                                     kv_pages_total=total, kv_pages_cached=cached, failed=failed)

    # == worker ======================================================================================
    def _run(self) -> None:
        try:
            bind_device(self.config.device)
            while True:
                new, closing, drain = self.ingress.take()
                self.ingress.serve_calls()
                for rec in new:
                    self.scheduler.enqueue(rec)
                    self.state.admission_event = True
                if closing and not drain:
                    self._drop_ahead()
                    self.settlement.settle_all(EngineClosed("engine closed before the request finished"))
                    return
                progressed = self._cycle()
                self._observe(idle=not progressed)
                if closing and not self.state.busy():
                    return
                if not progressed:
                    self.ingress.idle_wait(self._next_timer())
        except BaseException as exc:  # device error or broken invariant: fail every response, refuse new work
            log.exception("engine worker failed")
            self.settlement.fail(exc, self.ingress.fail(exc))
        finally:
            self.ingress.stop()
            self.masks.close()

    def _observe(self, *, idle: bool) -> None:
        """Refresh what /metrics reads of the Program's ledger and the context cache: when the worker goes
        idle, else at most every OBSERVE_INTERVAL_S (counting the cache's pages walks every checkpoint's
        block table, too much to repeat on every decode step)."""
        now = time.monotonic()
        if idle or now >= self._next_observe:
            self._next_observe = now + OBSERVE_INTERVAL_S
            try:
                self.kv_pages = self._kv_pages()
                self.reuse.record_stats()
            except Exception as exc:  # observation serves no request: /metrics keeps the last reading
                if is_fatal(exc):
                    raise
                log.exception("reading the Program's ledger for /metrics failed")

    def _kv_pages(self) -> tuple[int, int, int]:
        """Pages requests hold, pages only the context cache holds (reclaimable on demand), and the pool."""
        u = self.program.usage()
        return u.kv_pages_used - u.cache_pages, u.cache_pages, u.kv_pages_total

    def _next_timer(self) -> float | None:
        """Seconds until the nearest deadline or queue timeout (at most 1 s)."""
        now, best = time.monotonic(), None
        for rec in self.state.live():
            for t in (rec.deadline_at, rec.queue_deadline_at if rec.state is RequestState.WAITING else None):
                if t is not None and (best is None or t < best):
                    best = t
        if best is None:
            return 1.0
        return max(0.0, min(1.0, best - now))

    def _cycle(self) -> bool:
        st, policy = self.state, self.policy
        st.changed = False
        if st.ahead is not None:
            self._advance_pipeline()
            return True
        self.settlement.settle_interrupted()
        policy.try_resume()
        decode_rows = policy.grant_decode_permits()
        policy.admit_fresh()
        prefill_rec = policy.grant_prefill_permit()
        decode_rows = [r for r in decode_rows if r.state is RequestState.DECODE_READY and r.sequence_id is not None]
        progressed = False
        if decode_rows:
            self._run_decode(decode_rows)
            progressed = True
        if prefill_rec is not None and prefill_rec.resident:
            self._run_prefill(prefill_rec)
            progressed = True
        return progressed or st.changed

    def _run_decode(self, rows: list[RequestRecord]) -> None:
        """One decode unit over ``rows`` (launched, with a PipelinedDecode Program). Its forward is shared:
        which row a failure belongs to is unknown, so every row of a failed unit ends."""
        ids = [r.sequence_id for r in rows]
        stage = "decode launch" if self.pipelined else "decode"
        try:
            masks = self.masks.wanted(rows)
            if self.pipelined:  # collected next cycle (after this cycle's prefill chunk is queued behind it)
                self.state.ahead = (self.program.launch_decode(ids, masks=masks), rows)
            else:
                self.commit.consume(self.program.decode(ids, masks=masks), rows)
        except Exception as exc:
            self.settlement.recover(stage, rows, exc)

    def _advance_pipeline(self) -> None:
        """Collect the launched decode step; when the decode phase is steady, first queue the next step
        behind it on its device-resident tokens, so the device runs while the host settles this one."""
        st = self.state
        unit, rows = st.ahead
        st.ahead = None
        # Cancellations, deadlines and queue timeouts settle every cycle, pipelined or not (a resident ended
        # here is released; its launched row is left out when the unit is collected).
        self.settlement.settle_interrupted()
        try:
            if self.policy.steady(rows):  # a constrained row's sampling waits until the step it follows commits
                nxt = self.program.launch_decode(unit.sequence_ids, after=unit, masks=self.masks.wanted(rows))
                st.ahead = (nxt, rows)
        except Exception as exc:  # the chained step failed: the step it follows is aborted, their rows end
            self.settlement.recover("decode launch", [r for r in rows if r.resident], exc, launched=unit)
            return
        try:
            batch = self.program.collect(unit)
        except Exception as exc:  # the rows of the step (and of the one chained behind it) end
            self.settlement.recover("decode collect", [r for r in rows if r.resident], exc, launched=unit)
            return
        self.commit.consume(batch, [st.by_seq[i] for i in batch.sequence_ids()])

    def _run_prefill(self, rec: RequestRecord) -> None:
        """One prefill/Replay chunk of ``rec`` (one row: a failure is this request's alone)."""
        try:
            self.reuse.before_prefill(rec)
            batch = self.program.prefill(rec.sequence_id, self.policy.chunk(rec), masks=self.masks.wanted((rec,)))
            self.state.inflight = batch  # aborted if what follows fails before its commit
            if self.reuse.after_prefill():  # a save another request waits for may have landed
                self.state.admission_event = True
            if batch is not None:
                self.commit.consume(batch, [rec])
        except Exception as exc:
            self.settlement.recover("prefill", [rec], exc)
            return
        if batch is None and rec.resident:
            # Input done without a token: the prompt's last token is the first decode input (a save point).
            self.state.set_input_state(rec)

    def _drop_ahead(self) -> None:
        """Abandon a launched step (shutdown): its rows return to their committed frontier."""
        st = self.state
        if st.ahead is not None:
            unit, _ = st.ahead
            st.ahead = None
            self.program.abort_pending(self.program.collect(unit))


def bind_device(device: str | None) -> None:
    """The worker binds its CUDA device before executing ("cuda" alone keeps the current device)."""
    if device is None or not str(device).startswith("cuda"):
        return
    import torch

    dev = torch.device(device)
    if dev.index is not None:
        torch.cuda.set_device(dev)
