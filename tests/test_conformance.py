"""Every backend on every device present, held to the contract's tolerance (``nvfp4.tolerance``).

On a CPU machine this runs the reference and the sm90 Triton kernels under Triton's interpreter
(conftest sets ``TRITON_INTERPRET=1`` when there is no GPU); on the H200 it runs the sm90 kernels on
the GPU at Flux shapes. The expected output is the contract evaluated here in float64 from the
module's tensors; modules are random (codes, scales, branch), not derived from any converter.
"""

import pytest
import torch

from svdq_linear import NVFP4W4A16Linear, SVDQW4A4Linear, backends, nvfp4

HAS_CUDA = torch.cuda.is_available()


def _backend_devices():
    out = [("reference", "cpu")]
    if HAS_CUDA:
        out += [(b.name, "cuda") for b in backends.candidates("cuda", "w4a4") if b.name != "reference"]
    else:
        out += [("sm90", "cpu")]  # the Triton interpreter
    return out


BACKENDS = _backend_devices()
if HAS_CUDA:
    SHAPES = [(3072, 3072), (3072, 12288), (12288, 3072)]
    MS = [0, 1, 7, 128, 1000, 4096]
    # 20: padded to 16 for the low-rank MMA in quack's accumulator; 192: above LOWRANK_MAX_WINDOW
    RANKS = [0, 16, 20, 32, 128, 192]
else:
    RANKS = [0, 16, 32, 128]
    SHAPES = [(64, 48), (256, 96)]
    MS = [0, 1, 7, 128]


def _random_e4m3(shape, lo=-6, hi=8.8):
    """Random positive E4M3 scales between 2**lo and 2**hi (no NaN bytes)."""
    return torch.exp2(torch.empty(shape).uniform_(lo, hi)).clamp(max=448).to(torch.float8_e4m3fn)


