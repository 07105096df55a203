"""Tile, split-K and pipeline choices of the sm90 W4 GEMM, per shape, from a table measured on the H200.

``configs.json`` beside this file maps an M bucket (tokens) to the configuration that measured
fastest there (``benchmarks/bench_sm90.py --sweep`` writes it); ``pick`` reads it once and falls
back to the rules below for shapes the table does not hold. Split-K is chosen here, per (M, N, K):
enough CTAs to cover the 132 SMs twice when the output tiles alone would not.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..._env import getenv, switch

SM_COUNT = 132  # H100 SXM / H200
_TABLE = Path(__file__).with_name("configs.json")
M_BUCKETS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class GemmConfig:
    block_n: int  # weight rows per CTA (wgmma M)
    block_m: int  # tokens per CTA (wgmma N)
    block_k: int
    split_k: int = 1
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def as_dict(self) -> dict:
        return asdict(self)


def m_bucket(m: int) -> int:
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


@functools.lru_cache(maxsize=1)
def _table() -> dict[int, GemmConfig]:
    if not _TABLE.is_file():
        return {}
    raw = json.loads(_TABLE.read_text())
    return {int(b): GemmConfig(**c) for b, c in raw["configs"].items()}


def _default(m: int) -> GemmConfig:
    if m <= 64:
        return GemmConfig(block_n=64, block_m=max(16, 1 << (max(m, 1) - 1).bit_length()), block_k=256,
                          split_k=0, num_warps=4, num_stages=4)
    if m <= 256:
        return GemmConfig(block_n=128, block_m=64, block_k=128, num_warps=4, num_stages=4)
    return GemmConfig(block_n=128, block_m=128, block_k=64, num_warps=8, num_stages=4)


def split_for(cfg: GemmConfig, m: int, n: int, k: int) -> int:
    """Split K when the output tiles leave SMs idle, keeping >= 4 K-steps a split."""
    tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
    steps = k // cfg.block_k
    split = 1
    while tiles * split < 2 * SM_COUNT and steps // (split * 2) >= 4 and split < 16:
        split *= 2
    return split


# The Triton GEMM's pipeline depth above 64 tokens. Triton 3.6 on sm_90 compiles the 3-stage loop of the
# 128 x 256 x 64 (8 warps) tile that the table picks at 1000 tokens into a kernel that writes garbage
# into 1-3 of 6 outputs a run, varying run to run (a race; H200, docs/perf.md 2026-12-04 ninth session:
# conformance at M = 1000, R = 0, without quack-kernels, failed at this commit and at 1f8a5e2); with 1 or
# 2 stages 6 of 6 passed three runs each. A barrier after the loop did not help. 2 stages for every
# tile above 64 tokens until a Triton that compiles 3 correctly is measured.
MAX_STAGES_ABOVE_64 = 2


def pick(m: int, n: int, k: int) -> GemmConfig:
    cfg = _table().get(m_bucket(m)) or _default(m)
    if m > 64 and cfg.num_stages > MAX_STAGES_ABOVE_64:
        cfg = replace(cfg, num_stages=MAX_STAGES_ABOVE_64)
    if cfg.block_m > max(16, 1 << (max(m, 1) - 1).bit_length()):  # no wider than the tokens
        cfg = replace(cfg, block_m=max(16, 1 << (max(m, 1) - 1).bit_length()))
    if cfg.split_k == 0:  # 0 in the table: choose by occupancy
        cfg = replace(cfg, split_k=split_for(cfg, m, n, k))
    return cfg


PREFILL_TOKEN_TILES = (256, 240, 224, 208, 192)  # token-tile widths the prefill rule weighs (wgmma N, x16)
PREFILL_MARGIN = 0.95  # a narrower token tile must model at least 5 % faster than 256 to be taken


def prefill_tiles(m: int, n: int, sms: int = SM_COUNT) -> tuple[int, int]:
    """quack's tile (weight rows, tokens) above 1024 tokens: 128 weight rows, and the token-tile width
    that leaves the persistent grid's waves fullest.

    quack's scheduler is persistent: with ``t`` output tiles a call runs ``ceil(t / sms)`` waves, and a tile
    of ``tn`` tokens takes time about proportional to ``tn``, so the model cost is ``waves * tn``. 128 x 256
    is kept unless a width in ``PREFILL_TOKEN_TILES`` models ``PREFILL_MARGIN`` of its cost or less (narrower
    tiles run their wgmmas a little less efficiently). Same run on the H100 (docs/perf.md, 2026-12-06,
    ``bench_lowrank.py --tiles --tile-list``): at 4608 x 15360 -> 3072 (432 tiles of 256: 82 % of the last
    wave) 128 x 224 (504 tiles, 95 %) took the exact GEMM from 0.88-0.92x to 0.94-0.99x cuBLAS and the fast
    one from 1.57-1.70x to 1.66-1.83x, R = 32 (two runs); at 4352 x 3840 -> 3072 (408 tiles: 77 %) 128 x 208
    (504) took them from 0.89-0.91x to 1.03-1.04x and from 1.50-1.51x to 1.75-1.76x. At 97 % full (384, 1152
    tiles) 128 x 256 stays."""
    def cost(tn: int) -> int:
        t = -(-n // 128) * -(-m // tn)
        return -(-t // sms) * tn

    base = cost(256)
    best = min(PREFILL_TOKEN_TILES, key=lambda tn: (cost(tn), -tn))
    return (128, best) if cost(best) <= PREFILL_MARGIN * base else (128, 256)


MMA_MAX_M = 8  # tokens up to which small_m_mma's one 8-token tile wins (see use_small_m_mma)
MMA_TOKENS = 64  # the most tokens small_m_mma takes at all (eight 8-token MMA tiles)


def use_small_m_mma(mode: str, m: int, n: int, k: int) -> bool:
    """Whether ``small_m_mma`` (warp ``mma.sync``) serves a small-M call, from the H200's same-run
    crossover (docs/perf.md, 2026-12-04 fourth session, ``bench_small_m.py --mma``; module forward
    in CUDA graphs):

    - exact mode, M <= 8: 8-25 % faster than the Triton small-M kernel at 3072x3072, 3072x12288 and
      12288x3072 (its one 8-token tile; from 16 tokens the per-tile token loads make it lose);
    - fast mode, M <= 8 and K >= 2 N: 12288x3072 1.08-1.12x cuBLAS against 0.87x for quack's FP8
      GEMM; at K <= N quack's GEMM was as fast or 4-7 % faster, so it keeps those.
    """
    if m > MMA_MAX_M:
        return False
    return mode == "exact" or k >= 2 * n


ONE_LAUNCH_MAX_M = 1  # tokens up to which the fast mode's one-launch kernel is the default (use_fast_one_launch)
# and the token counts where it is the default for large weights (its FP8 dots on 16 token rows)
ONE_LAUNCH_DOTS_M = (16, 16)
ONE_LAUNCH_DOTS_MIN_WEIGHTS = 1 << 24  # weight values (N x K) from which that range takes it


def use_fast_one_launch(m: int, n: int, k: int) -> bool:
    """Whether a fast-mode call of ``m`` tokens of an ``n x k`` weight runs ``small_m_fast`` (one launch)
    instead of the routed path (the FP8 activation pass, cuBLAS ``lora_act``, small_m_mma or quack's FP8
    GEMM), from same-run tables on the H100 and the H200 (``bench_small_m.py --fast-one``; module forward
    in CUDA graphs):

    - one token: the one launch won at every Flux layer on both cards (docs/perf.md, sixteenth session): H100
      10.2 / 17.5 / 17.8 / 21.1 us against 15.2 / 20.0 / 21.4 / 24.7 (3072x3072, 3072x12288, 12288x3072,
      15360x3072: 1.15-1.49x), H200 9.6 / 17.0 / 17.2 / 20.3 against 15.0 / 19.9 / 21.2 / 24.6 (1.17-1.56x);
    - 16 tokens (``ONE_LAUNCH_DOTS_M``) on weights of ``ONE_LAUNCH_DOTS_MIN_WEIGHTS`` values or more: the
      one launch won on the three large layers on both cards (docs/perf.md, eighteenth session; H200, same
      run: 19.1 / 25.1 / 28.7 us against 20.2 / 27.7 / 31.2 at 3072x12288, 12288x3072, 15360x3072,
      1.06-1.10x; H100: 19.2 / 24.9 / 28.5 against 19.9 / 27.6 / 32.2, 1.04-1.13x, routed and one launch
      from two runs); at 3072x3072 it lost up to 7 %;
    - 9 and 12 tokens: the one launch runs the same 16 token rows but its k-loop is slower than at 16 (9.4
      against 7.1 us median at 12288x3072, cause not found): it lost by 9-20 % at 9 tokens and tied at 12
      (H100); 13-15 not measured;
    - two tokens: within 2 % at 3072x3072 and 3072x12288, 13-22 % slower at 12288x3072 and 15360x3072;
      8, 17-64 tokens: slower everywhere (up to 1.6x). The routed path keeps those.
    """
    lo, hi = ONE_LAUNCH_DOTS_M
    return 1 <= m <= ONE_LAUNCH_MAX_M or (lo <= m <= hi and n * k >= ONE_LAUNCH_DOTS_MIN_WEIGHTS)


EXACT_ONE_LAUNCH_MAX_M = 2  # tokens up to which the exact mode's one-launch kernel is the default
EXACT_ONE_LAUNCH_NARROW = 4  # K / N from which it splits for 4 CTAs an SM instead of what residency fits


def exact_one_launch_ctas(m: int, n: int, k: int) -> int | None:
    """Whether an exact call of ``m`` tokens of an ``n x k`` weight runs ``small_m_fast.linear_exact`` (one
    launch) instead of the routed path (``quantize_act``, cuBLAS ``lora_act``, small_m_mma and the split-K
    epilogue), and the CTAs an SM its split targets: None where it does not run, 0 for what the compiled
    kernel lets stay resident (``fitted_ctas_per_sm``). From a same-run table on the H100
    (``bench_small_m.py --exact-one``, module forward in CUDA graphs; docs/perf.md, twentieth session):

    - one token, routed against one launch: 16.0 / 24.1 / 23.6 / 29.9 us against 10.8 / 17.3 / 19.2 / 21.2
      (3072x3072, 3072x12288, 12288x3072, 15360x3072: 1.23-1.48x);
    - two tokens: 16.5 / 24.6 / 24.2 / 28.8 against 13.8 / 23.3 / 26.8 / 28.9: the two narrow weights (K = 4 N
      and 5 N) lost or tied at the residency's six CTAs an SM and won at four (23.8 and 26.3 us, 1.02x and
      1.09x), which also served them best at one token (17.6 and 20.2 us). So K >= ``EXACT_ONE_LAUNCH_NARROW``
      N splits for four. A later run with this rule (same card): 17.7 / 23.7 us at 12288x3072, 20.2 / 26.3 at
      15360x3072 (one / two tokens) against routed 23.7 / 24.0 and 30.1 / 28.8.
    """
    if not 1 <= m <= EXACT_ONE_LAUNCH_MAX_M:
        return None
    return 4 if k >= EXACT_ONE_LAUNCH_NARROW * n else 0


def exact_one_launch_stages(m: int, n: int, k: int) -> int:
    """The k-tiles in flight (``num_stages``) of an exact one-launch call: three at one token of a narrow
    weight (K >= ``EXACT_ONE_LAUNCH_NARROW`` N: long k-ranges a split), two elsewhere. The kernel alone, same
    run, twice on the H100 (docs/perf.md, twenty-second session; three against two, us): one token 10.3 / 10.0
    at 3072x3072, 16.8 / 15.9 at 3072x12288, 15.9 / 16.1 at 12288x3072, 17.7 / 18.6 at 15360x3072; two tokens
    12.8 / 12.6, 19.3 / 18.7, 20.1 / 19.8, 22.4 / 22.3."""
    return 3 if m == 1 and k >= EXACT_ONE_LAUNCH_NARROW * n else 2


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """The SMs of a CUDA device (``SM_COUNT`` for any other)."""
    return _sm_count(device.index or 0) if getattr(device, "type", None) == "cuda" else SM_COUNT


# lora_act = x @ (proj_down / smooth) of the fast mode's accumulator path (the second read of x): cuBLAS
# or kernels.lora_act. The default is the Triton kernel from LORA_ACT_MIN_M tokens with LORA_ACT_CONFIG
# (block_m, split, warps, stages): the best of 21 configs on the H200 (docs/perf.md, 2026-12-04 fifth
# session: 1.06x cuBLAS, geometric mean over six Flux shapes; 1.3x at 512 tokens).
# SVDQ_SM90_LORA_ACT="cublas" keeps cuBLAS, "bm,S,w,st" sets the Triton kernel's block rows, split (0: the
# rule of lora_split), warps and stages for every call.
ENV_LORA_ACT = "SVDQ_SM90_LORA_ACT"
# forward_cat_gelu (fuse_gelu_inputs) reads the GELU's parts from this many tokens; below, it writes the input
# and runs the plain path. Measured on the H200 (docs/perf.md, 2026-12-05 thirteenth session, bench_gelu_in):
# the whole linear 0.99-1.02x the written input's at 4096-4608 tokens, 0.70-0.71x at 512 (its two-source
# lora_act pass takes 51 us where the written input and cuBLAS's take 14 + 24).
CAT_GELU_MIN_M = 2048
# forward_ada_norm (Flux blocks' fused q/k/v and feed-forwards after fuse_qkv_projections) normalizes as it loads
# from this many tokens, unless SVDQ_SM90_ADA_NORM=0 (then it writes the norm's output and runs the plain path).
# On by default since the pair form (below) measured ahead of the written norm on the H100 (bench_norm_in.py,
# docs/perf.md thirty-ninth session, ah-2: whole fused q/k/v 1.04x exact, 1.09x fast in graphs); the split form
# alone had lost to it (twenty-seventh session).
ADA_NORM_MIN_M = 2048
ENV_ADA_NORM = "SVDQ_SM90_ADA_NORM"


def ada_norm_enabled() -> bool:
    """``SVDQ_SM90_ADA_NORM`` (an ``_env.switch``): unset or on reads the norm's input (the default), off writes the
    norm's output; any other value is an error, not a silent default. Read per call."""
    return switch(ENV_ADA_NORM) is not False


