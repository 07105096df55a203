"""sm100 backend: the shared-memory budget comes from the staged layouts' cosize, and the weight-scale
repack matches CuTe's scale-factor layout. Traces layouts with the CuTe DSL (no compile, no GPU)."""

import pytest
import torch

pytest.importorskip("cutlass", reason="the [kernels] extra (nvidia-cutlass-dsl) is not installed")

from svdq_linear import nvfp4  # noqa: E402
from svdq_linear.backends.sm100 import host  # noqa: E402
from svdq_linear.backends.sm100.host import K_TILE, LIBRARY_CONFIGS, SMEM_CAPACITY_SM100  # noqa: E402
from svdq_linear.backends.sm100.layouts import BARRIER_BYTES, NUM_C_STAGE, smem_budget  # noqa: E402

M, K, N, R = 4352, 3840, 3072, 128


@pytest.fixture(autouse=True)
def _tcgen05_target():
    """The tests' own traces build tcgen05 layouts: for sm_100a whatever GPU runs the suite (an H100 gave sm_90a)."""
    from svdq_linear.backends.sm100.layouts import tcgen05_target

    with tcgen05_target():
        yield


def test_the_budget_is_traced_for_a_tcgen05_target_on_any_machine():
    """On a Hopper machine CuTe's DSL targets sm_90a, where tcgen05's atoms refuse to build (the suite failed there):
    ``smem_budget`` traces for sm_100a and puts the machine's target back; a tcgen05 target is kept as it is."""
    from cutlass.cutlass_dsl import CuTeDSL

    from svdq_linear.backends.sm100.layouts import tcgen05_target

    envar = CuTeDSL._get_dsl().envar
    before = envar.arch
    try:
        for machine in ("sm_90a", "sm_103a"):
            envar.arch = machine
            assert smem_budget(LIBRARY_CONFIGS[0])["num_ab_stage"] >= 2
            assert envar.arch == machine, f"the target was left at {envar.arch}, not {machine}"
            with tcgen05_target() as arch:
                assert arch == ("sm_103a" if machine == "sm_103a" else "sm_100a") == envar.arch
            assert envar.arch == machine
    finally:
        envar.arch = before


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float16"])
def test_flux_size_layer_keeps_four_ab_stages_on_two_ctas(out_dtype):
    cfg = host.choose_config(M, N, R, out_dtype)
    assert cfg.use_2cta
    budget = smem_budget(cfg)
    assert budget["num_ab_stage"] >= 4, f"{cfg.name}: only {budget['num_ab_stage']} A/B stages"


