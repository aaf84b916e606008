"""What a Program uses while it runs is its own and goes with it: the readback copies' stream belongs to its
Sampler (``CopyStream``), its id is no process-wide counter, and once the Program is dropped nothing of it is
reachable from module state (CPU)."""

from __future__ import annotations

import gc
import itertools
import types
import weakref

import torch

import ninfer.core.readback
import ninfer.models.common.paged_program
import ninfer.models.common.sampler
import ninfer.models.common.speculative.program
from ninfer.contract.batch import RowDecision
from ninfer.contract.memory import ProgramCapacity
from ninfer.contract.prompt import PreparedPrompt
from ninfer.contract.request import SamplingParams
from ninfer.contract.state import KVPoolSpec, StateImageLayout
from ninfer.core.forward_batch import ForwardBatch
from ninfer.core.readback import CopyStream
from ninfer.models.common.paged_program import PagedProgram

V, D = 16, 4
SPEC = KVPoolSpec(name="main", layers=1, kv_heads=1, head_dim=D, dtype="float32", page_size=4)
MODULES = (ninfer.core.readback, ninfer.models.common.paged_program, ninfer.models.common.sampler,
           ninfer.models.common.speculative.program)


class EmbedProgram(PagedProgram):
    """The smallest native Program: a token's hidden is its embedding."""

    def __init__(self) -> None:
        super().__init__(state_layout=StateImageLayout(fields=()), kv_pool=SPEC, device="cpu", max_concurrency=2,
                         capacity=ProgramCapacity(kv_pages=8), vocab_size=V)
        gen = torch.Generator().manual_seed(0)
        self.embed, self.head = torch.randn(V, D, generator=gen), torch.randn(D, V, generator=gen)
        self.start_graphs(cuda_graphs=False, static_decode=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.embed[batch.input_ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head).float()


def _run_one_request(prog: PagedProgram) -> None:
    sid = prog.open_sequence(PreparedPrompt(token_ids=[1, 2, 3]), SamplingParams(temperature=0.0, logprobs=True))
    assert prog.reserve_units(sid, 3)
    prog.commit(prog.prefill(sid, 3), [RowDecision(accepted=1)])
    assert prog.reserve_units(sid, 1)
    prog.commit(prog.decode([sid]), [RowDecision(accepted=1)])
    prog.release(sid)


def _mutable_globals(module: types.ModuleType) -> list[str]:
    """Module-level values that could hold per-Program state: containers, counters, CUDA streams."""
    kinds = (dict, list, set, itertools.count, CopyStream, torch.cuda.Stream)
    return [f"{module.__name__}.{name}" for name, value in vars(module).items()
            if not name.startswith("__") and isinstance(value, kinds)]


def test_the_modules_a_program_runs_on_keep_no_mutable_state():
    assert [g for m in MODULES for g in _mutable_globals(m)] == []


def test_each_program_owns_its_copy_stream_and_id():
    a, b = EmbedProgram(), EmbedProgram()
    assert a.sampler.copies is not b.sampler.copies
    assert a.id != b.id and a.paused.program_id == a.id


def test_nothing_of_a_dropped_program_remains():
    prog = EmbedProgram()
    _run_one_request(prog)
    refs = [weakref.ref(prog), weakref.ref(prog.sampler), weakref.ref(prog.sampler.copies)]
    del prog
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert [g for m in MODULES for g in _mutable_globals(m)] == []
