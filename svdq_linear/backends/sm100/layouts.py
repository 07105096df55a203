"""Tiled MMAs, staged shared-memory layouts and the SMEM budget of the sm100 kernel (imports cutlass).

Every byte the kernel budgets comes from ``cute.cosize`` of a staged layout built here, sliced to one
stage; nothing is a hand-written byte formula. ``build_layouts`` must run while a CuTe DSL trace is
active (inside ``@cute.jit``) for a tcgen05 target (``tcgen05_target``); ``smem_budget`` wraps both for host code
and tests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from .host import (
    ATOMS_PER_K_TILE,
    NUM_LOWRANK_STAGE,
    SF_VEC_SIZE,
    SMEM_CAPACITY_SM100,
    KernelConfig,
    Sm100ConfigError,
)

AB_DTYPE = cutlass.Float4E2M1FN
SF_DTYPE = cutlass.Float8E4M3FN
LOWRANK_DTYPE = cutlass.BFloat16  # bf16 even for fp16 output: proj_up / wcscale can exceed fp16
ACC_DTYPE = cutlass.Float32
NUM_C_STAGE = 2
BARRIER_BYTES = 1024  # mbarriers + TMEM pointer, rounded up to the 1024-byte buffer alignment
BUFFER_ALIGN = 1024


def out_dtype_of(cfg: KernelConfig):
    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[cfg.out_dtype]


@dataclass
class Layouts:
    """What ``build_layouts`` returns: MMAs, tilers and staged layouts (DSL objects) plus the
    per-stage byte counts they imply (Python ints)."""

    tiled_mma: object
    tiled_mma_sfb: object
    tiled_mma_lr: object
    mma_tiler: tuple
    mma_tiler_sfb: tuple
    mma_tiler_lr: tuple
    cta_tile_shape_mnk: tuple
    epi_tile: object
    a_smem: object
    b_smem: object
    sfa_smem: object
    sfb_smem: object
    a2_smem: object
    b2_smem: object
    c_smem: object
    num_ab_stage: int
    stage_bytes: dict  # operand -> bytes of one stage (cosize of the one-stage slice)
    total_bytes: dict  # operand -> bytes of all its stages (cosize of the staged layout)


def _cosize_bytes(dtype, layout) -> int:
    outer = layout.outer if isinstance(layout, cute.ComposedLayout) else layout
    return cute.cosize(outer) * dtype.width // 8


def _slice_stage(layout, rank_modes: int):
    return cute.slice_(layout, (None,) * rank_modes + (0,))


def _aligned(nbytes: int) -> int:
    """A buffer's bytes in ``shared_storage``, which starts each buffer at a ``BUFFER_ALIGN`` boundary."""
    return -(-nbytes // BUFFER_ALIGN) * BUFFER_ALIGN


def shared_storage(lay: Layouts, cfg: KernelConfig):
    """The kernel's shared-memory struct for ``lay`` (its stage count): the pipelines' mbarriers and the TMEM
    pointer (``BARRIER_BYTES`` at most), then each operand buffer at a ``BUFFER_ALIGN`` boundary. Inside a trace;
    the kernel allocates it, and tests read ``size_in_bytes()`` against the budget."""
    c_dtype = out_dtype_of(cfg)

    fields = {  # real objects, not the strings this module's postponed annotations would give a class body
        "ab_full": cute.struct.MemRange[cutlass.Int64, lay.num_ab_stage],
        "ab_empty": cute.struct.MemRange[cutlass.Int64, lay.num_ab_stage],
        "lr_full": cute.struct.MemRange[cutlass.Int64, NUM_LOWRANK_STAGE],
        "lr_empty": cute.struct.MemRange[cutlass.Int64, NUM_LOWRANK_STAGE],
        "acc_full": cute.struct.MemRange[cutlass.Int64, cfg.num_acc_stage],
        "acc_empty": cute.struct.MemRange[cutlass.Int64, cfg.num_acc_stage],
        "tmem_dealloc_mbar": cutlass.Int64,
        "tmem_holding_buf": cutlass.Int32,
    }
    for name, dtype, layout in (("sC", c_dtype, lay.c_smem.outer), ("sA", AB_DTYPE, lay.a_smem.outer),
                                ("sB", AB_DTYPE, lay.b_smem.outer), ("sSFA", SF_DTYPE, lay.sfa_smem),
                                ("sSFB", SF_DTYPE, lay.sfb_smem), ("sA2", LOWRANK_DTYPE, lay.a2_smem.outer),
                                ("sB2", LOWRANK_DTYPE, lay.b2_smem.outer)):
        fields[name] = cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], BUFFER_ALIGN]
    SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
    return SharedStorage