def random_w4a4(k, n, r, dtype, device, bias=True):
    m = SVDQW4A4Linear(k, n, rank=r, bias=bias, dtype=dtype, device="meta")
    sd = {
        "qweight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
        "wscales": _random_e4m3((n, k // 16)),
        "smooth": torch.exp(torch.randn(k) * 0.5),
        "proj_down": (torch.randn(k, r) / k**0.5).to(dtype),
        "proj_up": torch.randn(n, r).to(dtype),
        "wcscale": torch.exp(torch.randn(n) * 0.3) * 1e-3,
    }
    if bias:
        sd["bias"] = torch.randn(n).to(dtype)
    m.load_state_dict(sd, assign=True)
    return m.to(device)


def _expected_and_bound(m, x):
    """The contract in float64 and its tolerance, on the input's device (float64 GEMMs on the GPU)."""
    args = (m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale)
    y = nvfp4.w4a4_linear(x, *args, m.bias, accum_dtype=torch.float64)
    return y.cpu(), nvfp4.tolerance(x, *args, m.bias, x.dtype).cpu()


def _run(backend_name, m, x):
    """The backend's output, its output buffer poisoned first (the allocator hands the block back)."""
    backend = backends.get_backend(backend_name)
    n = m.out_features
    poison = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)
    del poison
    return backend.linear(m, x, backend.prepare(m, x.device))


def _check(y, expected, bound, what):
    y = y.double().cpu()
    assert y.shape == expected.shape, what
    nan_expected = torch.isnan(expected)
    assert torch.isnan(y[nan_expected]).all(), f"{what}: a NaN/Inf block must give NaN"
    ok = ~nan_expected
    bad = ~torch.isfinite(y) & ok
    assert not bad.any(), f"{what}: {int(bad.sum())} unwritten or non-finite outputs, first at {bad.nonzero()[0].tolist()}"
    err = (y[ok] - expected[ok]).abs()
    excess = err / bound[ok]
    if excess.numel():
        worst = excess.argmax()
        assert excess.max() <= 1.0, (
            f"{what}: |y - contract| = {err[worst]:.3g} exceeds the tolerance {bound[ok][worst]:.3g} "
            f"(contract {expected[ok][worst]:.4g})"
        )


@pytest.mark.parametrize("backend,device", BACKENDS, ids=[f"{b}-{d}" for b, d in BACKENDS])
@pytest.mark.parametrize("m_tokens", MS)
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("rank", RANKS)
def test_w4a4_bf16_within_tolerance(backend, device, m_tokens, k, n, rank):
    m = random_w4a4(k, n, rank, torch.bfloat16, device)
    x = torch.randn(m_tokens, k, device=device, dtype=torch.bfloat16) * 3
    y = _run(backend, m, x)
    assert y.dtype == torch.bfloat16
    _check(y, *_expected_and_bound(m, x), f"{backend} M={m_tokens} K={k} N={n} R={rank}")


@pytest.mark.parametrize("backend,device", [(b, d) for b, d in BACKENDS if b == "sm90"])
@pytest.mark.parametrize("m_tokens,rank",
                         [(128, 32), (MS[-2], 16), (MS[-1], 128)] + ([(1000, 192)] if HAS_CUDA else []))
def test_w4a4_with_the_one_read_pass_within_tolerance(backend, device, m_tokens, rank, monkeypatch):
    """``SVDQ_SM90_EXACT_LORA=one``: the pass and ``lora_act`` from one read of x (``kernels.quantize_act_lora``),
    held to the same tolerance, through every GEMM the rank takes (low rank in quack's accumulator, the
    Triton GEMM without quack or below 128 tokens); a branch wider than ``tuning.EXACT_LORA_MAX_R`` (192 here,
    the [M, N] tile above quack's widest window) keeps the two launches."""
    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels, tuning

    calls = []
    one_read = kernels.quantize_act_lora
    monkeypatch.setattr(kernels, "quantize_act_lora",
                        lambda *a, **kw: calls.append(kw.get("inv_smooth")) or one_read(*a, **kw))
    monkeypatch.setenv(tuning.ENV_EXACT_LORA, "one")
    k, n = SHAPES[-1]
    m = random_w4a4(k, n, rank, torch.bfloat16, device)
    x = torch.randn(m_tokens, k, device=device, dtype=torch.bfloat16) * 3
    _check(_run(backend, m, x), *_expected_and_bound(m, x), f"{backend} one read M={m_tokens} K={k} N={n} R={rank}")
    want = m_tokens > sm90.SMALL_M["w4a4"] and rank <= tuning.EXACT_LORA_MAX_R
    assert len(calls) == want, "the one-read pass serves the calls above small M up to its widest branch"
    if calls:
        assert torch.equal(calls[0], 1.0 / m.smooth.float()), "the prepared 1 / smooth, the IEEE quotient"


@pytest.mark.parametrize("backend,device", [(b, d) for b, d in BACKENDS if b == "sm90"])
def test_w4a4_takes_the_one_read_by_default_where_tuning_says(backend, device, monkeypatch):
    """With ``SVDQ_SM90_EXACT_LORA`` unset and no PDL pair (an eager call): the one read from
    ``EXACT_LORA_AUTO_MIN_M`` tokens up to ``EXACT_LORA_AUTO_MAX_R`` columns (lowered here so the interpreter can
    run it), within the tolerance; "two", a wider branch, fewer tokens, ``SVDQ_SM90_LORA_STREAM=1`` or
    ``SVDQ_SM90_PDL=1`` (where the device has it) keep the other launches."""
    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels, tuning

    assert tuning.exact_lora_by_default(4096, 96) and tuning.exact_lora_by_default(2048, 32)
    assert not tuning.exact_lora_by_default(1024, 32) and not tuning.exact_lora_by_default(4096, 128)
    assert not tuning.exact_lora_by_default(4096, 0)
    calls = []
    one_read = kernels.quantize_act_lora
    monkeypatch.setattr(kernels, "quantize_act_lora", lambda *a, **kw: calls.append(1) or one_read(*a, **kw))
    monkeypatch.setattr(tuning, "EXACT_LORA_AUTO_MIN_M", 128)
    for name in (tuning.ENV_EXACT_LORA, sm90.ENV_PDL, sm90.ENV_LORA_STREAM):
        monkeypatch.delenv(name, raising=False)
    k, n = SHAPES[-1]
    mods = {r: random_w4a4(k, n, r, torch.bfloat16, device) for r in (32, 128)}
    x = torch.randn(256, k, device=device, dtype=torch.bfloat16) * 3

    def took_one_read(r, tokens=256, **env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        calls.clear()
        y = _run(backend, mods[r], x[:tokens])
        for name in env:
            monkeypatch.delenv(name)
        _check(y, *_expected_and_bound(mods[r], x[:tokens]), f"{backend} M={tokens} R={r} {env}")
        return bool(calls)

    assert took_one_read(32), "unset, 256 tokens, R = 32: the one read"
    assert not took_one_read(32, **{tuning.ENV_EXACT_LORA: "two"})
    assert sm90.SMALL_M["w4a4"] < 127
    assert not took_one_read(32, tokens=127), "fewer tokens than EXACT_LORA_AUTO_MIN_M: the two launches"
    assert not took_one_read(128), "wider than EXACT_LORA_AUTO_MAX_R: the two launches"
    assert not took_one_read(32, **{sm90.ENV_LORA_STREAM: "1"})
    if kernels.pdl_supported(x.device):
        assert not took_one_read(32, **{sm90.ENV_PDL: "1"}), "the PDL pair first"


@pytest.mark.parametrize("backend,device", [(b, d) for b, d in BACKENDS if b == "sm90"])
def test_exact_passes_read_the_prepared_inv_smooth(backend, device, monkeypatch):
    """The exact mode's activation pass is given the prepared ``1 / smooth`` (no division a column in the kernel),
    bit-equal to the IEEE quotient; an ``extra`` made without it (an unprepared call, or the lists tests build)
    still runs, dividing in the kernel, to the same output bits."""
    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels

    seen = []
    real = kernels.quantize_act
    monkeypatch.setattr(kernels, "quantize_act", lambda *a, **kw: seen.append(kw.get("inv_smooth")) or real(*a, **kw))
    k, n = SHAPES[-1]
    m = random_w4a4(k, n, 16, torch.bfloat16, device)
    x = torch.randn(128, k, device=device, dtype=torch.bfloat16) * 3
    b = backends.get_backend(backend)
    extra = b.extra_tensors(b.prepare(m, x.device))
    inv, rest = sm90._exact_inv(extra)
    assert inv is extra[-1] and len(rest) == len(extra) - 1
    assert torch.equal(inv, 1.0 / m.smooth.float())
    assert sm90._exact_inv(rest) == (None, rest) and sm90._exact_inv([]) == (None, [])
    t = m._parameters
    args = (x, t["qweight"], t["wscales"], t["smooth"], t["proj_down"], t["proj_up"], t["wcscale"], t["bias"])
    y = b.run_w4a4(*args, extra)
    assert seen and seen[-1] is inv, "the pass did not read the prepared 1 / smooth"
    y2 = b.run_w4a4(*args, rest)
    assert seen[-1] is None
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16))
    _check(y, *_expected_and_bound(m, x), f"{backend} inv_smooth")


