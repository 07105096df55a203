"""Linears on a GELU'd, concatenated input read from its parts (``SVDQW4A4Linear.forward_cat_gelu``).

The contract (``svdq_linear.nvfp4``, "Inputs built from two tensors"): the layer on ``x = cat([xa,
gelu_tanh(xb)], -1)``, the GELU rounded to the inputs' dtype. Oracles here: GELU's tanh formula in
float64 (written out below), rounded to the 16-bit dtype. An element whose float64 GELU lies within
``AMBIGUOUS`` of a 16-bit step from a rounding midpoint may round either way in a float32 kernel; the
tests allow a difference there and nowhere else.

CPU (Triton's interpreter) and GPU: the GELU device function, the two-source FP8 activation pass and
``lora_act``; the sm90 fast path's host code with the GEMM stubbed; the module seam and the diffusers
block switch (``fuse_gelu_inputs``) on the reference backend. GPU (H100/H200 with quack-kernels): the
fast linear and a Flux single block, two-source against the written input.
"""

import copy
import functools
import io
import math

import pytest
import torch
import triton
import triton.language as tl

from svdq_linear import SVDQW4A4Linear, backends, nvfp4, set_mode
from svdq_linear.backends.sm90 import kernels as sm90_kernels
from test_sm90_fast import _logical_k, _quack_fast  # the k order written out; the GPU gate

AMBIGUOUS = 2.0**-8  # of a 16-bit step: float32 kernels' GELU is within ~2**-21 of the value


@pytest.fixture(autouse=True)
def _two_source_at_any_tokens(monkeypatch):
    """The tests' layers are small: the two-source kernels serve any token count here (by default
    ``tuning.CAT_GELU_MIN_M`` sends fewer tokens to the written input, which
    ``test_sm90_reads_the_parts_from_cat_gelu_min_m_tokens`` checks)."""
    from svdq_linear.backends.sm90 import tuning

    monkeypatch.setattr(tuning, "CAT_GELU_MIN_M", 0)


@pytest.mark.parametrize("ka", [0, 3072])
def test_sm90_reads_the_parts_from_cat_gelu_min_m_tokens(ka, monkeypatch):
    """Below ``tuning.CAT_GELU_MIN_M`` tokens both modes write the input (measured slower there); from it,
    they read the parts; the limit is read at each call."""
    from svdq_linear.backends.sm90 import Sm90Backend, tuning

    monkeypatch.undo()
    be = Sm90Backend()
    lim = tuning.CAT_GELU_MIN_M
    assert lim == 2048
    for m, want in ((lim - 1, False), (lim, True), (4608, True)):
        xa = torch.empty(m, ka, device="meta", dtype=torch.bfloat16) if ka else None
        xb = torch.empty(m, 12288, device="meta", dtype=torch.bfloat16)
        assert be._exact_reads_cat(xa, xb) is want and be._fast_reads_cat(xa, xb) is want, m
    monkeypatch.setattr(tuning, "CAT_GELU_MIN_M", 100)
    for m, want in ((99, False), (100, True)):
        xb = torch.empty(m, 12288, device="meta", dtype=torch.bfloat16)
        assert be._exact_reads_cat(None, xb) is want and be._fast_reads_cat(None, xb) is want, m


def gelu64(v: torch.Tensor) -> torch.Tensor:
    """GELU, tanh form, in float64: 0.5 v (1 + tanh(u)), u = sqrt(2 / pi) (v + 0.044715 v^3), evaluated as
    v sigmoid(2 u) (the same function; 1 + tanh(u) cancels below v ~ -6 even in float64)."""
    v = v.double()
    return v * torch.sigmoid(2.0 * math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3))