def build_layouts(cfg: KernelConfig, smem_capacity: int = SMEM_CAPACITY_SM100, num_ab_stage: int | None = None):
    """Build everything shape-dependent; choose ``num_ab_stage`` from the cosizes: the most stages whose buffers,
    padded as ``shared_storage`` lays them out, fit beside the barriers (``BARRIER_BYTES``) in ``smem_capacity``."""
    cta_group = tcgen05.CtaGroup.TWO if cfg.use_2cta else tcgen05.CtaGroup.ONE
    mn = (cfg.mma_tile_m, cfg.mma_tile_n)
    k_major = OperandMajorMode.K
    tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
        AB_DTYPE, AB_DTYPE, k_major, k_major, SF_DTYPE, SF_VEC_SIZE, cta_group, mn
    )
    # SFB is copied to TMEM in 128-row groups by a 1-CTA view of the MMA.
    mn_sfb = (cfg.mma_tile_m // (2 if cfg.use_2cta else 1), cute.round_up(cfg.mma_tile_n, 128))
    tiled_mma_sfb = sm100_utils.make_blockscaled_trivial_tiled_mma(
        AB_DTYPE, AB_DTYPE, k_major, k_major, SF_DTYPE, SF_VEC_SIZE, tcgen05.CtaGroup.ONE, mn_sfb
    )
    tiled_mma_lr = sm100_utils.make_trivial_tiled_mma(LOWRANK_DTYPE, LOWRANK_DTYPE, k_major, k_major, ACC_DTYPE, cta_group, mn)
    atom_k = cute.size(tiled_mma.shape_mnk, mode=[2])
    mma_tiler = (*mn, atom_k * ATOMS_PER_K_TILE)
    mma_tiler_sfb = (*mn_sfb, atom_k * ATOMS_PER_K_TILE)
    mma_tiler_lr = (*mn, cfg.lowrank_chunk)
    n_cta = cute.size(tiled_mma.thr_id.shape)
    cta_tile = (mma_tiler[0] // n_cta, mma_tiler[1], mma_tiler[2])
    c_dtype = out_dtype_of(cfg)
    c_layout = LayoutEnum.ROW_MAJOR
    epi_tile = sm100_utils.compute_epilogue_tile_shape(cta_tile, cfg.use_2cta, c_layout, c_dtype)

    def staged(n_ab):
        return dict(
            a=sm100_utils.make_smem_layout_a(tiled_mma, mma_tiler, AB_DTYPE, n_ab),
            b=sm100_utils.make_smem_layout_b(tiled_mma, mma_tiler, AB_DTYPE, n_ab),
            sfa=blockscaled_utils.make_smem_layout_sfa(tiled_mma, mma_tiler, SF_VEC_SIZE, n_ab),
            sfb=blockscaled_utils.make_smem_layout_sfb(tiled_mma, mma_tiler, SF_VEC_SIZE, n_ab),
            a2=sm100_utils.make_smem_layout_a(tiled_mma_lr, mma_tiler_lr, LOWRANK_DTYPE, NUM_LOWRANK_STAGE),
            b2=sm100_utils.make_smem_layout_b(tiled_mma_lr, mma_tiler_lr, LOWRANK_DTYPE, NUM_LOWRANK_STAGE),
            c=sm100_utils.make_smem_layout_epi(c_dtype, c_layout, epi_tile, NUM_C_STAGE),
        )

    dtypes = dict(a=AB_DTYPE, b=AB_DTYPE, sfa=SF_DTYPE, sfb=SF_DTYPE, a2=LOWRANK_DTYPE, b2=LOWRANK_DTYPE, c=c_dtype)
    one = staged(1)
    # Bytes of ONE stage, from the one-stage slice of each staged layout (A/B/SF: 4 modes + stage;
    # epilogue: 2 modes + stage).
    stage_bytes = {}
    for name, lay in one.items():
        rank = 2 if name == "c" else 3
        stage_bytes[name] = _cosize_bytes(dtypes[name], _slice_stage(lay.outer if isinstance(lay, cute.ComposedLayout) else lay, rank))
    ab_stage = sum(stage_bytes[k] for k in ("a", "b", "sfa", "sfb"))
    fixed = (BARRIER_BYTES + _aligned(NUM_LOWRANK_STAGE * stage_bytes["a2"])
             + _aligned(NUM_LOWRANK_STAGE * stage_bytes["b2"]) + _aligned(NUM_C_STAGE * stage_bytes["c"]))
    fits = 0  # the most A/B stages whose buffers, each padded to BUFFER_ALIGN as shared_storage lays them, fit
    while fixed + sum(_aligned((fits + 1) * stage_bytes[k]) for k in ("a", "b", "sfa", "sfb")) <= smem_capacity:
        fits += 1
    if num_ab_stage is None:
        num_ab_stage = fits
    if num_ab_stage < 2 or num_ab_stage > fits:
        raise Sm100ConfigError(
            f"{cfg.name}: {num_ab_stage} A/B stages of {ab_stage} bytes do not fit beside {fixed} bytes "
            f"(prelude, epilogue, barriers) in {smem_capacity} bytes; expected 2 <= stages <= {fits}"
        )
    lay = staged(num_ab_stage)
    total = {}
    for name, l in lay.items():
        total[name] = _cosize_bytes(dtypes[name], l)
    return Layouts(
        tiled_mma, tiled_mma_sfb, tiled_mma_lr, mma_tiler, mma_tiler_sfb, mma_tiler_lr, cta_tile, epi_tile,
        lay["a"], lay["b"], lay["sfa"], lay["sfb"], lay["a2"], lay["b2"], lay["c"], num_ab_stage, stage_bytes, total,
    )


TCGEN05_ARCHS = ("sm_100a", "sm_100f", "sm_103a", "sm_107a", "sm_110a")  # the targets tcgen05's MMA atoms take


@contextlib.contextmanager
def tcgen05_target(arch: str = "sm_100a"):
    """Trace for a tcgen05 target. CuTe's DSL takes its target from ``CUTE_DSL_ARCH`` or, unset, the local GPU, and
    tcgen05's MMA atoms refuse any other: on an H100 (sm_90a) these layouts could not be built, for host-side budgets
    or tests. A target that already is a tcgen05 one (a B300's sm_103a) is kept; else ``arch`` is set for the block
    and the machine's put back. The target is process-wide: not for use beside a compile in another thread."""
    from cutlass.cutlass_dsl import CuTeDSL  # the DSL whose target the tcgen05 atoms read (not the experimental one)

    envar = CuTeDSL._get_dsl().envar
    current = envar.arch
    if current in TCGEN05_ARCHS:
        yield current
        return
    envar.arch = arch
    try:
        yield arch
    finally:
        envar.arch = current


def smem_budget(cfg: KernelConfig, smem_capacity: int = SMEM_CAPACITY_SM100) -> dict:
    """Host view of the budget: ``{"num_ab_stage", "stage_bytes", "total_bytes", "epi_tile_n"}`` (traced for a
    tcgen05 target whatever GPU this machine has)."""
    out = {}

    @cute.jit
    def trace():
        lay = build_layouts(cfg, smem_capacity)
        out["num_ab_stage"] = lay.num_ab_stage
        out["stage_bytes"] = dict(lay.stage_bytes)
        out["total_bytes"] = dict(lay.total_bytes)
        out["epi_tile_n"] = cute.size(lay.epi_tile[1])
        out["epi_tile_m"] = cute.size(lay.epi_tile[0])

    with tcgen05_target():
        trace()
    return out
