"""Host-side pieces of the sm90 backend that need no GPU: the quack weight repack, the tile table."""

import json

import pytest
import torch

quack_gemm = pytest.importorskip("svdq_linear.backends.sm90.quack_gemm",
                                 reason="quack-kernels (the [kernels] extra) is not installed")


@pytest.mark.parametrize("n,k", [(128, 128), (256, 512), (384, 3072)])
def test_repack_equals_quacks_and_inverts(n, k):
    from quack.gemm_w4 import prepare_w4_weight

    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    sf = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    blob_ref, sf_ref = prepare_w4_weight(q, sf, "nvfp4")
    blob, strip = quack_gemm.repack_weight(q), quack_gemm.repack_scales(sf)
    assert blob.shape == blob_ref.shape and torch.equal(blob, blob_ref), "weight bytes differ from quack's repack"
    assert torch.equal(strip, sf_ref.view(torch.uint8).reshape(strip.shape)), "scale bytes differ from quack's"
    assert torch.equal(quack_gemm.unpack_weight(blob), q)
    assert torch.equal(quack_gemm.unpack_scales(strip).view(torch.uint8), sf.view(torch.uint8))


def test_prefill_tile_fills_the_waves_and_its_low_rank_copy_splits():
    """Above 1024 tokens the token tile is 256 unless a narrower one runs fewer waves x width by 5 %; every
    width it picks splits the low-rank operands' copy for the windows the backend uses (16-64 wide)."""
    from svdq_linear.backends.sm90 import quack_lowrank, tuning

    def waves_x_width(m, n, tn, sms=132):
        tiles = -(-n // 128) * -(-m // tn)
        return -(-tiles // sms) * tn

    # Flux / the reference design (M, N): the part-empty last waves move, the full ones stay at 256
    want = {(4608, 3072): 224, (4352, 3072): 208, (4096, 3072): 256, (4096, 9216): 256, (4096, 12288): 256,
            (4608, 21504): 256, (4608, 12288): 256, (4352, 3840): 256, (4352, 15360): 256}
    for (m, n), tn in want.items():
        assert tuning.prefill_tiles(m, n) == (128, tn), (m, n)
    seen = set()
    for m in range(1025, 9000, 61):
        for n in (1024, 3072, 3840, 9216, 12288, 15360, 21504):
            tm, tn = tuning.prefill_tiles(m, n)
            assert tm == 128 and tn in (256, 240, 224, 208, 192)
            if tn != 256:
                assert waves_x_width(m, n, tn) <= 0.95 * waves_x_width(m, n, 256), (m, n, tn)
            assert all(waves_x_width(m, n, tn) <= waves_x_width(m, n, w) for w in (256, 240, 224, 208, 192)
                       if waves_x_width(m, n, w) <= 0.95 * waves_x_width(m, n, 256)), (m, n, tn)
            seen.add(tn)
    assert len(seen) >= 4  # the rule does pick narrow widths somewhere in this range
    for tn in seen:
        for w in (16, 32, 48, 64):
            per_row, rows = quack_lowrank.copy_split(tn, w, 256)
            assert tn % rows == 0 and per_row * rows <= 256


def test_tile_table_is_well_formed():
    from svdq_linear.backends.sm90 import tuning

    raw = json.loads(tuning._TABLE.read_text())
    assert set(map(int, raw["configs"])) == set(tuning.M_BUCKETS)
    for m in (1, 7, 64, 500, 4096, 10000):
        cfg = tuning.pick(m, 3072, 3072)
        assert cfg.block_m >= 16 and cfg.block_m <= max(16, 1 << (m - 1).bit_length())
        assert cfg.split_k >= 1 and 3072 % cfg.block_k == 0


def test_pick_reads_the_row_of_the_smallest_bucket_that_holds_the_tokens():
    """``pick(m)`` takes ``configs.json``'s row for the smallest M bucket >= m (the largest past the last bucket):
    a bucket's own token count is its row's (512 tokens ran the 1024 row's 256 x 64 tile when the bucket search
    took the next bucket up at equality)."""
    from svdq_linear.backends.sm90 import tuning

    raw = json.loads(tuning._TABLE.read_text())["configs"]
    buckets = sorted(map(int, raw))
    ms = set(buckets) | {b + 1 for b in buckets} | set(torch.randint(1, 9000, (40,)).tolist())  # and 40 others
    for m in sorted(ms):
        want = next((b for b in buckets if b >= m), buckets[-1])
        assert tuning.m_bucket(m) == want, (m, tuning.m_bucket(m), want)
        cfg, row = tuning.pick(m, 3072, 3072), raw[str(want)]
        assert (cfg.block_n, cfg.block_k, cfg.num_warps, cfg.group_n) == (
            row["block_n"], row["block_k"], row["num_warps"], row["group_n"]), (m, want, cfg)


def test_split_k_covers_the_sms_twice_where_k_allows():
    """Where the table leaves split-K to the rule (its small-M rows; the Triton GEMM serves W4A16 calls of 33-64
    tokens with them), the split is the smallest power of two up to 16 whose CTAs cover the 132 SMs twice, or the
    largest that keeps at least four K-steps a split (the rule written out here by brute force)."""
    from svdq_linear.backends.sm90 import tuning

    rows = json.loads(tuning._TABLE.read_text())["configs"]
    checked = 0
    for m in range(33, 65):
        for n, k in ((3072, 3072), (3072, 9216), (3072, 18432), (12288, 3072), (2432, 14592)):
            cfg = tuning.pick(m, n, k)
            if rows[str(tuning.m_bucket(m))]["split_k"] != 0:
                continue
            tiles = -(-n // cfg.block_n) * -(-m // cfg.block_m)
            allowed = [s for s in (1, 2, 4, 8, 16) if s == 1 or (k // cfg.block_k) // s >= 4]
            want = next((s for s in allowed if tiles * s >= 2 * tuning.SM_COUNT), allowed[-1])
            assert cfg.split_k == want, f"M {m}, N {n}, K {k}: split {cfg.split_k}, expected {want} ({tiles} tiles)"
            checked += 1
    assert checked > 100


def test_prefill_tile_ties_go_to_the_wider_tile():
    """Among token-tile widths of equal model cost (waves x width) the prefill rule takes the widest: narrower
    tiles run their wgmmas less efficiently, which is why 256 is the default (``tuning.prefill_tiles``). Ties are
    common: 1046 tokens x 18432 rows cost 224 wide as 192 wide does."""
    from svdq_linear.backends.sm90 import tuning

    def waves_x_width(m, n, tn, sms=132):
        return -(-(-(-n // 128) * -(-m // tn)) // sms) * tn

    ties = 0
    for m in range(1025, 12000, 37):
        for n in (3072, 9216, 12288, 15360, 18432, 21504):
            tn = tuning.prefill_tiles(m, n)[1]
            costs = {w: waves_x_width(m, n, w) for w in tuning.PREFILL_TOKEN_TILES}
            best = min(costs.values())
            if tn != 256 or costs[256] == best:
                assert tn == max(w for w, c in costs.items() if c == best), (m, n, tn, costs)
            ties += sum(c == best for c in costs.values()) > 1
    assert ties > 10
    assert tuning.prefill_tiles(1046, 18432) == (128, 224)


def test_lora_act_split_keeps_two_of_the_kernels_k_steps_at_every_rank():
    """The Triton ``lora_act``'s k-step is 128 where its padded rank (the next power of two, at least 16) is at most
    64, else 64 (``kernels.lora_act``); the default plan's split keeps at least two such steps a split and is the
    largest power of two up to ``LORA_ACT_CONFIG``'s split that does. At rank 64 a plan that assumed 64-wide steps
    split 512 columns four ways: one 128-wide step a split."""
    from svdq_linear.backends.sm90 import tuning

    split_max = tuning.LORA_ACT_CONFIG[1]
    for r in (1, 8, 16, 17, 32, 48, 63, 64, 65, 96, 128):
        step = 128 if max(16, 1 << (r - 1).bit_length()) <= 64 else 64
        for k in (256, 384, 512, 768, 1024, 3072):
            want = max([s for s in (1, 2, 4, 8, 16) if s <= split_max and (s == 1 or k // s >= 2 * step)])
            got = tuning.lora_act_plan(4096, k, r).split
            assert got == want, f"rank {r}, K {k}: split {got}, expected {want} ({step}-column k-steps)"


def test_sm_count_asks_the_device_of_the_call(monkeypatch):
    """``tuning.sm_count`` sizes grids by the SMs of the tensor's own GPU (``cuda:1`` in a pipeline spread over two
    unequal GPUs), not those of GPU 0; ``SM_COUNT`` off CUDA. The driver is stubbed (no GPU here)."""
    from types import SimpleNamespace

    from svdq_linear.backends.sm90 import tuning

    sms = {0: 132, 1: 114, 2: 78}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=sms[i]))
    tuning._sm_count.cache_clear()
    try:
        for i, n in sms.items():
            assert tuning.sm_count(torch.device("cuda", i)) == n, i
        assert tuning.sm_count(torch.device("cpu")) == tuning.SM_COUNT
    finally:
        tuning._sm_count.cache_clear()


def test_exact_state_stands_in_and_the_triton_gemm_rebuilds_per_call():
    """quack's blob and strip stand in for the canonical qweight and wscales (bit for bit); a call the
    Triton GEMM serves (fewer than QUACK_MIN_M tokens) rebuilds them and gives the same bytes as with
    the canonical tensors."""
    pytest.importorskip("triton")
    from test_conformance import random_w4a4

    from svdq_linear.backends.sm90 import Sm90Backend, Sm90Prepared

    backend = Sm90Backend()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton GEMM launches where the state lives
    m = random_w4a4(256, 128, 16, torch.bfloat16, dev)
    qw = quack_gemm.prepare(m.qweight, m.wscales, m.wcscale, m.bias)
    pds = (m.proj_down.float() / m.smooth[:, None]).bfloat16()
    prep = Sm90Prepared(pds, m.proj_up.bfloat16(), qw)
    rebuild = backend.replaced(prep)
    assert set(rebuild) == {"qweight", "wscales"}
    assert torch.equal(rebuild["qweight"](), m.qweight)
    assert torch.equal(rebuild["wscales"]().view(torch.uint8), m.wscales.view(torch.uint8))
    x = torch.randn(5, 256, dtype=torch.bfloat16, device=dev)
    args = (m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias, backend.extra_tensors(prep))
    want = backend.run_w4a4(x, m.qweight, m.wscales, *args)
    empty_q, empty_s = m.qweight.new_empty(0, 0), m.wscales.new_empty(0, 0)
    assert torch.equal(backend.run_w4a4(x, empty_q, empty_s, *args), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,k,r", [(37, 384, 32), (5, 256, 96), (40, 992, 20), (0, 128, 32)])
def test_lora_act_kernel_is_x_in_bf16_times_proj_down(dtype, m, k, r):
    """``kernels.lora_act``: ``x.to(bf16) @ pds`` with fp32 accumulation (one rounding of the fp32 sum:
    fp32-level error), R padded to a power of two inside, whole K in one program."""
    from svdq_linear.backends.sm90 import kernels

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(m + k + r)
    x = torch.randn(m, k, generator=g).to(dtype)
    pds = (torch.randn(k, r, generator=g) / 20).bfloat16()
    got = kernels.lora_act(x.to(dev), pds.to(dev), torch.float32).cpu().double()
    xb = x.to(torch.bfloat16).double()
    want = xb @ pds.double()
    mag = xb.abs() @ pds.double().abs() + 1e-30
    # exact x on the GPU and for bf16 x; Triton's CPU interpreter converts to bf16 by truncation: one ulp
    rel = 2.0**-20 if dev == "cuda" or dtype == torch.bfloat16 else 2.0**-7
    assert got.shape == (m, r) and ((got - want).abs() <= mag * rel).all()
    assert kernels.lora_act(x.to(dev), pds.to(dev), torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="pds"):
        kernels.lora_act(x.to(dev), pds.float().to(dev))


@pytest.mark.parametrize("m,k,r,split,block_m", [(37, 768, 32, 3, 16), (70, 1024, 96, 4, 32), (9, 256, 24, 8, 16)])
def test_lora_act_split_gives_partial_sums_over_k_ranges(m, k, r, split, block_m):
    """``split=S``: ``[S, M, R]`` fp32, slice s the product over its range of whole k-steps (a range past
    K is zeros), so that the slices add up to ``x @ pds``; bad splits are refused."""
    from svdq_linear.backends.sm90 import kernels

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(m + split)
    x = torch.randn(m, k, generator=g).bfloat16()
    pds = (torch.randn(k, r, generator=g) / 20).bfloat16()
    got = kernels.lora_act(x.to(dev), pds.to(dev), block_m=block_m, block_k=64, split=split).cpu().double()
    assert got.shape == (split, m, r)
    step = -(-(-(-k // split)) // 64) * 64  # each range: whole 64-column steps
    for s in range(split):
        lo, hi = min(s * step, k), min((s + 1) * step, k)
        want = x[:, lo:hi].double() @ pds[lo:hi].double()
        mag = x[:, lo:hi].double().abs() @ pds[lo:hi].double().abs() + 1e-30
        assert ((got[s] - want).abs() <= mag * 2.0**-20).all(), s
    with pytest.raises(ValueError, match="split"):
        kernels.lora_act(x.to(dev), pds.to(dev), torch.bfloat16, split=2)
    with pytest.raises(ValueError, match="split"):
        kernels.lora_act(x.to(dev), pds.to(dev), split=0)


_ONE_READ_SASS = """
import json, sys
sys.path.insert(0, sys.argv[2])
from sass_loops import compile_sm90, instructions, loop_bodies
from svdq_linear.backends.sm90 import kernels, tuning

sig = dict(x_ptr="*bf16", smooth_ptr="*fp32", xq_ptr="*bf16", pd_ptr="*bf16", lora_ptr="*bf16", part_ptr="*fp32",
           cnt_ptr="*i32", M="i32", K="i32", R="i32", stride_xm="i32", stride_xk="i32", K_SPLIT="i32", SPLIT="i32")
bm, bk, w, st = tuning.EXACT_LORA_CONFIG
out = {}
for rb in (32, 128):
    cx = dict(BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=rb, IS_SPLIT=True, DOT_F32=False, NUM_STAGES=st)
    sass = compile_sm90(kernels._quantize_act_lora_kernel, sig, cx, sys.argv[1] + f"/r{rb}.cubin",
                        ("M", "stride_xk", "SPLIT"), num_warps=w)
    body = max(loop_bodies(sass), key=len)
    out[rb] = dict(mma=[t.split()[0] for t in body if "MMA" in t], ldgsts=sum("LDGSTS" in t for t in body),
                   local=sum("LDL" in t or "STL" in t for _, t in instructions(sass)), atom=sass.count("ATOMG"))
print(json.dumps(out))
"""


def test_one_read_pass_compiles_to_wgmma_on_a_pipelined_loop(tmp_path):
    """``kernels.quantize_act_lora`` at its config (``tuning.EXACT_LORA_CONFIG``), compiled for sm_90a here
    (the real compiler, in a child process): its K loop issues ``lora_act`` as warpgroup MMAs (one
    ``HGMMA.64xRx16`` per 16 columns of the k-step), loads through ``LDGSTS`` (the stages in flight), keeps
    nothing in local memory, and counts in on one atomic a program."""
    from sass_loops import run_script

    from svdq_linear.backends.sm90 import tuning

    res = run_script(_ONE_READ_SASS, tmp_path, timeout=600)
    bk = tuning.EXACT_LORA_CONFIG[1]
    for rb, v in res.items():
        assert v["mma"] == [f"HGMMA.64x{rb}x16.F32.BF16"] * (bk // 16), (rb, v["mma"])
        assert v["ldgsts"] > 0 and v["local"] == 0 and v["atom"] == 1, (rb, v)


def test_exact_lora_plan_rule_and_environment():
    """The two launches by default; ``one`` takes the one read of x at its config, its split the smallest whose
    programs fill EXACT_LORA_WAVE_FILL of one wave of EXACT_LORA_PROGRAMS an SM where K allows; an explicit
    config is taken as given; bad values are refused by name."""
    from svdq_linear.backends.sm90 import tuning

    for env in (None, "", "two", "TWO"):
        assert tuning.exact_lora_plan(4096, 3072, 32, env) is None
    assert tuning.exact_lora_plan(4096, 3072, 0, "one") is None
    assert tuning.exact_lora_plan(4096, 3072, tuning.EXACT_LORA_MAX_R + 16, "one") is None  # wider: two launches
    for m, k in ((128, 3072), (512, 3072), (4096, 3072), (4608, 15360), (100, 256)):
        p = tuning.exact_lora_plan(m, k, 32, "one")
        assert (p.block_m, p.block_k, p.num_warps, p.num_stages) == tuning.EXACT_LORA_CONFIG
        blocks = -(-m // p.block_m)
        assert p.split in (1, 2, 4, 8) and (p.split == 1 or k // p.split >= 2 * p.block_k)
        fill = tuning.EXACT_LORA_WAVE_FILL * tuning.EXACT_LORA_PROGRAMS * tuning.SM_COUNT
        assert p.split == 1 or blocks * p.split // 2 < fill  # the smallest
        assert p.split == 8 or blocks * p.split >= fill or k // (2 * p.split) < 2 * p.block_k  # that fills the wave
    for m in (4096, 4352, 4608):  # the split measured best there (twenty-fifth session, H100)
        assert tuning.exact_lora_plan(m, 3840, 32, "one").split == 4
    assert tuning.exact_lora_plan(512, 3072, 32, "one").split == 8
    assert tuning.exact_lora_plan(4096, 3072, 32, "16,64,8,3,2") == tuning.ExactLoraPlan(16, 64, 8, 3, 2)
    assert tuning.exact_lora_plan(4096, 3072, 32, "16,64,8,0,1").split == tuning.exact_lora_split(4096, 3072, 16, 64)
    for bad in ("fast", "16,64,8,1", "24,64,8,1,1", "16,64,3,1,1", "16,64,8,1,0", "16,64,8,1,5"):
        with pytest.raises(ValueError, match=tuning.ENV_EXACT_LORA):
            tuning.exact_lora_plan(4096, 3072, 32, bad)


def test_lora_act_plan_rule_and_environment():
    """cuBLAS below ``LORA_ACT_MIN_M`` tokens and at rank 0; above, the Triton kernel's measured config with
    its split cut to keep two k-steps a split; the environment forces either or sets the config (split 0:
    the occupancy rule), and a malformed value is an error."""
    from svdq_linear.backends.sm90 import tuning

    lo = tuning.LORA_ACT_MIN_M
    assert tuning.lora_act_plan(lo - 1, 3072, 32) is None and tuning.lora_act_plan(4096, 3072, 0) is None
    assert tuning.lora_act_plan(lo, 3072, 32) is not None  # from LORA_ACT_MIN_M tokens on
    bm, s, w, st = tuning.LORA_ACT_CONFIG
    assert tuning.lora_act_plan(4096, 3072, 96) == tuning.LoraActPlan(bm, s, w, st)
    assert tuning.lora_act_plan(4096, 256, 32).split == 1  # 256 columns: two 128-column steps in all
    assert tuning.lora_act_plan(4096, 256, 96).split == min(s, 2)  # 64-column steps above rank 64
    assert tuning.lora_split(4096, 3072, 64) == 4 and tuning.lora_split(4096, 3072, 16) == 1
    assert tuning.lora_split(4096, 256, 128) == 1
    assert tuning.lora_act_plan(4096, 3072, 32, "cublas") is None
    assert tuning.lora_act_plan(8, 3072, 32, "64,2,4,3") == tuning.LoraActPlan(64, 2, 4, 3)
    assert tuning.lora_act_plan(4096, 3072, 32, "64,0,4,3").split == tuning.lora_split(4096, 3072, 64)
    for bad in ("fast", "64,2,4", "48,2,4,3"):
        with pytest.raises(ValueError, match="SVDQ_SM90_LORA_ACT"):
            tuning.lora_act_plan(4096, 3072, 32, bad)


def _lora_inputs(m, k, r, seed):
    """``x [m, k]`` bf16, ``smooth [k]``, ``pds = proj_down / smooth [k, r]`` bf16 and ``1 / smooth``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    smooth = torch.rand(k, generator=g) + 0.5
    pds = (torch.randn(k, r, generator=g) / k ** 0.5).bfloat16()
    return x, smooth, pds, 1.0 / smooth


@pytest.mark.parametrize("site", ["fast", "cat", "exact_pdl"])
def test_lora_act_setting_past_the_gpus_resources_is_named(site, monkeypatch):
    """A ``kernels.lora_act`` launch on ``SVDQ_SM90_LORA_ACT``'s config that Triton refuses for want of resources
    (its ``OutOfResources``) is a ValueError naming the setting, its value and the launch, chained from Triton's
    error, at each launch the setting configures: the fast mode's (``run_w4a4_fast``, its quack GEMM a stand-in),
    the two-source one of a ``cat_gelu`` input (``run_w4a4_cat_gelu``, 2048 tokens) and the exact mode's PDL pair
    (``run_w4a4``, PDL stood in on the CPU). Unset (the default plan at ``LORA_ACT_MIN_M`` tokens), and for the
    two-source launch also under "cublas" (which it cannot take: the default plan runs), Triton's error passes
    unchanged. Stand-in ``_lora_act_kernel`` launches."""
    from types import SimpleNamespace

    from test_norm_pass import _out_of_resources, _refusing
    from triton.runtime.errors import OutOfResources

    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels, tuning

    oor = _out_of_resources()
    monkeypatch.setattr(kernels, "_lora_act_kernel", _refusing(oor))
    for name in (tuning.ENV_LORA_ACT, tuning.ENV_EXACT_LORA, sm90.ENV_PDL, sm90.ENV_LORA_STREAM):
        monkeypatch.delenv(name, raising=False)
    be = sm90.Sm90Backend()
    k, r = 256, 16
    m = tuning.CAT_GELU_MIN_M if site == "cat" else tuning.LORA_ACT_MIN_M
    x, smooth, pds, inv = _lora_inputs(m, k, r, seed=12)
    pd = torch.zeros(k, r)  # (its width only: the prepared pds is extra[0])
    if site == "fast":
        class FakeQuackFast:
            weight = staticmethod(lambda ex: SimpleNamespace(cs=torch.zeros(1, 64)))

        monkeypatch.setattr(sm90, "_quack_fast_module", lambda: FakeQuackFast)
        ex = [pds] + [torch.zeros(1, 8)] * 6 + [inv]  # the accumulator form's 7 tensors + inv_smooth

        def call():
            be.run_w4a4_fast(x, None, None, smooth, pd, None, None, None, ex)
    elif site == "cat":
        assert be._exact_reads_cat(x[:, :128], x[:, 128:])

        def call():
            be.run_w4a4_cat_gelu(x[:, :128], x[:, 128:], None, None, smooth, pd, None, None, None, [pds, inv])
    else:
        monkeypatch.setattr(sm90, "_pdl", lambda x, kernels, auto=True: True)
        monkeypatch.setattr(kernels, "_check_pdl", lambda device, what: None)

        def call():
            be.run_w4a4(x, None, None, smooth, pd, None, None, None, [pds, inv])

    monkeypatch.setenv(tuning.ENV_LORA_ACT, "32,2,4,2")
    with pytest.raises(ValueError, match=f"{tuning.ENV_LORA_ACT}='32,2,4,2': lora_act at .*block_m=32, split=2, "
                                         f"num_warps=4, num_stages=2.* R = {r}") as info:
        call()
    assert info.value.__cause__ is oor
    unchanged = [None] + (["cublas"] if site == "cat" else [])
    for value in unchanged:
        if value is None:
            monkeypatch.delenv(tuning.ENV_LORA_ACT)
        else:
            monkeypatch.setenv(tuning.ENV_LORA_ACT, value)
        with pytest.raises(OutOfResources) as info:
            call()
        assert info.value is oor, f"{value}: Triton's own error"


@pytest.mark.parametrize("value", ["one", "32,64,4,1,2"])
def test_exact_lora_setting_past_the_gpus_resources_is_named(value, monkeypatch):
    """A ``kernels.quantize_act_lora`` launch (the exact mode's one read of x, ``run_w4a4``) that Triton refuses for
    want of resources is a ValueError naming ``SVDQ_SM90_EXACT_LORA``, its value and the launch, chained from
    Triton's error, for "one" (the config ``EXACT_LORA_CONFIG``, the launch the setting asked for) and an explicit
    config; unset, where ``tuning.exact_lora_by_default`` takes the one read (its token floor lowered here), Triton's
    error passes unchanged. Stand-in ``_quantize_act_lora_kernel`` launches."""
    from test_norm_pass import _out_of_resources, _refusing
    from triton.runtime.errors import OutOfResources

    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels, tuning

    oor = _out_of_resources()
    monkeypatch.setattr(kernels, "_quantize_act_lora_kernel", _refusing(oor))
    monkeypatch.setattr(tuning, "EXACT_LORA_AUTO_MIN_M", 128)
    for name in (tuning.ENV_LORA_ACT, sm90.ENV_PDL, sm90.ENV_LORA_STREAM):
        monkeypatch.delenv(name, raising=False)
    be = sm90.Sm90Backend()
    k, r = 256, 16
    x, smooth, pds, inv = _lora_inputs(128, k, r, seed=13)

    def call():
        be.run_w4a4(x, None, None, smooth, torch.zeros(k, r), None, None, None, [pds, inv])

    monkeypatch.setenv(tuning.ENV_EXACT_LORA, value)
    want = tuning.exact_lora_plan(128, k, r, value)
    with pytest.raises(ValueError, match=f"{tuning.ENV_EXACT_LORA}='{value}': quantize_act_lora at .*"
                                         f"block_m={want.block_m}, block_k={want.block_k}.* R = {r}") as info:
        call()
    assert info.value.__cause__ is oor
    monkeypatch.delenv(tuning.ENV_EXACT_LORA)
    assert tuning.exact_lora_by_default(128, r)
    with pytest.raises(OutOfResources) as info:
        call()
    assert info.value is oor, "unset: Triton's own error"


def test_triton_gemm_stays_at_two_stages_above_64_tokens():
    """Triton 3.6 on sm_90 mis-compiles the 3-stage loop of the table's 128 x 256 x 64 tile (garbage in
    some outputs at 1000 tokens, run to run: tuning.MAX_STAGES_ABOVE_64); the small-M configs keep theirs."""
    from svdq_linear.backends.sm90 import tuning

    for m in (65, 128, 512, 1000, 4096, 8192):
        for n, k in ((3072, 3072), (12288, 3072), (3072, 12288)):
            assert tuning.pick(m, n, k).num_stages <= tuning.MAX_STAGES_ABOVE_64 == 2
    assert tuning.pick(16, 3072, 3072).num_stages == tuning.pick(64, 3072, 3072).num_stages == 4  # 64: not above


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the mis-compile is the GPU compiler's)")
@pytest.mark.parametrize("m,n", [(1000, 3072), (4096, 12288)])
def test_gpu_triton_gemm_default_config_writes_the_product_every_call(m, n):
    """The Triton W4 GEMM at ``tuning.pick``'s config with a bf16 output (what the exact mode runs above 64
    tokens without quack-kernels): three calls, each against the float64 product of the same operands.
    At 3 stages this tile wrote up to inf on the H200 (docs/perf.md, tenth session)."""
    from svdq_linear import nvfp4
    from svdq_linear.backends.sm90 import kernels, tuning

    k = 3072
    gen = torch.Generator().manual_seed(m)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen).cuda()
    ws = (torch.rand(n, k // 16, generator=gen) * 0.5 + 0.01).to(torch.float8_e4m3fn).cuda()
    a = torch.randn(m, k, generator=gen).bfloat16().cuda()
    ref = (a.double() @ nvfp4.dequantize_nvfp4(q, ws, torch.float64).T).cpu()
    bound = ref.abs() * 2.0**-8 + 1e-3 * ref.abs().max()  # bf16 rounding, fp32 order
    cfg = tuning.pick(m, n, k)
    for _ in range(3):
        y = kernels.w4_gemm(a, q, ws, torch.ones(n, device="cuda"), None, None, None, torch.bfloat16, cfg)
        assert ((y.double().cpu() - ref).abs() <= bound).all(), f"{cfg}: wrong outputs"


def test_lora_beside_the_pass_runs_serially_off_a_capture(monkeypatch):
    """``_lora_beside`` gives ``x.to(bf16) @ pds`` and the pass's result; off a CUDA-graph capture (here: the
    CPU) it forks no stream whatever ``SVDQ_SM90_LORA_STREAM`` says."""
    from svdq_linear.backends import sm90

    x = torch.randn(5, 64, dtype=torch.float16)
    pds = torch.randn(64, 16).bfloat16()
    order = []
    monkeypatch.setenv(sm90.ENV_LORA_STREAM, "1")
    lora, out = sm90._lora_beside(x, pds, lambda: order.append("pass") or "done")
    assert out == "done" and order == ["pass"]
    assert lora.dtype == torch.bfloat16 and torch.equal(lora, x.bfloat16() @ pds)
    assert not sm90._SIDE_STREAMS


@pytest.mark.gpu
@pytest.mark.parametrize("r", [32, 96])
def test_gpu_exact_lora_beside_the_pass_in_a_graph_gives_the_same_bits(r, monkeypatch):
    """``SVDQ_SM90_LORA_STREAM=1``: a captured exact forward above the small-M range runs ``lora_act`` on a
    second stream and replays to the bits of the serial capture, the eager call's."""
    from test_conformance import random_w4a4

    from svdq_linear.backends import sm90

    mod = random_w4a4(3072, 3072, r, torch.bfloat16, "cuda").set_mode("exact")
    x = torch.randn(512, 3072, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv(sm90.ENV_PDL, "0")  # the serial capture: cuBLAS's lora_act, as the eager call (not the PDL pair)
    monkeypatch.setenv(sm90.ENV_LORA_STREAM, "0")
    y = mod(x)
    for env in ("0", "1"):
        monkeypatch.setenv(sm90.ENV_LORA_STREAM, env)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mod(x)  # warm outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yg = mod(x)
        for _ in range(3):
            yg.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(yg, y), f"SVDQ_SM90_LORA_STREAM={env}: the replay differs from the eager call"
    assert torch.cuda.current_device() in sm90._SIDE_STREAMS, "the capture with the setting did not fork"