def ambiguous(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the float64 value ``g`` lies within ``AMBIGUOUS`` of a midpoint between two ``dtype`` values."""
    lo16 = g.to(dtype)
    lo = lo16.double()
    up = g >= lo  # the other candidate lies above
    b = lo16.view(torch.int16).int()  # 16-bit patterns: +-1 is the next magnitude up / down
    nb = torch.where(up ^ (b < 0), b + 1, b - 1)
    nb = torch.where((b & 0x7FFF) == 0, torch.where(up, 1, -32767), nb)  # from +-0: the smallest subnormal
    other = nb.to(torch.int16).view(dtype).double()
    mid = (lo + other) / 2
    return (g - mid).abs() <= AMBIGUOUS * (other - lo).abs()


def _inputs(m, ka, kb, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 2, m).unsqueeze(1)
    xa = None if ka == 0 else (torch.randn(m, ka, generator=g) * scale).to(dtype)
    xb = (torch.randn(m, kb, generator=g) * 3 * scale).to(dtype)
    smooth = torch.rand(ka + kb, generator=g) + 0.25
    return xa, xb, smooth


def _written(xa, xb):
    """The input written out, GELU from the float64 oracle; and where its GELU part is ambiguous."""
    g = gelu64(xb)
    x = g.to(xb.dtype) if xa is None else torch.cat([xa, g.to(xb.dtype)], dim=1)
    amb = ambiguous(g, xb.dtype) & g.isfinite()
    amb = amb if xa is None else torch.cat([torch.zeros_like(xa, dtype=torch.bool), amb], dim=1)
    return x, amb


def _max_may_be_ambiguous(x, smooth, amb):
    """Rows whose maximum |x / smooth| may be an ambiguous GELU value (its row scale may differ)."""
    xs = nvfp4.smooth_input(x, smooth).abs().nan_to_num(0.0, 0.0)
    top = xs.amax(1, keepdim=True)
    return (amb & (xs >= top * (1 - 2.0**-6))).any(1)


def _dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- the GELU --------------------------------------------------------------------------------------

@triton.jit
def _gelu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, RNE_BITS: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    g = sm90_kernels._round_to(sm90_kernels._gelu_tanh(v), y_ptr, RNE_BITS)
    tl.store(y_ptr + i, g.to(y_ptr.dtype.element_ty), mask=i < n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_device_function_is_the_float64_gelu_rounded(dtype):
    """``kernels._gelu_tanh`` then ``_round_to``: PyTorch's GELU (tanh form) rounded once to the 16-bit
    dtype; off by one 16-bit step only where the exact value sits at a rounding midpoint; -0.0 far
    left, ``v`` far right, NaN for -Inf and NaN, +Inf for +Inf."""
    g = torch.Generator().manual_seed(1)
    v = torch.cat([torch.randn(6000, generator=g) * 4, torch.linspace(-12, 12, 4001),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 60000.0, -60000.0, float("inf"), -float("inf"),
                                 float("nan")])]).to(dtype)
    dev = _dev()
    y = torch.empty_like(v, device=dev)
    _gelu_kernel[(triton.cdiv(v.numel(), 1024),)](v.to(dev), y, v.numel(), BLOCK=1024,
                                                  RNE_BITS=sm90_kernels._INTERPRET)
    y = y.cpu()
    want64 = gelu64(v)
    want = want64.to(dtype)
    # exp2 overflows float32 below v ~ -10.3: zero where |GELU| < 2**-100 (PyTorch's own float32 GELU is
    # -0.0 from v ~ -5.5, where its 1 + tanh(u) cancels)
    same = (y == want) | (y.isnan() & want.isnan()) | ((want64.abs() < 2.0**-100) & (y == 0))
    amb = ambiguous(want64, dtype) & want64.isfinite()
    assert (same | amb).all(), f"{(~(same | amb)).sum().item()} values differ, first at v={v[~(same | amb)][:4]}"
    steps = (y.double() - want.double()).abs()[~same]
    assert (steps <= (want.double().abs() * 2.0**-7)[~same]).all()
    assert amb.float().mean() < 0.02, "the oracle is ambiguous too often to test anything"
    assert y[-3].item() == float("inf") and y[-2].isnan() and y[-1].isnan()
    assert y[-4] == -0.0 and torch.signbit(y[-4]) and y[-5] == 60000.0


# ---- the two-source activation pass ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ka,kb,gemm_order", [(384, 1536, True), (256, 768, False), (0, 1024, True),
                                              (3072, 12288, True)])
def test_two_source_pass_writes_the_pass_of_the_written_input(dtype, ka, kb, gemm_order):
    """``quantize_act_fp8_cat``: the bytes and row scales of the contract's FP8 activations of the
    written input ``cat([xa, gelu(xb)])`` (both sources, their chunks, the fast GEMM's k order, the
    Flux single block's widths), except at ambiguous GELU values; zero rows, NaN, +-Inf in either
    source; ``gelu_b=False`` is the plain concatenation bit for bit."""
    from svdq_linear.backends.sm90 import kernels

    m = 6 if ka + kb > 4096 else 11
    xa, xb, smooth = _inputs(m, ka, kb, dtype, seed=ka + kb)
    xb[1] = 0
    if xa is not None:
        xa[1] = 0  # an all-zero row: sa = 1
        xa[3, 5] = float("nan")
        xa[4, ka - 1] = 1e4  # the row max in xa's last chunk
    xb[2, 7] = -float("inf")  # GELU(-Inf) is NaN
    xb[5, kb - 2] = float("inf")
    xb[m - 1, 3] = float("nan")
    if dtype == torch.bfloat16:  # a row whose max lies below 448 / FLT_MAX (r = FLT_MAX, not Inf)
        xb[0] = (torch.rand(kb) * 2.0**-120 + 2.0**-121).to(dtype)
        if xa is not None:
            xa[0] = 0
    dev = _dev()
    inv = (1.0 / smooth).to(dev)
    x, amb = _written(xa, xb)
    ra8, rsa = nvfp4.fast_act(nvfp4.smooth_input(x, smooth))
    order = torch.tensor([128 * (p // 128) + _logical_k(p % 128) for p in range(ka + kb)]) if gemm_order else None
    if order is not None:
        ra8, amb = ra8[:, order], amb[:, order]
    a8, sa = kernels.quantize_act_fp8_cat(None if xa is None else xa.to(dev), xb.to(dev), inv, gemm_order=gemm_order)
    a8, sa = a8.view(torch.uint8).cpu(), sa.cpu()
    diff = a8 != ra8.view(torch.uint8)
    assert not (diff & ~amb).any(), f"{(diff & ~amb).sum().item()} bytes differ, first at {(diff & ~amb).nonzero()[:3]}"
    row_amb = _max_may_be_ambiguous(x, smooth, amb if order is None else amb[:, torch.argsort(order)])
    assert torch.equal(sa[~row_amb], rsa[~row_amb]) and (~row_amb).sum() >= m // 2
    assert ((sa == rsa) | (sa - rsa).abs().le(rsa * 2.0**-7))[row_amb].all()
    assert sa[1] == 1 and sa[2] == 1 and sa[m - 1] == 1  # a zero row; GELU(-Inf) and NaN rows
    if xa is not None:  # no GELU: the plain concatenation, every byte
        a8p, sap = kernels.quantize_act_fp8_cat(xa.to(dev), xb.to(dev), inv, gelu_b=False, gemm_order=gemm_order)
        pa8, psa = nvfp4.fast_act(nvfp4.smooth_input(torch.cat([xa, xb], 1), smooth))
        pa8 = pa8 if order is None else pa8[:, order]
        assert torch.equal(sap.cpu(), psa) and torch.equal(a8p.view(torch.uint8).cpu(), pa8.view(torch.uint8))


def _unambiguous(xb):
    """xb with its ambiguous GELU inputs set to 0 (GELU(0) = 0 is exact), and those whose GELU lies below
    2**-100 (a kernel may flush it to a zero of either sign, a zero code's sign that the contract leaves
    open): every kernel must then write the written input's bits exactly."""
    xb = xb.clone()
    g = gelu64(xb)
    xb[(ambiguous(g, xb.dtype) | ((g.abs() < 2.0**-100) & (g != 0))) & xb.isfinite()] = 0
    return xb


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ka,kb", [(256, 768), (0, 512), (384, 272)])
def test_exact_two_source_pass_is_the_pass_of_the_written_input(dtype, ka, kb):
    """``quantize_act_cat`` (the exact mode's NVFP4 pass on two sources): the exact dequantized values,
    and the packed codes and scales, of ``quantize_act`` on the written input, bit for bit (inputs
    without ambiguous GELU values; float32 sources concatenated without GELU), NaN / Inf blocks
    included; an xa width that is not a multiple of the k-block shrinks the block (384 with 256-wide
    blocks)."""
    from svdq_linear.backends.sm90 import kernels

    dev = _dev()
    xa, xb, smooth = _inputs(13, ka, kb, dtype, seed=ka + kb + 1)
    gelu = dtype != torch.float32  # float32 sources: the plain concatenation (no 16-bit rounding hides ulps)
    xb = _unambiguous(xb) if gelu else xb
    xb[2, 7] = -float("inf")
    xb[4, 20] = float("nan")
    if xa is not None:
        xa[5, 3] = float("inf")
        xa[6] = 0
    x = _written(xa, xb)[0] if gelu else (xb if xa is None else torch.cat([xa, xb], 1))
    s = smooth.to(dev)
    xa_d = None if xa is None else xa.to(dev)
    got = kernels.quantize_act_cat(xa_d, xb.to(dev), s, gelu_b=gelu)[0].cpu()
    want = kernels.quantize_act(x.to(dev), s)[0].cpu()
    assert got.dtype == want.dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))
    _, codes, scales = kernels.quantize_act_cat(xa_d, xb.to(dev), s, gelu_b=gelu, packed=True)
    rc, rs = nvfp4.quantize_nvfp4(nvfp4.smooth_input(x, smooth))
    assert torch.equal(codes.cpu(), rc) and torch.equal(scales.cpu().view(torch.uint8), rs.view(torch.uint8))


