"""sm100 kernel compile checks (no GPU): every library configuration compiles for sm_100a and
sm_103a, and its SASS holds what the design promises. Each configuration compiles once per session
(in a subprocess, two at a time); registers are reported beside quack's GemmSm100 compiled the same
way."""

import pytest

pytest.importorskip("cutlass", reason="the [kernels] extra (nvidia-cutlass-dsl) is not installed")

from svdq_linear.backends.sm100 import precompile  # noqa: E402
from svdq_linear.backends.sm100.host import LIBRARY_CONFIGS  # noqa: E402

if precompile.find_nvdisasm() is None:
    pytest.skip("nvdisasm not found (pip nvidia-cuda-nvdisasm, or triton's bundled copy)", allow_module_level=True)


@pytest.fixture(scope="module", params=precompile.ARCHES)
def compiled(request, tmp_path_factory):
    arch = request.param
    out = tmp_path_factory.mktemp(f"precompile-{arch}")
    recs = precompile.precompile_sm100(arch, out, keep_sass=False)
    base = precompile.precompile_baselines(arch, out) if arch == "sm_100a" else []
    return arch, recs, base


def test_every_library_configuration_compiles(compiled):
    arch, recs, _ = compiled
    assert [r["name"] for r in recs] == [c.name for c in LIBRARY_CONFIGS]
    failed = {r["name"]: r.get("error", "")[-1500:] for r in recs if not r["ok"]}
    assert not failed, f"{arch}: {failed}"


def test_sass_has_block_scaled_and_low_rank_mmas_tma_and_no_local_memory(compiled):
    arch, recs, base = compiled
    by_name = {c.name: c for c in LIBRARY_CONFIGS}
    lines = []
    for r in recs:
        cfg, c = by_name[r["name"]], r["sass_counts"]
        where = f"{arch} {r['name']}: {c}"
        assert c["LDL"] == 0 and c["STL"] == 0 and r["frame_bytes"] == 0, f"local memory in {where}"
        if cfg.use_2cta:
            assert c["UTCOMMA.2CTA"] >= 1, f"no 2-CTA block-scaled MMA in {where}"
        else:
            assert c["UTCOMMA"] >= 1 and c["UTCOMMA.2CTA"] == 0, where
        # every low-rank atom of a tile is its own instruction (chunks unrolled at trace time)
        assert c["UTCHMMA"] == cfg.rank // 16, f"expected {cfg.rank // 16} low-rank MMAs in {where}"
        assert c["UTCCP"] >= 2, f"no scale-factor SMEM->TMEM copies in {where}"
        assert c["UTMALDG"] >= 6 and c["UTMASTG"] >= 1, f"TMA loads (A, B, SFA, SFB, lora_act, proj_up) or store missing in {where}"
        assert 0 < r["registers"] <= 255
        # ACCUMULATE: the first block-scaled atom of a K tile clears the accumulator on the tile's
        # first K tile only (a runtime predicate), the other atoms and every low-rank atom add
        flags = r["accumulate_flags"]
        assert flags["block_scaled"] == ["runtime", "true", "true", "true"], f"{where}: {flags}"
        assert flags["low_rank"] == ["true"] * (cfg.rank // 16), f"{where}: {flags}"
        lines.append(f"{r['name']:50} regs {r['registers']:3} spills {r['spills']}")
    for b in base:
        if b["ok"]:
            lines.append(f"{b['name']:50} regs {b['registers']:3} spills {b.get('spills')}  (reference, no low-rank)")
    print("\n" + "\n".join(lines))


def test_the_weight_scales_reach_both_ctas_of_a_pair(compiled):
    """In a 2-CTA MMA each CTA of the pair loads half of B but needs the scales (SFB) of the whole N tile, so each
    CTA's SFB load goes to both (CUTLASS's block-scaled example and quack's GemmSm100 build its mask from the SFB
    cluster layout: 0b11). The kernel had used B's mask, the issuing CTA alone (``1 << rank``): half the bytes the
    pipeline's expect-tx counts would land, and the first K tile's barrier would never complete. Read from the PTX:
    the loads' masks, no GPU."""
    arch, recs, _ = compiled
    by_name = {c.name: c for c in LIBRARY_CONFIGS}
    for r in recs:
        cfg, masks = by_name[r["name"]], r["tma_load_masks"]
        where = f"{arch} {r['name']}: {masks}"
        # A, B, SFA, SFB, and lora_act and proj_up once per low-rank chunk (unrolled at trace time)
        assert len(masks) >= 6, f"loads missing in {where}"
        if cfg.use_2cta:  # SFB's load alone is multicast, to both CTAs
            assert masks.count("3") == 1 and masks.count("self") == len(masks) - 1, where
        else:
            assert masks == ["self"] * len(masks), where