@pytest.mark.parametrize("backend,device", [(b, d) for b, d in BACKENDS if d == "cuda"] or [(None, "cpu")])
@pytest.mark.parametrize("rank", [32, 128])
@pytest.mark.parametrize("tokens,k", [(4352, 3840), (4608, 3072)])
def test_w4a4_where_the_last_wave_is_part_empty(backend, device, rank, tokens, k):
    """4352 tokens x 3072 rows (K = 3840) and 4608 x 3072: on sm90 the GEMM takes 128 x 208 and 128 x 224 tiles
    there (``tuning.prefill_tiles``: 128 x 256 would leave the last wave 77 % / 82 % full), low-rank MMA included.
    Without a GPU only the tile rule is checked (the reference would take minutes at this size)."""
    from svdq_linear.backends.sm90 import tuning

    # 408 tiles of 256 tokens on 132 SMs: 4 waves; 504 of 208: 4 waves, each tile 208/256 as long
    assert tuning.prefill_tiles(4352, 3072) == (128, 208) and tuning.prefill_tiles(4096, 3072) == (128, 256)
    # 432 tiles of 256 (4 waves) against 504 of 224 (4 waves, 95 % full)
    assert tuning.prefill_tiles(4608, 3072) == (128, 224) and tuning.prefill_tiles(4096, 9216) == (128, 256)
    if backend is None:
        return
    m = random_w4a4(k, 3072, rank, torch.bfloat16, device)
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16) * 3
    _check(_run(backend, m, x), *_expected_and_bound(m, x), f"{backend} M={tokens} K={k} N=3072 R={rank}")


