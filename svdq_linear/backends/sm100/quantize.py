"""Activation quantization for the sm100 kernel (Triton): ``xs = x * (1 / smooth)`` -> packed E2M1
codes ``[M, K/2]`` and E4M3 block scales written directly in the tcgen05 scale-factor atom layout
(``host.sf_atom_offset``), so nothing is repacked per call (and, for tests, the float32 ``xs``).

Numerics are the contract's (``svdq_linear.nvfp4``): block max with NaN propagation, ``e4m3(amax / 6)``
rounded to nearest-even and saturated, NaN/Inf blocks -> NaN scale and zero codes, reciprocal
``1 / s`` by IEEE division then one multiply, E2M1 nearest-even with the contract's sign rule.
One program quantizes one row x 64 values of K (one column of 4 scales of an SF atom).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import host


@triton.jit
def _e2m1_code(q):
    """E2M1 code (int32 0..15) of float32 ``q``: nearest, ties to even, saturating; the sign bit only
    for strictly negative values, NaN -> 0 (the contract's ``round_e2m1``)."""
    a = tl.abs(q)
    mag = (a > 0.25).to(tl.int32)
    mag += (a >= 0.75).to(tl.int32)
    mag += (a > 1.25).to(tl.int32)
    mag += (a >= 1.75).to(tl.int32)
    mag += (a > 2.5).to(tl.int32)
    mag += (a >= 3.5).to(tl.int32)
    mag += (a > 5.0).to(tl.int32)
    return mag | ((q < 0).to(tl.int32) << 3)


@triton.jit
def _e4m3_round(v):
    """Round finite ``v >= 0`` to float8_e4m3fn, nearest-even, saturating at 448: ``(value, byte)``.

    Integer arithmetic on the float32 bits (normal range) and an exact power-of-two rescale plus
    round-to-integer (subnormal range, quantum 2**-9), so the result is the same on the GPU and in
    Triton's CPU interpreter.
    """
    v = tl.minimum(v, 448.0)
    bits = v.to(tl.int32, bitcast=True)
    # keep 3 mantissa bits, ties to even
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    n_val = rb.to(tl.float32, bitcast=True)
    n_byte = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
    t = v * 512.0  # exact; in [0, 8) below 2**-6
    t_int = (t + 8388608.0) - 8388608.0  # round to integer, ties to even (2**23 trick)
    s_val = t_int * 0.001953125
    s_byte = t_int.to(tl.int32)
    sub = v < 0.015625
    return tl.where(sub, s_val, n_val), tl.where(sub, s_byte, n_byte)


@triton.jit
def quantize_act_kernel(
    x_ptr, smooth_recip_ptr, codes_ptr, sf_ptr, xs_ptr,
    M, K, stride_xm, atoms_k,
    WRITE_XS: tl.constexpr,
):
    m = tl.program_id(0)
    kc = tl.program_id(1)  # 64-value chunk of K = one SF atom column (4 blocks of 16)
    b = tl.arange(0, 4)[:, None]  # block within the chunk
    j = tl.arange(0, 8)[None, :]  # pair within the block
    k_even = kc * 64 + b * 16 + 2 * j
    valid = k_even < K  # K is a multiple of 32: a pair and a block are all in or all out
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    x0 = tl.load(x_row + k_even, mask=valid, other=0.0).to(tl.float32)
    x1 = tl.load(x_row + k_even + 1, mask=valid, other=0.0).to(tl.float32)
    r0 = tl.load(smooth_recip_ptr + k_even, mask=valid, other=0.0)
    r1 = tl.load(smooth_recip_ptr + k_even + 1, mask=valid, other=0.0)
    xs0 = x0 * r0
    xs1 = x1 * r1
    if WRITE_XS:
        xs_row = xs_ptr + m.to(tl.int64) * K
        tl.store(xs_row + k_even, xs0, mask=valid)
        tl.store(xs_row + k_even + 1, xs1, mask=valid)
    # block amax with NaN propagation: a NaN anywhere makes the block's scale NaN
    a = tl.maximum(tl.abs(xs0), tl.abs(xs1))
    amax = tl.max(a, axis=1)
    has_nan = tl.max((xs0 != xs0).to(tl.int32) | (xs1 != xs1).to(tl.int32), axis=1) > 0
    bad = has_nan | (amax == float("inf"))
    s, s_byte = _e4m3_round(tl.where(bad, 0.0, tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))))
    s = tl.where(bad, float("nan"), s)
    recip = tl.where(s > 0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)  # div.rn; 0 for s = 0 or NaN
    q0 = xs0 * recip[:, None]
    q1 = xs1 * recip[:, None]
    byte = _e2m1_code(q0) | (_e2m1_code(q1) << 4)
    tl.store(codes_ptr + m.to(tl.int64) * (K // 2) + k_even // 2, byte.to(tl.uint8), mask=valid)
    # scale bytes straight into the tcgen05 scale-factor atom layout (host.sf_atom_offset)
    kb = kc * 4 + tl.arange(0, 4)
    off = ((m // 128) * atoms_k + kb // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + kb % 4
    sbyte = tl.where(bad, 0x7F, s_byte)
    tl.store(sf_ptr + off, sbyte.to(tl.uint8), mask=kb * 16 < K)


def quantize_act(x: torch.Tensor, smooth_recip: torch.Tensor, want_xs: bool = False):
    """``x [M, K]`` (bf16/fp16/fp32) -> ``(codes [M, K/2] uint8, sf flat uint8 in the atom layout,
    xs [M, K] float32 or None)``. ``smooth_recip = 1 / smooth`` (float32, computed once at prepare)."""
    m, k = x.shape
    if k % 32:
        raise ValueError(f"expected in_features % 32 == 0, got {k}")
    rows_pad, kb_pad = host.sf_atom_shape(m, k)
    codes = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    # zeros: the padding of the atom (rows past M, blocks past K/16) must read as scale 0
    sf = torch.zeros(rows_pad * kb_pad, dtype=torch.uint8, device=x.device)
    xs = torch.empty(m, k, dtype=torch.float32, device=x.device) if want_xs else codes
    grid = (m, triton.cdiv(k, 64))
    # no FMA contraction: the contract rounds every multiply on its own
    quantize_act_kernel[grid](x, smooth_recip, codes, sf, xs, m, k, x.stride(0), kb_pad // 4, WRITE_XS=want_xs,
                              enable_fp_fusion=False)
    return codes, sf, (xs if want_xs else None)


def compile_for(arch: str = "sm_100a", x_dtype: str = "bf16"):
    """Compile ``quantize_act_kernel`` for ``arch`` without a GPU; returns the compiled kernel
    (``.asm["sass"]`` when nvdisasm is available, ``.asm["ptx"]`` always)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cap = {"sm_100a": 100, "sm_103a": 103}[arch]
    sig = {"x_ptr": f"*{x_dtype}", "smooth_recip_ptr": "*fp32", "codes_ptr": "*u8", "sf_ptr": "*u8",
           "xs_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32", "atoms_k": "i32", "WRITE_XS": "constexpr"}
    src = ASTSource(quantize_act_kernel, sig, constexprs={"WRITE_XS": False})
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"enable_fp_fusion": False})