@pytest.mark.parametrize("ka,kb,r,dtype", [(256, 512, 16, torch.bfloat16), (0, 768, 0, torch.bfloat16),
                                           (128, 640, 8, torch.float16)])
def test_exact_mode_reads_the_two_tensors_within_the_contract(ka, kb, r, dtype, monkeypatch):
    """The sm90 exact mode above the small-M kernels' 64 tokens reads the two tensors
    (``quantize_act_cat``, ``lora_act(xb=)``, the GEMM) and meets the contract's tolerance on the
    written input (without ambiguous GELU values); at 64 tokens it writes the input."""
    from test_conformance import _check, _expected_and_bound, random_w4a4

    from svdq_linear.backends.sm90 import kernels

    dev = _dev()
    mod = random_w4a4(ka + kb, 128, r, dtype, dev)
    xa, xb, _ = _inputs(72, ka, kb, dtype, seed=r + kb)
    xb = _unambiguous(xb)
    xa, xb = (None if xa is None else xa.to(dev)), xb.to(dev)
    if dev == "cuda" and backends.choose(mod, xb).name != "sm90":
        pytest.skip("not an sm90 GPU")
    be = backends.get_backend("sm90")  # on the CPU: Triton's interpreter (not a dispatch candidate there)
    prepared = be.prepare(mod, xb.device)
    calls = []
    real = kernels.quantize_act_cat
    monkeypatch.setattr(kernels, "quantize_act_cat", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = be.linear_cat_gelu(mod, xa, xb, prepared, "w4a4")
    assert calls, "the exact mode wrote the input instead of reading its parts"
    x, _ = _written(None if xa is None else xa.cpu(), xb.cpu())
    expected, bound = _expected_and_bound(mod, x.to(dev))
    _check(y.cpu(), expected, bound, "exact mode on two sources")
    calls.clear()
    be.linear_cat_gelu(mod, None if xa is None else xa[:64], xb[:64], prepared, "w4a4")
    assert not calls
    if dev == "cuda":  # the module's own call takes the same path
        mod.forward_cat_gelu(xa, xb)
        assert calls
    args = (xa, xb, mod.qweight, mod.wscales, mod.smooth, mod.proj_down, mod.proj_up, mod.wcscale, mod.bias,
            be.extra_tensors(prepared), False, "sm90")
    torch.library.opcheck(backends.w4a4_cat_gelu_linear, args,
                          test_utils=("test_autograd_registration", "test_faketensor"))


def test_two_source_pass_divides_lora_act_and_refuses_bad_inputs():
    """``lora=``: ``la = lora / sa`` rounded once (partials added in order), as ``quantize_act_fp8``;
    sources of other dtypes, shapes, widths or a wrong ``inv_smooth`` are refused by name."""
    from svdq_linear.backends.sm90 import kernels

    dev = _dev()
    xa, xb, smooth = _inputs(9, 128, 384, torch.bfloat16, seed=3)
    inv = (1.0 / smooth).to(dev)
    part = torch.randn(2, 9, 24) * 100
    a8, sa, la = kernels.quantize_act_fp8_cat(xa.to(dev), xb.to(dev), inv, lora=part.to(dev))
    want = (part[0] + part[1]).double() / sa.cpu().double()[:, None]
    assert la.shape == (9, 24) and la.dtype == torch.bfloat16
    assert ((la.cpu().double() - want).abs() <= want.abs() * 2.0**-7).all()
    cases = [
        ((xa.half(), xb, inv), "one dtype"),
        ((xa[:5], xb, inv), "xa \\[M, KA\\]"),
        ((xa[:, :100], xb, inv[28:]), "multiple of 128"),
        ((xa, xb, inv[:-1]), "inv_smooth"),
        ((xa, xb.int(), inv), "float input|one dtype"),
    ]
    for (a, b, i), msg in cases:
        with pytest.raises(ValueError, match=msg):
            kernels.quantize_act_fp8_cat(a.to(dev), b.to(dev), i.to(dev))
    with pytest.raises(ValueError, match="K <= "):
        big = torch.zeros(1, kernels.ROW_MAX_K, device=dev, dtype=torch.bfloat16)
        kernels.quantize_act_fp8_cat(big[:, :128], big, torch.ones(kernels.ROW_MAX_K + 128, device=dev))


@pytest.mark.parametrize("ka,kb,split,block_m", [(256, 512, 1, 16), (256, 512, 3, 16), (0, 640, 2, 32),
                                                  (384, 256, 4, 16)])
def test_lora_act_reads_the_two_tensors(ka, kb, split, block_m):
    """``lora_act(xa, pds, xb=, gelu_b=True)``: the written input times ``pds`` (fp32 accumulation of
    bf16 operands), its K split into ``split`` partial sums of whole k-steps that straddle the two
    sources or not (an empty range writes zeros)."""
    from svdq_linear.backends.sm90 import kernels

    dev = _dev()
    xa, xb, _ = _inputs(37, ka, kb, torch.bfloat16, seed=7 + ka)
    g = torch.Generator().manual_seed(8)
    pds = (torch.randn(ka + kb, 24, generator=g) / 20).bfloat16()
    out = kernels.lora_act(None if xa is None else xa.to(dev), pds.to(dev), xb=xb.to(dev), gelu_b=True, split=split,
                           block_m=block_m).cpu()
    assert out.shape == ((split,) if split > 1 else ()) + (37, 24)
    total = out.sum(0) if split > 1 else out
    x, amb = _written(xa, xb)
    want = x.double() @ pds.double()
    mag = x.double().abs() @ pds.double().abs()
    bound = mag * (ka + kb) * 2.0**-24 + (amb.double() * x.double().abs()) @ pds.double().abs() * 2.0**-7 + 1e-30
    err = (total.double() - want).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"
    if split > 1:
        k_split = kernels.cdiv(kernels.cdiv(ka + kb, split), 128) * 128
        empty = [s for s in range(split) if s * k_split >= ka + kb]
        assert all((out[s] == 0).all() for s in empty)
    with pytest.raises(ValueError, match="xb must be"):
        kernels.lora_act(torch.zeros(37, 128, device=dev), pds[: 128 + kb].to(dev), xb=xb.to(dev))
    with pytest.raises(ValueError, match="pds must be"):
        kernels.lora_act(None, pds.to(dev), xb=xb.to(dev)[:, :128])
    if ka == 384:  # xb's k-steps would start inside a 256-wide step of a split
        with pytest.raises(ValueError, match="multiple of block_k"):
            kernels.lora_act(xa.to(dev), pds.to(dev), xb=xb.to(dev), split=2, block_k=256)
    with pytest.raises(ValueError, match="needs x, xb"):
        kernels.lora_act(None, pds.to(dev))


# ---- the module seam and the diffusers blocks (reference backend) ---------------------------------

def _layer(k, n, r=16, seed=0):
    from test_conformance import random_w4a4

    torch.manual_seed(seed)
    return random_w4a4(k, n, r, torch.bfloat16, "cpu")


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_forward_cat_gelu_is_the_layer_on_the_written_input(mode):
    """On the reference backend (which writes the input): ``forward_cat_gelu(xa, xb)`` equals
    ``layer(cat_gelu(xa, xb))`` bit for bit, any leading dimensions, xa None included; a hooked layer
    is called on the written input (its hooks run); mismatched parts are refused by name."""
    m = _layer(384, 256).set_mode(mode)
    xa = torch.randn(2, 5, 128).bfloat16()
    xb = torch.randn(2, 5, 256).bfloat16() * 3
    y = m.forward_cat_gelu(xa, xb)
    assert y.shape == (2, 5, 256) and torch.equal(y, m(nvfp4.cat_gelu(xa, xb)))
    solo = _layer(256, 128, seed=1).set_mode(mode)
    assert torch.equal(solo.forward_cat_gelu(None, xb), solo(torch.nn.functional.gelu(xb, approximate="tanh")))
    seen = []
    hook = m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    assert torch.equal(m.forward_cat_gelu(xa, xb), y) and seen == [(2, 5, 384)]  # hooks see the layer's call
    hook.remove()
    with pytest.raises(ValueError, match="add up to 384"):
        m.forward_cat_gelu(xa, xb[..., :200])
    with pytest.raises(ValueError, match="leading dimensions, dtype"):
        m.forward_cat_gelu(xa.half(), xb)
    with pytest.raises(ValueError, match="leading dimensions, dtype"):
        m.forward_cat_gelu(xa[:1], xb)


def _flux_single_block(dim=64, heads=2):
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(dim, heads, dim // heads).bfloat16().eval()
    block.proj_out = SVDQW4A4Linear.from_linear(block.proj_out, rank=8).bfloat16()
    return block


def _feed_forward(dim=64):
    from diffusers.models.attention import FeedForward

    torch.manual_seed(1)
    ff = FeedForward(dim, activation_fn="gelu-approximate").bfloat16().eval()
    ff.net[2] = SVDQW4A4Linear.from_linear(ff.net[2], rank=8).bfloat16()
    return ff


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_fuse_gelu_inputs_keeps_the_blocks_outputs(mode, monkeypatch):
    """``fuse_gelu_inputs`` switches a Flux single block and a feed-forward with quantized ``proj_out`` /
    down projection to classes whose linear reads the GELU's parts (``forward_cat_gelu``, once a call):
    outputs bit for bit as before on the reference backend, the same state_dict; the switched blocks
    copy and pickle; ``unfuse_gelu_inputs`` gives the diffusers classes back; unquantized blocks stay."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention import FeedForward
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    from svdq_linear.fuse import fuse_gelu_inputs, unfuse_gelu_inputs

    block, ff = _flux_single_block(), _feed_forward()
    plain = FluxSingleTransformerBlock(64, 2, 32)  # proj_out not quantized: left alone
    model = torch.nn.ModuleDict({"block": block, "ff": ff, "plain": plain})
    set_mode(model, mode)
    hs, enc = torch.randn(1, 12, 64).bfloat16(), torch.randn(1, 4, 64).bfloat16()
    temb = torch.randn(1, 64).bfloat16()
    with torch.no_grad():
        before = block(hs, enc, temb), ff(hs)
    keys = list(model.state_dict())
    assert fuse_gelu_inputs(model) == 2
    assert type(plain) is FluxSingleTransformerBlock and type(block) is not FluxSingleTransformerBlock
    # diffusers finds blocks by class name (compile_repeated_blocks, _no_split_modules): the names stay
    assert type(block).__name__ == "FluxSingleTransformerBlock" and type(ff).__name__ == "FeedForward"
    calls = []
    real = SVDQW4A4Linear.forward_cat_gelu
    monkeypatch.setattr(SVDQW4A4Linear, "forward_cat_gelu", lambda self, a, b: calls.append(a is None) or real(self, a, b))
    with torch.no_grad():
        after = block(hs, enc, temb), ff(hs)
    assert calls == [False, True]
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and torch.equal(before[1], after[1])
    assert list(model.state_dict()) == keys
    buf = io.BytesIO()
    torch.save(model, buf)  # a whole module: torch's pickle (weights_only=False), the class by reference
    buf.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        with torch.no_grad():
            assert torch.equal(twin["ff"](hs), before[1])
        assert type(twin["block"]) is type(block)
    assert unfuse_gelu_inputs(model) == 2
    assert type(block) is FluxSingleTransformerBlock and type(ff) is FeedForward
    ff.forward = functools.partial(type(ff).forward, ff)  # what accelerate's / diffusers' hooks do
    with pytest.warns(UserWarning, match="left 1 blocks"):
        assert fuse_gelu_inputs(model) == 1  # the block, not the wrapped feed-forward
    assert type(ff) is FeedForward and type(block) is not FluxSingleTransformerBlock


# ---- the sm90 fast path's host code, GEMM stubbed (CPU) --------------------------------------------

@pytest.mark.parametrize("r,dtype", [(16, torch.bfloat16), (0, torch.bfloat16), (16, torch.float16),
                                     (96, torch.bfloat16)])
def test_sm90_fast_path_hands_the_gemm_the_operands_of_the_written_input(r, dtype, monkeypatch):
    """The sm90 fast mode's ``linear_cat_gelu`` on the CPU (Triton's interpreter; quack's FP8 GEMM
    stubbed to record its operands): the GEMM gets the ``a8``, ``sa`` and ``la`` that the fast mode
    computes from the written input (except at ambiguous GELU values) and the same prepared tensors;
    few tokens (small_m_mma's), a layer whose branch is not in the accumulator (rank 96, wider than a
    window: the tile path), or an empty ``xb`` write the input; compiled (fullgraph) it is the one op
    ``w4a4_cat_gelu_linear``."""
    pytest.importorskip("quack")
    from test_conformance import random_w4a4

    from svdq_linear.backends import sm90

    if torch.cuda.is_available():
        pytest.skip("checks the host code on the CPU under Triton's interpreter")
    m = random_w4a4(768, 128, r, dtype, "cpu").set_mode("fast")
    be = sm90.Sm90Backend()
    be.interpret = False
    prepared = be.prepare(m, torch.device("cpu"))
    seen = []

    real = sm90._quack_fast_module()

    class FakeQuackFast:
        weight = staticmethod(real.weight)

        @staticmethod
        def gemm(a8, sa, fw, lowrank=None, out_dtype=None, lr_acc=None):
            seen.append((a8, sa, fw, lr_acc, lowrank))
            return torch.full((a8.shape[0], 128), 3.0, dtype=out_dtype)

    monkeypatch.setattr(sm90, "_quack_fast_module", lambda: FakeQuackFast)
    two_source = []
    for name in ("quantize_act_fp8_cat", "lora_act"):
        fn = getattr(be.kernels, name)
        monkeypatch.setattr(be.kernels, name, lambda *a, fn=fn, name=name, **k: two_source.append(
            (name, k.get("xb") is not None or name == "quantize_act_fp8_cat")) or fn(*a, **k))
    xa, xb, _ = _inputs(72, 256, 512, dtype, seed=11)
    y = be.linear_cat_gelu(m, xa, xb, prepared, "w4a4_fast")
    assert (y == 3).all() and y.shape == (72, 128) and y.dtype == dtype and len(seen) == 1
    if r == 96:  # the tile path: the input written, then the fast mode on it
        assert prepared.lowrank_segments is None and not two_source and seen[0][4] is not None
        return
    assert two_source == [("lora_act", True), ("quantize_act_fp8_cat", True)][(0 if r else 1):]
    x, amb = _written(xa, xb)
    be.linear(m, x, prepared, "w4a4_fast")
    assert len(seen) == 2
    (a8, sa, fw, lr, _), (a8w, saw, fww, lrw, _) = seen
    order = torch.tensor([128 * (p // 128) + _logical_k(p % 128) for p in range(768)])
    diff = a8.view(torch.uint8) != a8w.view(torch.uint8)
    assert not (diff & ~amb[:, order]).any()
    row_amb = _max_may_be_ambiguous(x, m.smooth, amb)
    assert torch.equal(sa[~row_amb], saw[~row_amb])
    assert fw is fww is real.weight(prepared.quack.tensors())
    if r:
        assert lr[0] is lrw[0] and lr[2] is lrw[2]
        la, law = lr[1].float(), lrw[1].float()
        assert ((la - law).abs() <= law.abs() * 2.0**-6 + 1e-6 * law.abs().max()).all()
    else:
        assert lr is None and lrw is None
    seen.clear()  # 64 tokens (small_m_mma's at most): the written input
    monkeypatch.setattr(sm90.Sm90Backend, "run_w4a4_fast", lambda self, x, *a: seen.append(x) or x.new_zeros(x.shape[0], 128))
    be.linear_cat_gelu(m, xa[:64], xb[:64], prepared, "w4a4_fast")
    assert len(seen) == 1 and seen[0].shape == (64, 768)
    seen.clear()
    be.linear_cat_gelu(m, x, xb[:, :0], prepared, "w4a4_fast")  # nothing to GELU: the input as it is
    assert len(seen) == 1 and torch.equal(seen[0], x)
    seen.clear()
    torch._dynamo.reset()
    ops = []
    real_op = backends.w4a4_cat_gelu_linear
    monkeypatch.setattr(sm90, "w4a4_cat_gelu_linear", lambda *a: ops.append(a[-2]) or real_op(*a))
    y = torch.compile(lambda a, b: be.linear_cat_gelu(m, a, b, prepared, "w4a4_fast") * 1, fullgraph=True)(xa, xb)
    assert ops == [True] and (y == 3).all()  # the op, in its fast form
    torch._dynamo.reset()
    args = (xa, xb, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias,
            be.extra_tensors(prepared), True, "sm90")
    torch.library.opcheck(backends.w4a4_cat_gelu_linear, args,
                          test_utils=("test_autograd_registration", "test_faketensor"))


# ---- GPU --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens,ka,kb,n,r", [(4608, 3072, 12288, 3072, 32), (200, 384, 1536, 512, 0),
                                             (1000, 0, 1024, 256, 32), (96, 256, 768, 384, 96)])
def test_gpu_fast_cat_gelu_linear_matches_the_fast_formula(tokens, ka, kb, n, r):
    """The sm90 fast mode reading the two tensors (``quantize_act_fp8_cat``, ``lora_act(xb=)``, quack's
    FP8 GEMM) meets the fast formula on the written input, and stays within a few of its bound of the
    same layer on the input written out."""
    _quack_fast()
    from test_conformance import random_w4a4
    from test_sm90_fast import _assert_fast_formula

    torch.manual_seed(tokens + kb)
    m = random_w4a4(ka + kb, n, r, torch.bfloat16, "cuda").set_mode("fast")
    xa = None if ka == 0 else torch.randn(tokens, ka, device="cuda", dtype=torch.bfloat16)
    xb = torch.randn(tokens, kb, device="cuda", dtype=torch.bfloat16) * 3
    be = backends.choose(m, xb)
    assert be.name == "sm90"
    prepared = be.prepare(m, xb.device)
    assert be._reads_cat_gelu(m, xa, xb, prepared) == (r != 96)  # rank 96: the tile path writes the input
    y = m.forward_cat_gelu(xa, xb)
    x = nvfp4.cat_gelu(xa, xb)
    _assert_fast_formula(m, x, y)
    assert torch.equal(m(x), m(x))  # deterministic (no atomics), so the comparison below means something
    rel = ((y.float() - m(x).float()).norm() / m(x).float().norm()).item()
    assert rel < 2e-3, f"two-source and written-input fast linears differ by {rel:.3g}"


@pytest.mark.gpu
def test_gpu_flux_single_block_reads_its_gelu_parts_compiled():
    """A Flux-width single block in the fast mode, switched by ``fuse_gelu_inputs`` and compiled
    (fullgraph), stays within the fast mode's noise of the unswitched block."""
    _quack_fast()
    pytest.importorskip("diffusers")
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    import svdq_linear
    from svdq_linear.fuse import fuse_gelu_inputs

    torch.manual_seed(0)
    block = FluxSingleTransformerBlock(3072, 24, 128).to("cuda", torch.bfloat16).eval()
    block.proj_out = SVDQW4A4Linear.from_linear(block.proj_out, rank=32).to("cuda", torch.bfloat16)
    svdq_linear.set_mode(block, "fast")
    hs = torch.randn(1, 1024, 3072, device="cuda", dtype=torch.bfloat16)
    enc = torch.randn(1, 128, 3072, device="cuda", dtype=torch.bfloat16)
    temb = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = torch.cat(block(hs, enc, temb), 1).float()
        assert fuse_gelu_inputs(block) == 1
        torch._dynamo.reset()
        got = torch.cat(torch.compile(block, fullgraph=True)(hs, enc, temb), 1).float()
    torch._dynamo.reset()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 2e-3, f"switched block differs by {rel:.3g}"


# ---- whole pipelines (reference backend, CPU) -------------------------------------------------------

@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_quantized_pipeline_images_do_not_change_with_gelu_inputs(kind):
    """A tiny quantized Flux / SD3 pipeline: ``fuse_gelu_inputs`` switches every single block and every
    feed-forward whose down projection is quantized, the image is the same bit for bit (the reference
    backend writes the input), and diffusers' regional compile still finds the blocks by class name
    (one graph per block class, the same image)."""
    pytest.importorskip("diffusers")
    import numpy as np
    from diffusers.models.attention import FeedForward
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    import svdq_linear
    from svdq_linear.convert.tiny import TINY_CALL_KWARGS, build_tiny_pipeline

    def generate(p):
        p.set_progress_bar_config(disable=True)
        return p("a cat", generator=torch.Generator().manual_seed(0), output_type="np",
                 **TINY_CALL_KWARGS[kind]).images[0]

    pipe = build_tiny_pipeline(kind)
    svdq_linear.quantize_pipeline(pipe, rank=8, calib=False, progress=False)
    before = generate(pipe)
    tr = pipe.transformer
    want = sum(1 for m in tr.modules() if type(m) is FluxSingleTransformerBlock
               or (type(m) is FeedForward and isinstance(m.net[2], SVDQW4A4Linear)))
    assert want > 0 and svdq_linear.fuse_gelu_inputs(tr) == want
    assert np.array_equal(generate(pipe), before)
    if kind == "flux":
        torch._dynamo.reset()
        try:
            tr.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
            switched = [b for b in tr.single_transformer_blocks if type(b) is not FluxSingleTransformerBlock]
            assert switched and all(b._compiled_call_impl is not None for b in switched)  # found by name
            assert np.array_equal(generate(pipe), before)
        finally:
            torch._dynamo.reset()