@pytest.mark.parametrize("backend,device", BACKENDS, ids=[f"{b}-{d}" for b, d in BACKENDS])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_w4a4_other_dtypes_and_no_bias(backend, device, dtype, bias):
    k, n = SHAPES[-1]
    m = random_w4a4(k, n, 32, torch.float16 if dtype == torch.float16 else torch.bfloat16, device, bias=bias)
    x = torch.randn(33, k, device=device, dtype=dtype)
    y = _run(backend, m, x)
    assert y.dtype == dtype
    _check(y, *_expected_and_bound(m, x), f"{backend} {dtype} bias={bias}")


@pytest.mark.parametrize("backend,device", BACKENDS, ids=[f"{b}-{d}" for b, d in BACKENDS])
def test_w4a4_non_contiguous_input(backend, device):
    k, n = SHAPES[0]
    m = random_w4a4(k, n, 16, torch.bfloat16, device)
    x = torch.randn(k, 40, device=device, dtype=torch.bfloat16).T  # stride (1, 40)
    assert not x.is_contiguous()
    _check(_run(backend, m, x), *_expected_and_bound(m, x), f"{backend} transposed x")
    x2 = torch.randn(40, 2 * k, device=device, dtype=torch.bfloat16)[:, ::2]
    _check(_run(backend, m, x2), *_expected_and_bound(m, x2), f"{backend} strided x")


@pytest.mark.parametrize("backend,device", BACKENDS, ids=[f"{b}-{d}" for b, d in BACKENDS])
def test_w4a4_special_blocks(backend, device):
    k, n = SHAPES[0]
    m = random_w4a4(k, n, 16, torch.bfloat16, device)
    x = torch.randn(12, k) * 2
    x[1, :16] = 0  # all-zero block: scale 0
    x[2, 16:32] = torch.randn(16) * 2.0**-12  # amax/6 in E4M3's subnormal range (after smoothing)
    x[3, 32:48] = torch.randn(16) * 2.0**-20  # rounds to a zero scale
    x[4, 5] = float("nan")
    x[5, 17] = float("inf")
    x[6, :] = 0  # a whole zero row
    x[7, :16] = 1e4  # saturating scale
    x = x.to(device, torch.bfloat16)
    _check(_run(backend, m, x), *_expected_and_bound(m, x), f"{backend} special blocks")


def _nearest_even(target, grid):
    """Index of the nearest ``grid`` value (ascending) to each ``target``; ties go to the even index."""
    d = (target.unsqueeze(-1) - grid).abs()
    best = d == d.min(-1, keepdim=True).values
    index = torch.arange(grid.numel())
    pick = best & ((index % 2 == 0) | (best.sum(-1, keepdim=True) == 1))
    return torch.where(pick, index, grid.numel()).min(-1).values


def _reference_codes(xs):
    """An independent NVFP4 encoder: nearest-value searches in float64 (ties to the even code)."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0x7F is NaN
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    blocks = xs.float().reshape(xs.shape[0], -1, 16)
    target = (blocks.abs().amax(-1) / 6).double().clamp(max=448)  # amax / 6 in float32, as the contract
    idx = _nearest_even(target, e4m3)
    scale = e4m3[idx].float()
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = blocks * inv.unsqueeze(-1)  # one float32 multiply
    mag = _nearest_even(q.abs().double().clamp(max=6), e2m1)
    codes = mag | ((q < 0).long() << 3)
    return codes.reshape(xs.shape[0], -1).to(torch.uint8), idx.to(torch.uint8)


@pytest.mark.parametrize("device", ["cuda"] if HAS_CUDA else ["cpu"])
def test_quantize_act_codes_are_bit_identical(device):
    from svdq_linear.backends.sm90 import kernels

    k = SHAPES[-1][0]
    x = torch.randn(50, k) * torch.exp(torch.randn(1, k) * 2)
    smooth = torch.exp(torch.randn(k) * 0.5)
    x = x.to(device)
    _, codes, scales = kernels.quantize_act(x, smooth.to(device), packed=True)
    xs = x.cpu().float() * (1.0 / smooth)
    want_codes, want_scales = _reference_codes(xs)
    assert torch.equal(scales.view(torch.uint8).cpu(), want_scales), "E4M3 block scales differ"
    assert torch.equal(nvfp4.unpack_e2m1(codes.cpu()), want_codes), "E2M1 codes differ"


def _reference_values(xs):
    """The independent encoder's dequantized values of ``xs [rows, K]`` (float64, signs of zero kept)."""
    codes, scale_idx = _reference_codes(xs)
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
    scales = scale_idx.view(torch.float8_e4m3fn).double()
    return (values[codes.long()].reshape(xs.shape[0], -1, 16) * scales.unsqueeze(-1)).reshape(xs.shape)


