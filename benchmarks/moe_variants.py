"""What ``benchmarks/moe.py`` and ``benchmarks/moe_full_depth.py`` re-time beside their main runs: an all-device
instance built with some Triton kernels left to their parts (``NINFER_OPS_OFF``), with other PDL experiment
constants or other kernel tiles, and host-experts decode with other upload limits and CPU teams.
"""

from __future__ import annotations

import contextlib
import os

import attrs

from benchmarks.moe_runs import decode_run


@contextlib.contextmanager
def ops_off(ops: str):
    """NINFER_OPS_OFF=ops inside the block (the instance built there captures its graphs with those ops)."""
    before = os.environ.get("NINFER_OPS_OFF")
    os.environ["NINFER_OPS_OFF"] = ops
    try:
        yield
    finally:
        if before is None:
            del os.environ["NINFER_OPS_OFF"]
        else:
            os.environ["NINFER_OPS_OFF"] = before


@contextlib.contextmanager
def pdl_knobs(knobs: dict):
    """``ninfer.ops.triton._pdl``'s experiment constants set inside the block (a Program built there captures its
    graphs with them), restored on exit."""
    from ninfer.ops.triton import _pdl

    before = {k: getattr(_pdl, k) for k in knobs}
    for k, v in knobs.items():
        setattr(_pdl, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(_pdl, k, v)


@contextlib.contextmanager
def tiles(moe: dict | None = None, linear: dict | None = None, gdn_block_v: int | None = None,
          moe_down: dict | None = None, attention: tuple[int, int] | None = None, one_token=None,
          norm: dict | None = None):
    """Kernel tiles other than the defaults inside the block (a Program started there captures its graphs with
    them), restored on exit: ``moe`` {token limit of a ``_BY_TOKENS`` row: MoeConfig}, ``linear`` {(N, K):
    (block_n, block_k, split_k)} for the few-row linear, ``gdn_block_v`` for the GDN decode steps, ``moe_down``
    {token limit: (block_n, block_k, warps, stages)} for the down kernel alone (its block_m stays the row's),
    ``attention`` (keys per tile, most splits) for decode attention, ``one_token`` (``OneTokenTiles``) for the
    one-launch MoE block of one token, ``norm`` {D: (block_d, rows, warps)} for the RMS norm kernels."""
    from ninfer.ops.triton import attention as t_attention
    from ninfer.ops.triton import gdn as t_gdn
    from ninfer.ops.triton import linear as t_linear
    from ninfer.ops.triton import moe as t_moe
    from ninfer.ops.triton import norm as t_norm

    rows, measured, block_v = t_moe._BY_TOKENS, dict(t_linear._MEASURED), t_gdn._default_block_v
    down, row_tile = t_moe.down_grouped, t_norm._row_tile
    # Read only when patched: a tree from before these constants (a before/after run) still times its defaults.
    attention_tiles = (t_attention.DECODE_TILE_N, t_attention.MAX_DECODE_SPLITS) if attention else None
    one_token_tiles = _one_token_module().TILES if one_token else None
    limits = {limit for limit, _ in rows}
    if moe and not set(moe) <= limits:
        raise ValueError(f"moe tiles: token limits {sorted(set(moe) - limits)} are not rows of {sorted(limits)}")
    try:
        if moe:
            t_moe._BY_TOKENS = tuple((limit, moe.get(limit, cfg)) for limit, cfg in rows)
        if linear:
            t_linear._MEASURED.update(linear)
            t_linear.default_config.cache_clear()
        if gdn_block_v:
            t_gdn._default_block_v = lambda *_: gdn_block_v
        if moe_down:
            def down_with(hidden, bank, blocks, route, per_pair, cfg, shared=None):
                limit = next((lim for lim in sorted(moe_down) if blocks.numel <= lim), None)
                if limit is not None:
                    bn, bk, warps, stages = moe_down[limit]
                    cfg = attrs.evolve(cfg, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
                down(hidden, bank, blocks, route, per_pair, cfg, shared)
            t_moe.down_grouped = down_with
        if attention:
            t_attention.DECODE_TILE_N, t_attention.MAX_DECODE_SPLITS = attention
        if one_token:
            _one_token_module().TILES = one_token
        if norm:
            t_norm._row_tile = lambda D: norm.get(D) or row_tile(D)
        yield
    finally:
        t_moe._BY_TOKENS, t_gdn._default_block_v, t_moe.down_grouped = rows, block_v, down
        t_norm._row_tile = row_tile
        if attention_tiles is not None:
            t_attention.DECODE_TILE_N, t_attention.MAX_DECODE_SPLITS = attention_tiles
        if one_token_tiles is not None:
            _one_token_module().TILES = one_token_tiles
        t_linear._MEASURED.clear()
        t_linear._MEASURED.update(measured)
        t_linear.default_config.cache_clear()


def _one_token_module():
    from ninfer.ops.triton import moe_one_token  # imported only when patched: a before tree lacks it

    return moe_one_token


class CallerTeam:
    """The CPU share on the calling thread with torch's own intra-op threads, in place of a CpuExecutor team (an
    experiment: ``benchmarks/cpu_experts.py`` measured that path ~10x faster than a team of pinned one-thread
    workers on cold experts; docs/performance.md)."""

    size = 1

    def run(self, fn) -> None:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)  # the host experts hold the caller at one thread around this
        try:
            fn(0, 1)
        finally:
            torch.set_num_threads(before)

    def close(self) -> None:
        pass


def host_variant(inst, experts, spec: str, args, device: str) -> dict:
    """Decode B=1 again with ``spec`` = "prefetch,admit,team" (uploads per call, CPU team size; 0: the caller
    thread with torch's intra-op threads, ``CallerTeam``)."""
    from ninfer.core.cpu_executor import CpuExecutor

    prefetch, admit, team = (int(v) for v in spec.split(","))
    experts.prefetch_per_call, experts.admit_per_call = prefetch, admit
    if team == 0:
        experts.replace_team(CallerTeam())
    elif team != experts.team.size or isinstance(experts.team, CallerTeam):
        experts.replace_team(CpuExecutor(team))
    row = decode_run(inst.program, inst.config, device, 1, args.context, args.steps, lambda: experts.stats)
    row.update(prefetch=prefetch, admit=admit, team=team)
    e = row["experts"]
    print(f"#   host variant prefetch {prefetch} admit {admit} team {team}: {row['ms_per_step']:.3f} ms/step, "
          f"hit rate {'-' if e['hit_rate'] is None else format(e['hit_rate'], '.3f')}, per call: wait {e['wait_s'] / e['mixed_calls'] * 1e3:.2f} ms, "
          f"team {e['team_s'] / e['mixed_calls'] * 1e3:.2f} ms, uploads {e['upload_s'] / e['mixed_calls'] * 1e3:.2f} "
          f"ms, total {e['mixed_s'] / e['mixed_calls'] * 1e3:.2f} ms", flush=True)
    return row