@pytest.mark.parametrize("cfg", LIBRARY_CONFIGS, ids=lambda c: c.name)
def test_every_budgeted_operand_is_its_layouts_cosize(cfg):
    b = smem_budget(cfg)
    n_cta = 2 if cfg.use_2cta else 1
    # Independent oracle: bytes per CTA written out from the operand shapes. In 2-CTA mode each CTA
    # holds half of A along M and half of B along N (the low-rank operands too); the weight scales
    # (SFB) are held for the whole N tile, in 128-row groups.
    per_stage = {
        "a": cfg.cta_tile_m * K_TILE // 2,
        "b": cfg.mma_tile_n // n_cta * K_TILE // 2,
        "sfa": cfg.cta_tile_m * K_TILE // 16,
        "sfb": -(-cfg.mma_tile_n // 128) * 128 * K_TILE // 16,
        "a2": cfg.cta_tile_m * cfg.lowrank_chunk * 2,
        "b2": cfg.mma_tile_n // n_cta * cfg.lowrank_chunk * 2,
        "c": b["epi_tile_m"] * b["epi_tile_n"] * 2,
    }
    assert b["stage_bytes"] == per_stage
    stages = {"a": b["num_ab_stage"], "b": b["num_ab_stage"], "sfa": b["num_ab_stage"], "sfb": b["num_ab_stage"],
              "a2": 2, "b2": 2, "c": NUM_C_STAGE}
    for name, n in stages.items():
        assert b["total_bytes"][name] == per_stage[name] * n, name
    used = sum(b["total_bytes"].values()) + BARRIER_BYTES
    assert used <= SMEM_CAPACITY_SM100


@pytest.mark.parametrize("cfg", [*LIBRARY_CONFIGS, host.KernelConfig(256, 128, 16), host.KernelConfig(256, 128, 48),
                                                 host.KernelConfig(256, 256, 16), host.KernelConfig(128, 128, 64)],
                         ids=lambda c: c.name)
def test_the_kernels_shared_storage_fits_and_one_more_stage_would_not(cfg):
    """The stage count is the most that the kernel's real shared-memory struct holds. The budget had reserved 7 KiB
    of alignment padding that the 1024-byte buffers never need, and so left a stage unused: the 1-CTA rank-128 tile
    kept 3 of 4, and tiles of ranks 16-64 one fewer than fit (found by a helper's probe against CUTLASS's rule)."""
    import cutlass.cute as cute

    from svdq_linear.backends.sm100.layouts import build_layouts, shared_storage

    got = {}

    @cute.jit
    def trace():
        lay = build_layouts(cfg)
        more = build_layouts(cfg, smem_capacity=1 << 30, num_ab_stage=lay.num_ab_stage + 1)
        got.update(stages=lay.num_ab_stage, size=shared_storage(lay, cfg).size_in_bytes(),
                   more=shared_storage(more, cfg).size_in_bytes())

    trace()
    assert got["size"] <= SMEM_CAPACITY_SM100 < got["more"], got


def test_weight_scale_repack_matches_cute_scale_factor_layout():
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as blockscaled_utils

    rows, k = 300, 3072
    scales = nvfp4.round_e4m3(torch.rand(rows, k // 16) * 400 + 0.01)
    flat = host.to_sf_atom_layout(scales).view(torch.uint8)
    coords = [(r, kb) for r in range(0, rows, 7) for kb in range(0, k // 16, 5)] + [(rows - 1, k // 16 - 1)]
    got = {}

    @cute.jit
    def trace():
        lay = blockscaled_utils.tile_atom_to_shape_SF((rows, k, 1), 16)
        got["size"] = cute.cosize(lay)
        got["offsets"] = [cute.crd2idx((r, kb * 16, 0), lay) for r, kb in coords]

    trace()
    assert got["size"] <= flat.numel()
    sv = scales.view(torch.uint8)
    for (r, kb), off in zip(coords, got["offsets"]):
        assert flat[off] == sv[r, kb], f"scale ({r}, {kb}) is not at CuTe's offset {off}"


@pytest.mark.parametrize("rank", [16, 32, 48, 64, 96, 128])
@pytest.mark.parametrize("m,n", [(64, 3072), (4352, 3072), (4352, 12288), (1000, 520)])
def test_chosen_config_keeps_enough_ab_stages(rank, m, n):
    # every chosen tile keeps at least 4 stages (the 1-CTA small-M tile, holding a full 128-row B, 4 at rank 128)
    cfg = host.choose_config(m, n, rank, "bfloat16")
    want = 4
    assert smem_budget(cfg)["num_ab_stage"] >= want, cfg.name


@pytest.mark.parametrize("cfg", LIBRARY_CONFIGS[::2], ids=lambda c: c.name)
def test_tmem_plan_gives_the_scale_factors_the_columns_cutes_layouts_span(cfg):
    """``host.tmem_plan`` places SFB right after SFA's columns, so SFA's count must be what CuTe's TMEM layout of the
    kernel's SFA tile spans (``make_tmem_layout_sfa`` over the one-stage SMEM layout, as ``kernel.mma`` builds it):
    fewer columns would put SFB over the last SFA columns; the same for SFB, which must end inside the allocation.
    Only the accumulator's span was checked (by the kernel, at trace time)."""
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as blockscaled_utils
    from cutlass.cute.nvgpu import tcgen05

    from svdq_linear.backends.sm100.layouts import SF_DTYPE, build_layouts

    got = {}

    @cute.jit
    def trace():
        lay = build_layouts(cfg)
        ptr = cute.make_ptr(SF_DTYPE, 0, cute.AddressSpace.tmem)
        for name, make, smem in (("sfa", blockscaled_utils.make_tmem_layout_sfa, lay.sfa_smem),
                                 ("sfb", blockscaled_utils.make_tmem_layout_sfb, lay.sfb_smem)):
            layout = make(lay.tiled_mma, lay.mma_tiler, 16, cute.slice_(smem, (None, None, None, 0)))
            got[name] = tcgen05.find_tmem_tensor_col_offset(cute.make_tensor(ptr, layout))

    trace()
    plan = host.tmem_plan(cfg)
    assert (plan.sfa_cols, plan.sfb_cols) == (got["sfa"], got["sfb"]), (plan, got)
    assert plan.offsets["sfb"] == plan.offsets["sfa"] + got["sfa"]
    assert plan.offsets["sfb"] + got["sfb"] <= plan.alloc_cols <= host.TMEM_COLUMNS


def test_the_stage_count_is_the_most_the_kernels_struct_fits_in_any_capacity():
    """At a capacity of exactly the kernel's shared-memory struct for S stages, ``build_layouts`` takes S stages; one
    byte less, S - 1, and below two stages it refuses (a one-stage pipeline cannot overlap a load with an MMA). The
    budget's barrier bytes and padding are thereby held to the real struct at every stage count, not only at the
    227 KiB of sm_100."""
    import cutlass.cute as cute

    from svdq_linear.backends.sm100.host import Sm100ConfigError
    from svdq_linear.backends.sm100.layouts import build_layouts, shared_storage

    cfg = LIBRARY_CONFIGS[0]
    got = {}

    @cute.jit
    def trace():
        for s in (2, 3):
            size = shared_storage(build_layouts(cfg, smem_capacity=1 << 30, num_ab_stage=s), cfg).size_in_bytes()
            got[s] = build_layouts(cfg, smem_capacity=size).num_ab_stage
            try:
                got[s - 0.5] = build_layouts(cfg, smem_capacity=size - 1).num_ab_stage
            except Sm100ConfigError:
                got[s - 0.5] = "refused"

    trace()
    assert got == {2: 2, 1.5: "refused", 3: 3, 2.5: 2}, got