@pytest.mark.parametrize("device", ["cuda"] if HAS_CUDA else ["cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_act_writes_exact_values(device, dtype):
    from svdq_linear.backends.sm90 import kernels

    k = SHAPES[0][0]
    x = (torch.randn(20, k) * 3).to(device, dtype)
    x[3, :16] = 0
    x[4, 7] = float("nan")
    smooth = torch.exp(torch.randn(k) * 0.5).to(device)
    xq, _, _ = kernels.quantize_act(x, smooth)
    assert xq.dtype == (dtype if dtype != torch.float32 else torch.bfloat16)
    xs = x.cpu().float() * (1.0 / smooth.cpu())
    xs[4, :16] = 0  # the NaN block is checked on its own below
    want = _reference_values(xs)
    got = xq.double().cpu()
    nan_block = torch.zeros(20, k, dtype=torch.bool)
    nan_block[4, :16] = True
    assert torch.isnan(got[nan_block]).all(), "a NaN block must dequantize to NaN"
    assert torch.equal(got[~nan_block], want[~nan_block]), "dequantized activations are not exact"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,r,block_m,block_k,split", [(37, 384, 32, 16, 64, 3), (40, 256, 96, 32, 128, 1),
                                                         (70, 1024, 20, 16, 128, 4), (5, 512, 128, 16, 64, 8),
                                                         (0, 128, 32, 16, 64, 2)])
def test_quantize_act_lora_is_the_pass_and_x_times_proj_down(dtype, m, k, r, block_m, block_k, split):
    """``kernels.quantize_act_lora``: ``xq`` the bytes of ``quantize_act``; ``lora_act`` ``x.to(bf16) @ pds``
    rounded once to bf16 (within half a bf16 ulp plus an fp32 sum's error of the float64 product), NaN on
    a row that holds a NaN; the split's partials added in a fixed order (two calls give the same bits), its
    counters left at zero; a non-contiguous x reads the same."""
    from svdq_linear.backends.sm90 import kernels
    from svdq_linear.backends.sm90.small_m import sync_words

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(m + k + r + split)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    if m > 3:
        x[1, 7] = float("nan")
        x[2, 16:32] = 0.0
    smooth = torch.exp(torch.randn(k, generator=g) * 0.5)
    pds = (torch.randn(k, r, generator=g) / 20).bfloat16()
    x, smooth, pds = x.to(dev), smooth.to(dev), pds.to(dev)
    xq, lora = kernels.quantize_act_lora(x, smooth, pds, block_m=block_m, block_k=block_k, split=split)
    assert xq.dtype == dtype and lora.dtype == torch.bfloat16 and lora.shape == (m, r)
    assert torch.equal(xq.view(torch.int16), kernels.quantize_act(x, smooth)[0].view(torch.int16))
    xd, pd = x.cpu().bfloat16().double(), pds.cpu().double()
    want, mag = xd @ pd, xd.abs() @ pd.abs()
    got = lora.cpu().double()
    fin = ~want.isnan()
    assert got[~fin].isnan().all(), "a row holding a NaN gives a NaN lora_act"
    assert ((got - want).abs()[fin] <= (want.abs() * 2.0**-8 + mag * 2.0**-20)[fin]).all()
    xq2, lora2 = kernels.quantize_act_lora(x, smooth, pds, block_m=block_m, block_k=block_k, split=split)
    assert torch.equal(lora2.view(torch.int16), lora.view(torch.int16))
    assert torch.equal(xq2.view(torch.int16), xq.view(torch.int16))
    assert not sync_words(x.device, 1, "quantize_act_lora").any(), "counters left at zero"  # the kernel's words
    xt = torch.empty(k, m, dtype=dtype, device=dev).t()
    xt.copy_(x)
    xq3, lora3 = kernels.quantize_act_lora(xt, smooth, pds, block_m=block_m, block_k=block_k, split=split)
    assert torch.equal(xq3.view(torch.int16), xq.view(torch.int16)) and torch.equal(lora3.view(torch.int16),
                                                                                    lora.view(torch.int16))
    with pytest.raises(ValueError, match="pds"):
        kernels.quantize_act_lora(x, smooth, pds.float())
    with pytest.raises(ValueError, match="power-of-two"):
        kernels.quantize_act_lora(x, smooth, pds, block_m=8)
    with pytest.raises(ValueError, match="272 columns"):
        kernels.quantize_act_lora(x, smooth, torch.zeros(k, 272, dtype=torch.bfloat16, device=dev))


