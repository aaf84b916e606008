"""Shared pieces of the GPU kernel tests: Qwen3.5 shapes, seeded inputs on the device, the acceptance measure.

Each test compares a Triton kernel of ``ninfer.ops.triton`` with its pure-torch reference computed in fp32 on
the upcast bf16 inputs, at the real Qwen3.5-9B and -0.8B shapes, for one and eight decode rows and one prefill
length. Inputs are fresh random draws from a generator seeded by the test's id, so a case sees the same
inputs on every run and a failure reproduces. Outputs written through ``out=`` start as NaN, so a value the
kernel never wrote fails. The acceptance is the relative error ‖out − ref‖ / ‖ref‖ against a stated
tolerance (NaN or inf anywhere fails); in-place state updates must leave every other slot bit-identical.

Every test is marked ``gpu``: without CUDA the root conftest skips them (the Triton interpreter's CPU tests
are ``ninfer-core/tests/test_triton_*.py``). On the GPU machine, from the repository root:

    python3 -m pytest -q -m gpu ninfer-core/tests/gpu
"""

from __future__ import annotations

import importlib.util
import math
import sys
import zlib
from pathlib import Path

import attrs
import pytest
import torch

_ROOT = Path(__file__).resolve().parents[3]
# The GPU machine runs a bare checkout: make ninfer (and the shapes in benchmarks/) importable uninstalled.
for _name, _path in (("ninfer", _ROOT / "ninfer-core" / "src"), ("benchmarks", _ROOT)):
    if importlib.util.find_spec(_name) is None:
        sys.path.insert(0, str(_path))

from benchmarks.shapes import SHAPES  # noqa: E402

MODELS = ("9b", "0.8b")
BATCHES = (1, 8)
PREFILL = 1000  # one prompt chunk; fills no tile evenly, so every kernel's edge masking is exercised
PAGE = 16


@attrs.frozen
class Model:
    """The dimensions of one Qwen3.5 shape that the kernels see."""

    name: str
    hidden: int
    inter: int
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    hk: int
    hv: int
    dk: int
    dv: int
    conv_k: int
    vocab: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    @classmethod
    def named(cls, name: str) -> Model:
        c = SHAPES[name]
        return cls(name=name, hidden=c["hidden_size"], inter=c["intermediate_size"], eps=c["rms_norm_eps"],
                   heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                   rotary_dim=int(c["head_dim"] * c.get("partial_rotary_factor", 0.25)),
                   hk=c["linear_num_key_heads"], hv=c["linear_num_value_heads"], dk=c["linear_key_head_dim"],
                   dv=c["linear_value_head_dim"], conv_k=c["linear_conv_kernel_dim"], vocab=c["vocab_size"])


def rel_error(out, ref) -> tuple[float, float]:
    """(‖out − ref‖ / ‖ref‖, max |out − ref|) in float64, the worst over paired tuples; inf when out holds NaN
    or inf."""
    if isinstance(out, (tuple, list)):
        pairs = [rel_error(o, r) for o, r in zip(out, ref, strict=True)]
        return max(p[0] for p in pairs), max(p[1] for p in pairs)
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf, math.inf
    diff = o - r
    denom = r.norm().item()
    rel = diff.norm().item() / denom if denom > 0 else diff.norm().item()
    return rel, diff.abs().max().item() if diff.numel() else 0.0


class Case:
    """Seeded random inputs on the GPU (bf16 unless asked) and the checks every test uses."""

    page = PAGE
    prefill = PREFILL

    def __init__(self, seed: int):
        self.device = torch.device("cuda")
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        t = torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32) * scale
        return t.to(dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen, device=self.device)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen, device=self.device)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen, device=self.device)

    def nans(self, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """An output buffer poisoned with NaN: whatever the kernel does not write fails the comparison."""
        return torch.full(shape, float("nan"), dtype=dtype, device=self.device)

    @staticmethod
    def no_host_sync(fn) -> None:
        """``fn()`` twice: once to compile and warm, then under the sync debug mode that raises on a host sync."""
        fn()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    @staticmethod
    def within(out, ref, tol: float, what: str = "") -> None:
        rel, mx = rel_error(out, ref)
        assert rel <= tol, f"{what}: relative error {rel:.3e} over the tolerance {tol:.0e} (max error {mx:.3e})"

    def state_image(self, slots: int, per_slot: tuple[int, ...], pad: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A [slots, pad + prod(per_slot) + pad] image and the strided [slots, *per_slot] view into it, as the
        Program's state pools hand slot views to the kernels."""
        size = math.prod(per_slot)
        image = self.randn(slots, size + 2 * pad, scale=0.1, dtype=dtype)
        return image, image[:, pad:pad + size].view(slots, *per_slot)

    def paged(self, model: Model, seqs: list[tuple[int, int]]) -> tuple:
        """paged_attention's positional inputs for sequences given as (query length, earlier context), their
        pages scattered at random over a cache with spare pages."""
        from ninfer.testing.paged import paged_attention_inputs

        return paged_attention_inputs(seqs, page=PAGE, heads=model.heads, kv_heads=model.kv_heads,
                                      head_dim=model.head_dim, randn=self.randn, randperm=self.randperm,
                                      device=self.device)


@pytest.fixture(scope="session", autouse=True)
def _fp32_references_in_fp32():
    """References are fp32 matmuls: never let them run in TF32."""
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def case(request) -> Case:
    return Case(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=MODELS)
def model(request) -> Model:
    return Model.named(request.param)


@pytest.fixture(params=BATCHES, ids=lambda b: f"B{b}")
def batch(request) -> int:
    return request.param


@pytest.fixture(params=(1, 8, PREFILL), ids=lambda n: f"N{n}")
def tokens(request) -> int:
    """Rows of a per-token op: one decode row, a decode batch, a prefill chunk."""
    return request.param


def pytest_generate_tests(metafunc):
    """Tests taking ``weight_shape`` run once per distinct decode weight [N, K] of each model."""
    if "weight_shape" in metafunc.fixturenames:
        from benchmarks.shapes import decode_weight_shapes

        cases = [(m, nk) for m in MODELS for nk in sorted(set(decode_weight_shapes(SHAPES[m])))]
        metafunc.parametrize("weight_shape", [nk for _, nk in cases], ids=[f"{m}-{n}x{k}" for m, (n, k) in cases])
