"""Would the post-MoE norm cost less inside the next projection? A micro-benchmark for issue 21's next lever.

At B=1 a 35B-A3B decode step spends ~2.4 us per layer in ``add_rms_norm`` after the MoE block: it sums the
block's nine slot terms and the residual, norms the row, and the next layer's input projection (a few-row
linear) waits for it. The design under test (``docs/performance.md``, issue 21, twelfth session) drops that
launch: the norm's (1 + w) is folded into the projection's columns once (W' = W diag(1 + w)), and the projection
takes the ten rows (residual and terms) as its M rows, multiplies them all (the tensor cores pad M to 16 anyway),
and scales the summed products by rstd, computed from the sums of squares its K loop accumulates from the same x
tiles (read beside the dot, not modified for it: a modified operand stalled the dot in session 3).

Each layer of a chain captured in one CUDA graph under PDL is:

- ``producer``: a small kernel that writes ten rows of H (the residual and nine MoE slot terms) from the previous
  layer's projection output, as the MoE block does;
- ``parts``: then ``add_rms_norm`` (the nine terms onto the residual) and the library's few-row ``linear``;
- ``fused``: then ``_linear_terms_kernel`` (below) on the ten rows with W'.

The table gives us per layer for both, and for the two projections alone (no producer, no norm). The fused
output is checked against the parts (the fused one multiplies the unrounded sum of the rows, so within bf16's
rounding, not bitwise).

    python -m benchmarks.norm_in_linear --json out.json              # the H200, 35B-A3B GDN in_proj shape
    python -m benchmarks.norm_in_linear --device cpu --layers 2 --rows 64 --hidden 128   # smoke (TRITON_INTERPRET=1)
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from benchmarks.handoff import chain_parser, graph_us
from ninfer.ops.triton._pdl import pdl_args
from ninfer.ops.triton._pdl_jit import pdl_prologue
from ninfer.ops.triton.linear import _prefetch_l2, linear
from ninfer.ops.triton.norm import add_rms_norm

TERMS = 10  # the residual and a MoE block's nine slot terms (eight routed experts and the shared one)
MODES = ("parts", "fused", "linear alone", "fused alone")


@triton.jit
def _producer(y_ptr, base_ptr, rows_ptr, H, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    # rows[t] = base[t] * (1 + y[0] / 64): ten rows that depend on the previous projection, as the MoE's do.
    pdl_prologue(USE_PDL)
    t = tl.program_id(1)
    cc = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cc < H
    scale = 1.0 + tl.load(y_ptr).to(tl.float32) / 64.0
    v = tl.load(base_ptr + t * H + cc, mask=ok, other=0.0).to(tl.float32) * scale
    tl.store(rows_ptr + t * H + cc, v.to(rows_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _linear_terms_kernel(x_ptr, w_ptr, y_ptr, N, K, T, s_wn, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0):
    # y[n] = rstd * sum_t sum_k W'[n, k] x[t, k], rstd = rsqrt(mean_k (sum_t x[t, k])^2 + eps): one output row
    # from T term rows. The x tile feeds the dot unchanged; its column sums are squared beside it. Under PDL the
    # first weight tiles are hinted into L2 before the wait, as the library's few-row linear does.
    mm = tl.arange(0, BLOCK_M)
    nn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = mm < T, nn < N
    w_rows = w_ptr + nn.to(tl.int64)[:, None] * s_wn
    if USE_PDL:
        rows_in = w_ptr + tl.minimum(nn, N - 1).to(tl.int64)[:, None] * s_wn
        for t in tl.static_range(PREFETCH):
            _prefetch_l2(rows_in + tl.minimum(t * BLOCK_K + tl.arange(0, BLOCK_K // 64) * 64, K - 1)[None, :])
    pdl_prologue(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < K
        x = tl.load(x_ptr + mm[:, None] * K + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        h = tl.sum(x.to(tl.float32), axis=0)
        squares += h * h
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    y = tl.sum(acc, axis=0) * rstd
    tl.store(y_ptr + nn, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def linear_terms(rows: torch.Tensor, w_folded: torch.Tensor, eps: float, out: torch.Tensor, block_n: int = 32,
                 block_k: int = 256) -> torch.Tensor:
    """The fused projection: ``rows`` [T <= 16, K] (residual and terms), ``w_folded`` [N, K] = W diag(1 + w)."""
    T, K = rows.shape
    N = w_folded.shape[0]
    pdl = pdl_args(rows.device)
    if pdl.get("USE_PDL"):  # one weight tile hinted into L2 before the wait, as the library's linear does
        pdl = {**pdl, "PREFETCH": 1}
    _linear_terms_kernel[(triton.cdiv(N, block_n),)](
        rows, w_folded, out, N, K, T, w_folded.stride(0), eps, BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=min(block_k, K), num_warps=4, num_stages=3, **pdl)
    return out


class Chain:
    """The buffers of ``layers`` layers and the launches of one mode over them."""

    def __init__(self, layers: int, N: int, H: int, dev: torch.device, eps: float = 1e-6) -> None:
        gen = torch.Generator(device=dev).manual_seed(0)
        bf = torch.bfloat16 if dev.type == "cuda" else torch.float16  # Triton's interpreter has no bf16 arithmetic
        self.eps, self.H = eps, H
        self.w = (torch.randn(N, H, generator=gen, device=dev) * H ** -0.5).to(bf)
        self.norm_w = (torch.randn(H, generator=gen, device=dev) * 0.1).to(bf)
        self.w_folded = (self.w.float() * (1.0 + self.norm_w.float())).to(bf)
        self.base = torch.randn(TERMS, H, generator=gen, device=dev).to(bf)
        self.ys = [torch.zeros(N, dtype=bf, device=dev) for _ in range(layers + 1)]
        self.rows = [self.base.clone() for _ in range(layers)]
        self.normed = [torch.randn(1, H, generator=gen, device=dev).to(bf) for _ in range(layers)]
        self.residual = [torch.empty(1, H, dtype=bf, device=dev) for _ in range(layers)]

    def run(self, mode: str) -> None:
        H = self.H
        for i, rows in enumerate(self.rows):
            y_in, y_out = self.ys[i], self.ys[i + 1]
            if mode in ("parts", "fused"):
                _producer[(triton.cdiv(H, 1024), TERMS)](y_in, self.base, rows, H, BLOCK=1024, num_warps=4,
                                                         **pdl_args(rows.device))
            if mode == "parts":
                add_rms_norm(rows[1:][None], rows[:1], self.norm_w, self.eps, out=self.normed[i],
                             residual_out=self.residual[i])
            if mode in ("parts", "linear alone"):
                linear(self.normed[i], self.w, out=y_out[None])
            else:
                linear_terms(rows, self.w_folded, self.eps, y_out)


def _check(chain: Chain, when: str) -> float:
    """The fused layers' outputs against the parts' (run now, eagerly): the largest error relative to the output."""
    fused = [y.float().clone() for y in chain.ys[1:]]
    chain.run("parts")
    parts = [y.float() for y in chain.ys[1:]]
    err = max(float((f - p).abs().max()) / max(float(p.abs().max()), 1e-6) for f, p in zip(fused, parts, strict=True))
    if not err < 2e-2:
        raise AssertionError(f"norm_in_linear: fused output off the parts' by {err:.3e} (relative){when}")
    return err


def run(args) -> dict:
    dev = torch.device(args.device)
    chain = Chain(args.layers, args.rows, args.hidden, dev)
    out: dict = {"args": vars(args), "rows": []}
    if dev.type != "cuda":  # the smoke run: eager, checked, not timed
        chain.run("fused")
        out["rows"].append({"mode": "fused", "max_rel_err": _check(chain, "")})
        return out
    for mode in MODES:
        row: dict = {"mode": mode}

        def check(mode=mode, row=row):
            if mode == "fused":
                row["max_rel_err"] = _check(chain, " after replays")

        row["us_per_layer"] = graph_us(lambda mode=mode: chain.run(mode), args.pdl, args.replays, check) / args.layers
        out["rows"].append(row)
    out["projection_bytes"] = chain.w.numel() * chain.w.element_size()
    return out


def parse_args(argv=None):
    p = chain_parser(__doc__)
    p.add_argument("--rows", type=int, default=12352, help="N of the projection (35B-A3B GDN in_proj)")
    p.add_argument("--hidden", type=int, default=2048, help="H: K of the projection, the norm's width")
    p.add_argument("--layers", type=int, default=40, help="layers per captured chain")
    args = p.parse_args(argv)
    if args.rows < 1 or args.hidden < 16 or args.layers < 1 or args.replays < 1:
        p.error("--rows, --layers and --replays must be positive and --hidden at least 16")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    if args.device.startswith("cuda"):
        print(f"| mode | us per layer |  projection {res['projection_bytes'] / 1e6:.1f} MB, {args.layers} layers, "
              f"PDL {'on' if args.pdl else 'off'}")
        print("|---|---|")
        for row in res["rows"]:
            print(f"| {row['mode']} | {row['us_per_layer']:.2f} |")
    else:
        print(f"norm_in_linear smoke run: fused checked against the parts (max rel err {res['rows'][0]['max_rel_err']:.2e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