@pytest.mark.parametrize("device", ["cuda"] if HAS_CUDA else ["cpu"])
def test_quantize_act_rounds_every_midpoint_to_even(device):
    """Blocks whose max is 6 get the scale 1, so q is x itself: every E2M1 midpoint (0.25 and 1.25
    down, 0.75 and 1.75 up, 2.5 and 5 down, 3.5 up), values just beside them, the signs of zero, and the
    same at other scales, bit for bit (bf16 bits, signs of zero included) against the reference."""
    from svdq_linear.backends.sm90 import kernels

    mids = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -2.5, 5.5, 0.2499,
                         0.7501, -0.0])
    x = torch.cat([mids, mids * 2.0**-3, -mids * 2.0**5, -mids * 2.0**-12]).repeat(3, 1)
    x[1] = torch.tensor([-6.0, 3.49, 3.51, 1.7499, 1.2501, 2.4999, 2.5001, 4.9999, 5.0001, 0.0, 0.5, 1.0, 1.5, 2.0,
                         3.0, 4.0]).repeat(4)
    x[2] = torch.randn(64)
    xq = kernels.quantize_act(x.bfloat16().to(device), torch.ones(64, device=device))[0].cpu()
    xs = nvfp4.smooth_input(x.bfloat16(), torch.ones(64))
    want = nvfp4.dequantize_nvfp4(*nvfp4.quantize_nvfp4(xs), torch.float32).bfloat16()
    diff = (xq.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} values differ, first {diff[:3].tolist()}: {xq[tuple(diff[0])]} " \
                              f"vs {want[tuple(diff[0])]}"
    # the packed codes come from another rounding (a comparison ladder, _e2m1_mag): the same midpoints, bit for bit
    # (a mutation rounding 1.75 down there passed every random-input test)
    _, codes, scales = kernels.quantize_act(x.bfloat16().to(device), torch.ones(64, device=device), packed=True)
    want_codes, want_scales = nvfp4.quantize_nvfp4(xs)
    assert torch.equal(codes.cpu(), want_codes)
    assert torch.equal(scales.cpu().view(torch.uint8), want_scales.view(torch.uint8))


