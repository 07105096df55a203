"""The fast mode's one-launch kernel for 1 to 64 tokens (``backends/sm90/small_m_fast.py``) against the
fast formula (float64 oracles from ``svdq_linear.nvfp4``): the fast blob decoded by the kernel's own
tables (multiply-adds at 1-2 tokens, FP8 dots on the decoded tile otherwise), the activations
quantized per token in the kernel, ``lora_act`` by the producers, the ordered split-K sum and the
sync words it leaves at zero. On the CPU through Triton's interpreter
(conftest); on the H200 compiled, against the same oracles and through the backend."""

import subprocess
import sys

import pytest
import torch

from svdq_linear import nvfp4

pytest.importorskip("triton")
smf = pytest.importorskip("svdq_linear.backends.sm90.small_m_fast")
from svdq_linear.backends.sm90 import fast_layout, small_m  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layer(n, k, r, gen):
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    ws = (torch.rand(n, k // 16, generator=gen) * 0.9 + 0.01).to(torch.float8_e4m3fn)
    ws[0, 1] = 0  # a zero block scale
    ws[1, 2] = torch.tensor(2.0**-9).to(torch.float8_e4m3fn)  # the smallest subnormal one
    codes = torch.arange(16, dtype=torch.uint8)
    q[2, :16] = codes | ((15 - codes) << 4)  # all 16 codes (both signs) in either nibble
    q[3] = 0  # an all-zero row (2**e = 1)
    wc = torch.rand(n, generator=gen) + 0.5
    smooth = torch.exp(torch.randn(k, generator=gen) * 0.3)
    pd = torch.randn(k, r, generator=gen) * 0.1
    up = (torch.randn(n, r, generator=gen) * 0.1).bfloat16()
    return q, ws, wc, smooth, pd, up


def _operands(q, ws, wc, smooth, pd, up, bias):
    """What the backend's prepared fast state holds: the blob, the strip, 2**e * wcscale, 1 / smooth and
    proj_down / smooth in bf16."""
    blob = fast_layout.repack_fast_weight(q)
    strip, nw = fast_layout.fast_scales(q, ws)
    to = dict(device=DEV)
    r = pd.shape[1]
    return dict(inv_smooth=(1.0 / smooth).to(**to), blob=blob.to(**to), strip=strip.to(**to),
                cs=(nw * wc).to(**to), bias=None if bias is None else bias.to(**to),
                proj_down=(pd / smooth[:, None]).bfloat16().to(**to) if r else None,
                proj_up=up.to(**to) if r else None)


def _want(x, q, ws, wc, smooth, pd, up, bias, dot=False, floor=1e-30):
    """The fast formula in float64 with the low-rank branch as the backend feeds it (x in bf16 times the
    bf16 proj_down / smooth: the contract's allowance), and the bound of fp32 summation of exact
    products over K plus that of the low-rank sum; ``dot``: plus the FP8 tensor-core accumulator's
    allowance of the fast contract (2**-13 of the products' magnitudes a k32 step, as
    ``test_sm90_fast._fast_bound``), and bf16 ``proj_up`` / two-part bf16 ``lora_act`` in the epilogue."""
    xs = nvfp4.smooth_input(x, smooth)
    a8, sa = nvfp4.fast_act(xs)
    w8, nw = nvfp4.fast_weight(q, ws)
    col = nw.double() * wc.double()
    main = (a8.double() @ w8.double().T) * sa.double()[:, None] * col
    mag = (a8.double().abs() @ w8.double().abs().T) * sa.double()[:, None] * col.abs()
    y = main + (0 if bias is None else bias.double())
    bound = mag * x.shape[1] * 2.0**-23
    if dot:
        bound = bound + mag * (x.shape[1] // 32) * 2.0**-13
    if pd.shape[1]:
        pds = (pd / smooth[:, None]).bfloat16().double()
        xb = x.bfloat16().double()
        y = y + (xb @ pds) @ up.double().T
        bound = bound + ((xb.abs() @ pds.abs()) @ up.double().abs().T) * (x.shape[1] * 2.0**-23 + 2.0**-15)
    return y, bound + floor


def _check(y, want, bound, what):
    y = y.double().cpu()
    assert y.shape == want.shape, what
    fin = want.isfinite()
    assert torch.equal(y.isnan(), want.isnan()), f"{what}: NaN pattern"
    err = (y[fin] - want[fin]).abs()
    assert (err <= bound[fin]).all(), f"{what}: max err/bound {(err / bound[fin]).max().item():.3g}"


@pytest.mark.parametrize("m,r,with_bias,dtype,dot", [
    (1, 20, True, torch.bfloat16, False), (2, 32, True, torch.bfloat16, False), (1, 0, False, torch.float16, False),
    (2, 0, True, torch.float32, False), (2, 16, False, torch.float16, False), (2, 24, True, torch.float32, False),
    (1, 20, True, torch.bfloat16, True), (2, 0, False, torch.float32, True), (7, 32, True, torch.bfloat16, True),
    (33, 40, False, torch.float32, True), (64, 16, True, torch.float16, True)])
def test_one_launch_meets_the_fast_formula(m, r, with_bias, dtype, dot):
    """Every code of either sign, zero / subnormal block scales, an all-zero weight row, K split across
    workers and producers, 1-64 tokens in both forms (multiply-adds, FP8 dots), with and without a
    low-rank branch (R in more than one chunk at 40) and a bias, 16- and 32-bit inputs (x rounded to bf16
    to nearest for ``lora_act``)."""
    gen = torch.Generator().manual_seed(m * 10 + r)
    n, k = 128, 768
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    ops = _operands(q, ws, wc, smooth, pd, up, bias)
    y = smf.linear(x.to(DEV), **ops, out_dtype=torch.float32, dot=dot)
    want, bound = _want(x.float(), q, ws, wc, smooth, pd, up, bias, dot)
    _check(y, want, bound, f"m={m} r={r} dot={dot}")
    if r:
        # The bound is a worst case (K * 2**-23 of the magnitudes' sums); these inputs land ~1000x inside it. A
        # lora_act that lost the low bf16 half of its two-part form (2**-9 of itself: a mutation probe) lands at
        # 0.36-0.72 of it, inside, so the branch's precision is held to a twentieth of the bound.
        fin = want.isfinite()
        ratio = ((y.double().cpu() - want).abs()[fin] / bound[fin]).max().item()
        assert ratio < 0.05, f"m={m} r={r} dot={dot}: err / bound {ratio:.3g}, far above the kernel's usual ~1e-3"
    assert all(int(b.abs().sum()) == 0 for b in small_m._SYNC_WORDS.values()), "sync words left nonzero"
    # a second launch on the same sync words gives the same bits
    assert torch.equal(smf.linear(x.to(DEV), **ops, out_dtype=torch.float32, dot=dot), y)


@pytest.mark.parametrize("m,dot", [(1, False), (2, False), (9, True)])
def test_epilogue_sums_more_partials_than_it_loads_at_once(m, dot):
    """More splits than the epilogue loads at once (``chunks``' SC: 16 at 1-2 tokens, 4 at 16 rows) and more
    producers than PC at 16 rows: every chunk of partials is added, the last one partly masked."""
    gen = torch.Generator().manual_seed(40 + m)
    n, k = 64, 2304
    split, _, producers, _ = smf.plan(m, n, k)
    ck = smf.chunks(16 if dot else m, 32)
    assert split == 18 > ck["SC"] and split % ck["SC"] and (not dot or producers > ck["PC"]), (split, producers, ck)
    q, ws, wc, smooth, pd, up = _layer(n, k, 32, gen)
    bias = torch.randn(n, generator=gen)
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    y = smf.linear(x.to(DEV), **_operands(q, ws, wc, smooth, pd, up, bias), out_dtype=torch.float32, dot=dot)
    want, bound = _want(x.float(), q, ws, wc, smooth, pd, up, bias, dot)
    _check(y, want, bound, f"m={m} dot={dot}")


@pytest.mark.parametrize("m,dot", [(2, False), (9, True)])
def test_workers_and_producers_walk_several_k_tiles(m, dot):
    """One worker a group walking all 40 k-tiles (the plan at one SM, one CTA an SM) and producers of two
    k-tiles each: the k-loops accumulate across tiles, in both forms."""
    gen = torch.Generator().manual_seed(90 + m)
    n, k, r = 64, 5120, 16
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    bias = torch.randn(n, generator=gen)
    assert smf.plan(m, n, k, sms=1, ctas_per_sm=1)[:3] == (1, 40, 20)
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    ops = _operands(q, ws, wc, smooth, pd, up, bias)
    y = smf.linear(x.to(DEV), **ops, out_dtype=torch.float32, dot=dot, sms=1, ctas_per_sm=1)
    want, bound = _want(x.float(), q, ws, wc, smooth, pd, up, bias, dot)
    _check(y, want, bound, f"m={m} dot={dot}")


@pytest.mark.gpu
@pytest.mark.parametrize("m,dot", [(1, False), (16, True)])
def test_gpu_epilogues_wait_for_the_last_producers_sum(m, dot):
    """The last producer's ``lora_act`` sum held back 200 us (``delay_ns``): every group's epilogue is then
    ready first and must wait for the sum's count (P + 1), not read slot P early. Slot P of the partials'
    buffer most likely holds another input's sum from the call before (same sizes: the allocator's cached
    block), so an early read gives wrong outputs, not a lucky right one. Under the interpreter the programs run in ticket order
    (producers first), so only the GPU sees this order."""
    gen = torch.Generator().manual_seed(70 + m)
    n, k, r = 3072, 3072, 32
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    ops = _operands(q, ws, wc, smooth, pd, up, torch.randn(n, generator=gen))
    x, other = ((torch.randn(m, k, generator=gen) * 3).bfloat16() for _ in range(2))
    want = smf.linear(x.cuda(), **ops, dot=dot, out_dtype=torch.float32)
    smf.linear(other.cuda(), **ops, dot=dot, out_dtype=torch.float32, delay_ns=200_000)  # compiles the build
    for _ in range(3):
        smf.linear(other.cuda(), **ops, dot=dot, out_dtype=torch.float32)  # slot P: the other input's sum
        y = smf.linear(x.cuda(), **ops, dot=dot, out_dtype=torch.float32, delay_ns=200_000)
        torch.cuda.synchronize()
        assert torch.equal(y, want)
    _check(y, *_want(x.float(), q, ws, wc, smooth, pd, up, ops["bias"].cpu(), dot), f"m={m} dot={dot}")
    assert all(int(b.abs().sum()) == 0 for b in small_m._SYNC_WORDS.values()), "sync words left nonzero"


def test_one_launch_plans_the_split_and_the_producers():
    """Every worker has a k-tile, producers cover K in whole k-tiles, at most PRODUCERS_MAX of them, and
    the grid aims at CTAS_PER_SM workers an SM, all of it resident at once."""
    for n, k in [(3072, 3072), (3072, 12288), (12288, 3072), (128, 768), (64, 128), (18432, 3072)]:
        split, per, producers, kp = smf.plan(1, n, k)
        kt = k // 128
        assert split * per >= kt and (split - 1) * per < kt, (n, k)
        assert producers <= smf.PRODUCERS_MAX and kp % 128 == 0 and producers * kp >= k > (producers - 1) * kp
        assert (n // 64) * split <= max(smf.CTAS_PER_SM * 132 * 1.5, n // 64), (n, k, split)
    assert smf.plan(1, 3072, 12288)[0] > 1  # K is split where the row groups alone leave SMs idle
    # about the target: at most half a group's splits over it, whatever the target (the Flux.1 / SD3.5 layers)
    for n, k in [(3072, 3072), (12288, 3072), (3072, 12288), (18432, 3072), (9216, 3072), (21504, 3072),
                 (3072, 15360), (3840, 3072), (15360, 3840), (3072, 10240), (3840, 15360)]:
        for cps in (4, 5, 6):
            for m in (1, 2, 3, 16, 33, 64):
                split, _, prods, _ = smf.plan(m, n, k, ctas_per_sm=cps)
                assert n // 64 * (split - 0.5) <= cps * 132, (n, k, cps, m)
                grid = smf.grid_size(m, n, k, ctas_per_sm=cps)
                others = prods * (2 if smf.use_dots(m, n, k) else 1)  # producers (and quantizers)
                assert grid == n // 64 * split + others
                # the whole grid resident (no second wave) wherever one worker a group leaves room for it
                assert grid <= cps * 132 or n // 64 + others > cps * 132, (n, k, cps, m, grid)
    # rounding to the nearest split would take these past the resident slots: rounded down instead
    assert smf.plan(16, 12288, 3072, ctas_per_sm=6)[0] == 3  # 192 groups x 4 + 48 > 792
    assert smf.plan(16, 3072, 12288, ctas_per_sm=6)[0] == 14  # 48 x 16 + 64 > 792: 15 rounds to 14 of 7 tiles
    assert smf.plan(1, 12288, 3072, ctas_per_sm=6)[0] == 4  # 192 x 4 + 24 = 792 fits
    # the partials one CTA a group adds: at most SPLIT_ROWS splits x token rows, and the rule binds at 64 rows
    # (rows are the padded tile rows: at least 16 with the FP8 dots, so 3 tokens count as 16)
    for m, rows in ((1, 1), (2, 2), (3, 16), (16, 16), (33, 64), (64, 64)):
        assert smf.rows(m, m > smf.FMA_MAX_M) == rows, m  # the multiply-adds up to 2 tokens, the dots above
        for n in (3072, 64):
            padded = smf.rows(m, smf.use_dots(m, n, 12288))
            assert smf.plan(m, n, 12288)[0] * padded <= smf.SPLIT_ROWS, (m, n)
    assert smf.plan(3, 64, 12288)[0] == smf.SPLIT_ROWS // 16  # one group: the rule binds on the padded rows
    assert smf.plan(2, 64, 12288, dot=True)[0] == smf.SPLIT_ROWS // 16 < smf.plan(2, 64, 12288, dot=False)[0]
    assert smf.plan(64, 3072, 12288)[0] == smf.SPLIT_ROWS // 64 < smf.plan(16, 3072, 12288)[0]
    # the default form: multiply-adds at one token; at two, the dots for the large layers only (measured)
    for n, k, two in ((3072, 3072, False), (12288, 3072, True), (3072, 12288, True), (64, 256, False)):
        assert not smf.use_dots(1, n, k) and smf.use_dots(2, n, k) == two and smf.use_dots(3, n, k), (n, k)
        for m in (1, 2, 3):
            dot = smf.use_dots(m, n, k)
            assert smf.plan(m, n, k) == smf.plan(m, n, k, dot=dot) and smf.grid_size(m, n, k) == smf.grid_size(
                m, n, k, dot=dot), (m, n, k)
    assert smf.grid_size(2, 12288, 3072) != smf.grid_size(2, 12288, 3072, dot=False)  # the quantizers' CTAs


def test_resident_ctas_follow_hopper_occupancy_rules():
    """``resident``: CTAs an H100 / H200 SM holds, worked by hand from the CUDA occupancy rules (65536
    registers allocated 256 a warp, 228 KiB of shared memory with 1 KiB reserved a CTA, 2048 threads,
    32 CTAs): the builds' register counts seen for sm_90a (Triton 3.9: 80 at one token, 106 with the
    dots at 16 rows, 127-128 at two tokens and 64 rows; 64-104 at eight warps)."""
    # 80 regs: 2560 a warp -> 25 warps -> 6 CTAs of 4; 106 -> 3392 -> 3584 -> 18 warps -> 4; 127 -> 4064 -> 4096
    for regs, warps, want in ((80, 4, 6), (106, 4, 4), (127, 4, 4), (128, 4, 4), (64, 4, 8), (64, 8, 4),
                              (104, 8, 2), (72, 4, 7), (255, 4, 2), (32, 4, 16)):
        assert smf.resident(regs, warps, 10752) == want, (regs, warps)
    # shared memory binds: 100 KiB a CTA -> 2; 227 KiB -> 1 (the reserved KiB counts); threads bind at 16 warps
    assert smf.resident(64, 4, 100 * 1024) == 2 and smf.resident(64, 4, 227 * 1024) == 1
    assert smf.resident(32, 16, 0) == 4 and smf.resident(16, 1, 0) == 32 and smf.resident(16, 1, 10752) == 19
    assert smf.resident(80, 4, 10752, sm_regs=32768) == 3  # another part's register file


def test_compiled_resources_fall_back_when_triton_does_not_say():
    """The fit reads Triton internals (``_init_handles``, ``n_regs``): a kernel object that has them gives its
    registers and shared memory; one that lacks them gives None and one warning (the fixed target then)."""
    class _Meta:
        shared = 18432

    class _Full:
        metadata = _Meta()

        def _init_handles(self):
            self.n_regs = 96

    class _Bare:
        metadata = _Meta()

    assert smf.compiled_resources(_Full()) == (96, 18432)
    from svdq_linear import backends

    backends._WARNED.discard(("small_m_fast", "resources"))
    with pytest.warns(RuntimeWarning, match="registers"):
        assert smf.compiled_resources(_Bare()) is None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert smf.compiled_resources(_Bare()) is None  # warned once


def test_measurement_knobs_refuse_what_the_kernel_cannot_run():
    """``num_warps`` is a warpgroup's multiple the kernel was laid out for (4 or 8): anything else is refused
    by name before a launch."""
    gen = torch.Generator().manual_seed(3)
    ops = _operands(*_layer(64, 256, 16, gen), None)
    x = torch.randn(1, 256, generator=gen).bfloat16().to(DEV)
    for bad in (2, 6, 16):
        with pytest.raises(ValueError, match="num_warps must be 4 or 8"):
            smf.linear(x, **ops, num_warps=bad)


@pytest.mark.parametrize("dot", [False, True])
def test_special_rows_follow_the_contract(dot):
    """A token holding a NaN has NaN outputs (sa = 1, its NaN codes); one holding +-Inf too; an all-zero
    token gives the bias; a token whose max lies below 448 / FLT_MAX keeps its tiny product (r = FLT_MAX).
    One token a call, and (FP8 dots) all of them with a normal token in one call, which stays exact."""
    gen = torch.Generator().manual_seed(7)
    n, k, r = 64, 256, 16
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    q[3] = 0x11  # no all-zero weight row here: every output reads the token
    bias = torch.randn(n, generator=gen)
    rows = {"nan": torch.randn(k, generator=gen), "inf": torch.randn(k, generator=gen), "zero": torch.zeros(k),
            "tiny": torch.randn(k, generator=gen) * 1e-37, "normal": torch.randn(k, generator=gen)}
    rows["nan"][5] = float("nan")
    rows["inf"][9] = float("-inf")
    no_lr = dict(proj_down=None, proj_up=None)
    for name, row in rows.items():
        b = None if name == "tiny" else bias  # the tiny product is checked on its own
        ops = {**_operands(q, ws, wc, smooth, pd, up, b), **no_lr}
        x = row[None].float()
        y = smf.linear(x.to(DEV), **ops, out_dtype=torch.float32, dot=dot)
        want, bound = _want(x, q, ws, wc, smooth, pd[:, :0], up[:, :0], b, dot, floor=0.0 if name == "tiny" else 1e-30)
        _check(y, want, bound, name)
        if name in ("nan", "inf"):
            assert y.isnan().all(), name
        if name == "zero":
            assert torch.equal(y.cpu(), bias[None].float())
        if name == "tiny":  # the bound above scales with the products (~1e-35, no floor): a wrong sa or r fails
            assert want.abs().min() > 0 and bound.max() < 0.05 * want.abs().max()
    if dot:
        x = torch.stack(list(rows.values())).float()
        ops = {**_operands(q, ws, wc, smooth, pd, up, bias), **no_lr}
        y = smf.linear(x.to(DEV), **ops, out_dtype=torch.float32, dot=True)
        want, bound = _want(x, q, ws, wc, smooth, pd[:, :0], up[:, :0], bias, True)
        _check(y, want, bound, "all rows")
        assert y[4].isfinite().all()


def test_bad_calls_name_the_problem():
    gen = torch.Generator().manual_seed(3)
    q, ws, wc, smooth, pd, up = _layer(64, 256, 16, gen)
    ops = _operands(q, ws, wc, smooth, pd, up, torch.randn(64))
    x = torch.randn(65, 256).bfloat16().to(DEV)
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        smf.linear(x, **ops)
    with pytest.raises(ValueError, match="multiply-add form serves at most 2"):
        smf.linear(x[:3], **ops, dot=False)
    with pytest.raises(ValueError, match="fast blob"):
        smf.linear(x[:1, :128], **ops)
    with pytest.raises(ValueError, match="come together"):
        smf.linear(x[:1], **{**ops, "proj_down": None})
    with pytest.raises(ValueError, match="proj_up must be"):
        smf.linear(x[:1], **{**ops, "proj_up": ops["proj_up"][:, :8].t().contiguous().t()})
    bad = torch.empty(128, device=DEV)[::2]
    for name in ("cs", "bias"):
        with pytest.raises(ValueError, match=f"{name} must be a contiguous float32"):
            smf.linear(x[:1], **{**ops, name: bad.copy_(ops[name])})
    with pytest.raises(ValueError, match="inv_smooth must be"):
        smf.linear(x[:1], **{**ops, "inv_smooth": ops["inv_smooth"][:128]})
    with pytest.raises(ValueError, match="bf16 proj_down"):
        smf.linear(x[:1], **{**ops, "proj_down": ops["proj_down"].float()})
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        smf.linear(x[0], **ops)
    with pytest.raises(ValueError, match="contiguous uint8"):
        smf.linear(x[:1], **{**ops, "blob": ops["blob"].view(torch.int8)})
    with pytest.raises(ValueError, match="delay_ns"):
        smf.linear(x[:1], **ops, delay_ns=-1)


def test_sync_words_grow_and_stay_per_kernel_and_stream():
    """Eager launches share one zeroed buffer per (device, stream, kernel); a larger request replaces it."""
    dev = torch.device(DEV)
    a = small_m.sync_words(dev, 10, "t1")
    assert a.numel() >= 10 and int(a.abs().sum()) == 0
    assert small_m.sync_words(dev, 10, "t1") is a and small_m.sync_words(dev, 10, "t2") is not a
    big = small_m.sync_words(dev, 5000, "t1")
    assert big.numel() >= 5000 and big is not a and small_m.sync_words(dev, 10, "t1") is big


@pytest.mark.gpu
def test_gpu_captured_launches_take_words_of_their_own_from_the_arena():
    """Inside a capture each launch gets fresh zeroed words from the arena set aside beforehand (no memset
    in the graph, nothing in the graph's pool), never the eager buffer and never another launch's."""
    dev = torch.device("cuda")
    small_m.reserve_sync_words(dev)
    eager = small_m.sync_words(dev, 100, "t3")
    arena, start = small_m._ARENAS[torch.device("cuda", torch.cuda.current_device())]
    got = []
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = [small_m.sync_words(dev, 100, "t3"), small_m.sync_words(dev, 100, "t3")]
    ptrs = {t.data_ptr() for t in got}
    assert len(ptrs) == 2 and eager.data_ptr() not in ptrs
    assert all(arena.data_ptr() <= p < arena.data_ptr() + arena.numel() * 4 for p in ptrs)
    assert all(int(t.abs().sum()) == 0 for t in got)


@pytest.mark.parametrize("m", [1, 2, 9])
def test_backend_takes_the_one_launch_kernel_when_asked(m, monkeypatch):
    """``SVDQ_SM90_FAST_ONE_LAUNCH=1``: ``run_w4a4_fast`` hands a 1-64-token call the prepared fast state
    (the blob, the strip, ``2**e * wcscale``, ``1 / smooth`` and the first R columns of the padded
    ``proj_down / smooth``) and its result meets the fast formula."""
    qf = pytest.importorskip("svdq_linear.backends.sm90.quack_fast")
    from svdq_linear.backends import sm90

    gen = torch.Generator().manual_seed(40 + m)
    n, k, r = 128, 256, 8
    host = _layer(n, k, r, gen) + (torch.randn(n, generator=gen),)
    q, ws, wc, smooth, pd, up, bias = (t.to(DEV) for t in host)  # the state lives where the kernel runs
    fw = qf.prepare(q, ws, wc, bias)
    pds = torch.nn.functional.pad((pd / smooth[:, None]).bfloat16(), (0, 8))  # padded as the accumulator path's
    extra = sm90.Sm90Prepared(pds, up, fw, None, (1.0 / smooth).contiguous()).tensors()
    x = (torch.randn(m, k, generator=gen) * 2).bfloat16()
    x_dev = x.to(DEV)
    monkeypatch.setenv(sm90.ENV_FAST_ONE_LAUNCH, "1")
    assert smf.MAX_M == 64  # the backend's routing limit
    calls = []
    run = smf.linear
    monkeypatch.setattr(smf, "linear", lambda *a, **kw: calls.append(a) or run(*a, **kw))
    y = sm90.Sm90Backend().run_w4a4_fast(x_dev, q, ws, smooth, pd, up, wc, bias, extra)
    assert calls and calls[0][6].shape == (k, r), "the call did not take the kernel with R columns"
    assert y.dtype == x.dtype and y.device == x_dev.device
    want, bound = _want(x.float(), *host, smf.use_dots(m, n, k))
    _check(y.float(), want, bound + 2.0**-8 * want.abs(), f"m={m}")


_SASS = r"""
import json, re, sys
sys.path.insert(0, sys.argv[2])
from sass_loops import compile_sm90, instructions, loop_with, opcodes
from svdq_linear.backends.sm90 import small_m_fast as smf

sig = dict(x_ptr="*bf16", inv_ptr="*fp32", blob_ptr="*u8", strip_ptr="*u8", cs_ptr="*fp32", bias_ptr="*fp32",
           pd_ptr="*bf16", up_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", lpart_ptr="*fp32", a8_ptr="*u8",
           sync_ptr="*i32", trace_ptr="*i64", M="i32", N="i32", K="i32", R="i32", stride_xm="i32", stride_pd="i32", stride_om="i32",
           tiles_per_split="i32", S="i32", P="i32", k_per_prod="i32")
out = {}
# (label, BM, RB, DOT, measurement): the multiply-adds at 1 and 2 tokens, the FP8 dots at 16 and 64 token rows,
# rank 128; the traced build with load polls (measurement: poll=1, trace); the delayed last producer (tests)
for label, bm, rb, dot, meas in (("1", 1, 32, False, 0), ("2", 2, 32, False, 0), ("d16", 16, 32, True, 0),
                                 ("d64", 64, 32, True, 0), ("1r128", 1, 128, False, 0), ("d64r128", 64, 128, True, 0),
                                 ("d16trace", 16, 32, True, 1), ("1delay", 1, 32, False, 2)):
    cx = dict(BM=bm, RB=rb, RC=min(rb, 32), **smf.chunks(bm, rb), HAS_BIAS=True, HAS_LORA=True, ASM=True,
              NUM_STAGES=3, DOT=dot, POLL=int(meas == 1), TRACE=meas == 1, DELAY=50000 if meas == 2 else 0, EXACT=False)
    sass = compile_sm90(smf._fast_small_m_kernel, sig, cx, sys.argv[1] + f"/f{label}.cubin",
                        ("M", "R", "S", "P", "tiles_per_split"))
    body = loop_with(sass, "UNPACK_B_MERGE_C", longest=False)  # the worker's loop (its tables)
    ops, whole = opcodes(body), opcodes(t for _, t in instructions(sass))
    out[label] = dict(per_value=len(body) / 64, ffma=ops["FFMA"], unpack=ops["F2FP.F16.E4M3.UNPACK_B"],
                      tables=ops["F2FP.SATFINITE.E4M3.F16.UNPACK_B_MERGE_C"],
                      qgmma=sum(v for o, v in ops.items() if o.startswith("QGMMA")),
                      shfl=sum(v for o, v in ops.items() if "SHFL" in o),
                      local=sum(v for o, v in whole.items() if o.startswith(("LDL", "STL"))),
                      atomics=sum(v for o, v in whole.items() if o.startswith(("ATOM", "RED"))),
                      prefetch=whole["CCTL.E.PF2"], timer=len(re.findall(r"SR_GLOBALTIMER", sass)),
                      membar=whole["MEMBAR.ALL.GPU"], exch=sum(v for o, v in whole.items() if ".EXCH" in o),
                      nanosleep=whole["NANOSLEEP"], ivall=whole["CCTL.IVALL"], body=len(body),
                      loop_timer=sum("GLOBALTIMER" in t for t in body))
print(json.dumps(out))
"""


def test_one_launch_compiles_to_table_lookups_and_fp8_wgmma(tmp_path):
    """Compiled for sm_90a here (no GPU; the real compiler, in a child process). Both forms build four
    tables a k-tile with the hardware E4M3 converts, touch no local memory (rank 128 included: the
    low-rank tiles go 32 columns at a time), prefetch the worker's weight lines into L2 before it waits,
    count in atomics and fence only at the counts (the sync words are reset by plain stores). The multiply-adds (1-2 tokens) widen the
    decoded bytes two at a time and issue one FFMA a weight value a token, nothing across threads (5.1
    instructions a value at one token, 6.6 at two, Triton 3.9). The FP8 dots hand the decoded bytes to
    ``wgmma`` from registers (four ``QGMMA`` a k-tile, no FFMA, no widening) at about 3 instructions a
    value, whatever the token rows."""
    from sass_loops import run_script

    out = run_script(_SASS, tmp_path)
    for label, st in out.items():
        assert st["tables"] == 16 and st["shfl"] == 0 and st["local"] == 0, (label, st)
        assert st["atomics"] >= 8 and st["prefetch"] >= 2, (label, st)
    one, two = out["1"], out["2"]
    for bm, st in ((1, one), (2, two)):
        assert st["ffma"] == 64 * bm and st["qgmma"] == 0, st
        assert 32 <= st["unpack"] <= 36, st  # the 64 weight values two a convert, plus the activations'
    assert one["per_value"] <= 5.75, one
    assert two["per_value"] <= one["per_value"] + 1.75, (one, two)  # the second token: its FFMA and activations
    for label in ("d16", "d64"):
        st = out[label]
        assert st["qgmma"] == 4 and st["ffma"] == 0 and st["unpack"] == 0, (label, st)
        assert st["per_value"] <= 3.25, (label, st)
    # the fences, exactly the counts' own (six fenced exchanges that reset the sync words made the launch's
    # tail a chain of round trips; they are plain stores now). A release is a MEMBAR, an acquire an L1
    # invalidation (CCTL.IVALL), acq_rel both. Multiply-adds: MEMBAR at the amax count, the low-rank count
    # (acq_rel), its sum's count, the group counter (acq_rel) and the done count (acq_rel); IVALL at those three
    # acq_rel and the two waits' acquires (amax, lora_act). The FP8 dots add the quantizers' count (release)
    # and their wait for the amax (acquire). Triton 3.9 gives one IVALL at each of those; Triton 3.6 (the
    # device image's) gives 3 at the multiply-add build, so the invalidations are bounded, not counted.
    for label, st in out.items():
        fences = 6 if label.startswith("d") else 5
        assert st["exch"] == 0 and st["membar"] == fences and 1 <= st["ivall"] <= fences, (label, st)
    # the measurement build reads the global timer at its phase ends and sleeps between load polls; the
    # default builds do neither, and its worker loop is the same code
    assert out["d16trace"]["timer"] >= 6 and out["d16trace"]["nanosleep"] >= 1, out["d16trace"]
    assert all(out[label]["timer"] == 0 and out[label]["nanosleep"] == 0 for label in ("1", "d16")), out
    # the same loop: no timer read in it, the same tables, dots and multiply-adds, and its length within two
    # instructions of the default's (Triton 3.6 schedules the traced build's loop one instruction shorter;
    # Triton 3.9 gives the same length)
    def same_loop(a, b):
        keys = ("tables", "qgmma", "ffma", "unpack", "shfl", "local")
        return (out[a]["loop_timer"] == 0 and all(out[a][k] == out[b][k] for k in keys)
                and abs(out[a]["body"] - out[b]["body"]) <= 2)

    assert same_loop("d16trace", "d16"), out
    # the test's delayed last producer spins on the timer; its worker loop is the default's
    assert out["1delay"]["timer"] >= 2 and out["1delay"]["nanosleep"] == 0, out["1delay"]
    assert same_loop("1delay", "1"), out


def test_one_launch_routing_follows_the_measured_crossover(monkeypatch):
    """``tuning.use_fast_one_launch`` (the same-run tables, docs/perf.md sixteenth and eighteenth sessions):
    by default one token takes the one-launch kernel on a GPU, and so do 16 tokens of a weight of 2**24
    values or more (3072 x 12288), not of 3072 x 3072; 2-15 and 17-64 tokens do not; the Triton
    interpreter's CPU calls keep the routed path; ``SVDQ_SM90_FAST_ONE_LAUNCH`` forces it on ("1", any
    device, 1-64 tokens) or off ("0")."""
    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import tuning

    class _X:  # the shape and device of an input, without a GPU
        def __init__(self, m, cuda=True, k=3072):
            self.shape, self.is_cuda = (m, k), cuda

    monkeypatch.delenv(sm90.ENV_FAST_ONE_LAUNCH, raising=False)
    big, small = (12288, 3072), (3072, 3072)  # (n, k)
    assert tuning.use_fast_one_launch(1, *small) and tuning.use_fast_one_launch(1, *big)
    assert [m for m in range(0, 66) if tuning.use_fast_one_launch(m, *big)] == [1, 16]
    assert [m for m in range(0, 66) if tuning.use_fast_one_launch(m, *small)] == [1]
    assert tuning.use_fast_one_launch(16, 4096, 4096) and not tuning.use_fast_one_launch(16, 4096, 4095)
    assert sm90._route_fast_one_launch(_X(1), 3072) and sm90._route_fast_one_launch(_X(16), 12288)
    assert sm90._route_fast_one_launch(_X(16, k=12288), 3072) and not sm90._route_fast_one_launch(_X(16), 3072)
    assert not any(sm90._route_fast_one_launch(_X(m), 12288) for m in (0, 2, 8, 9, 12, 15, 17, 64, 65))
    assert not sm90._route_fast_one_launch(_X(1, cuda=False), 3072)
    assert not sm90._route_fast_one_launch(_X(16, cuda=False), 12288)
    monkeypatch.setenv(sm90.ENV_FAST_ONE_LAUNCH, "1")
    assert all(sm90._route_fast_one_launch(_X(m, cuda), 3072) for m in (1, 2, 64) for cuda in (True, False))
    assert not sm90._route_fast_one_launch(_X(0), 3072) and not sm90._route_fast_one_launch(_X(smf.MAX_M + 1), 3072)
    monkeypatch.setenv(sm90.ENV_FAST_ONE_LAUNCH, "0")
    assert not sm90._route_fast_one_launch(_X(1), 3072) and not sm90._route_fast_one_launch(_X(16), 12288)


@pytest.mark.gpu
@pytest.mark.parametrize("m,dot", [(1, False), (2, False), (16, True)])
def test_gpu_default_split_fits_the_compiled_kernels_residency(m, dot):
    """By default the split aims at the workers an SM the compiled kernel lets stay resident (at most
    CTAS_PER_SM_MAX), found once a build from the compiled kernel's registers and shared memory on this
    device's Triton; the default launch meets the formula."""
    gen = torch.Generator().manual_seed(70 + m)
    n, k = 3072, 3072
    q, ws, wc, smooth, pd, up = _layer(n, k, 32, gen)
    bias = torch.randn(n, generator=gen)
    ops = _operands(q, ws, wc, smooth, pd, up, bias)
    x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    smf._FITTED.clear()
    y = smf.linear(x.to(DEV), **ops, out_dtype=torch.float32, dot=dot)
    _check(y, *_want(x.float(), q, ws, wc, smooth, pd, up, bias, dot), f"m={m} dot={dot}")
    fits = list(smf._FITTED.values())
    assert len(fits) == 1, smf._FITTED  # one build, found once
    ((_, dtypes, items),) = smf._FITTED
    assert dtypes == (torch.bfloat16, torch.float32) and dict(items)["BM"] == smf.rows(m, dot), smf._FITTED
    smf.linear(x.to(DEV), **ops, out_dtype=torch.float32, dot=dot, poll=1)  # a measurement build: the same fit
    assert list(smf._FITTED.values()) == fits, smf._FITTED
    assert 4 <= fits[0] <= smf.CTAS_PER_SM_MAX, fits  # at most 128 registers: four CTAs of four warps fit


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,one", [(1, 3072, 3072, True), (2, 3072, 3072, False), (16, 3072, 3072, False),
                                       (16, 3072, 12288, True), (12, 3072, 12288, False)])
def test_gpu_backend_takes_the_one_launch_kernel_by_default_where_it_won(m, k, n, one, monkeypatch):
    """With no setting the module's fast-mode forward runs the one-launch kernel where
    ``tuning.use_fast_one_launch`` measured it faster (one token; 16 tokens of a large weight) and meets
    the fast formula; the other calls take the routed path."""
    pytest.importorskip("quack")
    from test_conformance import random_w4a4
    from test_sm90_fast import _assert_fast_formula

    from svdq_linear.backends import sm90

    monkeypatch.delenv(sm90.ENV_FAST_ONE_LAUNCH, raising=False)
    torch.manual_seed(5 + m)
    mod = random_w4a4(k, n, 32, torch.bfloat16, "cuda").set_mode("fast")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    calls = []
    run = smf.linear
    monkeypatch.setattr(smf, "linear", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    y = mod(x)
    assert bool(calls) == one, f"m={m} {n}x{k}: one-launch calls {len(calls)}"
    _assert_fast_formula(mod, x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 7, 64])
@pytest.mark.parametrize("k,n,r,dtype", [(3072, 3072, 32, torch.bfloat16), (12288, 3072, 32, torch.bfloat16),
                                         (3072, 12288, 0, torch.float16), (1024, 3072, 96, torch.bfloat16)])
def test_gpu_backend_routes_a_few_tokens_to_one_launch(m, k, n, r, dtype, monkeypatch):
    """``SVDQ_SM90_FAST_ONE_LAUNCH=1``: the fast mode's calls of 1-64 tokens take the kernel, meet the fast
    formula, leave the sync words at zero, and replay in a CUDA graph with the same bits."""
    pytest.importorskip("quack")
    from test_conformance import random_w4a4
    from test_sm90_fast import _assert_fast_formula

    from svdq_linear import backends
    from svdq_linear.backends import sm90

    monkeypatch.setenv(sm90.ENV_FAST_ONE_LAUNCH, "1")
    torch.manual_seed(m + k + r)
    mod = random_w4a4(k, n, r, dtype, "cuda")
    mod.set_mode("fast")
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    backend = backends.choose(mod, x)
    prepared = backend.prepare(mod, x.device)
    calls = []
    run = smf.linear
    monkeypatch.setattr(smf, "linear", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    y = backend.linear(mod, x, prepared)
    assert calls, "the call did not take the one-launch kernel"
    _assert_fast_formula(mod, x, y)
    assert_words_zero_and_graphs_replay(lambda: backend.linear(mod, x, prepared), y, captures=2)


def assert_words_zero_and_graphs_replay(call, y, captures=1):
    """After an eager ``call`` that gave ``y``: the sync words are all at zero, and ``captures`` CUDA graphs of
    the call (each launch with sync words of its own) write ``y``'s bits at every replay."""
    torch.cuda.synchronize()
    assert all(int(b.abs().sum()) == 0 for b in small_m._SYNC_WORDS.values())
    for _ in range(captures):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yg = call()
        for _ in range(3):
            yg.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(yg, y)


_CONCURRENT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_sm90_small_m_fast import _layer, _operands
from svdq_linear.backends.sm90 import small_m_fast as smf
gen = torch.Generator().manual_seed(0)
runs = []
for m, (n, k) in ((1, (3072, 3072)), (7, (3072, 12288)), (2, (12288, 3072))):
    q, ws, wc, smooth, pd, up = _layer(n, k, 32, gen)
    ops = {a: (t.cuda() if t is not None else None) for a, t in _operands(q, ws, wc, smooth, pd, up, None).items()}
    x = torch.randn(m, k, generator=gen).bfloat16().cuda()
    want = smf.linear(x, **ops)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # every capture on PyTorch's default capture stream
        y = smf.linear(x, **ops)
    runs.append((g, y, want, x, ops))  # a graph holds addresses, not tensors: keep its inputs alive
streams = [torch.cuda.Stream() for _ in runs]
for it in range(50):
    for (g, *_), st in zip(runs, streams):
        with torch.cuda.stream(st):
            g.replay()
    torch.cuda.synchronize()
    for g, y, want, *_ in runs:
        assert torch.equal(y, want), it
# replays on the current stream once more, then eager calls of the same layers: the same bits
for g, *_ in runs:
    g.replay()
torch.cuda.synchronize()
assert all(torch.equal(y, want) for _, y, want, *_ in runs)
print("ok")
"""


@pytest.mark.gpu
def test_gpu_graphs_replayed_at_once_on_several_streams_keep_their_own_sync_words():
    """Graphs captured on one capture stream (PyTorch's default) and replayed concurrently on three
    streams: each launch has its own tickets and counters, so every replay writes what the eager call
    did. Run in a child process with a time limit: shared words would hang or corrupt it."""
    import pathlib

    res = subprocess.run([sys.executable, "-c", _CONCURRENT, str(pathlib.Path(__file__).parent)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_trace_stamps_every_cta_with_its_ticket_and_sm(m):
    """The measurement build (``trace=``, what ``benchmarks/trace_small_m_fast.py`` reads) gives the default
    build's bits, stamps every CTA with a distinct ticket and the SM it ran on, and each worker's phase ends
    in order: start, wait, its two weight probes, k-loop, counted, end; a trace too short is refused."""
    if not torch.cuda.is_available():
        pytest.skip("the global timer and %smid are read on a GPU")
    gen = torch.Generator().manual_seed(70 + m)
    n, k = 256, 1024
    ops = _operands(*_layer(n, k, 16, gen), torch.randn(n, generator=gen))
    x = torch.randn(m, k, generator=gen).bfloat16().cuda()
    smf._FITTED.clear()
    want = smf.linear(x, **ops)
    (cps,) = smf._FITTED.values()  # the default's split target: the traced launch splits alike
    grid = smf.grid_size(m, n, k, smf.sm_count(x.device), ctas_per_sm=cps)  # the device's SMs, as the launch plans
    tr = torch.full((grid + 8, smf.TRACE_COLS), -1, dtype=torch.int64, device="cuda")
    assert torch.equal(smf.linear(x, **ops, trace=tr), want)
    tr = tr.cpu()
    assert bool((tr[grid:] == -1).all())  # no CTA past the grid
    tr = tr[:grid]
    tick, sm = tr[:, 7] & 0xFFFFFFFF, tr[:, 7] >> 32
    assert sorted(tick.tolist()) == list(range(grid))
    assert int(sm.min()) >= 0 and int(sm.max()) < torch.cuda.get_device_properties(0).multi_processor_count
    _, _, prods, _ = smf.plan(m, n, k, ctas_per_sm=cps)
    work = tr[tick >= prods * (2 if smf.use_dots(m, n, k) else 1)]
    assert len(work) == grid - prods * (2 if smf.use_dots(m, n, k) else 1) and len(work) > 0
    # start, wait, the two weight probes, k-loop, counted, end
    for c0, c1 in ((0, 1), (1, 8), (1, 9), (8, 2), (9, 2), (2, 3), (3, 6)):
        assert bool((work[:, c0] > 0).all() and (work[:, c1] >= work[:, c0]).all()), (c0, c1, work[:, :10])
    with pytest.raises(ValueError, match="trace needs"):
        smf.linear(x, **ops, trace=tr.cuda()[:-1], ctas_per_sm=cps)


def test_small_m_kernels_split_for_the_devices_sms(monkeypatch):
    """The one-launch kernels and the Triton small-M kernel plan their split for the SMs of the device they run
    on (``tuning.sm_count``: 132 on an H100 / H200 SXM, 114 on an H100 PCIe), not for a fixed count; an explicit
    ``sms`` still wins. Checked by what the planners are handed, with the device's count patched to 66."""
    from svdq_linear.backends.sm90 import small_m as sm

    seen = []
    monkeypatch.setattr(smf, "sm_count", lambda device: 66)
    monkeypatch.setattr(sm, "sm_count", lambda device: 66)
    real_plan, real_split = smf.plan, sm.split_for
    monkeypatch.setattr(smf, "plan", lambda m, n, k, sms, *a: seen.append(("plan", sms)) or real_plan(m, n, k, sms, *a))
    monkeypatch.setattr(sm, "split_for", lambda *a: seen.append(("split_for", a[5])) or real_split(*a))
    gen = torch.Generator().manual_seed(3)
    q, ws, wc, smooth, pd, up = _layer(64, 256, 0, gen)
    ops = _operands(q, ws, wc, smooth, pd, up, None)
    x = torch.randn(1, 256, generator=gen).bfloat16().to(DEV)
    smf.linear(x, **ops, out_dtype=torch.float32, ctas_per_sm=1)
    smf.linear(x, **ops, out_dtype=torch.float32, ctas_per_sm=1, sms=8)
    sm.linear(x, sm.CANONICAL, q.to(DEV), ws.to(DEV), wc.to(DEV), 64, act=sm.ACT_X, out_dtype=torch.float32)
    assert seen == [("plan", 66), ("plan", 8), ("split_for", 66)], seen