# the norm pass's apply tile, rows x warps: 32 x 4 (mma.sync for lora_act; 142-152 registers and 60 KB at R = 128)
# by default; SVDQ_SM90_ADA_NORM_TILE=64x4 / 64x8 takes wgmma and half the proj_down reloads, which measured only
# 4-8 us faster at R = 96-128 and slower at R = 32 (docs/perf.md, twenty-ninth session, z-2). Each loop pipelines
# its loads at Triton's default three stages. The same bits at any tile.
ENV_ADA_NORM_TILE = "SVDQ_SM90_ADA_NORM_TILE"
ADA_NORM_TILES = ((16, 4), (32, 4), (32, 8), (64, 4), (64, 8))


def ada_norm_tile() -> tuple[int, int]:
    """``(block_m, num_warps)`` of ``norm_pass``'s apply launch: ``SVDQ_SM90_ADA_NORM_TILE`` ("ROWSxWARPS", one
    of ``ADA_NORM_TILES``), else 32 x 4. A value outside the list is an error, not a silent default. Read per
    call; the parse of each value is kept."""
    return parse_ada_norm_tile(getenv(ENV_ADA_NORM_TILE) or "")


@functools.lru_cache(maxsize=16)
def parse_ada_norm_tile(v: str) -> tuple[int, int]:
    """A ``SVDQ_SM90_ADA_NORM_TILE`` value's tile (``ada_norm_tile``'s rules; "" the default)."""
    return _tile_of(v, ENV_ADA_NORM_TILE, ADA_NORM_TILES) if v else (32, 4)