@pytest.mark.parametrize("device", ["cuda"] if HAS_CUDA else ["cpu"])
@pytest.mark.parametrize("inv", [False, True], ids=["smooth", "inv_smooth"])
def test_quantize_act_exact_at_the_scale_limits(device, inv):
    """Blocks whose values over their scale pass 6 before E2M1 saturates them: scales in E4M3's subnormal range
    (a block max of 6 * 1.49 * 2**-9 takes the scale 2**-9, so q reaches 8.9) and saturated ones (a block max
    above 6 * 448), plus every binade of q from 2**-20 to 2**3 at random mantissas and both signs. ``xq`` bit for
    bit (signs of zero included) against the independent encoder, with ``1 / smooth`` divided in the kernel or
    given (``inv_smooth``, the same bits); ``quantize_act_lora`` the same bytes both ways."""
    from svdq_linear.backends.sm90 import kernels

    g = torch.Generator().manual_seed(7)
    k = 256
    rows = []
    for amax in (6 * 1.49 * 2.0**-9, 6 * 1.9 * 2.0**-8, 6 * 1.3 * 2.0**-7, 2700.0, 9000.0, 6.0, 6 * 2.0**-6):
        r = (torch.rand(k, generator=g) * 2 - 1) * amax
        r[::16] = amax  # each block's max
        rows.append(r)
    mag = torch.exp2(torch.empty(k).uniform_(-20, 3, generator=g))
    mag = mag * torch.where(torch.rand(k, generator=g) < 0.5, -1, 1)
    mag[::16] = 6.0
    rows.append(mag)
    x = torch.stack(rows).bfloat16()
    smooth = torch.exp(torch.randn(k, generator=g) * 0.1).clamp(0.5, 2.0)
    smooth[::16] = 1.0  # the block maxima stay where they were put
    xs = x.float() * (1.0 / smooth)
    _, scale_idx = _reference_codes(xs)
    scales = scale_idx.view(torch.float8_e4m3fn).double()
    want = _reference_values(xs)
    assert (scale_idx[:3] < 8).all() and (scale_idx[3:5] == 0x7E).all(), "not the scale limits meant"
    assert ((xs.reshape(len(rows), -1, 16) / scales.float().unsqueeze(-1)).abs() > 6.5).any(), "no q past 6"
    xd, sd = x.to(device), smooth.to(device)
    kw = {"inv_smooth": (1.0 / sd).contiguous()} if inv else {}
    xq = kernels.quantize_act(xd, sd, **kw)[0].cpu()
    want = want.bfloat16()
    diff = (xq.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} values differ, first {diff[:3].tolist()}: {xq[tuple(diff[0])]} " \
                              f"vs {want[tuple(diff[0])]}"
    pds = (torch.randn(k, 32, generator=g) / 20).bfloat16().to(device)
    xq2, lora = kernels.quantize_act_lora(xd, sd, pds, block_m=16, block_k=64, **kw)
    assert torch.equal(xq2.cpu().view(torch.int16), xq.view(torch.int16))
    if inv:
        _, lora0 = kernels.quantize_act_lora(xd, sd, pds, block_m=16, block_k=64)
        assert torch.equal(lora.view(torch.int16), lora0.view(torch.int16)), "lora_act reads x, not x / smooth"
        with pytest.raises(ValueError, match="inv_smooth"):
            kernels.quantize_act(xd, sd, inv_smooth=kw["inv_smooth"].double())
        with pytest.raises(ValueError, match="inv_smooth"):
            kernels.quantize_act_lora(xd, sd, pds, inv_smooth=kw["inv_smooth"][:-16])


@pytest.mark.parametrize("backend,device", BACKENDS, ids=[f"{b}-{d}" for b, d in BACKENDS])
@pytest.mark.parametrize("m_tokens", [1, 4, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_matches_contract(backend, device, m_tokens, dtype):
    k, n = SHAPES[0]
    lin = torch.nn.Linear(k, n, dtype=torch.float32)
    w = NVFP4W4A16Linear.from_linear(lin).to(device, dtype)
    x = torch.randn(m_tokens, k, device=device, dtype=dtype)
    b = backends.get_backend(backend)
    y = b.linear(w, x, b.prepare(w, x.device)).double().cpu()
    want = nvfp4.w4a16_linear(x.cpu(), w.qweight.cpu(), w.wscales.cpu(), w.wcscale.cpu(), w.bias.cpu(),
                              torch.float64)
    wabs = nvfp4.dequantize_nvfp4(w.qweight.cpu(), w.wscales.cpu(), torch.float64).abs()
    eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    bound = (x.cpu().double().abs() @ wabs.T) * w.wcscale.cpu().double() * k * 2.0**-24 + eps * want.abs() + 1e-30
    assert ((y - want).abs() <= bound).all(), ((y - want).abs() / bound).max()


@pytest.mark.skipif(not HAS_CUDA, reason="opcheck of the GPU kernels needs the GPU")
def test_sm90_ops_pass_opcheck():
    m = random_w4a4(3072, 3072, 32, torch.bfloat16, "cuda")
    x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    # test_schema is left out: its mutation check multiplies the float8 inputs, which torch lacks.
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for name in [b for b, d in BACKENDS if d == "cuda"]:
        b = backends.get_backend(name)
        extra = b.extra_tensors(b.prepare(m, x.device))
        torch.library.opcheck(backends.w4a4_linear, (x, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up,
                                                     m.wcscale, m.bias, extra, name), test_utils=tests)
