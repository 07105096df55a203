"""Triton kernels of the sm90 backend: fused NVFP4 activation quantization and the W4 GEMM.

Hopper has no FP4 tensor cores, but E2M1 codes times E4M3 scales are exact in bf16 and fp16 and
their products are exact in FP32, so the exact W4A4 product runs on 16-bit wgmma:

- ``quantize_act``: one pass over ``x [M, K]``: ``xs = x * (1/smooth)``, the per-16 amax, the E4M3
  scale, the E2M1 codes under the contract's rules (``svdq_linear.nvfp4``), writing the exact 16-bit
  dequantized activations ``xq`` that the GEMM reads (or packed codes + scale bytes). ``lora_act``
  comes from one cuBLAS GEMM on ``x`` with ``proj_down / smooth`` folded at prepare time
  (``lora_act`` here is the one-launch candidate to replace it).
- ``quantize_act_fp8``: the fast mode's per-token E4M3 activations, whole rows in registers (one read
  of x).
- ``w4_gemm``: ``out [M, N] = (a @ Wq^T) * wcscale (+ lora_act @ proj_up^T) (+ bias)``. The kernel
  computes the transposed tile ``acc [BLOCK_N, BLOCK_M]``: the 4-bit weight is decoded in registers
  (A operand of wgmma; weight rows fill wgmma's 64-row M), the activations are the shared-memory B
  operand, so a handful of tokens still gives full-width MMAs. After the K-loop the accumulator is
  scaled by ``wcscale`` and the low-rank product is issued into the same accumulator, then ``bias`` is
  added and the tile is written once. With ``SPLIT_K > 1`` each split writes fp32 partials and
  ``_splitk_epilogue_kernel`` sums them in a fixed order (deterministic) and applies the same epilogue.

The E2M1 decode places the 3 magnitude bits at fp32 bits 24..22 and the sign at bit 31: that float
times 2**126 is exactly the E2M1 value (code 1, the subnormal, included).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ... import nvfp4

if TYPE_CHECKING:
    from .tuning import GemmConfig

try:  # programmatic dependent launch (sm_90+): Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: no PDL launches (pdl_supported() is False)
    gdc_launch_dependents = gdc_wait = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_e4m3(v):
    """Non-negative finite fp32 -> the nearest E4M3 value (ties to even, saturating at 448), as fp32.

    Arithmetic rather than a conversion instruction, so it is exact the same way everywhere
    (Triton's CPU interpreter mis-rounds conversions that carry into the exponent).
    """
    bits = v.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of fp32's 23 mantissa bits, nearest-even; a carry moves into the exponent.
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormal range (< 2**-6): multiples of 2**-9, nearest-even through the 1.5 * 2**23 trick.
    sub = ((v * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.minimum(tl.where(v < 0.015625, sub, normal), 448.0)


@triton.jit
def _e4m3_bits(q):
    """fp32 ``q`` -> its E4M3 byte (uint8) by arithmetic: nearest even, saturating at 448, the sign bit
    set from q's (of -0.0 too), NaN and +-Inf -> 0x7F (``nvfp4.round_e4m3``). The rounded magnitude is
    an exact E4M3 value, so the cast does not round."""
    a = tl.abs(q)
    finite = a < float("inf")  # false for NaN too
    v = _round_e4m3(tl.where(finite, a, 0.0)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    v = v | (((q.to(tl.int32, bitcast=True) >> 31) & 1) << 7).to(tl.uint8)
    return tl.where(finite, v, 0x7F)


@triton.jit
def _gelu_tanh(v):
    """PyTorch's ``gelu(v, approximate="tanh")`` = 0.5 v (1 + tanh(u)), u = sqrt(2/pi) (v + 0.044715 v^3),
    computed as v * sigmoid(2 u) = v / (1 + 2**(-2 u log2(e))): one exp2 and one division, a few fp32
    ulps from the exact value everywhere (0.5 v (1 + tanh u) in fp32 cancels below v ~ -3). The same
    special values: -0.0 for large negative v, v for large positive, NaN for -Inf and NaN."""
    u = 0.7978845608028654 * (v + 0.044715 * (v * v * v))
    return v / (1.0 + tl.exp2(u * -2.8853900817779268))


@triton.jit
def _round_to(v, like_ptr, RNE_BITS: tl.constexpr):
    """fp32 ``v`` rounded to nearest even in the element type of ``like_ptr`` (bf16 or fp16), back in
    fp32: the value a 16-bit tensor would hold. RNE_BITS (Triton's CPU interpreter, whose fp32 -> bf16
    conversion truncates): bf16 by integer arithmetic."""
    if RNE_BITS and like_ptr.dtype.element_ty == tl.bfloat16:
        return _rne_bf16(v)
    return v.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rne_bf16(v):
    """fp32 ``v`` rounded to bf16 (nearest even; NaN kept), back in fp32, by integer arithmetic."""
    bits = v.to(tl.int32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000
    return tl.where(v == v, r, v)


@triton.jit
def _nvfp4_block_scales(xb):
    """Blocks ``xb [rows, blocks, 16]`` (fp32) -> ``(finite, sf, r)`` ``[rows, blocks]``: whether the block holds
    no NaN or Inf, its E4M3 scale ``round_e4m3(amax / 6)`` (0 where not finite) and ``1 / sf`` (0 for a zero
    scale), the contract's rules (``nvfp4.quantize_nvfp4``). The block max is taken on the magnitudes' bits:
    integer order is float order for non-negative floats, and +-Inf and every NaN lie at or above 0x7F800000, so
    one integer max also tells a finite block."""
    mb = tl.max(xb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    finite = mb < 0x7F800000
    sdiv = tl.math.div_rn(mb.to(tl.float32, bitcast=True), tl.full(mb.shape, 6.0, tl.float32))
    sf = tl.where(finite, _round_e4m3(sdiv), 0.0)
    r = tl.where(sf > 0, tl.math.div_rn(tl.full(mb.shape, 1.0, tl.float32), sf), 0.0)
    return finite, sf, r


@triton.jit
def _e2m1_mag(a):
    """Non-negative ``a`` (a value over its block scale) -> the nearest-even E2M1 magnitude code 0..7: the
    midpoints 0.25 (down), 0.75 (up), 1.25, 1.75, 2.5, 3.5, 5 alternate."""
    return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))


@triton.jit
def _nvfp4_tile(x, smooth_ptr, rk, k_ok, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INV: tl.constexpr = False):
    """A tile ``x [BLOCK_M, BLOCK_K]`` (fp32, columns ``rk``) over ``smooth``, in NVFP4 blocks: ``(finite, sf, q)``,
    the blocks' ``_nvfp4_block_scales`` and ``q [BLOCK_M, BLOCK_K / 16, 16]``, each value over its block's
    scale (the reciprocal rule of the contract: ``x * (1 / smooth)``, then ``* (1 / sf)``). INV: ``smooth_ptr``
    holds ``1 / smooth`` already (fp32, the IEEE quotient, as the backend caches it), so no division a column."""
    sm = tl.load(smooth_ptr + rk, mask=k_ok, other=1.0)
    if not INV:
        sm = tl.math.div_rn(tl.full([BLOCK_K], 1.0, tl.float32), sm)
    xs = x * sm[None, :]
    xb = tl.reshape(xs, (BLOCK_M, BLOCK_K // 16, 16))
    finite, sf, r = _nvfp4_block_scales(xb)
    return finite, sf, xb * r[:, :, None]


@triton.jit
def _nvfp4_dequant(q, finite, sf):
    """The exact dequantized NVFP4 values ``[rows, blocks, 16]`` (fp32) of ``q`` (each value over its block
    scale, signed), blocks' ``finite`` and scales ``sf`` (``_nvfp4_block_scales``): the nearest-even E2M1
    value times the scale, NaN in a block that held NaN or Inf.

    One rounding by a magic constant: on [0, 2] the E2M1 grid is the multiples of 0.5, on [2, 4] of 1, on
    [4, 6] of 2, and its ties to even are those of the multiples (the contract's alternating midpoints
    0.25 down, 0.75 up, 1.25, 1.75, 2.5, 3.5, 5). Adding ``c = 1.5 * 2**23`` times that step rounds to
    it, nearest even, for either sign (``c / step`` is even); subtracting ``c`` is exact. The step is
    half the power of two of ``max(|q|, 1)``, read from its exponent bits. ``q`` is clamped to +-6 first,
    which is E2M1's saturation. Only the sign of a zero is lost; it is put back as ``q < 0``."""
    qc = tl.minimum(tl.maximum(q, -6.0), 6.0)
    e = tl.maximum(tl.abs(qc), 1.0).to(tl.int32, bitcast=True) & 0x7F800000
    c = (e + 0x0B400000).to(tl.float32, bitcast=True)  # 1.5 * 2**22 * 2**floor(log2 max(|q|, 1))
    v = (qc + c) - c
    # the sign of q < 0 (-0.0 + 0.0 is +0.0): the contract's code for -0.0 is +0. On the GPU the add contracts
    # with q's product into one FFMA, which keeps the minus of a nonzero product rounding to zero: a zero code's
    # sign, which the contract leaves open (nvfp4's docstring, item 4)
    sgn = (q + 0.0).to(tl.int32, bitcast=True) & -2147483648
    v = (v.to(tl.int32, bitcast=True) | sgn).to(tl.float32, bitcast=True)
    # NaN a block that held NaN or Inf (the GPU's canonical NaN: a product with a NaN factor)
    return v * tl.where(finite != 0, sf, float("nan"))[:, :, None]


@triton.jit
def _quantize_act_kernel(
    x_ptr, smooth_ptr, xq_ptr, codes_ptr, scales_ptr,
    M, K, stride_xm, stride_xk, xb_ptr, KA, stride_bm, lora_ptr, la_ptr, R,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_XQ: tl.constexpr, WRITE_CODES: tl.constexpr,
    HAS_B: tl.constexpr = False, GELU_B: tl.constexpr = False, RNE_BITS: tl.constexpr = False,
    AFTER_LORA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16, NSPLIT: tl.constexpr = 1, INV: tl.constexpr = False,
):
    # One [BLOCK_M, BLOCK_K] tile a program: every byte is read once and the grid fills the GPU.
    # HAS_B: the row is cat([x, gelu(xb)]) read from its two sources (x: the first KA columns, KA a
    # multiple of BLOCK_K, so a tile lies in one of them; xb with unit stride along K), GELU applied
    # as xb loads (GELU_B) and rounded to xb's dtype as the written tensor would hold it.
    # AFTER_LORA: launched as the programmatic dependent of lora_act(pdl=True), which waited for x before it
    # let this grid start, so the tiles are read without a wait and both read x at once. The programs of
    # the last k-tile (the grid's last to start) then wait for lora_act's grid and add its [NSPLIT, M, R]
    # fp32 partials of their rows in split order into la [M, R] (bf16, one rounding); this grid ends after
    # lora_act's, so the GEMM launched after it waits for both.
    if AFTER_LORA:
        gdc_launch_dependents()
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    m_ok = rm < M
    k_ok = rk < K  # K % 16 == 0: whole blocks are in or out
    mask = m_ok[:, None] & k_ok[None, :]
    if HAS_B:
        if k0 >= KA:
            x = tl.load(xb_ptr + rm[:, None] * stride_bm + (rk - KA)[None, :], mask=mask, other=0.0).to(tl.float32)
            if GELU_B:
                x = _round_to(_gelu_tanh(x), xb_ptr, RNE_BITS)
        else:
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    finite, sf, q = _nvfp4_tile(x, smooth_ptr, rk, k_ok, BLOCK_M, BLOCK_K, INV)
    if WRITE_XQ:
        v = _nvfp4_dequant(q, finite, sf)
        tl.store(xq_ptr + rm[:, None] * K + rk[None, :], tl.reshape(v, (BLOCK_M, BLOCK_K)).to(xq_ptr.dtype.element_ty),
                 mask=mask)
    if WRITE_CODES:
        code = tl.reshape(_e2m1_mag(tl.abs(q)) | ((q < 0).to(tl.int32) << 3), (BLOCK_M, BLOCK_K // 2, 2))
        lo, hi = tl.split(code)
        rk2 = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        tl.store(codes_ptr + rm[:, None] * (K // 2) + rk2[None, :], (lo | (hi << 4)).to(tl.uint8),
                 mask=m_ok[:, None] & (rk2 < K // 2)[None, :])
        sbits = tl.where(finite != 0, sf.to(tl.float8e4nv).to(tl.uint8, bitcast=True), 0x7F)  # exact cast
        rks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        tl.store(scales_ptr + rm[:, None] * (K // 16) + rks[None, :], sbits,
                 mask=m_ok[:, None] & (rks < K // 16)[None, :])
    if AFTER_LORA:
        if tl.program_id(1) == tl.num_programs(1) - 1:
            gdc_wait()
            _scale_lora(lora_ptr, la_ptr, rm, m_ok, tl.full([BLOCK_M], 1.0, tl.float32), M, R, BLOCK_M, BLOCK_R,
                        NSPLIT)


@triton.jit
def _quantize_act_lora_kernel(
    x_ptr, smooth_ptr, xq_ptr, pd_ptr, lora_ptr, part_ptr, cnt_ptr, M, K, R, stride_xm, stride_xk, K_SPLIT, SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, IS_SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    NUM_STAGES: tl.constexpr = 1, INV: tl.constexpr = False,
):
    # The exact pass and lora_act in one read of x. Program (i, s): rows [i BLOCK_M, (i + 1) BLOCK_M), the
    # columns [s K_SPLIT, (s + 1) K_SPLIT) in BLOCK_K steps. Each step writes its tile's dequantized values
    # (the arithmetic of _quantize_act_kernel) and adds x.to(bf16) @ pds over its columns on tensor cores.
    # IS_SPLIT (SPLIT > 1): each program writes its fp32 partial [BLOCK_M, R]; the last of a row block to count
    # itself in (an atomic counter, nobody waits) adds the SPLIT partials in split order (a fixed order), writes
    # lora_act in lora_ptr's dtype and leaves the counter at zero. DOT_F32: the CPU interpreter (its products and its
    # rounding to bf16 done as the GPU does them: _lora_dot, _round_to).
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    m_ok = rm < M
    r_ok = rr < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    kb = pid_s * K_SPLIT
    for k0 in tl.range(kb, tl.minimum(kb + K_SPLIT, K), BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K  # K % 16 == 0: whole blocks are in or out
        mask = m_ok[:, None] & k_ok[None, :]
        xin = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=mask, other=0.0)
        finite, sf, q = _nvfp4_tile(xin.to(tl.float32), smooth_ptr, rk, k_ok, BLOCK_M, BLOCK_K, INV)
        v = _nvfp4_dequant(q, finite, sf)
        tl.store(xq_ptr + rm[:, None] * K + rk[None, :], tl.reshape(v, (BLOCK_M, BLOCK_K)).to(xq_ptr.dtype.element_ty),
                 mask=mask)
        w = tl.load(pd_ptr + rk[:, None] * R + rr[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = _lora_dot(xin, w, acc, DOT_F32)
    out_mask = m_ok[:, None] & r_ok[None, :]
    if not IS_SPLIT:
        lora = _round_to(acc, lora_ptr, DOT_F32).to(lora_ptr.dtype.element_ty)
        tl.store(lora_ptr + rm[:, None] * R + rr[None, :], lora, mask=out_mask)
    else:
        total, last = _split_total(acc, part_ptr, cnt_ptr, pid_m, pid_s, rm, rr, out_mask, M, R, SPLIT, BLOCK_M,
                                   BLOCK_R)
        if last:
            tl.store(lora_ptr + rm[:, None] * R + rr[None, :],
                     _round_to(total, lora_ptr, DOT_F32).to(lora_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_total(acc, part_ptr, cnt_ptr, pid_m, pid_s, rm, rr, out_mask, M, R, SPLIT, BLOCK_M: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    # Split-K sums of a [BLOCK_M, BLOCK_R] fp32 tile (lora_act), a fixed order for any timing: program (pid_m, pid_s)
    # writes its partial; the last of row block pid_m to count itself in (an atomic counter, nobody waits) adds the
    # SPLIT partials in split order and leaves the counter at zero for the next call. Returns (sum, is the last).
    tl.store(part_ptr + pid_s.to(tl.int64) * M * R + rm[:, None] * R + rr[None, :], acc, mask=out_mask)
    tl.debug_barrier()  # every thread's partial is written before the counter moves
    last = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel") == SPLIT - 1
    total = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    if last:
        part = part_ptr + rm[:, None] * R + rr[None, :]
        for _ in range(SPLIT):
            total += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
            part += M * R  # (pointer arithmetic: 64-bit)
        tl.store(cnt_ptr + pid_m, 0)  # no other program touches the counter again in this launch
    return total, last


@triton.jit
def _gemm_k(pos, GEMM_ORDER: tl.constexpr):
    """The logical column that position ``pos`` of the fast GEMM's k order holds (``fast_layout``: in-tile
    bits ``[B b0 h c1 c0 j1 j0]`` of the position are ``[c1 c0 B b0 h j1 j0]`` of the column); runs of
    four stay contiguous."""
    if GEMM_ORDER:
        k = (pos & ~127) | (pos & 3) | (((pos >> 4) & 7) << 2) | (((pos >> 2) & 3) << 5)
        return tl.max_contiguous(tl.multiple_of(k, 4), 4)
    return pos


@triton.jit
def _scale_lora(lora_ptr, la_ptr, rm, m_ok, sa, M, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                NSPLIT: tl.constexpr):
    # la = lora_act / sa, rounded once to bf16: the fast mode's operand of the low-rank MMA that joins
    # the accumulator before the epilogue multiplies it by sa (quack_lowrank). NSPLIT > 1: lora_act
    # comes as [NSPLIT, M, R] fp32 partial sums over K (lora_act(split=)), added here in split order.
    rr = tl.arange(0, BLOCK_R)
    mask = m_ok[:, None] & (rr < R)[None, :]
    lo = tl.load(lora_ptr + rm[:, None] * R + rr[None, :], mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, NSPLIT):
        lo += tl.load(lora_ptr + s * M * R + rm[:, None] * R + rr[None, :], mask=mask, other=0.0)
    q = tl.math.div_rn(lo, tl.broadcast_to(sa[:, None], (BLOCK_M, BLOCK_R)))
    tl.store(la_ptr + rm[:, None] * R + rr[None, :], q.to(tl.bfloat16), mask=mask)


@triton.jit
def _quantize_act_fp8_kernel(
    x_ptr, smooth_ptr, a8_ptr, sa_ptr, lora_ptr, pds_ptr, la_ptr, M, K, R, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, HAS_LORA: tl.constexpr,
    FUSE_LORA: tl.constexpr, DOT_F32: tl.constexpr, GEMM_ORDER: tl.constexpr, NSPLIT: tl.constexpr,
):
    # The fast mode's per-token E4M3 activations: the row max first, then one more pass that
    # quantizes (the second read of a row block comes from L2). FUSE_LORA: the first pass also
    # accumulates lora_act = x @ (proj_down / smooth) on tensor cores from the x it reads anyway.
    # GEMM_ORDER: the second pass reads the columns in the fast GEMM's k order and writes a8 in it.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    amax = tl.zeros([BLOCK_M], tl.float32)
    nan = tl.zeros([BLOCK_M], tl.int32)
    rr = tl.arange(0, BLOCK_R)
    lacc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    # plain loops: software-pipelined (tl.range num_stages=3) Triton 3.6 wrote wrong la / codes on the
    # H200 at 64-row blocks (docs/perf.md, 2026-12-04 fifth session)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        sm = tl.load(smooth_ptr + rk, mask=k_ok, other=1.0)
        xs = tl.abs(x * tl.math.div_rn(tl.full([BLOCK_K], 1.0, tl.float32), sm)[None, :])
        amax = tl.maximum(amax, tl.max(tl.where(xs == xs, xs, 0.0), axis=1))
        nan = tl.maximum(nan, tl.max((xs != xs).to(tl.int32), axis=1))
        if FUSE_LORA:
            pd = tl.load(pds_ptr + rk[:, None] * R + rr[None, :], mask=k_ok[:, None] & (rr < R)[None, :], other=0.0)
            if DOT_F32:  # Triton's CPU interpreter multiplies bf16 operands wrongly; same values in fp32
                lacc += tl.dot(x.to(tl.bfloat16).to(tl.float32), pd.to(tl.float32))
            else:
                lacc += tl.dot(x.to(tl.bfloat16), pd)
    # as nvfp4.fast_act: 1 for an all-zero row and where the max is NaN
    ok = (amax > 0) & (nan == 0)
    sa = tl.where(ok, tl.math.div_rn(amax, tl.full([BLOCK_M], 448.0, tl.float32)), 1.0)
    r = tl.minimum(tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), sa), 3.4028234663852886e38)
    tl.store(sa_ptr + rm, sa, mask=m_ok)
    if FUSE_LORA:
        la = tl.math.div_rn(lacc, tl.broadcast_to(sa[:, None], (BLOCK_M, BLOCK_R)))
        tl.store(la_ptr + rm[:, None] * R + rr[None, :], la.to(tl.bfloat16), mask=m_ok[:, None] & (rr < R)[None, :])
    elif HAS_LORA:
        _scale_lora(lora_ptr, la_ptr, rm, m_ok, sa, M, R, BLOCK_M, BLOCK_R, NSPLIT)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        mask = m_ok[:, None] & k_ok[None, :]
        lk = _gemm_k(rk, GEMM_ORDER)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + lk[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        sm = tl.load(smooth_ptr + lk, mask=k_ok, other=1.0)
        q = (x * tl.math.div_rn(tl.full([BLOCK_K], 1.0, tl.float32), sm)[None, :]) * r[:, None]
        tl.store(a8_ptr + rm[:, None] * K + rk[None, :], _e4m3_bits(q), mask=mask)


ROW_MAX_K = 16384  # the one-pass FP8 kernel holds a row block of up to this many columns in registers
LORA_SCALE_ROWS = 32  # _lora_scale_kernel's rows a program


@triton.jit
def _fp8_row_scale(mx, rm, m_ok, sa_ptr, lora_ptr, la_ptr, M, R, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                   HAS_LORA: tl.constexpr, NSPLIT: tl.constexpr):
    # From the rows' max magnitudes (their bits, mx [ROWS]): sa stored (as nvfp4.fast_act: 1 for an
    # all-zero row and where a NaN is in the row), la = lora / sa (HAS_LORA), and returned the factor
    # r = min(1 / sa, FLT_MAX) [ROWS, 1] (a row max below 448 / FLT_MAX would overflow 1 / sa) and
    # whether a NaN or +-Inf is in the block's rows (the stores' ``special``)
    ok = (mx > 0) & (mx <= 0x7F800000)
    sa = tl.where(ok, tl.math.div_rn(mx.to(tl.float32, bitcast=True), tl.full([ROWS], 448.0, tl.float32)), 1.0)
    tl.store(sa_ptr + rm, sa, mask=m_ok)
    if HAS_LORA:
        _scale_lora(lora_ptr, la_ptr, rm, m_ok, sa, M, R, ROWS, BLOCK_R, NSPLIT)
    r = tl.minimum(tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), sa), 3.4028234663852886e38)[:, None]
    return r, tl.max((mx >= 0x7F800000).to(tl.int32), axis=0) > 0


@triton.jit
def _fp8_src_load(src_ptr, inv_ptr, rm, m_ok, stride_m, BASE, KS, J: tl.constexpr, C: tl.constexpr,
                  GEMM_ORDER: tl.constexpr, GELU: tl.constexpr, RNE_BITS: tl.constexpr):
    # positions [J*C, J*C + C) of one source's KS columns (the columns themselves, or those the fast
    # GEMM's k order puts there), which sit at BASE + those in the row; GELU: the source holds GELU's
    # input, rounded to its dtype after GELU as a tensor would hold it; then smoothed: xs = x * (1 /
    # smooth) in fp32
    rk = J * C + tl.arange(0, C)
    k_ok = rk < KS
    lk = _gemm_k(rk, GEMM_ORDER)
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(src_ptr + rm[:, None] * stride_m + lk[None, :], mask=mask, other=0.0)
    v = x.to(tl.float32)
    if GELU:
        v = _round_to(_gelu_tanh(v), src_ptr, RNE_BITS)
    # loaded in x's own shape (each row's copy from L1) so that it lands in x's register layout: a
    # [C] load would be moved into it through shared memory
    inv = tl.load(inv_ptr + BASE + (lk[None, :] + 0 * rm[:, None]), mask=mask, other=1.0)
    return v * inv


@triton.jit
def _fp8_src_store(a8_ptr, q, rm, m_ok, K, special, BASE, KS, J: tl.constexpr, C: tl.constexpr,
                   HW_CVT: tl.constexpr, CANON_NAN: tl.constexpr):
    # q [rows, C] (already divided by the row scale) -> E4M3 bytes at the positions BASE + [J*C, J*C + C)
    # of a8's rows (those below BASE + KS); special: a NaN or +-Inf is in the block's rows (a runtime
    # scalar, uniform over the program)
    rk = J * C + tl.arange(0, C)
    mask = m_ok[:, None] & (rk < KS)[None, :]
    ptrs = a8_ptr + rm[:, None] * K + (BASE + rk)[None, :]
    if HW_CVT:
        # the hardware convert rounds to nearest even and saturates at 448 as the contract does, keeps
        # the sign (of -0.0 too). CANON_NAN: +-Inf becomes NaN (the convert would saturate it to 448) and
        # every NaN the positive one (0x7F). q holds Inf or NaN only where ``special`` says so (a NaN or
        # Inf in the rows: sa = 1 with the Inf kept, or sa = Inf; r is finite, min(1 / sa, FLT_MAX)),
        # so other blocks skip the two instructions a value.
        if CANON_NAN:
            if special:
                q = q + q * 0.0  # +-Inf -> NaN, every other value (-0.0 included) unchanged
                q = tl.where(q == q, q, float("nan"))
        tl.store(ptrs, q.to(tl.float8e4nv), mask=mask)
    else:  # Triton's interpreter mis-rounds conversions that carry into the exponent: round by arithmetic
        tl.store(ptrs.to(tl.pointer_type(tl.uint8), bitcast=True), _e4m3_bits(q), mask=mask)


@triton.jit
def _bits_max(xs):
    # |xs| as integer bits: for non-negative floats integer order is float order and every NaN lies above
    # +Inf, so one integer max gives both the row max and "a NaN is here"
    return xs.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _quantize_act_fp8_rows_kernel(
    xa_ptr, xb_ptr, inv_ptr, a8_ptr, sa_ptr, lora_ptr, la_ptr, M, KA, KB, R, stride_am, stride_bm,
    ROWS: tl.constexpr, CA: tl.constexpr, NA: tl.constexpr, CB: tl.constexpr, NB: tl.constexpr,
    BLOCK_R: tl.constexpr, HAS_LORA: tl.constexpr, GELU_B: tl.constexpr, HW_CVT: tl.constexpr,
    CANON_NAN: tl.constexpr, GEMM_ORDER: tl.constexpr, NSPLIT: tl.constexpr, RNE_BITS: tl.constexpr,
    AFTER_LORA: tl.constexpr = False,
):
    # AFTER_LORA: launched as the programmatic dependent of lora_act(pdl=True), which waited for x before it
    # let this grid start: the rows are read without a wait, both grids reading x at once. la is left to
    # _lora_scale_kernel (launched next); the grid's last program waits for lora_act's grid before it ends,
    # so this grid ends after lora_act's.
    if AFTER_LORA:
        gdc_launch_dependents()
    # One pass: ROWS whole rows a program, held in registers and x read once. A row is cat([xa, xb]) (xb
    # alone where NA = 0: quantize_act_fp8's one-pass kernel) read from its sources: xa's KA columns in
    # NA chunks of CA, then xb's KB in NB chunks of CB, GELU applied to xb's values as they load
    # (GELU_B). Each source's chunks are powers of two sized to it (a row of 3 * 2^n columns wastes no
    # lanes; no chunk straddles the two sources; KA % 128 == 0 keeps the k order's tiles inside one).
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_ok = rm < M
    K = KA + KB
    # every load issued before the first row max
    if NA > 0:
        a0 = _fp8_src_load(xa_ptr, inv_ptr, rm, m_ok, stride_am, 0, KA, 0, CA, GEMM_ORDER, False, RNE_BITS)
    if NA > 1:
        a1 = _fp8_src_load(xa_ptr, inv_ptr, rm, m_ok, stride_am, 0, KA, 1, CA, GEMM_ORDER, False, RNE_BITS)
    if NA > 2:
        a2 = _fp8_src_load(xa_ptr, inv_ptr, rm, m_ok, stride_am, 0, KA, 2, CA, GEMM_ORDER, False, RNE_BITS)
    if NA > 3:
        a3 = _fp8_src_load(xa_ptr, inv_ptr, rm, m_ok, stride_am, 0, KA, 3, CA, GEMM_ORDER, False, RNE_BITS)
    b0 = _fp8_src_load(xb_ptr, inv_ptr, rm, m_ok, stride_bm, KA, KB, 0, CB, GEMM_ORDER, GELU_B, RNE_BITS)
    if NB > 1:
        b1 = _fp8_src_load(xb_ptr, inv_ptr, rm, m_ok, stride_bm, KA, KB, 1, CB, GEMM_ORDER, GELU_B, RNE_BITS)
    if NB > 2:
        b2 = _fp8_src_load(xb_ptr, inv_ptr, rm, m_ok, stride_bm, KA, KB, 2, CB, GEMM_ORDER, GELU_B, RNE_BITS)
    if NB > 3:
        b3 = _fp8_src_load(xb_ptr, inv_ptr, rm, m_ok, stride_bm, KA, KB, 3, CB, GEMM_ORDER, GELU_B, RNE_BITS)
    mb = _bits_max(b0)
    if NB > 1:
        mb = tl.maximum(mb, _bits_max(b1))
    if NB > 2:
        mb = tl.maximum(mb, _bits_max(b2))
    if NB > 3:
        mb = tl.maximum(mb, _bits_max(b3))
    mx = tl.max(mb, axis=1)
    if NA > 0:
        ma = _bits_max(a0)
        if NA > 1:
            ma = tl.maximum(ma, _bits_max(a1))
        if NA > 2:
            ma = tl.maximum(ma, _bits_max(a2))
        if NA > 3:
            ma = tl.maximum(ma, _bits_max(a3))
        mx = tl.maximum(mx, tl.max(ma, axis=1))
    r, special = _fp8_row_scale(mx, rm, m_ok, sa_ptr, lora_ptr, la_ptr, M, R, ROWS, BLOCK_R, HAS_LORA, NSPLIT)
    if NA > 0:
        _fp8_src_store(a8_ptr, a0 * r, rm, m_ok, K, special, 0, KA, 0, CA, HW_CVT, CANON_NAN)
        if NA > 1:
            _fp8_src_store(a8_ptr, a1 * r, rm, m_ok, K, special, 0, KA, 1, CA, HW_CVT, CANON_NAN)
        if NA > 2:
            _fp8_src_store(a8_ptr, a2 * r, rm, m_ok, K, special, 0, KA, 2, CA, HW_CVT, CANON_NAN)
        if NA > 3:
            _fp8_src_store(a8_ptr, a3 * r, rm, m_ok, K, special, 0, KA, 3, CA, HW_CVT, CANON_NAN)
    _fp8_src_store(a8_ptr, b0 * r, rm, m_ok, K, special, KA, KB, 0, CB, HW_CVT, CANON_NAN)
    if NB > 1:
        _fp8_src_store(a8_ptr, b1 * r, rm, m_ok, K, special, KA, KB, 1, CB, HW_CVT, CANON_NAN)
    if NB > 2:
        _fp8_src_store(a8_ptr, b2 * r, rm, m_ok, K, special, KA, KB, 2, CB, HW_CVT, CANON_NAN)
    if NB > 3:
        _fp8_src_store(a8_ptr, b3 * r, rm, m_ok, K, special, KA, KB, 3, CB, HW_CVT, CANON_NAN)
    if AFTER_LORA:
        if tl.program_id(0) == tl.num_programs(0) - 1:
            gdc_wait()


@triton.jit
def _lora_scale_kernel(lora_ptr, sa_ptr, la_ptr, M, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                       NSPLIT: tl.constexpr):
    # la = lora_act / sa for the AFTER_LORA pass (_scale_lora), launched as the programmatic dependent of
    # that pass: its wait covers the pass's sa and, through the pass's last program, lora_act's partials.
    gdc_wait()
    gdc_launch_dependents()
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    sa = tl.load(sa_ptr + rm, mask=m_ok, other=1.0)
    _scale_lora(lora_ptr, la_ptr, rm, m_ok, sa, M, R, BLOCK_M, BLOCK_R, NSPLIT)


@triton.jit
def _epilogue(acc, rn, rm, N, M, R, wc_ptr, bias_ptr, up_ptr, lora_ptr, out_ptr, stride_om,
              BLOCK_R: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M]`` -> ``out[rm, rn] = acc * wcscale + lora @ proj_up^T + bias``."""
    n_ok = rn < N
    m_ok = rm < M
    wc = tl.load(wc_ptr + rn, mask=n_ok, other=0.0)
    acc = acc * wc[:, None]
    if HAS_LORA:
        rr = tl.arange(0, BLOCK_R)
        up = tl.load(up_ptr + rn[:, None] * R + rr[None, :], mask=n_ok[:, None] & (rr < R)[None, :], other=0.0)
        lt = tl.load(lora_ptr + rm[None, :] * R + rr[:, None], mask=m_ok[None, :] & (rr < R)[:, None], other=0.0)
        if DOT_F32:
            acc = tl.dot(up.to(tl.float32), lt.to(tl.float32), acc, input_precision="ieee")
        else:  # bf16 operands (the contract allows them): twice tf32's rate
            acc = tl.dot(up.to(tl.bfloat16), lt.to(tl.bfloat16), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _w4_gemm_kernel(
    a_ptr, w_ptr, ws_ptr, wc_ptr, bias_ptr, up_ptr, lora_ptr, out_ptr, part_ptr,
    M, N, K, R, stride_am, stride_om, k_per_split,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_N: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    num_m = tl.cdiv(M, BLOCK_M)
    # Grouped order: GROUP_N weight tiles share the token tiles they sweep (L2 reuse of both).
    per_group = GROUP_N * num_m
    group = pid // per_group
    first_n = group * GROUP_N
    size_n = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % size_n
    pid_m = (pid % per_group) // size_n

    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn_l = rn % N  # clamped rows for loads; stores are masked
    rm_l = rm % M
    half_k = K // 2
    sf_k = K // 16
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk2 = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        rks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            wp = tl.load(w_ptr + rn_l[:, None] * half_k + rk2[None, :])
            sc = tl.load(ws_ptr + rn_l[:, None] * sf_k + rks[None, :])
            a = tl.load(a_ptr + rm_l[None, :] * stride_am + rk[:, None])
        else:
            wp = tl.load(w_ptr + rn_l[:, None] * half_k + rk2[None, :], mask=(rk2 < half_k)[None, :], other=0)
            sc = tl.load(ws_ptr + rn_l[:, None] * sf_k + rks[None, :], mask=(rks < sf_k)[None, :], other=0)
            a = tl.load(a_ptr + rm_l[None, :] * stride_am + rk[:, None], mask=(rk < K)[:, None], other=0.0)
        c = tl.interleave(wp & 0xF, wp >> 4).to(tl.int32)  # element 2i is the low nibble
        bits = ((c & 7) << 22) | ((c & 8) << 28)
        v = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2**126
        scf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w = tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // 16, 16)) * scf[:, :, None], (BLOCK_N, BLOCK_K))
        if DOT_F32:  # the CPU interpreter multiplies bf16 bit patterns: give it the (exact) fp32 values
            acc = tl.dot(w, a.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(a.dtype), a, acc)
    if SPLIT_K == 1:
        _epilogue(acc, rn, rm, N, M, R, wc_ptr, bias_ptr, up_ptr, lora_ptr, out_ptr, stride_om,
                  BLOCK_R, HAS_BIAS, HAS_LORA, DOT_F32)
    else:
        ptrs = part_ptr + pid_k * M * N + rm[None, :] * N + rn[:, None]
        tl.store(ptrs, acc, mask=(rn < N)[:, None] & (rm < M)[None, :])


@triton.jit
def _splitk_epilogue_kernel(
    part_ptr, wc_ptr, bias_ptr, up_ptr, lora_ptr, out_ptr, M, N, R, stride_om,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, DOT_F32: tl.constexpr, rs_ptr, HAS_RS: tl.constexpr,
    SC: tl.constexpr = 1,
):
    # HAS_RS: a per-token factor too (the fast mode's sa), applied to the sum before the epilogue
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # SC partials loaded at once (one round trip a chunk, not one a split), each chunk added as a tree, chunks
    # in order: a fixed order, so the result does not depend on scheduling
    for s0 in range(0, SPLIT_K, SC):
        rs = s0 + tl.arange(0, SC)
        acc += tl.sum(tl.load(part_ptr + rs[:, None, None] * M * N + (rm[None, :] * N + rn[:, None])[None, :, :],
                              mask=(rs < SPLIT_K)[:, None, None] & mask[None, :, :], other=0.0), axis=0)
    if HAS_RS:
        acc = acc * tl.load(rs_ptr + rm, mask=rm < M, other=0.0)[None, :]
    _epilogue(acc, rn, rm, N, M, R, wc_ptr, bias_ptr, up_ptr, lora_ptr, out_ptr, stride_om,
              BLOCK_R, HAS_BIAS, HAS_LORA, DOT_F32)


@triton.jit
def _lora_act_kernel(x_ptr, pd_ptr, out_ptr, M, K, R, stride_xm, K_SPLIT, xb_ptr, KA, stride_bm,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, NUM_STAGES: tl.constexpr,
                     DOT_F32: tl.constexpr, HAS_B: tl.constexpr, GELU_B: tl.constexpr, RNE_BITS: tl.constexpr,
                     PDL: tl.constexpr = False):
    # PDL (launched as a programmatic dependent): wait for the grid before (x's writer), then let the grid
    # after this one start, an activation pass that reads x beside this one (AFTER_LORA).
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    # lora_act [BLOCK_M, R] of a row block: x (rounded to bf16, as the cuBLAS path's x.to(bf16)) times
    # proj_down / smooth (bf16), fp32 accumulation over the columns [s K_SPLIT, (s + 1) K_SPLIT) of
    # split s = program_id(1) (K_SPLIT a multiple of BLOCK_K), written to out[s]: a fixed order.
    # HAS_B: the row is cat([x, gelu(xb)]) read from its two sources (x: its first KA columns, KA a
    # multiple of BLOCK_K; K in all), GELU applied to xb as it loads (GELU_B); else KA = K.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    m_ok = rm < M
    r_ok = rr < R
    kb = tl.program_id(1) * K_SPLIT
    out_ptr += tl.program_id(1).to(tl.int64) * M * R
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in tl.range(kb, tl.minimum(kb + K_SPLIT, KA), BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < KA
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(pd_ptr + rk[:, None] * R + rr[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc = _lora_dot(x, w, acc, DOT_F32)
    if HAS_B:
        for k0 in tl.range(tl.maximum(kb, KA), tl.minimum(kb + K_SPLIT, K), BLOCK_K, num_stages=NUM_STAGES):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(xb_ptr + rm[:, None] * stride_bm + (rk - KA)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            if GELU_B:
                x = _round_to(_gelu_tanh(x.to(tl.float32)), xb_ptr, RNE_BITS)
            w = tl.load(pd_ptr + rk[:, None] * R + rr[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            acc = _lora_dot(x, w, acc, DOT_F32)
    tl.store(out_ptr + rm[:, None] * R + rr[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _lora_dot(x, w, acc, DOT_F32: tl.constexpr):
    if DOT_F32:  # the CPU interpreter multiplies bf16 bit patterns (and truncates to bf16): give it the
        # fp32 values of the nearest-even bf16 rounding, the GPU's conversion
        return tl.dot(_rne_bf16(x.to(tl.float32)), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x.to(tl.bfloat16), w, acc)


# ---- launchers -----------------------------------------------------------------------------------
# Host arithmetic in plain Python: triton.cdiv / next_power_of_2 are constexpr functions whose wrapper
# costs ~4 us a call on the host (three of them doubled the fast pass's host time, docs/perf.md).


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _block_r(r: int) -> int:
    return max(16, next_pow2(r)) if r else 16


def quantize_act(
    x: torch.Tensor,
    smooth: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    packed: bool = False,
    block_m: int = 8,
    block_k: int = 256,
    num_warps: int = 4,
    inv_smooth: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """NVFP4-quantize ``x [M, K]`` (any strides) after smoothing, in one pass.

    Returns ``(xq, codes, scales)``: ``xq [M, K]`` the exact dequantized values in ``out_dtype``
    (default: x's dtype if 16-bit, else bf16; None when ``packed``); ``codes [M, K/2]`` uint8 and
    ``scales [M, K/16]`` float8_e4m3fn, bit-identical to ``nvfp4.quantize_nvfp4`` (None unless ``packed``).
    The default block (8 x 256 on 4 warps) measured fastest of eight on the H200: 78-84 % of the copy
    bandwidth at the Flux shapes (docs/perf.md, 2026-12-04). ``inv_smooth``: ``1 / smooth`` already made
    (a contiguous [K] fp32 tensor, the IEEE quotient), read instead of dividing a column a tile.
    """
    m, k = x.shape
    if k % nvfp4.BLOCK_SIZE:
        raise ValueError(f"expected K % 16 == 0, got {k}")
    dt = out_dtype or (x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    return _quantize_act_launch(x, None, _smooth_operand(smooth, inv_smooth, k), m, k, dt, packed, block_m,
                                min(block_k, next_pow2(k)), num_warps, False)


def _smooth_operand(smooth: torch.Tensor, inv_smooth: torch.Tensor | None, k: int) -> tuple[torch.Tensor, bool]:
    """``(tensor, INV)``: what the exact passes read for the smoothing: ``inv_smooth`` (checked) where given, the
    kernels' ``INV`` form, else ``smooth`` itself, divided in the kernel."""
    if inv_smooth is None:
        return smooth, False
    _check_inv_smooth(inv_smooth, k)
    return inv_smooth, True


def _quantize_act_launch(x, xb, smooth_op, m, k, dt, packed, block_m, block_k, num_warps, gelu_b, lora=None,
                         la=None):
    smooth, inv = smooth_op  # _smooth_operand's
    xq = None if packed else torch.empty(m, k, device=smooth.device, dtype=dt)
    codes = torch.empty(m, k // 2, device=smooth.device, dtype=torch.uint8) if packed else None
    scales = torch.empty(m, k // 16, device=smooth.device, dtype=torch.uint8) if packed else None
    r, nsplit = _lora_input(lora, m)
    if m:
        xa = xb if x is None else x  # any pointer when there are no columns of x
        after_lora = lora is not None  # (quantize_act_after_lora: launched as lora_act's programmatic dependent)
        _quantize_act_kernel[(cdiv(m, block_m), cdiv(k, block_k))](
            xa, smooth, smooth if xq is None else xq, smooth if codes is None else codes,
            smooth if scales is None else scales, m, k, xa.stride(0), xa.stride(1),
            smooth if xb is None else xb, k if xb is None else k - xb.shape[1], 0 if xb is None else xb.stride(0),
            smooth if lora is None else lora, smooth if la is None else la, r,
            BLOCK_M=block_m, BLOCK_K=block_k, WRITE_XQ=not packed, WRITE_CODES=packed, HAS_B=xb is not None,
            GELU_B=gelu_b, RNE_BITS=_INTERPRET, AFTER_LORA=after_lora, BLOCK_R=_block_r(r), NSPLIT=nsplit, INV=inv,
            num_warps=num_warps, **_pdl_opts(after_lora),
        )
    return xq, codes, None if scales is None else scales.view(torch.float8_e4m3fn)


_PDL_DEVICES: dict[int, bool] = {}


def _pdl_opts(pdl: bool) -> dict:
    """A launch's options: ``launch_pdl`` only where it is on (a Triton without grid dependency control has no such
    option, and the default launches stay as they were)."""
    return {"launch_pdl": True} if pdl else {}


def pdl_supported(device: torch.device | None = None) -> bool:
    """Whether kernels here can be launched as programmatic dependents (PDL): a CUDA device of capability 9.0
    or later, a Triton with grid dependency control, not the interpreter (asked once a device)."""
    if gdc_wait is None or _INTERPRET or device is None or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _PDL_DEVICES.get(idx)
    if ok is None:
        ok = _PDL_DEVICES[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return ok


def _check_pdl(device: torch.device, what: str) -> None:
    if not pdl_supported(device):
        raise ValueError(f"{what}: programmatic dependent launch needs a CUDA device of capability 9.0 or later "
                         f"and a Triton with grid dependency control (not the interpreter); got {device}")


class setting_launch:
    """A context manager around a launch whose tile, warps or stages the environment setting ``setting`` chose
    (``value``: what it holds, read per call by the caller, or a callable that reads it, called only on a refusal so
    that a launch that fits reads nothing more). A launch Triton refuses for want of resources
    (``OutOfResources``: more shared memory than this GPU has, or more threads than its registers allow) is a
    ValueError naming the setting, its value and ``launch`` (what ran at which config: a ``str.format`` template of
    ``config``, filled only on a refusal, so a launch that fits pays for no message), then ``hint`` (what to
    change), chained from Triton's error. Where ``value`` is unset or blank the config is the library's own, and
    Triton's error passes unchanged: naming a setting the user did not set would mislead. Any other error passes
    unchanged.

    ``with setting_launch(tuning.ENV_LORA_ACT, env, "lora_act at {} and R = {}", plan, r): lora_act(...)``"""

    __slots__ = ("setting", "value", "launch", "config", "hint")

    def __init__(self, setting: str, value: str | None, launch: str, *config,
                 hint: str = "take fewer rows, warps or stages"):
        self.setting, self.value, self.launch, self.config, self.hint = setting, value, launch, config, hint

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> None:
        if kind is None or not issubclass(kind, OutOfResources):
            return
        value = self.value() if callable(self.value) else self.value
        if value and value.strip():
            raise ValueError(f"{self.setting}={value!r}: {self.launch.format(*self.config)} does not fit this "
                             f"GPU ({e}); {self.hint}") from e


def quantize_act_after_lora(x: torch.Tensor, smooth: torch.Tensor, lora: torch.Tensor, *,
                            out_dtype: torch.dtype | None = None, block_m: int = 8, block_k: int = 256,
                            num_warps: int = 4, inv_smooth: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, la)``: ``quantize_act``'s ``xq`` (the same bytes) and ``la [M, R] bf16``, the sum in split order of
    ``lora [S, M, R]`` (or ``[M, R]``) fp32, rounded once: ``lora_act`` as the exact GEMM takes it.

    **Call it right after ``lora_act(x, ..., pdl=True)`` on the same stream, with that call's output and
    nothing launched between.** It launches as that grid's programmatic dependent and reads x without waiting:
    lora_act's grid waited for x's writer before it let this one start. Both grids read x at once, and this
    grid ends after lora_act's (its last k-tile's programs wait for it before they add the partials)."""
    m, k = x.shape
    if k % nvfp4.BLOCK_SIZE:
        raise ValueError(f"expected K % 16 == 0, got {k}")
    r, _ = _lora_input(lora, m)
    if lora.dtype != torch.float32:
        raise ValueError(f"lora must be lora_act's float32 output, got {lora.dtype}")
    _check_pdl(x.device, "quantize_act_after_lora")
    smooth_op = _smooth_operand(smooth, inv_smooth, k)
    dt = out_dtype or (x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    la = torch.empty(m, r, device=x.device, dtype=torch.bfloat16)
    xq = _quantize_act_launch(x, None, smooth_op, m, k, dt, False, block_m, min(block_k, next_pow2(k)), num_warps,
                              False, lora, la)[0]
    return xq, la


MAX_ONE_READ_R = 256  # quantize_act_lora's widest lora_act (its fp32 sums: block_m x R a program, in registers)


def quantize_act_lora(x: torch.Tensor, smooth: torch.Tensor, pds: torch.Tensor, *, out_dtype: torch.dtype | None = None,
                      block_m: int = 32, block_k: int = 128, split: int = 1, num_warps: int = 4,
                      num_stages: int = 1, inv_smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xq, lora_act)`` in one read of ``x [M, K]`` (any strides, 16-bit or fp32): ``xq`` the exact
    dequantized NVFP4 values of ``x / smooth``, the same bytes as ``quantize_act`` (``out_dtype`` as
    there), and ``lora_act [M, R] = x.to(bf16) @ pds`` in bf16 (``pds [K, R]`` bf16 contiguous), what the
    backend got from cuBLAS: fp32 accumulation on tensor cores, one rounding, another summation order.

    The grid is ``M / block_m`` row blocks times ``split`` ranges of K (whole ``block_k`` steps); with
    ``split > 1`` each program writes an fp32 partial sum and the last of its row block adds them in
    split order (the same bits whichever finishes last) using an atomic counter a row block
    (``small_m.sync_words``, left at zero). ``inv_smooth``: ``1 / smooth`` already made, as ``quantize_act``'s."""
    m, k = x.shape
    if k % nvfp4.BLOCK_SIZE:
        raise ValueError(f"expected K % 16 == 0, got {k}")
    if pds.dim() != 2 or pds.shape[0] != k or pds.dtype != torch.bfloat16 or not pds.is_contiguous():
        raise ValueError(f"pds must be a contiguous [{k}, R] bf16 tensor, got {tuple(pds.shape)} {pds.dtype}")
    if pds.shape[1] > MAX_ONE_READ_R:
        raise ValueError(f"pds has {pds.shape[1]} columns: the one read holds lora_act's [block_m, R] sums in "
                         f"registers, up to R = {MAX_ONE_READ_R}")
    if split < 1 or block_m < 16 or block_k < 16 or block_k & (block_k - 1) or block_m & (block_m - 1):
        raise ValueError(f"need split >= 1 and power-of-two blocks of at least 16 (tensor-core rows), got "
                         f"split={split}, block_m={block_m}, block_k={block_k}")
    smooth, inv = _smooth_operand(smooth, inv_smooth, k)
    dt = out_dtype or (x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    r = pds.shape[1]
    xq = torch.empty(m, k, device=x.device, dtype=dt)
    lora = torch.empty(m, r, device=x.device, dtype=torch.bfloat16)
    if not m:
        return xq, lora
    block_k = min(block_k, next_pow2(k))
    k_split = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_split)  # no range past K
    rows = cdiv(m, block_m)
    if split > 1:
        from .small_m import sync_words

        part = torch.empty(split, m, r, device=x.device, dtype=torch.float32)
        cnt = sync_words(x.device, rows, "quantize_act_lora")
    else:
        part = cnt = lora
    _quantize_act_lora_kernel[(rows, split)](
        x, smooth, xq, pds, lora, part, cnt, m, k, r, x.stride(0), x.stride(1), k_split, split,
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=_block_r(r), IS_SPLIT=split > 1, DOT_F32=_INTERPRET,
        NUM_STAGES=num_stages, INV=inv, num_warps=num_warps)
    return xq, lora


def quantize_act_cat(xa: torch.Tensor | None, xb: torch.Tensor, smooth: torch.Tensor, *, gelu_b: bool = True,
                     out_dtype: torch.dtype | None = None, packed: bool = False, block_m: int = 8,
                     block_k: int = 256, num_warps: int = 4, inv_smooth: torch.Tensor | None = None):
    """``quantize_act`` of the rows ``x = cat([xa, gelu_tanh(xb)], -1)`` (``nvfp4.cat_gelu``;
    ``gelu_b=False``: ``cat([xa, xb])``) read from the two sources, without writing x (the exact mode's
    form of ``quantize_act_fp8_cat``). ``xa [M, KA]`` (KA % 128 == 0, or None) and ``xb [M, KB]`` (KB %
    16 == 0) of one float dtype; xb is read with unit stride along K. A tile lies in one source: the
    k-block shrinks to a power of two dividing KA. Same results as ``quantize_act`` on the written x,
    except where the GELU values differ from the tensor's (``quantize_act_fp8_cat``). ``inv_smooth`` as
    ``quantize_act``'s."""
    ka, m, kb = _check_sources(xa, xb)
    if kb % nvfp4.BLOCK_SIZE:
        raise ValueError(f"expected xb's columns a multiple of 16, got {kb}")
    k = ka + kb
    smooth_op = _smooth_operand(smooth, inv_smooth, k)
    block_k = min(block_k, next_pow2(k))
    while ka % block_k:
        block_k //= 2
    xb = xb if xb.stride(1) == 1 else xb.contiguous()
    dt = out_dtype or (xb.dtype if xb.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    return _quantize_act_launch(xa, xb, smooth_op, m, k, dt, packed, block_m, block_k, num_warps, gelu_b)


def _check_sources(xa: torch.Tensor | None, xb: torch.Tensor) -> tuple[int, int, int]:
    """``(KA, M, KB)`` of the two sources of a ``cat_gelu`` input, after checking them."""
    if xb.dim() != 2 or (xa is not None and (xa.dim() != 2 or xa.shape[0] != xb.shape[0])):
        raise ValueError(f"expected xa [M, KA] and xb [M, KB], got {None if xa is None else tuple(xa.shape)} and "
                         f"{tuple(xb.shape)}")
    if xa is not None and xa.dtype != xb.dtype:
        raise ValueError(f"xa and xb must have one dtype, got {xa.dtype} and {xb.dtype}")
    if xb.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"expected a float input, got {xb.dtype}")
    m, kb = xb.shape
    ka = 0 if xa is None else xa.shape[1]
    if ka % 128 or kb == 0:
        raise ValueError(f"expected xa's columns a multiple of 128 and xb's at least 1, got {ka} and {kb}")
    return ka, m, kb




def _src_chunks(ks: int) -> tuple[int, int]:
    """``(C, N)``: a source of ``ks`` columns in N <= 4 power-of-two chunks of C (N = 0 for none)."""
    if ks == 0:
        return 16, 0
    c = next_pow2(cdiv(ks, 4))
    return c, cdiv(ks, c)


@functools.lru_cache(maxsize=64)
def fp8_rows_config(k: int) -> tuple[int, int, int, int]:
    """``(rows, C, NCH, num_warps)`` of the one-pass FP8 kernel for rows of ``k`` columns: a row in at
    most 4 power-of-two chunks; the blocks measured fastest on the H200 (docs/perf.md, 2026-12-04):
    2 rows on 8 warps up to 3072 columns (24 values a thread), 1 row on 4 warps up to 4096, 1 row on 8
    warps above (48-64 values a thread)."""
    c, nch = _src_chunks(k)
    if k <= 3072:
        return 2, c, nch, 8
    return 1, c, nch, 4 if k <= 4096 else 8


def _lora_input(lora: torch.Tensor | None, m: int) -> tuple[int, int]:
    """``(R, S)`` of the ``lora`` argument of the FP8 passes: ``[M, R]`` (S = 1) or ``[S, M, R]`` fp32
    partial sums over K (``lora_act(split=S)``); ``(0, 1)`` for None."""
    if lora is None:
        return 0, 1
    if lora.dim() == 3:
        if lora.shape[1] != m or lora.dtype != torch.float32 or not lora.is_contiguous():
            raise ValueError(f"lora partials must be a contiguous [S, {m}, R] float32 tensor, got "
                             f"{tuple(lora.shape)} {lora.dtype}")
        return lora.shape[-1], lora.shape[0]
    if lora.dim() != 2 or lora.shape[0] != m or not lora.is_contiguous():
        raise ValueError(f"lora must be a contiguous [{m}, R] tensor, got {tuple(lora.shape)}")
    return lora.shape[-1], 1


def _check_inv_smooth(inv_smooth: torch.Tensor, k: int) -> None:
    if inv_smooth.shape != (k,) or inv_smooth.dtype != torch.float32 or not inv_smooth.is_contiguous():
        raise ValueError(f"inv_smooth must be a contiguous [{k}] float32 tensor, got "
                         f"{tuple(inv_smooth.shape)} {inv_smooth.dtype}")


def quantize_act_fp8(x: torch.Tensor, smooth: torch.Tensor, *, lora: torch.Tensor | None = None,
                     proj_down_smoothed: torch.Tensor | None = None, inv_smooth: torch.Tensor | None = None,
                     one_pass: bool | None = None, rows: int | None = None, num_warps: int | None = None,
                     canon_nan: bool = True, block_m: int = 4, block_k: int = 512, gemm_order: bool = False,
                     lora_pdl: bool = False):
    """The fast mode's activations of ``x [M, K]`` (any strides): ``(a8 [M, K] float8_e4m3fn, sa [M]
    float32)``, bit-identical to ``nvfp4.fast_act(nvfp4.smooth_input(x, smooth))``. With ``lora [M, R]``
    (contiguous, any float dtype: ``lora_act``) also ``la [M, R] bf16 = lora / sa`` rounded once, as the
    third result; with ``proj_down_smoothed [K, R]`` (bf16, contiguous) instead, the kernel computes
    ``lora_act = x @ proj_down_smoothed`` itself (tensor cores, fp32, from the x of its first pass;
    blocks of at least 16 rows, k-chunks of at most 128) and returns the same ``la``: one read of x
    fewer than a separate GEMM, but slower than it on the H200 (docs/perf.md), so opt-in.

    Two kernels. The default (``one_pass``, K up to ``ROW_MAX_K``) holds whole rows in registers and
    reads x once (``fp8_rows_config``; ``rows`` / ``num_warps`` override its block), with
    ``inv_smooth = 1 / smooth`` (fp32, as the backend caches it; computed here when not given). The
    other walks a ``block_m x block_k`` block along the row twice, its max then the codes (the second
    read from L2); it serves ``proj_down_smoothed`` and longer rows. ``canon_nan=False`` (for
    measurement) leaves NaN and +-Inf as the hardware convert writes them (Inf: 448); the default
    writes 0x7F for each, as the contract's ``round_e4m3``.
    ``gemm_order=True`` (K % 128 == 0) writes ``a8``'s columns in the fast GEMM's k order
    (``fast_layout.gemm_k_order`` of the above): what ``quack_fast.gemm`` reads.

    ``lora_pdl=True``: ``lora`` is the output of ``lora_act(x, ..., pdl=True)`` launched right before on this
    stream (nothing between). The one-pass kernel then launches as its programmatic dependent and reads x
    beside it, and ``la`` comes from one more small launch after both (``_lora_scale_kernel``). Same bits. It
    needs ``inv_smooth`` and x of unit stride along K (no launch may come between the two)."""
    m, k = x.shape
    if gemm_order and k % 128:
        raise ValueError(f"the fast GEMM's k order needs in_features % 128 == 0, got {k}")
    if lora_pdl and (x.stride(1) != 1 or inv_smooth is None or lora is None or one_pass is False or k > ROW_MAX_K):
        # launched beside lora_act, the one-pass kernel must be the next launch: no copy of x or inv_smooth first
        raise ValueError(f"lora_pdl needs lora, inv_smooth, x of unit stride along K and K <= {ROW_MAX_K} (the "
                         f"one-pass kernel, launched right after lora_act); got lora {lora is not None}, inv_smooth "
                         f"{inv_smooth is not None}, stride {x.stride(1)}, K {k}, one_pass {one_pass}")
    if lora is not None and proj_down_smoothed is not None:
        raise ValueError("pass lora (computed) or proj_down_smoothed (to compute it here), not both")
    if one_pass is None:
        one_pass = proj_down_smoothed is None and k <= ROW_MAX_K
    elif one_pass and (proj_down_smoothed is not None or k > ROW_MAX_K):
        raise ValueError(f"the one-pass kernel takes K <= {ROW_MAX_K} and no proj_down_smoothed, got K={k}")
    if x.stride(1) != 1 and (one_pass or not _INTERPRET):
        # The one-pass kernel reads rows of unit stride. The two-pass one under Triton 3.6 on sm_90
        # writes wrong bytes for an input strided along K (seen on the H200 for a column-major x,
        # docs/perf.md): such inputs are rare in a transformer, so copy them.
        x = x.contiguous()
    a8 = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    sa = torch.empty(m, device=x.device, dtype=torch.float32)
    la, lora_in, pds = None, sa, sa
    r, nsplit = _lora_input(lora, m)
    if lora is not None:
        lora_in = lora
    if proj_down_smoothed is not None:
        pds = proj_down_smoothed
        if pds.dim() != 2 or pds.shape[0] != k or pds.dtype != torch.bfloat16 or not pds.is_contiguous():
            raise ValueError(f"proj_down_smoothed must be a contiguous [{k}, R] bf16 tensor, got "
                             f"{tuple(pds.shape)} {pds.dtype}")
        # tl.dot takes 16 rows at least; a k-chunk of at most 128 keeps the proj_down tile in registers
        r, block_m, block_k = pds.shape[1], max(block_m, 16), min(block_k, 128)
    wants_la = lora is not None or proj_down_smoothed is not None
    if wants_la:
        la = torch.empty(m, r, device=x.device, dtype=torch.bfloat16)
    if m and one_pass:
        if inv_smooth is None:
            inv_smooth = 1.0 / smooth.float()  # IEEE division: the bits of nvfp4.smooth_input's factor
        else:
            _check_inv_smooth(inv_smooth, k)
        _fp8_rows_launch(None, x, inv_smooth, a8, sa, lora, la, nsplit, False, gemm_order, canon_nan, rows,
                         num_warps, lora_pdl)
    elif m:
        _quantize_act_fp8_kernel[(cdiv(m, block_m),)](
            x, smooth, a8.view(torch.uint8), sa, lora_in, pds, la if r else sa, m, k, r, x.stride(0), x.stride(1),
            BLOCK_M=block_m, BLOCK_K=min(block_k, next_pow2(k)), BLOCK_R=_block_r(r),
            HAS_LORA=lora is not None, FUSE_LORA=proj_down_smoothed is not None, DOT_F32=_INTERPRET,
            GEMM_ORDER=gemm_order, NSPLIT=nsplit, num_warps=num_warps or 4)
    if not wants_la:
        return a8, sa
    return a8, sa, la


def quantize_act_fp8_cat(xa: torch.Tensor | None, xb: torch.Tensor, inv_smooth: torch.Tensor, *,
                         gelu_b: bool = True, lora: torch.Tensor | None = None, gemm_order: bool = False,
                         canon_nan: bool = True, rows: int | None = None, num_warps: int | None = None,
                         lora_pdl: bool = False):
    """``quantize_act_fp8`` of the rows ``x = cat([xa, gelu_tanh(xb)], -1)`` (``nvfp4.cat_gelu``;
    ``gelu_b=False``: ``cat([xa, xb])``) read from the two sources, without writing x: the input of a
    Flux single block's ``proj_out`` (attention output, MLP before its GELU) or of a feed-forward's down
    projection (``xa`` None). ``xa [M, KA]`` (KA % 128 == 0) and ``xb [M, KB]`` of one dtype, unit
    stride along K; ``inv_smooth [KA + KB]`` fp32 (``1 / smooth``), KA + KB <= ``ROW_MAX_K``.

    One pass like the one-pass kernel, each source in its own power-of-two chunks. Returns ``(a8, sa)``
    (and ``la`` with ``lora``, as ``quantize_act_fp8``). Its bytes are ``quantize_act_fp8``'s of the
    materialized x wherever the GELU values (``kernels._gelu_tanh``, a few fp32 ulps from exact, rounded
    to xb's dtype) equal the tensor's (``torch.nn.functional.gelu``'s own rounding). ``lora_pdl``: as in
    ``quantize_act_fp8``, after ``lora_act(xa, ..., xb=xb, pdl=True)``."""
    ka, m, kb = _check_sources(xa, xb)
    k = ka + kb
    if lora_pdl and (xb.stride(1) != 1 or (xa is not None and xa.stride(1) != 1) or lora is None):
        raise ValueError("lora_pdl needs lora and sources of unit stride along K (the pass is launched right after "
                         f"lora_act, with no copy between); got lora {lora is not None}, strides "
                         f"{[t.stride(1) for t in (xa, xb) if t is not None]}")
    if gemm_order and k % 128:
        raise ValueError(f"the fast GEMM's k order needs in_features % 128 == 0, got {k}")
    if k > ROW_MAX_K:
        raise ValueError(f"the one-pass kernel takes K <= {ROW_MAX_K}, got K={k}")
    _check_inv_smooth(inv_smooth, k)
    xa = None if xa is None else (xa if xa.stride(1) == 1 else xa.contiguous())
    xb = xb if xb.stride(1) == 1 else xb.contiguous()
    r, nsplit = _lora_input(lora, m)
    a8 = torch.empty(m, k, device=xb.device, dtype=torch.float8_e4m3fn)
    sa = torch.empty(m, device=xb.device, dtype=torch.float32)
    la = torch.empty(m, r, device=xb.device, dtype=torch.bfloat16) if lora is not None else None
    if m:
        _fp8_rows_launch(xa, xb, inv_smooth, a8, sa, lora, la, nsplit, gelu_b, gemm_order, canon_nan, rows, num_warps,
                         lora_pdl)
    return (a8, sa) if la is None else (a8, sa, la)


def _fp8_rows_launch(xa, xb, inv_smooth, a8, sa, lora, la, nsplit, gelu_b, gemm_order, canon_nan, rows, num_warps,
                     lora_pdl=False):
    """``_quantize_act_fp8_rows_kernel`` on the row ``cat([xa, xb])`` (xa None: xb alone), checked by the
    caller; its block from ``fp8_rows_config`` unless ``rows`` / ``num_warps`` say otherwise. ``lora_pdl``
    (with ``lora``): launched as lora_act's programmatic dependent, ``la`` by ``_lora_scale_kernel`` after it."""
    after_lora = lora_pdl and lora is not None
    if after_lora:
        _check_pdl(xb.device, "the FP8 pass with lora_pdl")
    m, ka, kb = xb.shape[0], 0 if xa is None else xa.shape[1], xb.shape[1]
    r = 0 if lora is None else lora.shape[-1]
    rows_d, _, _, warps_d = fp8_rows_config(ka + kb)
    (ca, na), (cb, nb) = _src_chunks(ka), _src_chunks(kb)
    _quantize_act_fp8_rows_kernel[(cdiv(m, rows or rows_d),)](
        xb if xa is None else xa, xb, inv_smooth, a8, sa, sa if lora is None else lora, sa if la is None else la,
        m, ka, kb, r, 0 if xa is None else xa.stride(0), xb.stride(0),
        ROWS=rows or rows_d, CA=ca, NA=na, CB=cb, NB=nb, BLOCK_R=_block_r(r),
        HAS_LORA=lora is not None and not after_lora,
        GELU_B=gelu_b, HW_CVT=not _INTERPRET, CANON_NAN=canon_nan, GEMM_ORDER=gemm_order, NSPLIT=nsplit,
        RNE_BITS=_INTERPRET, AFTER_LORA=after_lora, num_warps=num_warps or warps_d, **_pdl_opts(after_lora))
    if after_lora:
        _lora_scale_kernel[(cdiv(m, LORA_SCALE_ROWS),)](lora, sa, la, m, r, BLOCK_M=LORA_SCALE_ROWS,
                                                        BLOCK_R=_block_r(r), NSPLIT=nsplit, num_warps=4,
                                                        **_pdl_opts(True))

def lora_act(x: torch.Tensor | None, pds: torch.Tensor, out_dtype: torch.dtype = torch.float32, *, block_m: int = 16,
             block_k: int | None = None, num_stages: int = 4, num_warps: int = 4, split: int = 1,
             xb: torch.Tensor | None = None, gelu_b: bool = False, pdl: bool = False) -> torch.Tensor:
    """``lora_act [M, R] = x.to(bf16) @ pds`` in ``out_dtype`` (fp32 accumulation, one rounding): what
    the backend gets from cuBLAS (``x @ pds``; ``_mm_f32`` for fp32), as one Triton launch of
    ``block_m``-row blocks streaming x once. ``x [M, K]`` with unit stride along K, any float dtype;
    ``pds [K, R]`` bf16 contiguous.

    ``xb [M, KB]``: the row is ``cat([x, xb], -1)`` (``x [M, KA]``, KA % 128 == 0, or None for KA = 0)
    read from its two sources, ``gelu_b`` applying ``gelu_tanh`` to xb's values as they load, rounded to
    xb's dtype as the tensor ``nvfp4.cat_gelu`` writes would hold them (``pds`` has KA + KB rows).

    ``split = S > 1`` splits K into S ranges of whole ``block_k`` steps (S x the programs, each reading
    ``proj_down``'s rows of its range only) and returns the fp32 partial sums ``[S, M, R]``, which
    ``quantize_act_fp8(lora=...)`` adds in split order; an empty range writes zeros. Larger row blocks
    re-read ``proj_down`` from L2 fewer times (M / block_m times in all); the split keeps the SMs busy.

    ``pdl=True`` launches it as a programmatic dependent: it waits for the grid before it (x's writer), then
    lets the next grid start at once. Only ``quantize_act_after_lora`` or the FP8 passes with ``lora_pdl=True``
    may come next: they read x beside this grid."""
    if pdl:
        _check_pdl(pds.device, "lora_act")
        if (x is not None and x.stride(1) != 1) or (xb is not None and xb.stride(1) != 1):
            # a copy made here would be freed on return while this grid still reads it, and the pass launched
            # next (beside this grid) could be handed its memory
            strides = [t.stride(1) for t in (x, xb) if t is not None]
            raise ValueError(f"lora_act(pdl=True) reads x as it lies: it needs unit stride along K, got {strides}")
    if x is None and xb is None:
        raise ValueError("lora_act needs x, xb or both")
    ka = 0 if x is None else x.shape[1]
    m = xb.shape[0] if x is None else x.shape[0]
    k = ka + (0 if xb is None else xb.shape[1])
    if xb is not None and (xb.dim() != 2 or xb.shape[0] != m or (x is not None and xb.dtype != x.dtype)):
        raise ValueError(f"xb must be [{m}, KB] of x's dtype, got {tuple(xb.shape)} {xb.dtype}")
    if xb is not None and ka % 128:
        raise ValueError(f"with xb, x's columns must be a multiple of 128, got {ka}")
    if gelu_b and xb is None:
        raise ValueError("gelu_b applies to xb: pass xb")
    if pds.dim() != 2 or pds.shape[0] != k or pds.dtype != torch.bfloat16 or not pds.is_contiguous():
        raise ValueError(f"pds must be a contiguous [{k}, R] bf16 tensor, got {tuple(pds.shape)} {pds.dtype}")
    if split < 1 or (split > 1 and out_dtype != torch.float32):
        raise ValueError(f"split must be >= 1, and partial sums (split > 1) are float32; got split={split}, "
                         f"{out_dtype}")
    if x is not None and x.stride(1) != 1:
        x = x.contiguous()
    if xb is not None and xb.stride(1) != 1:
        xb = xb.contiguous()
    r = pds.shape[1]
    out = torch.empty(*((split,) if split > 1 else ()), m, r, device=pds.device, dtype=out_dtype)
    # 128-deep k-steps up to 64 columns; 64 above (R = 128 would otherwise spill: 4 stages of 110 KB)
    block_k = block_k or (128 if _block_r(r) <= 64 else 64)
    if xb is not None and ka % block_k:  # xb's k-steps start at KA: a split's steps must meet it
        raise ValueError(f"with xb, x's columns must be a multiple of block_k = {block_k}, got {ka}")
    k_split = cdiv(cdiv(k, split), block_k) * block_k
    xa = xb if x is None else x  # any pointer when there are no columns of x
    if m and r:
        _lora_act_kernel[(cdiv(m, block_m), split)](
            xa, pds, out, m, k, r, xa.stride(0), k_split, pds if xb is None else xb, ka if xb is not None else k,
            0 if xb is None else xb.stride(0), BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=_block_r(r),
            NUM_STAGES=num_stages, DOT_F32=_INTERPRET, HAS_B=xb is not None, GELU_B=gelu_b, RNE_BITS=_INTERPRET,
            PDL=pdl, num_warps=num_warps, **_pdl_opts(pdl))
    elif m:
        out.zero_()
    return out


def w4_gemm(
    a: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None,
    proj_up: torch.Tensor | None,
    lora_act: torch.Tensor | None,
    out_dtype: torch.dtype,
    cfg: "GemmConfig",
) -> torch.Tensor:
    """``out [M, N] = (a @ Wq^T) * wcscale + lora_act @ proj_up^T + bias`` (fp32 accumulation).

    ``a [M, K]`` bf16/fp16 with unit stride along K (the exact activations, or x itself for W4A16);
    ``qweight [N, K/2]`` / ``wscales [N, K/16]`` canonical (contiguous); ``lora_act [M, R]`` (any float dtype).
    """
    m, k = a.shape
    n = qweight.shape[0]
    if _INTERPRET and out_dtype != torch.float32:
        # The CPU interpreter's fp32 -> 16-bit conversion does not round to nearest: cast outside.
        return w4_gemm(a, qweight, wscales, wcscale, bias, proj_up, lora_act, torch.float32, cfg).to(out_dtype)
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if m == 0:
        return out
    r = 0 if lora_act is None else lora_act.shape[1]
    has_bias = bias is not None
    dummy = wcscale
    split = cfg.split_k
    k_per_split = cdiv(cdiv(k, split), cfg.block_k) * cfg.block_k
    split = cdiv(k, k_per_split)
    part = torch.empty(split, m, n, device=a.device, dtype=torch.float32) if split > 1 else dummy
    grid = (cdiv(n, cfg.block_n) * cdiv(m, cfg.block_m), split)
    even_k = k % cfg.block_k == 0 and k_per_split * split == k
    _w4_gemm_kernel[grid](
        a, qweight, wscales.view(torch.uint8), wcscale, bias if has_bias else dummy,
        proj_up if r else dummy, lora_act if r else dummy, out, part,
        m, n, k, r, a.stride(0), out.stride(0), k_per_split,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=_block_r(r),
        GROUP_N=cfg.group_n, SPLIT_K=split, EVEN_K=even_k, HAS_BIAS=has_bias, HAS_LORA=bool(r), DOT_F32=_INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        splitk_epilogue(part, out, wcscale, bias, proj_up if r else None, lora_act if r else None)
    return out


def splitk_epilogue(part: torch.Tensor, out: torch.Tensor, colscale: torch.Tensor, bias=None, proj_up=None,
                    lora_act=None, rowscale=None) -> torch.Tensor:
    """``out [M, N] = (sum_s part[s]) (* rowscale[m]) * colscale[n] + lora_act @ proj_up^T + bias``, the
    partials ``part [S, M, N]`` fp32 summed in a fixed order (chunks of partials loaded at once, each added as
    a tree, chunks in order: the result does not depend on scheduling)."""
    split, m, n = part.shape
    r = 0 if proj_up is None else proj_up.shape[1]
    bn, bm = 64, min(64, max(16, next_pow2(m)))
    _splitk_epilogue_kernel[(cdiv(n, bn), cdiv(m, bm))](
        part, colscale, part if bias is None else bias, proj_up if r else part, lora_act if r else part,
        out, m, n, r, out.stride(0),
        SPLIT_K=split, BLOCK_N=bn, BLOCK_M=bm, BLOCK_R=_block_r(r), HAS_BIAS=bias is not None, HAS_LORA=bool(r),
        DOT_F32=_INTERPRET, rs_ptr=part if rowscale is None else rowscale, HAS_RS=rowscale is not None,
        SC=max(1, 4096 // (bn * bm)), num_warps=4,
    )
    return out

