"""The sm90 fast mode: the FP8 decode layout, the per-token E4M3 activations, and (GPU) the FP8 GEMM.

CPU: the layout is checked against the wgmma register fragment written out independently here, the
kernel's decode arithmetic (``fast_layout.emulate_decode``) against ``nvfp4.fast_weight`` bit for bit,
and ``quantize_act_fp8`` (under Triton's interpreter) against ``nvfp4.fast_act`` bit for bit.
GPU (H100/H200 with quack-kernels): the same on the device, the decoded weights read back through the
GEMM itself, and the whole fast linear against the fast formula in float64 (ranks that put the low-rank
MMA into the accumulator, one padded to 16, a fused q/k/v whose tiles each read their own window, and
one above ``LOWRANK_MAX_WINDOW`` that adds a tile).
"""

import pytest
import torch

from svdq_linear import SVDQW4A4Linear, backends, nvfp4
from svdq_linear.backends.sm90 import fast_layout

E4M3_GRID = torch.tensor(sorted({float(v) for v in torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
                                 if v == v and v >= 0}), dtype=torch.float64)


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 3, n).unsqueeze(1)
    w[1] = 0  # an all-zero row
    w[2, :32] = 0  # all-zero blocks in a row with a large maximum
    w[3, 16:32] = 1e-7  # a block whose scale underflows
    return nvfp4.quantize_nvfp4(w)


