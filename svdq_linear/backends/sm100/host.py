"""Pure-Python side of the sm100 backend: tile configurations, alignment rules, the TMEM column plan,
the persistent scheduler's tile order and the scale-factor repack. No cutlass import here.

Shapes and names (see ``svdq_linear.nvfp4`` for the numerics):

- ``M`` tokens, ``N`` out_features, ``K`` in_features, ``R`` low-rank rank.
- A = activation codes ``[M, K/2] uint8`` (E2M1, K-major), SFA = activation scales in the
  scale-factor atom layout (``sf_atom_layout``), B = ``qweight [N, K/2]``, SFB = weight scales in the
  same atom layout, A2 = ``lora_act [M, R]`` bf16, B2 = ``proj_up / wcscale [N, R]`` bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

SF_VEC_SIZE = 16
"""Elements of K per E4M3 scale (NVFP4)."""

MMA_ATOM_K = 64
"""K of one ``tcgen05.mma.kind::mxf4nvf4`` instruction (E2M1 operands)."""

ATOMS_PER_K_TILE = 4
"""Main MMA atoms per K tile: one TMA stage holds ``4 * 64 = 256`` values of K (128 B rows: SW128)."""

K_TILE = MMA_ATOM_K * ATOMS_PER_K_TILE

LOWRANK_ATOM_K = 16
"""K of one ``tcgen05.mma.kind::f16`` instruction (bf16 operands)."""

LOWRANK_CHUNK = 64
"""R values per low-rank prelude stage: 64 bf16 = one 128-byte swizzle row."""

NUM_LOWRANK_STAGE = 2
"""Prelude stages; every chunk of a tile fits at once, so the loader never waits on its own tile (nor, with
``pipeline_model.load_order``'s mid-tile chunk loads, at a tile's start on the previous tile's last MMA)."""

MAX_RANK = LOWRANK_CHUNK * NUM_LOWRANK_STAGE

TMEM_COLUMNS = 512
"""Tensor memory per SM: 128 lanes x 512 columns of 32 bits."""

SF_ATOM_ROWS = 128
SF_ATOM_COLS = 4
"""The tcgen05 scale-factor atom: 128 rows x 4 scales (64 values of K), 512 bytes."""

SMEM_CAPACITY_SM100 = 232448
"""Dynamic shared memory per CTA on sm_100/sm_103 (227 KiB)."""

SM_COUNT = {"sm_100a": 148, "sm_103a": 148}
"""SMs of B200 (sm_100a) and B300 (sm_103a), used when compiling without a driver."""

OUT_DTYPES = (torch.bfloat16, torch.float16)


class Sm100ConfigError(ValueError):
    """A layer or call the sm100 kernel cannot run (the message says what was expected)."""


@dataclass(frozen=True)
class KernelConfig:
    """One compiled kernel: MMA tile, cluster, rank and output dtype.

    ``mma_tile_m`` is the tile of one (possibly 2-CTA) MMA: 256 means a (2, 1) cluster whose two
    CTAs each own 128 rows of A and half the N columns of B (``CtaGroup.TWO``).
    """

    mma_tile_m: int
    mma_tile_n: int
    rank: int
    out_dtype: str = "bfloat16"  # "bfloat16" | "float16"
    has_bias: bool = True

    def __post_init__(self):
        if self.mma_tile_m not in (128, 256):
            raise Sm100ConfigError(f"expected mma_tile_m 128 (1-CTA) or 256 (2-CTA), got {self.mma_tile_m}")
        if self.mma_tile_n not in (128, 256):
            raise Sm100ConfigError(f"expected mma_tile_n 128 or 256, got {self.mma_tile_n}")
        if self.rank <= 0 or self.rank % LOWRANK_ATOM_K or self.rank > MAX_RANK:
            raise Sm100ConfigError(
                f"expected a rank that is a positive multiple of {LOWRANK_ATOM_K} and at most {MAX_RANK}, "
                f"got {self.rank}"
            )
        if self.out_dtype not in ("bfloat16", "float16"):
            raise Sm100ConfigError(f"expected out_dtype bfloat16 or float16, got {self.out_dtype}")
        tmem_plan(self)  # raises if the columns do not fit

    @property
    def use_2cta(self) -> bool:
        return self.mma_tile_m == 256

    @property
    def cluster_shape_mn(self) -> tuple[int, int]:
        return (2, 1) if self.use_2cta else (1, 1)

    @property
    def cta_tile_m(self) -> int:
        return self.mma_tile_m // (2 if self.use_2cta else 1)

    @property
    def num_acc_stage(self) -> int:
        """Accumulator stages: two at tile_n 128 (tile i's epilogue runs under tile i+1's MMAs)."""
        return 1 if self.mma_tile_n == 256 else 2

    @property
    def lowrank_chunk(self) -> int:
        return min(self.rank, LOWRANK_CHUNK)

    @property
    def num_lowrank_chunks(self) -> int:
        return math.ceil(self.rank / LOWRANK_CHUNK)

    @property
    def lowrank_atoms_per_chunk(self) -> int:
        return self.lowrank_chunk // LOWRANK_ATOM_K

    @property
    def name(self) -> str:
        cta = "2cta" if self.use_2cta else "1cta"
        return f"svdq_w4a4_sm100_{cta}_{self.mma_tile_m}x{self.mma_tile_n}_r{self.rank}_{self.out_dtype}" + (
            "" if self.has_bias else "_nobias"
        )


@dataclass(frozen=True)
class TmemPlan:
    """Tensor-memory columns of one CTA (each column is 128 lanes x 32 bit)."""

    acc_cols: int  # fp32 accumulators, all stages
    sfa_cols: int  # activation scales of one K tile
    sfb_cols: int  # weight scales of one K tile
    alloc_cols: int  # what tcgen05.alloc asks for (a power of two >= 32)
    lowrank_acc_cols: int = 0  # only with a separate low-rank accumulator (not chosen)
    offsets: dict = field(default_factory=dict)

    @property
    def used_cols(self) -> int:
        return self.acc_cols + self.lowrank_acc_cols + self.sfa_cols + self.sfb_cols


def tmem_plan(cfg: KernelConfig, separate_lowrank_acc: bool = False) -> TmemPlan:
    """The column plan: accumulators first, then SFA, then SFB. Raises if it exceeds 512 columns.

    ``separate_lowrank_acc`` models the alternative of item 3 (a second fp32 accumulator per stage for
    the low-rank product so the epilogue can keep the contract's order): at tile_n 128 with two stages
    it needs 512 accumulator columns and leaves none for the scale factors.
    """
    acc_cols = cfg.mma_tile_n * cfg.num_acc_stage
    lr_cols = acc_cols if separate_lowrank_acc else 0
    # SFA: one column of 4 scales per 32 rows per MMA atom -> (cta_tile_m / 32) * 4 per K tile.
    sfa_cols = (cfg.cta_tile_m // 32) * ATOMS_PER_K_TILE
    # SFB: the weight scales of a (possibly 2-CTA) MMA are copied in 128-row groups per CTA.
    sfb_rows = math.ceil(cfg.mma_tile_n / 128) * 128
    sfb_cols = (sfb_rows // 32) * ATOMS_PER_K_TILE
    used = acc_cols + lr_cols + sfa_cols + sfb_cols
    if used > TMEM_COLUMNS:
        raise Sm100ConfigError(
            f"TMEM plan for {cfg.mma_tile_m}x{cfg.mma_tile_n} needs {used} columns "
            f"(accumulators {acc_cols} + low-rank accumulators {lr_cols} + SFA {sfa_cols} + SFB {sfb_cols}), "
            f"expected at most {TMEM_COLUMNS}"
        )
    alloc = 32
    while alloc < used:
        alloc *= 2
    offsets = {"acc": 0, "lowrank_acc": acc_cols, "sfa": acc_cols + lr_cols, "sfb": acc_cols + lr_cols + sfa_cols}
    return TmemPlan(acc_cols, sfa_cols, sfb_cols, alloc, lr_cols, offsets)


# ---------------------------------------------------------------------------------------------
# Alignment rules (checked on the host before anything is compiled or launched)


def layer_alignment_error(n: int, k: int, rank: int) -> str | None:
    """Why a layer ``[N, K]`` with rank ``R`` cannot run on the sm100 kernel, or None.

    TMA needs 16-byte aligned row strides: packed codes ``K/2`` bytes -> ``K % 32``; output rows
    ``2N`` bytes -> ``N % 8``; ``lora_act``/``proj_up`` rows ``2R`` bytes -> ``R % 8`` (R % 16 is
    needed anyway: one low-rank MMA consumes 16 values of R).
    """
    if k % 32:
        return f"expected in_features % 32 == 0 (16-byte TMA rows of E2M1 codes), got {k}"
    if n % 8:
        return f"expected out_features % 8 == 0 (16-byte TMA rows of the 16-bit output), got {n}"
    if rank <= 0 or rank % LOWRANK_ATOM_K:
        return f"expected a rank that is a positive multiple of {LOWRANK_ATOM_K}, got {rank}"
    if rank > MAX_RANK:
        return f"expected rank <= {MAX_RANK} ({NUM_LOWRANK_STAGE} prelude stages of {LOWRANK_CHUNK}), got {rank}"
    return None


def choose_config(m: int, n: int, rank: int, out_dtype: str, has_bias: bool = True) -> KernelConfig:
    """The tile for a call: 1-CTA 128x128 for small M (one 2-CTA tile would be mostly padding),
    2-CTA 256x256 where N is a multiple of 256 and the rank is at most 32, else 2-CTA 256x128.

    256x256 with a rank-64 or rank-128 prelude leaves room for only 3 A/B stages (see
    ``layouts.smem_budget``); 256x128 keeps 5, so those layers take 256x128.
    """
    if m <= 128:
        return KernelConfig(128, 128, rank, out_dtype, has_bias)
    tile_n = 256 if n % 256 == 0 and n >= 2048 and rank <= 32 else 128
    return KernelConfig(256, tile_n, rank, out_dtype, has_bias)


LIBRARY_CONFIGS = tuple(
    KernelConfig(tm, tn, r, dt)
    for (tm, tn) in ((256, 128), (256, 256), (128, 128))
    for r in (32, 128)
    for dt in ("bfloat16", "float16")
)
"""Every kernel the library compiles (``svdq-precompile``)."""


# ---------------------------------------------------------------------------------------------
# Static persistent scheduler (the kernel evaluates the same arithmetic on Int32)


def num_clusters_mn(m: int, n: int, cfg: KernelConfig) -> tuple[int, int]:
    """Clusters along M and N: one cluster computes one MMA tile (mma_tile_m x mma_tile_n)."""
    return math.ceil(m / cfg.mma_tile_m), math.ceil(n / cfg.mma_tile_n)


def grid_clusters(m: int, n: int, cfg: KernelConfig, sm_count: int) -> int:
    """Persistent clusters launched: ``min(num_tiles, sm_count // cluster_size)``, as the kernel computes it, for
    ``num_tiles >= 1`` (the backend launches nothing for zero rows; 1 here for the host model's loops)."""
    cm, cn = num_clusters_mn(m, n, cfg)
    cluster_size = cfg.cluster_shape_mn[0] * cfg.cluster_shape_mn[1]
    return max(1, min(cm * cn, sm_count // cluster_size))


def tile_of_work(work_idx, num_clusters_m):
    """(cluster tile m, tile n) of the ``work_idx``-th MMA tile, rastered along M.

    Pure arithmetic so the kernel (on ``Int32``) and the host model (on ``int``) run the same lines.
    """
    return work_idx % num_clusters_m, work_idx // num_clusters_m


def work_of_cluster(cluster_idx, iteration, num_persistent_clusters):
    """Grid stride: cluster ``c`` computes work ``c, c + G, c + 2G, ...``."""
    return cluster_idx + iteration * num_persistent_clusters


def cta_tiles(m: int, n: int, cfg: KernelConfig, sm_count: int) -> dict[int, list[tuple[int, int]]]:
    """For every CTA (linear block id), the (row tile of cta_tile_m, column tile of mma_tile_n) it
    writes, in order. Used by the tests (coverage) and the pipeline model (tiles per CTA)."""
    cm, cn = num_clusters_mn(m, n, cfg)
    g = grid_clusters(m, n, cfg, sm_count)
    cluster_m = cfg.cluster_shape_mn[0]
    out: dict[int, list[tuple[int, int]]] = {}
    for c in range(g):
        for v in range(cluster_m):
            tiles = []
            it = 0
            while (w := work_of_cluster(c, it, g)) < cm * cn:
                tm, tn = tile_of_work(w, cm)
                tiles.append((tm * cluster_m + v, tn))
                it += 1
            out[c * cluster_m + v] = tiles
    return out


# ---------------------------------------------------------------------------------------------
# Scale-factor atom layout (tcgen05 ``kind::mxf4nvf4`` scale_vec::4X with vector 16)


def sf_atom_shape(rows: int, k: int) -> tuple[int, int]:
    """(padded rows, padded K/16) of the atom layout: rows to 128, K/16 to 4."""
    kb = k // SF_VEC_SIZE
    return math.ceil(rows / SF_ATOM_ROWS) * SF_ATOM_ROWS, math.ceil(kb / SF_ATOM_COLS) * SF_ATOM_COLS


def sf_atom_offset(r: torch.Tensor, kb: torch.Tensor, k: int) -> torch.Tensor:
    """Byte offset of scale ``(row r, block kb)`` in the atom layout of a ``[rows, K/16]`` tensor.

    Each 128-row x 4-block atom is 512 bytes: row ``r`` sits at ``(r % 32) * 16 + ((r // 32) % 4) * 4``
    and block ``kb`` at ``+ kb % 4``; atoms follow K first, then rows (CUTLASS's
    ``BlockScaledBasicChunk`` tiled with order (2, 1, 3)).
    """
    _, kb_pad = sf_atom_shape(1, k)
    atoms_k = kb_pad // SF_ATOM_COLS
    inner = (r % 32) * 16 + ((r // 32) % 4) * 4 + kb % 4
    return ((r // SF_ATOM_ROWS) * atoms_k + kb // SF_ATOM_COLS) * 512 + inner


def to_sf_atom_layout(scales: torch.Tensor) -> torch.Tensor:
    """Repack canonical ``[rows, K/16] float8_e4m3fn`` into the flat atom layout (zero padded)."""
    rows, kb = scales.shape
    k = kb * SF_VEC_SIZE
    rp, kbp = sf_atom_shape(rows, k)
    out = torch.zeros(rp * kbp, dtype=torch.uint8, device=scales.device)
    r = torch.arange(rows, device=scales.device)[:, None]
    b = torch.arange(kb, device=scales.device)[None, :]
    out[sf_atom_offset(r, b, k).flatten()] = scales.view(torch.uint8).flatten()
    return out.view(torch.float8_e4m3fn)


def from_sf_atom_layout(flat: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """Inverse of ``to_sf_atom_layout``: canonical ``[rows, K/16]``."""
    kb = k // SF_VEC_SIZE
    r = torch.arange(rows, device=flat.device)[:, None]
    b = torch.arange(kb, device=flat.device)[None, :]
    return flat.view(torch.uint8)[sf_atom_offset(r, b, k)].view(torch.float8_e4m3fn)