def _tile_of(v: str, setting: str, allowed: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """A "ROWSxWARPS" value of ``setting`` as its tile, which must be one of ``allowed``; else an error naming the
    setting and the tiles it takes."""
    try:
        tile = tuple(int(p) for p in v.lower().split("x"))
    except ValueError:
        tile = ()
    if tile not in allowed:
        raise ValueError(f"{setting}={v!r}: expected one of " + ", ".join(f"{b}x{w}" for b, w in allowed))
    return tile


# the norm pass's form (SVDQ_SM90_ADA_NORM_FORM, read per call): "pair" (by default: the statistics, then lora_act
# and the pass in small tiles as the written input's PDL pair runs them, the pair's PDL taken where SVDQ_SM90_PDL
# says: by default in captured graphs; ah-2: 345 us against the split form's 380 at the exact fused q/k/v) or
# "split" (the statistics, then split-K apply tiles that add lora_act's partial sums); the same xq / a8 / sa bits
# (norm_pass's forms). "rows" (forty-first session): whole rows a program, the statistics and the pass from one read
# of x, then lora_act with those statistics; its statistics are summed in another order than the other two forms'.
ENV_ADA_NORM_FORM = "SVDQ_SM90_ADA_NORM_FORM"
ADA_NORM_FORMS = ("split", "pair", "rows")


def ada_norm_form() -> str:
    """``SVDQ_SM90_ADA_NORM_FORM`` (one of ``ADA_NORM_FORMS``), else "pair"; a value outside the list is an
    error, not a silent default."""
    raw = getenv(ENV_ADA_NORM_FORM) or "pair"
    v = raw.strip().lower()
    if v not in ADA_NORM_FORMS:
        raise ValueError(f"{ENV_ADA_NORM_FORM}={raw!r}: expected one of {', '.join(ADA_NORM_FORMS)}")
    return v


# the norm pass's rows form, its first launch's rows x warps (SVDQ_SM90_ADA_ROWS_TILE, read per call): unset, the
# one-pass FP8 kernel's block for the row's width (norm_pass.rows_config: 2 x 8 at 3072 columns); one of
# ADA_ROWS_TILES to measure others (benchmarks/bench_norm_in.py --rows-tiles). The same bits at any tile.
ENV_ADA_ROWS_TILE = "SVDQ_SM90_ADA_ROWS_TILE"
ADA_ROWS_TILES = ((1, 4), (1, 8), (2, 4), (2, 8), (4, 8))


def ada_rows_tile() -> tuple[int, int] | None:
    """``(rows, num_warps)`` of the rows form's first launch from ``SVDQ_SM90_ADA_ROWS_TILE`` ("ROWSxWARPS", one of
    ``ADA_ROWS_TILES``), else None (the form's own). A value outside the list is an error, not a silent default."""
    return parse_ada_rows_tile(getenv(ENV_ADA_ROWS_TILE) or "")


@functools.lru_cache(maxsize=16)
def parse_ada_rows_tile(v: str) -> tuple[int, int] | None:
    """A ``SVDQ_SM90_ADA_ROWS_TILE`` value's tile (``ada_rows_tile``'s rules; "" None)."""
    return _tile_of(v, ENV_ADA_ROWS_TILE, ADA_ROWS_TILES) if v else None


LORA_ACT_MIN_M = 128
LORA_ACT_CONFIG = (64, 4, 4, 3)


def _parse_lora_config(setting: str, v: str, *, min_split: int, max_warps: int,
                       other: str = "") -> tuple[int, int, int, int]:
    """``(block_m, split, warps, stages)`` of a "block_m,split,warps,stages" value ``v`` of ``setting`` (a ``lora_act``
    launch's: ``SVDQ_SM90_LORA_ACT``, ``SVDQ_SM90_ADA_PAIR_LORA``): block_m one of 16, 32, 64, 128, split at least
    ``min_split``, warps a power of two up to ``max_warps``, stages at least 1. A value of another shape, or outside
    those ranges, is an error naming the setting (``other``: the setting's other accepted values, as the message's
    prefix to the format, e.g. "'cublas' or ")."""
    try:
        bm, s, w, st = (int(p) for p in v.split(","))
    except ValueError:
        raise ValueError(f"{setting} must be {other}'block_m,split,warps,stages', got {v!r}") from None
    if bm not in (16, 32, 64, 128) or s < min_split or w < 1 or w > max_warps or w & (w - 1) or st < 1:
        raise ValueError(f"{setting}={v!r}: block_m in 16/32/64/128, split >= {min_split}, warps a power of two up "
                         f"to {max_warps}, stages >= 1")
    return bm, s, w, st


# The pair form's lora_act (norm_pass._ada_lora_kernel: block_m, split, warps, stages; the split halved by
# fit_split): LORA_ACT_CONFIG by default, the plain lora_act's. That launch is the pair's critical path (ah-2: 29 us
# at the exact fused q/k/v against the written norm's lora_act at 17, the pass ending ~12 us after it), so
# SVDQ_SM90_ADA_PAIR_LORA="bm,S,w,st" sets it per call for measuring (bench_norm_in.py --pair-lora).
ENV_ADA_PAIR_LORA = "SVDQ_SM90_ADA_PAIR_LORA"


def ada_pair_lora() -> tuple[int, int, int, int]:
    """``(block_m, split, warps, stages)`` of the pair form's ``lora_act``: ``SVDQ_SM90_ADA_PAIR_LORA``, else
    ``LORA_ACT_CONFIG``; a malformed value is an error naming the setting. Read per call."""
    return parse_ada_pair_lora(getenv(ENV_ADA_PAIR_LORA) or "")


@functools.lru_cache(maxsize=16)
def parse_ada_pair_lora(v: str) -> tuple[int, int, int, int]:
    """A ``SVDQ_SM90_ADA_PAIR_LORA`` value's config (``ada_pair_lora``'s rules; "" the default)."""
    if not v.strip():
        return LORA_ACT_CONFIG
    return _parse_lora_config(ENV_ADA_PAIR_LORA, v, min_split=1, max_warps=8)


@dataclass(frozen=True)
class LoraActPlan:
    block_m: int
    split: int
    num_warps: int
    num_stages: int


def lora_split(m: int, k: int, block_m: int, block_k: int = 128, sms: int = SM_COUNT) -> int:
    """Splits of K for ``kernels.lora_act``: the smallest power of two (up to 8) that gives at least one
    program an SM, keeping at least two ``block_k`` steps a split."""
    blocks = -(-m // block_m)
    s = 1
    while blocks * s < sms and s < 8 and k // (2 * s) >= 2 * block_k:
        s *= 2
    return s


def fit_split(s: int, k: int, block_k: int) -> int:
    """``s`` halved until each split keeps at least two ``block_k`` steps (1 at the least)."""
    while s > 1 and k // s < 2 * block_k:
        s //= 2
    return max(s, 1)


def lora_act_plan(m: int, k: int, r: int, env: str | None = None) -> LoraActPlan | None:
    """How the fast mode computes ``lora_act`` for ``x [M, K]`` and rank ``R``: None for cuBLAS, else the
    Triton kernel's plan (``env``: the value of ``SVDQ_SM90_LORA_ACT``, read per call by the caller)."""
    if env is not None and env.strip().lower() == "cublas":
        return None
    block_k = 128 if r <= 64 else 64  # kernels.lora_act's k-step
    if env:
        bm, s, w, st = _parse_lora_config(ENV_LORA_ACT, env, min_split=0, max_warps=16, other="'cublas' or ")
        return LoraActPlan(bm, s or lora_split(m, k, bm, block_k), w, st)
    if m < LORA_ACT_MIN_M or r == 0:
        return None
    bm, s, w, st = LORA_ACT_CONFIG
    return LoraActPlan(bm, fit_split(s, k, block_k), w, st)


# The exact mode's activation pass and its lora_act above SMALL_M tokens: the pass, then cuBLAS (two reads of
# x), or kernels.quantize_act_lora, which reads x once (the pass's tiles feed a tensor-core lora_act as they
# load). Measured on the H100: the kernel alone gains 1.11-1.29x over the two launches at 4096-4608 tokens up
# to R = 96 and loses at R = 128 and at 1024 tokens (twenty-fifth session); through the module, in graphs of
# back-to-back calls over 10-12 rounds, 1.02-1.08x at six Flux shapes of 4096-4608 tokens and R <= 96, 0.98-0.99x
# at 512 tokens and at R = 128 (twenty-sixth session: the plain pass's writes are still in L2 when the GEMM
# starts, and their write-back slows it). So where no PDL pair is taken (SVDQ_SM90_PDL; by default in
# captured graphs, where it measured faster still), unset takes it from EXACT_LORA_AUTO_MIN_M tokens up to
# EXACT_LORA_AUTO_MAX_R columns (exact_lora_by_default). SVDQ_SM90_EXACT_LORA="one" takes it at any size,
# at EXACT_LORA_CONFIG; "bm,bk,w,S,st" sets its block rows, k-step, warps, split (0: exact_lora_split's rule)
# and pipeline stages; "two": the two launches. It serves lora_act widths (the prepared proj_down's columns)
# up to EXACT_LORA_MAX_R; wider ones (rank 128 fused three ways) keep the two launches. With it,
# SVDQ_SM90_LORA_STREAM has nothing to move beside the pass, so an explicit SVDQ_SM90_LORA_STREAM=1 keeps
# the two launches when unset.
ENV_EXACT_LORA = "SVDQ_SM90_EXACT_LORA"
EXACT_LORA_MAX_R = 128  # the widest measured (t-2: R = 128 at 4608 tokens), 64 fp32 sums a thread at 64 x 128
EXACT_LORA_CONFIG = (64, 64, 4, 3)  # block rows, k-step, warps, stages: the best of 54 at fused q/k/v (t-2)
EXACT_LORA_PROGRAMS = 2  # programs an SM the split aims at (its best split, 4, gives 2 an SM at 4096 tokens)
EXACT_LORA_WAVE_FILL = 0.9  # the share of that wave the split fills at least
EXACT_LORA_AUTO_MIN_M = 2048  # unset: the one read from this many tokens (measured 4096-4608; 0.99x at 512)
EXACT_LORA_AUTO_MAX_R = 96  # ... up to this many lora_act columns (measured to 96: fused q/k/v; 0.99x at 128)


@dataclass(frozen=True)
class ExactLoraPlan:
    block_m: int
    block_k: int
    num_warps: int
    split: int
    num_stages: int


def exact_lora_split(m: int, k: int, block_m: int, block_k: int, sms: int = SM_COUNT) -> int:
    """Splits of K for ``kernels.quantize_act_lora``: the smallest power of two (up to 8) whose programs fill
    ``EXACT_LORA_WAVE_FILL`` of one wave of ``EXACT_LORA_PROGRAMS`` an SM, keeping at least two ``block_k``
    steps a split. (The rule before, the largest split inside one wave, took 2 at 4352-4608 tokens, where
    4 measured 1.27-1.36x faster with a few programs past the wave: docs/perf.md, twenty-fifth session.)"""
    blocks = -(-m // block_m)
    s = 1
    while blocks * s < EXACT_LORA_WAVE_FILL * EXACT_LORA_PROGRAMS * sms and s < 8 and k // (2 * s) >= 2 * block_k:
        s *= 2
    return s


def exact_lora_by_default(m: int, r: int) -> bool:
    """Whether an exact call with ``SVDQ_SM90_EXACT_LORA`` unset, and no PDL pair, takes the one read: from
    ``EXACT_LORA_AUTO_MIN_M`` tokens and up to ``EXACT_LORA_AUTO_MAX_R`` columns of the prepared proj_down."""
    return m >= EXACT_LORA_AUTO_MIN_M and 0 < r <= EXACT_LORA_AUTO_MAX_R


def exact_lora_plan(m: int, k: int, r: int, env: str | None = None, sms: int = SM_COUNT) -> ExactLoraPlan | None:
    """How the exact mode gets ``lora_act`` beside its activation pass for ``x [M, K]`` and ``R`` columns of the
    prepared ``proj_down``: None for the two launches (the pass, then cuBLAS: "two", unset, and every R above
    ``EXACT_LORA_MAX_R``), else ``kernels.quantize_act_lora``'s plan (``env``: the value of
    ``SVDQ_SM90_EXACT_LORA``, read per call by the caller; the caller asks "one" for an unset call that
    ``exact_lora_by_default`` serves)."""
    env = (env or "").strip().lower()
    if r == 0 or r > EXACT_LORA_MAX_R or env in ("", "two"):
        return None
    if env == "one":
        bm, bk, w, st = EXACT_LORA_CONFIG
        return ExactLoraPlan(bm, bk, w, exact_lora_split(m, k, bm, bk, sms), st)
    try:
        bm, bk, w, s, st = (int(v) for v in env.split(","))
    except ValueError:
        raise ValueError(f"{ENV_EXACT_LORA} must be 'two', 'one' or 'block_m,block_k,warps,split,stages', "
                         f"got {env!r}") from None
    if (bm not in (16, 32, 64, 128) or bk not in (16, 32, 64, 128, 256) or w not in (1, 2, 4, 8) or s < 0
            or not 1 <= st <= 4):
        raise ValueError(f"{ENV_EXACT_LORA}={env!r}: block_m in 16-128, block_k in 16-256 (powers of two), "
                         "warps a power of two up to 8, split >= 0, stages 1-4")
    return ExactLoraPlan(bm, bk, w, s or exact_lora_split(m, k, bm, bk, sms), st)