def _logical_k(pos):
    """The fast GEMM's k order written out: position 32 b + 16 h + 4 c + j of a k-tile holds logical
    column 32 c + 16 (b // 2) + 8 (b % 2) + 4 h + j (thread quad c owns NVFP4 blocks 2 c and 2 c + 1)."""
    b, rest = divmod(pos, 32)
    h, rest = divmod(rest, 16)
    c, j = divmod(rest, 4)
    return 32 * c + 16 * (b // 2) + 8 * (b % 2) + 4 * h + j


def test_codes_sit_where_the_fp8_wgmma_fragment_reads_them():
    q, _ = _weight(128, 256)
    codes = nvfp4.unpack_e2m1(q)
    blob = fast_layout.repack_fast_weight(q)
    assert blob.shape == (2, 2, 128, 32)
    for g, kt, t in [(0, 0, 0), (1, 1, 127), (0, 1, 37), (1, 0, 66)]:
        warp, lane = divmod(t, 32)
        for reg in range(16):  # four registers per k32 block, four blocks per k-tile
            b, p = divmod(reg, 4)
            row = 64 * g + 16 * warp + lane // 4 + 8 * (p % 2)
            word_i = 2 * b + p // 2
            word = int.from_bytes(bytes(blob[g, kt, t, 4 * word_i:4 * word_i + 4].tolist()), "little")
            for j in range(4):
                pos = 32 * b + 16 * (p // 2) + 4 * (lane % 4) + j
                if p % 2 == 0:  # row r: magnitude at bits 4 j, sign at 8 j + 7
                    code = (word >> 4 * j) & 7 | ((word >> (8 * j + 7)) & 1) << 3
                else:  # row r + 8: magnitude at 16 + 4 j, sign at 8 j + 3
                    code = (word >> (16 + 4 * j)) & 7 | ((word >> (8 * j + 3)) & 1) << 3
                assert code == int(codes[row, 128 * kt + _logical_k(pos)]), (g, kt, t, reg, j)
    assert torch.equal(fast_layout.unpack_fast_weight(blob), q)


def test_gemm_k_order_puts_each_column_at_its_position():
    a = torch.arange(3 * 384).reshape(3, 384)
    got = fast_layout.gemm_k_order(a)
    want = torch.tensor([128 * (p // 128) + _logical_k(p % 128) for p in range(384)])
    assert torch.equal(got, a[:, want])
    assert torch.equal(fast_layout.logical_k_order(got), a)
    with pytest.raises(ValueError, match="K % 128"):
        fast_layout.gemm_k_order(a[:, :200])


def test_strip_holds_each_block_factor_once():
    q, s = _weight(192, 384)
    strip, nw = fast_layout.fast_scales(q, s)
    g = fast_layout.strip_factors(strip).double()
    w = nvfp4.dequantize_nvfp4(q, s, torch.float64)
    nonzero = (nvfp4.unpack_e2m1(q) & 7).reshape(192, -1, 16).amax(2) > 0
    want = torch.where(nonzero, s.double() / nw.double()[:, None], 0.0)
    assert torch.equal(g, want)
    row_max = w.abs().amax(1)
    live = row_max > 0
    assert ((row_max / nw)[live] <= 448).all() and ((row_max / nw)[live] > 224).all()
    assert nw[1] == 1  # the all-zero row
    # thread t's word t: byte 2 B + p is block 2 c + B of the tile, row r + 8 p (c = t % 4)
    ue = (want.half().view(torch.int16).int() >> 7) & 0xFF
    for gi, kt, t in [(0, 0, 0), (2, 2, 127), (1, 1, 45)]:
        warp, lane = divmod(t, 32)
        for big in range(2):
            for p in range(2):
                row = 64 * gi + 16 * warp + lane // 4 + 8 * p
                assert int(strip[gi, kt, 4 * t + 2 * big + p]) == int(ue[row, 8 * kt + 2 * (lane % 4) + big])


def test_emulated_decode_is_the_fast_weight_bit_for_bit():
    q, s = _weight(192, 512, seed=1)
    strip, _ = fast_layout.fast_scales(q, s)
    got = fast_layout.emulate_decode(fast_layout.repack_fast_weight(q), strip)
    w8, nw = nvfp4.fast_weight(q, s)
    assert torch.equal(got.view(torch.uint8), w8.view(torch.uint8))
    # and the fast weight is one nearest-even E4M3 rounding of w / nw, checked by search
    w = nvfp4.dequantize_nvfp4(q, s, torch.float64) / nw.double()[:, None]
    a = w.abs().flatten()
    d = (E4M3_GRID[None, :] - a[:, None]).abs()
    nearest = E4M3_GRID[d.argmin(1)]
    assert ((w8.double().abs().flatten() - a).abs() <= (nearest - a).abs()).all()


def test_layout_refuses_shapes_it_cannot_tile():
    q, _ = _weight(128, 256)
    with pytest.raises(ValueError, match="in_features % 128"):
        fast_layout.repack_fast_weight(q[:, :32])
    with pytest.raises(ValueError, match="out_features % 64"):
        fast_layout.repack_fast_weight(q[:96])


def _fp8_input(m, k, dtype, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-5, 4, m).unsqueeze(1)).to(dtype)
    x[3] = 0
    x[5, 7] = float("nan")
    x[6, 9] = float("inf")
    x[7, 100] = -float("inf")
    x[8, 3] = -0.0
    x[9, 11] = -float("nan")  # a NaN with its sign bit set
    x[9, 12] = float("nan")
    x[9, 14] = float("inf")  # Inf in a NaN row (sa = 1): 0x7F, not the convert's saturated 448
    x[9, 15] = -float("inf")
    # a row whose max lies below 448 / FLT_MAX (1 / sa would overflow: r = FLT_MAX); zeros in float16
    x[10] = (torch.rand(k, generator=g) * 2.0**-122 + 2.0**-123).to(dtype)  # normal floats; sa subnormal
    smooth = torch.rand(k, generator=g) + 0.25
    return x, smooth


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kernel", [(False, 4, 512, 4), (False, 8, 256, 4), (False, 1, 1024, 8), (True, None, 0, None),
                                    (True, 1, 0, 4), (True, 4, 0, 8)])
def test_quantize_act_fp8_is_bit_exact(dtype, kernel):
    """Both kernels (two passes over a block; whole rows in registers, at its default block and others)
    against the contract, bit for bit: zero rows, +-Inf, NaN of either sign, -0.0, both majors."""
    from svdq_linear.backends.sm90 import kernels

    one_pass, rows, block_k, warps = kernel
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, smooth = _fp8_input(11, 1000, dtype)
    x, smooth = x.to(dev), smooth.to(dev)
    for xin in [x, x.T.contiguous().T]:  # both majors
        if one_pass:
            a8, sa = kernels.quantize_act_fp8(xin, smooth, one_pass=True, rows=rows, num_warps=warps)
        else:
            a8, sa = kernels.quantize_act_fp8(xin, smooth, one_pass=False, block_m=rows, block_k=block_k,
                                              num_warps=warps)
        ra8, rsa = nvfp4.fast_act(nvfp4.smooth_input(xin, smooth))
        assert torch.equal(sa.cpu(), rsa.cpu())
        diff = (a8.view(torch.uint8) != ra8.view(torch.uint8)).nonzero()
        assert diff.numel() == 0, f"{len(diff)} bytes differ, first at {diff[:3].tolist()}"


@pytest.mark.parametrize("gemm_order", [False, True])
@pytest.mark.parametrize("k", [3072, 3840, 12288, 15360])
def test_quantize_act_fp8_one_pass_at_flux_widths(k, gemm_order):
    """The one-pass kernel splits a row into up to 4 power-of-two chunks (3 x 1024 at K = 3072, 4 x 4096
    with the last one partly masked at K = 15360): every chunk's bytes and the row scale are the
    contract's, given ``inv_smooth`` as the backend caches it, in either k order."""
    from svdq_linear.backends.sm90 import kernels

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows, c, nch, _ = kernels.fp8_rows_config(k)
    assert nch <= 4 and (nch - 1) * c < k <= nch * c and c & (c - 1) == 0
    x, smooth = _fp8_input(11, k, torch.bfloat16, seed=k)
    x[10, k - 1] = 1e4  # the row max in the last chunk
    a8, sa = kernels.quantize_act_fp8(x.to(dev), smooth.to(dev), inv_smooth=(1.0 / smooth).to(dev),
                                      gemm_order=gemm_order)
    ra8, rsa = nvfp4.fast_act(nvfp4.smooth_input(x, smooth))
    if gemm_order:
        ra8 = ra8[:, [128 * (p // 128) + _logical_k(p % 128) for p in range(k)]]
    assert torch.equal(sa.cpu(), rsa)
    assert torch.equal(a8.view(torch.uint8).cpu(), ra8.view(torch.uint8))
    with pytest.raises(ValueError, match="inv_smooth"):
        kernels.quantize_act_fp8(x.to(dev), smooth.to(dev), inv_smooth=smooth[:-16].to(dev))
    with pytest.raises(ValueError, match="one-pass"):
        kernels.quantize_act_fp8(torch.zeros(2, kernels.ROW_MAX_K + 16, device=dev),
                                 torch.ones(kernels.ROW_MAX_K + 16, device=dev), one_pass=True)


@pytest.mark.parametrize("kernel", [(False, 4, 512), (False, 8, 64), (True, None, 0), (True, 1, 0)])
def test_quantize_act_fp8_writes_the_gemm_k_order(kernel):
    """``gemm_order=True``: both kernels write the contract's bytes at the fast GEMM's positions (the
    order written out in ``_logical_k``, not taken from the library), both majors; K % 128 is required."""
    from svdq_linear.backends.sm90 import kernels

    one_pass, rows, block_k = kernel
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, smooth = _fp8_input(11, 384, torch.bfloat16, seed=4)
    x, smooth = x.to(dev), smooth.to(dev)
    order = [128 * (p // 128) + _logical_k(p % 128) for p in range(384)]
    for xin in [x, x.T.contiguous().T]:
        kw = dict(rows=rows) if one_pass else dict(block_m=rows, block_k=block_k)
        a8, sa = kernels.quantize_act_fp8(xin, smooth, one_pass=one_pass, gemm_order=True, **kw)
        ra8, rsa = nvfp4.fast_act(nvfp4.smooth_input(xin, smooth))
        assert torch.equal(sa.cpu(), rsa.cpu())
        assert torch.equal(a8.view(torch.uint8).cpu(), ra8.view(torch.uint8).cpu()[:, order])
    with pytest.raises(ValueError, match="in_features % 128"):
        kernels.quantize_act_fp8(x[:, :200], smooth[:200], gemm_order=True)


@pytest.mark.parametrize("one_pass", [True, False])
def test_quantize_act_fp8_divides_lora_act_by_the_token_scale(one_pass):
    """``la = lora_act / sa`` rounded once to bf16: the operand that adds the low-rank product to the
    accumulator before the epilogue multiplies it by ``sa``."""
    from svdq_linear.backends.sm90 import kernels

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(13, 256, generator=g) * torch.logspace(-6, 5, 13).unsqueeze(1)).bfloat16()
    x[4] = 0  # sa = 1
    smooth = torch.rand(256, generator=g) + 0.5
    lora = torch.randn(13, 24, generator=g) * 1e3
    a8, sa, la = kernels.quantize_act_fp8(x.to(dev), smooth.to(dev), lora=lora.to(dev), one_pass=one_pass, block_m=8)
    ra8, rsa = nvfp4.fast_act(nvfp4.smooth_input(x, smooth))
    assert torch.equal(sa.cpu(), rsa) and torch.equal(a8.view(torch.uint8).cpu(), ra8.view(torch.uint8))
    want = (lora.double() / rsa.double()[:, None])
    assert la.dtype == torch.bfloat16 and la.shape == (13, 24)
    if dev == "cuda":  # one round-to-nearest of the exact fp32 quotient
        assert torch.equal(la.cpu(), (lora / rsa[:, None]).bfloat16())
    else:  # Triton's interpreter converts to bf16 without rounding to nearest: one ulp
        assert ((la.double() - want).abs() <= want.abs() * 2.0**-7).all()
    with pytest.raises(ValueError, match="lora"):
        kernels.quantize_act_fp8(x.to(dev), smooth.to(dev), lora=lora[:5].to(dev))


@pytest.mark.parametrize("one_pass", [True, False])
def test_quantize_act_fp8_adds_lora_act_partials_in_order(one_pass):
    """``lora`` as ``[S, M, R]`` fp32 partial sums (``kernels.lora_act(split=S)``): ``la`` is their sum,
    added in split order in fp32, divided by ``sa`` and rounded once; other shapes or dtypes are refused."""
    from svdq_linear.backends.sm90 import kernels

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(11, 256, generator=g) * 10).bfloat16()
    smooth = torch.rand(256, generator=g) + 0.5
    part = torch.randn(3, 11, 40, generator=g) * 1e2
    a8, sa, la = kernels.quantize_act_fp8(x.to(dev), smooth.to(dev), lora=part.to(dev), one_pass=one_pass)
    rsa = nvfp4.fast_act(nvfp4.smooth_input(x, smooth))[1]
    total = (part[0] + part[1]) + part[2]  # fp32, in split order
    want = total.double() / rsa.double()[:, None]
    assert la.shape == (11, 40) and torch.equal(sa.cpu(), rsa)
    if dev == "cuda":
        assert torch.equal(la.cpu(), (total / rsa[:, None]).bfloat16())
    else:  # the interpreter's bf16 conversion truncates: one ulp
        assert ((la.double() - want).abs() <= want.abs() * 2.0**-7).all()
    for bad in (part[:, :5], part.double(), part.transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match="lora"):
            kernels.quantize_act_fp8(x.to(dev), smooth.to(dev), lora=bad.to(dev))


@pytest.mark.parametrize("block_m,block_k", [(16, 128), (32, 64)])
def test_quantize_act_fp8_can_compute_lora_act_itself(block_m, block_k):
    """``proj_down_smoothed=``: the kernel's first pass also multiplies the x it reads by
    ``proj_down / smooth`` (bf16 operands, fp32 accumulation) and writes ``la = lora_act / sa``; the codes
    and scales stay bit-exact, at any row block, k-chunk (a dot of 16 or 32 rows)."""
    from svdq_linear.backends.sm90 import kernels

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(37, 384, generator=g) * torch.logspace(-3, 3, 37).unsqueeze(1)).bfloat16()
    x[5] = 0
    smooth = torch.rand(384, generator=g) + 0.5
    pds = (torch.randn(384, 24, generator=g) / 20 / smooth[:, None]).bfloat16()
    a8, sa, la = kernels.quantize_act_fp8(x.to(dev), smooth.to(dev), proj_down_smoothed=pds.to(dev), block_m=block_m,
                                          block_k=block_k)
    ra8, rsa = nvfp4.fast_act(nvfp4.smooth_input(x, smooth))
    assert torch.equal(sa.cpu(), rsa) and torch.equal(a8.view(torch.uint8).cpu(), ra8.view(torch.uint8))
    want = (x.double() @ pds.double()) / rsa.double()[:, None]
    bound = (x.double().abs() @ pds.double().abs()) / rsa.double()[:, None] * 2.0**-7 + 1e-30
    err = (la.cpu().double() - want).abs()
    assert la.shape == (37, 24) and (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"
    with pytest.raises(ValueError, match="not both"):
        kernels.quantize_act_fp8(x.to(dev), smooth.to(dev), lora=torch.zeros(37, 24, device=dev),
                                 proj_down_smoothed=pds.to(dev))


def test_float64_division_rounds_to_the_float32_quotient():
    """``fast_layout.fast_act_ops`` divides in float64 and rounds to float32, which must equal one
    IEEE float32 division (what the Triton pass's ``div_rn`` does) for every pair it meets: random
    float32 bit patterns across the whole range, subnormals and the overflow edge included."""
    g = torch.Generator().manual_seed(9)
    bits = torch.randint(1, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    a = bits.view(torch.float32)
    b = torch.randint(1, 0x7F800000, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    edge = torch.tensor([1.0, 448.0, 2.0**-149, 2.0**-126, 3.4028235e38, 1.1754942e-38 / 3, 2.0**-127 * 3])
    for num, den in [(a, torch.full_like(a, 448.0)), (torch.ones_like(a), a), (a, b),
                     (edge, torch.full_like(edge, 448.0)), (torch.ones_like(edge), edge)]:
        want = num / den  # one IEEE division on the CPU
        got = (num.double() / den.double()).float()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_act_ops_is_the_contract_bit_for_bit(dtype, compiled):
    """The activation pass in PyTorch ops (what a compiled fast-mode call traces, for the compiler to
    fuse into the ops producing x) writes the contract's bytes at the fast GEMM's positions, the row
    scales, and ``la = lora / sa`` rounded once to bf16, eager and compiled (inductor on the CPU):
    zero rows, +-Inf, NaN of either sign, -0.0, tiny and huge rows."""
    from svdq_linear.backends.sm90 import fast_layout

    x, smooth = _fp8_input(14, 384, dtype, seed=12)
    x[11] = 1e-30 if dtype == torch.float32 else 1e-20  # a row max far below E4M3's range
    x[12] = 3e38 if dtype == torch.float32 else 3e38  # near float32's top: sa is large, 1 / sa tiny
    x[13, ::7] = 2.0**-133 if dtype == torch.float32 else 2.0**-126  # subnormal sa
    g = torch.Generator().manual_seed(13)
    lora = torch.randn(14, 24, generator=g) * torch.logspace(-3, 4, 24)
    inv = 1.0 / smooth
    fn = torch.compile(fast_layout.fast_act_ops, fullgraph=True) if compiled else fast_layout.fast_act_ops
    a8, sa, la = fn(x, inv, lora)
    ra8, rsa = nvfp4.fast_act(nvfp4.smooth_input(x, smooth))
    order = [128 * (p // 128) + _logical_k(p % 128) for p in range(384)]
    assert torch.equal(sa.view(torch.int32), rsa.view(torch.int32))
    diff = (a8.view(torch.uint8) != ra8.view(torch.uint8)[:, order]).nonzero()
    assert diff.numel() == 0, f"{len(diff)} bytes differ, first at {diff[:3].tolist()}"
    assert la.dtype == torch.bfloat16 and torch.equal(la, (lora / rsa[:, None]).bfloat16())
    a8n, san = fn(x, inv)
    assert torch.equal(a8n.view(torch.uint8), a8.view(torch.uint8)) and torch.equal(san, sa)


@pytest.mark.parametrize("r", [32, 0])
def test_compiled_fast_call_hands_the_gemm_op_the_contract_operands(r, monkeypatch):
    """``SVDQ_SM90_COMPILER_PASS=1``, on the CPU with the GEMM stubbed: a traced sm90 fast-mode call
    compiles in one graph (fullgraph) around the ``w4a8_fast_gemm`` op, whose operands are the
    contract's ``a8`` (the GEMM's k order) and ``sa``, ``la = (x @ proj_down') / sa`` in bf16 and the
    prepared tensors; at 64 tokens (small_m_mma's), eagerly, or with the setting off, the whole op runs."""
    pytest.importorskip("quack")
    from test_conformance import random_w4a4

    from svdq_linear.backends import sm90

    m = random_w4a4(384, 256, r, torch.bfloat16, "cpu").set_mode("fast")
    be = sm90.Sm90Backend()
    be.interpret = False
    prepared = be.prepare(m, torch.device("cpu"))
    seen, whole = [], []

    def gemm(self, a8, sa, la, extra, out_dtype):
        seen.append((a8, sa, la, extra))
        return torch.full((a8.shape[0], extra[-2].shape[-1]), 2.0, dtype=out_dtype)

    monkeypatch.setattr(sm90.Sm90Backend, "run_fast_gemm", gemm)
    monkeypatch.setattr(sm90.Sm90Backend, "run_w4a4_fast", lambda self, x, *a: whole.append(1) or x.new_ones(x.shape[0], 256))
    monkeypatch.setenv(sm90.ENV_COMPILER_PASS, "1")
    x = (torch.randn(96, 384) * 4).bfloat16()
    torch._dynamo.reset()
    y = torch.compile(lambda t: be.linear(m, t, prepared, "w4a4_fast") * 1, fullgraph=True)(x)
    assert len(seen) == 1 and not whole and (y == 2).all() and y.dtype == torch.bfloat16
    a8, sa, la, extra = seen[0]
    ra8, rsa = nvfp4.fast_act(nvfp4.smooth_input(x, m.smooth))
    order = [128 * (p // 128) + _logical_k(p % 128) for p in range(384)]
    assert torch.equal(sa, rsa) and torch.equal(a8.view(torch.uint8), ra8.view(torch.uint8)[:, order])
    fw = [t for t in prepared.quack.tensors()]
    assert all(a is b or torch.equal(a, b) for a, b in zip(extra[-4:], fw))
    if r:
        pds = prepared.proj_down_smoothed
        want = ((x.float() @ pds.float()) / rsa[:, None]).bfloat16()
        assert la.shape == want.shape and ((la.float() - want.float()).abs() <= want.float().abs() * 2.0**-7).all()
        assert torch.equal(extra[0], prepared.proj_up_bf16) and torch.equal(extra[1], prepared.lowrank_segments)
    else:
        assert la is None and len(extra) == 4
    torch.library.opcheck(backends.w4a8_fast_gemm, (a8, sa, la, extra, torch.bfloat16, "sm90"),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    seen.clear()
    be.linear(m, x, prepared, "w4a4_fast")  # eager: the whole op
    assert len(whole) == 1 and not seen
    torch._dynamo.reset()
    torch.compile(lambda t: be.linear(m, t, prepared, "w4a4_fast"), fullgraph=True)(x[:64])
    assert len(whole) == 2 and not seen
    monkeypatch.setenv(sm90.ENV_COMPILER_PASS, "0")
    torch._dynamo.reset()
    torch.compile(lambda t: be.linear(m, t, prepared, "w4a4_fast"), fullgraph=True)(x)
    assert len(whole) == 3 and not seen
    torch._dynamo.reset()


def test_sm90_leaves_the_fast_mode_to_the_reference_on_the_cpu():
    m = SVDQW4A4Linear(256, 128, rank=8)
    m.set_mode("fast")
    assert backends.choose(m, torch.empty(2, 256)).name == "reference"


def test_fast_state_stands_in_for_the_canonical_codes_and_scales():
    """The fast kernel's blob is a permutation of the canonical codes, and its strip times each row's
    ``2**e`` gives the scales (a patch keeps the scales of all-zero blocks, which the strip zeroes):
    while the state is cached the module frees both and rebuilds them bit for bit. The exact mode's
    stand-ins: ``test_sm90_host``."""
    qf = pytest.importorskip("svdq_linear.backends.sm90.quack_fast")
    qg = pytest.importorskip("svdq_linear.backends.sm90.quack_gemm")
    from svdq_linear.backends.sm90 import Sm90Backend, Sm90Prepared
    from svdq_linear.backends.sm90.fast_layout import scale_patch

    q, s = _weight(128, 256, seed=7)
    backend = Sm90Backend()
    fw = qf.prepare(q, s, torch.rand(128) + 0.5, None)
    rebuild = backend.replaced(Sm90Prepared(None, None, fw, scale_patch=scale_patch(s, fw.strip, fw.nw)))
    assert set(rebuild) == {"qweight", "wscales"} and torch.equal(rebuild["qweight"](), q)
    got = rebuild["wscales"]()
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), s.view(torch.uint8))
    # without the patch (a state built elsewhere) the scales stay
    assert set(backend.replaced(Sm90Prepared(None, None, fw))) == {"qweight"}
    assert set(backend.replaced(Sm90Prepared(None, None, qg.prepare(q, s, torch.ones(128), None)))) == {
        "qweight", "wscales"}
    assert backend.replaced(None) == {} and backend.replaced(Sm90Prepared(None, None, None)) == {}


def test_fast_scales_rebuild_bit_for_bit_with_the_patch_of_zero_blocks():
    """``rebuild_scales``: the strip's block factors times ``2**e`` are the E4M3 scales; blocks of zero
    codes lose theirs in the strip, and ``scale_patch`` lists exactly those that were not 0."""
    from svdq_linear.backends.sm90 import fast_layout

    q, s = _weight(192, 384, seed=11)
    codes = nvfp4.unpack_e2m1(q)
    codes[5, 32:48] = 0  # a block of zero codes whose scale is not 0
    codes[6, 64:80] = 8  # -0 codes: zero magnitudes too
    s = s.clone()
    s.view(torch.uint8)[5, 2] = 0x38
    s.view(torch.uint8)[6, 4] = 0x41
    q = nvfp4.pack_e2m1(codes)
    strip, nw = fast_layout.fast_scales(q, s)
    idx, vals = fast_layout.scale_patch(s, strip, nw)
    zero_blocks = (codes & 7).reshape(192, -1, 16).amax(2) == 0
    want_idx = (zero_blocks & (s.view(torch.uint8) != 0)).reshape(-1).nonzero().reshape(-1)
    assert torch.equal(idx, want_idx) and {5 * 24 + 2, 6 * 24 + 4} <= set(idx.tolist())
    assert torch.equal(vals, s.view(torch.uint8).reshape(-1)[want_idx])
    full = fast_layout.rebuild_scales(strip, nw, (idx, vals))
    assert torch.equal(full.view(torch.uint8), s.view(torch.uint8))
    bare = fast_layout.rebuild_scales(strip, nw).view(torch.uint8)
    assert torch.equal(bare[~zero_blocks], s.view(torch.uint8)[~zero_blocks]) and (bare[zero_blocks] == 0).all()


# ---- GPU ------------------------------------------------------------------------------------------

def _quack_fast():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    return pytest.importorskip("svdq_linear.backends.sm90.quack_fast")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(128, 256), (192, 384), (3072, 3072)])
def test_gpu_fast_gemm_reads_back_the_fast_weight_exactly(n, k):
    qf = _quack_fast()
    q, s = _weight(n, k, seed=3)
    w8, nw = nvfp4.fast_weight(q, s)
    fw = qf.prepare(q.cuda(), s.cuda(), torch.ones(n, device="cuda"), None)
    # token i is 448 at k = i: each output is one weight times nw, no accumulation to round
    m = min(k, 512)
    a8 = torch.zeros(m, k, dtype=torch.float32)
    a8[torch.arange(m), torch.arange(m)] = 448.0
    a8 = a8[:, [128 * (p // 128) + _logical_k(p % 128) for p in range(k)]]  # the GEMM's k order
    a8 = a8.to(torch.float8_e4m3fn).cuda()
    sa = torch.full((m,), 1.0 / 448, device="cuda")
    y = qf.gemm(a8, sa, fw, None).float().cpu()
    want = (w8.float()[:, :m] * nw[:, None]).T
    bf16 = want.bfloat16().float()
    bad = (y != bf16) & ~(torch.isnan(y) & torch.isnan(bf16))
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs differ, first {bad.nonzero()[:4].tolist()}"


def _fast_bound(m, x, a8, sa):
    """|y - y_fast| bound: the exact mode's low-rank and output allowances plus FP8 accumulation with
    a 2**-13 relative error per k32 step of the running sum (Hopper's FP8 accumulator)."""
    w8, nw = nvfp4.fast_weight(m.qweight.cpu(), m.wscales.cpu())
    main = (a8.double().abs() @ w8.double().abs().T) * sa.double()[:, None] * (nw.double() * m.wcscale.double().cpu())
    steps = x.shape[1] // 32
    xs = nvfp4.smooth_input(x.cpu(), m.smooth.cpu()).double()
    low = (xs.abs() @ m.proj_down.double().cpu().abs()) @ m.proj_up.double().cpu().abs().T * (4 * 2.0**-8)
    return main * steps * 2.0**-13 + low


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 200, 1000, 4096])
@pytest.mark.parametrize("k,n,r,dtype", [(3072, 3072, 32, torch.bfloat16), (512, 384, 0, torch.bfloat16),
                                         (1024, 256, 128, torch.float16), (768, 320, 20, torch.bfloat16), (512, 256, 48, torch.bfloat16),
                                         (1024, 3072, 96, torch.bfloat16),
                                         (512, 256, 192, torch.bfloat16)])
def test_gpu_fast_linear_matches_the_fast_formula(tokens, k, n, r, dtype):
    _quack_fast()
    from test_conformance import random_w4a4

    torch.manual_seed(tokens + k + r)
    m = random_w4a4(k, n, r, dtype, "cuda")
    if r == 96:  # a fused q/k/v: block-diagonal proj_up, each third of the rows on its own 32 columns
        with torch.no_grad():
            mask = torch.block_diag(*[torch.ones(n // 3, 32)] * 3).to(m.proj_up)
            m.proj_up.mul_(mask)
    m.set_mode("fast")
    x = torch.randn(tokens, k, device="cuda", dtype=dtype)
    backend = backends.choose(m, x)
    assert backend.name == "sm90"
    _assert_fast_formula(m, x, backend.linear(m, x, backend.prepare(m, x.device)))


def _assert_fast_formula(m, x, y):
    y, dtype = y.double().cpu(), x.dtype
    args = (m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias)
    want = nvfp4.w4a8_fast_linear(x.cpu(), *[t.cpu() if t is not None else None for t in args], torch.float64)
    a8, sa = nvfp4.fast_act(nvfp4.smooth_input(x.cpu(), m.smooth.cpu()))
    eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    bound = _fast_bound(m, x, a8, sa) + eps * want.abs() + 1e-30
    assert y.isfinite().all()
    err = (y - want).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,r", [(256, 32), (4096, 32), (1000, 0), (4608, 96)])
def test_gpu_compiled_fast_mode_fuses_its_pass_with_the_same_bits(tokens, r, monkeypatch):
    """``SVDQ_SM90_COMPILER_PASS=1``: a compiled fast-mode call traces its activation pass as PyTorch
    ops and calls only the GEMM op. Compiled, the pass writes the Triton pass's bytes; the layer meets
    the fast formula; with a layer norm before it (fused by inductor) it stays close to the eager
    layer on the eager norm's output (the compiled norm rounds differently); eager calls are unchanged."""
    _quack_fast()
    from test_conformance import random_w4a4

    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import fast_layout, kernels

    torch.manual_seed(tokens + r)
    m = random_w4a4(3072, 3072, r, torch.bfloat16, "cuda")
    if r == 96:  # a fused q/k/v
        with torch.no_grad():
            m.proj_up.mul_(torch.block_diag(*[torch.ones(1024, 32)] * 3).to(m.proj_up))
    m.set_mode("fast")
    x = torch.randn(tokens, 3072, device="cuda", dtype=torch.bfloat16) * 3
    inv = (1.0 / m.smooth.float()).contiguous()
    xn = torch.nn.functional.layer_norm(x, (3072,))
    a8, sa = kernels.quantize_act_fp8(xn, m.smooth, inv_smooth=inv, gemm_order=True)
    ca8, csa = torch.compile(lambda t: fast_layout.fast_act_ops(t, inv), fullgraph=True)(xn)
    assert torch.equal(csa, sa) and torch.equal(ca8.view(torch.uint8), a8.view(torch.uint8))

    calls = []
    run = sm90.Sm90Backend.run_fast_gemm
    monkeypatch.setattr(sm90.Sm90Backend, "run_fast_gemm", lambda self, *a: calls.append(1) or run(self, *a))
    monkeypatch.setenv(sm90.ENV_COMPILER_PASS, "1")
    y_eager = m(xn)
    assert not calls, "an eager call left the Triton pass"
    _assert_fast_formula(m, xn, y_eager)
    torch._dynamo.reset()
    y = torch.compile(m, fullgraph=True)(xn)
    assert calls, "the compiled call did not take the GEMM entry point"
    _assert_fast_formula(m, xn, y)
    torch._dynamo.reset()
    y_ln = torch.compile(lambda t: m(torch.nn.functional.layer_norm(t, (3072,))), fullgraph=True)(x)
    rel = ((y_ln.float() - y_eager.float()).norm() / y_eager.float().norm()).item()
    assert rel < 2e-2, rel
    torch._dynamo.reset()
    be = backends.get_backend("sm90")
    p = be.prepare(m, x.device)
    extra, la = p.quack.tensors(), None
    if r:
        extra = [p.proj_up_bf16, p.lowrank_segments, *extra]
        la = kernels.quantize_act_fp8(xn, m.smooth, lora=xn @ p.proj_down_smoothed, gemm_order=True)[2]
    torch.library.opcheck(backends.w4a8_fast_gemm, (a8, sa, la, extra, torch.bfloat16, "sm90"),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.gpu
@pytest.mark.parametrize("r", [32, 128])
def test_gpu_fast_linear_on_the_narrow_prefill_tile(r):
    """4352 tokens x 3072 rows: 128 x 256 tiles would leave the last wave 77 % full, so the GEMM takes
    128 x 208 tiles, with the low-rank operands copied into shared memory in 16-row passes."""
    from svdq_linear.backends.sm90 import tuning

    assert tuning.prefill_tiles(4352, 3072) == (128, 208)
    test_gpu_fast_linear_matches_the_fast_formula(4352, 3840, 3072, r, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 33, 64])
def test_gpu_fast_small_m_on_warp_tensor_cores(tokens, monkeypatch):
    """``SVDQ_SM90_SMALL_M_MMA=1``: up to 64 tokens take ``small_m_mma.linear_fast`` (the table decode
    feeding ``mma.sync``), held to the same bound as the FP8 GEMM."""
    from svdq_linear.backends.sm90 import ENV_FAST_ONE_LAUNCH, ENV_SMALL_M_MMA

    monkeypatch.setenv(ENV_SMALL_M_MMA, "1")
    monkeypatch.setenv(ENV_FAST_ONE_LAUNCH, "0")  # one token would take the one-launch kernel
    test_gpu_fast_linear_matches_the_fast_formula(tokens, 3072, 3072, 32, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_fast_mode_keeps_one_copy_of_the_codes_and_scales():
    _quack_fast()
    from test_conformance import random_w4a4

    m = random_w4a4(3072, 3072, 32, torch.bfloat16, "cuda").set_mode("fast")
    q, s = m.qweight.clone(), m.wscales.clone()
    x = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    y = m(x)
    assert m._parameters["qweight"].numel() == 0, "the canonical codes stay beside the kernel's blob"
    assert m._parameters["wscales"].numel() == 0, "the canonical scales stay beside the kernel's strip"
    assert torch.equal(m(x), y)
    sd = m.state_dict()
    assert torch.equal(sd["qweight"], q) and torch.equal(sd["wscales"].view(torch.uint8), s.view(torch.uint8))
    assert m._parameters["qweight"].numel() == 0 and m._parameters["wscales"].numel() == 0
    m.set_mode("exact")
    m(x)  # the exact mode's own prepared state (quack's blob and strip) stands in now; the codes rebuild exactly
    assert torch.equal(m.qweight, q), "the canonical codes did not come back bit for bit"
    assert torch.equal(m.state_dict()["qweight"], q)


def test_auto_mode_is_exact_where_no_gpu_kernel_serves_the_fast_mode(monkeypatch):
    monkeypatch.delenv("SVDQ_LINEAR_MODE", raising=False)
    m = SVDQW4A4Linear(256, 128, rank=8)
    assert m.mode == "auto" and m.kind == "w4a4"  # the CPU: the reference does not count as native
    monkeypatch.setattr(backends, "fast_mode_is_native", lambda device, preferred=None: True)
    assert m.kind == "w4a4_fast"
    assert m.set_mode("exact").kind == "w4a4"  # the module's own setting wins
    monkeypatch.setenv("SVDQ_LINEAR_MODE", "exact")
    assert m.set_mode(None).kind == "w4a4"


@pytest.mark.gpu
def test_gpu_auto_mode_runs_the_fast_kernel_on_hopper(monkeypatch):
    _quack_fast()
    monkeypatch.delenv("SVDQ_LINEAR_MODE", raising=False)
    m = SVDQW4A4Linear(512, 256, rank=16).to("cuda", torch.bfloat16)
    assert m.kind == "w4a4_fast"
    assert backends.choose(m, torch.empty(4, 512, device="cuda", dtype=torch.bfloat16)).name == "sm90"
    monkeypatch.setenv("SVDQ_LINEAR_BACKEND", "reference")
    assert SVDQW4A4Linear(512, 256, rank=16).to("cuda").kind == "w4a4"  # a pinned reference keeps the contract


def test_prepared_state_hands_the_kernels_back_what_they_were_given():
    """``run_w4a4_fast`` rebuilds the kernel's weight and ``1 / smooth`` from the op's trailing tensors."""
    qf = pytest.importorskip("svdq_linear.backends.sm90.quack_fast")
    from svdq_linear.backends.sm90 import Sm90Prepared

    q, s = _weight(128, 256)
    fw = qf.prepare(q, s, torch.rand(128) + 0.5, torch.randn(128))
    pds, up = torch.randn(256, 8).bfloat16(), torch.randn(128, 8).bfloat16()
    inv = 1.0 / (torch.rand(256) + 0.5)
    extra = Sm90Prepared(pds, up, fw, None, inv).tensors()
    assert extra[-1] is inv  # run_w4a4_fast takes inv_smooth from the end, then the weight before it
    back = qf.weight(extra[-5:-1])
    assert extra[0] is pds and extra[1] is up
    assert back is fw, "the op's tensors did not find the prepared weight (and its launch cache) again"
    other = qf.weight([t.clone() for t in extra[-5:-1]])  # equal tensors, other objects: a fresh weight
    assert other is not fw and other.warm is None and torch.equal(other.blob, fw.blob)  # caches nothing
    fw_id = id(fw.blob)
    del fw, back, extra
    import gc

    gc.collect()
    from svdq_linear.backends.sm90 import quack_launch

    assert fw_id not in quack_launch._WEIGHTS, "the registry kept a dropped weight alive"
    back = qf.prepare(q, s, torch.rand(128) + 0.5, torch.randn(128))
    w8, nw = nvfp4.fast_weight(q, s)
    assert torch.equal(fast_layout.emulate_decode(back.blob, back.strip).view(torch.uint8), w8.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("tokens", [7, 1000])
def test_gpu_autocast_leaves_the_sm90_kernels_alone(mode, tokens):
    """Under CUDA autocast (bf16 or fp16) an sm90 layer and its weight-only sibling give the bits they give the input
    cast to the region's dtype without autocast, in that dtype (as ``nn.Linear``): the ops turn autocast off for
    their bodies, and the kernels' own dtypes hold."""
    _quack_fast()
    from svdq_linear import NVFP4W4A16Linear
    from test_conformance import random_w4a4

    torch.manual_seed(tokens)
    m = random_w4a4(1024, 768, 32, torch.bfloat16, "cuda").set_mode(mode)
    w16 = NVFP4W4A16Linear.from_linear(torch.nn.Linear(1024, 256)).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    assert backends.choose(m, x).name == "sm90"
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float16):
            want, want16 = m(x.to(dtype)), w16(x.to(dtype))
            with torch.autocast("cuda", dtype=dtype):
                got, got16 = m(x), w16(x)
                got32 = m(x.float())  # an fp32 stream under autocast takes the 16-bit kernels
            assert got.dtype == got16.dtype == got32.dtype == dtype, dtype
            assert torch.equal(got, want) and torch.equal(got16, want16) and torch.equal(got32, want), dtype
