"""Activation quantization for the sm100 kernel (Triton): ``xs = x * (1 / smooth)`` -> packed E2M1
codes ``[M, K/2]`` and E4M3 block scales written directly in the tcgen05 scale-factor atom layout
(``host.sf_atom_offset``), so nothing is repacked per call (and, for tests, the float32 ``xs``).

Numerics are the contract's (``svdq_linear.nvfp4``): block max with NaN propagation, ``e4m3(amax / 6)``
rounded to nearest-even and saturated, NaN/Inf blocks -> NaN scale and zero codes, reciprocal
``1 / s`` by IEEE division then one multiply, E2M1 nearest-even with the contract's sign rule.
One program quantizes a ``BLOCK_M`` x ``BLOCK_K`` tile, read row by row in whole (coalesced) rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import host


@triton.jit
def _e2m1_code_by_rounding(q):
    """E2M1 code (int32 0..15) of float32 ``q`` (not NaN: the caller zeroes NaN blocks): nearest, ties to even,
    saturating; the sign bit only for strictly negative values (the contract's ``round_e2m1``). By arithmetic rather
    than comparisons (which had bound the pass: docs/perf.md): ``|q|`` clamped to 6 is rounded to the E2M1 grid by
    one add and subtract of a magic constant (``1.5 * 2**22`` times the grid step of ``max(|q|, 1)``'s binade: the
    step is 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6]; float addition rounds to nearest even on it, which is the
    contract's alternating midpoints 0.25 down, 0.75 up, 1.25 down, ... 5 down). The rounded value ``v`` times
    ``2**-126`` is then E2M1's code in float32's bits: 0.5 lands on the first subnormal bit (2**22), 1 on the least
    normal exponent, and each grid step on the next exponent or mantissa bit, so ``bits >> 22`` is the code (exact:
    ``v`` has one mantissa bit). Needs subnormals kept: the GPU's ``mul.rn.f32`` keeps them (no ``.ftz``); in Triton's
    CPU interpreter a process that flushes them (``torch.set_flush_denormal(True)``) gets 0.5 wrong. Needs no FMA
    contraction (the kernel compiles without it)."""
    a = tl.minimum(tl.abs(q), 6.0)
    step = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000
    c = (step + 0x0B400000).to(tl.float32, bitcast=True)  # 1.5 * 2**22 * 2**floor(log2 max(a, 1))
    v = (a + c) - c
    mag = (v * 1.1754943508222875e-38).to(tl.int32, bitcast=True) >> 22  # v * 2**-126
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
    M, K, stride_xm, atoms_k, rows_pad,
    WRITE_XS: tl.constexpr, BLOCK_M: tl.constexpr = 16, BLOCK_K: tl.constexpr = 256,
):
    # One [BLOCK_M, BLOCK_K] tile a program, read in whole rows of BLOCK_K (coalesced), its 16-value blocks and
    # value pairs taken apart in registers: every byte of x is read once. The grid covers the scale atoms' padded
    # rows (``rows_pad``, past M) and BLOCK_K is a multiple of 64 (one atom's four blocks): rows past M and blocks
    # past K/16 read as zeros, so their scales are written as 0 and the atom tensor needs no clearing.
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    rk = k0 + tl.arange(0, BLOCK_K)
    m_ok = rm < M
    k_ok = rk < K  # K is a multiple of 32: a pair and a block are all in or all out
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    recip_smooth = tl.load(smooth_recip_ptr + rk, mask=k_ok, other=0.0)
    xs = x * recip_smooth[None, :]
    if WRITE_XS:
        tl.store(xs_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :], xs, mask=mask)
    xb = tl.reshape(xs, (BLOCK_M, BLOCK_K // 16, 16))
    # the block max on the magnitudes' bits, one reduction: integer order is float order for non-negative floats,
    # and +-Inf and every NaN lie at or above 0x7F800000, so the same max tells a block that must read NaN
    mb = tl.max(xb.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    bad = mb >= 0x7F800000
    amax = mb.to(tl.float32, bitcast=True)
    s, s_byte = _e4m3_round(tl.where(bad, 0.0, tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))))
    s = tl.where(bad, float("nan"), s)
    recip = tl.where(s > 0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s), 0.0)  # div.rn; 0 for s = 0 or NaN
    # a NaN block's values (recip 0: NaN for its NaN / Inf entries, else 0) quantize as zeros
    q = tl.where(bad[:, :, None], 0.0, xb * recip[:, :, None])
    # eight codes a 32-bit word, code j of a word in nibble j (even k in the low nibble of each byte, little
    # endian): word stores, where byte stores of split pairs had bound the pass at ~40 % of copy bandwidth
    code = tl.reshape(_e2m1_code_by_rounding(q), (BLOCK_M, BLOCK_K // 8, 8)).to(tl.uint32)
    word = tl.sum(code << (tl.arange(0, 8) * 4).to(tl.uint32)[None, None, :], axis=2)  # disjoint nibbles: sum = or
    rk8 = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    tl.store(codes_ptr + rm.to(tl.int64)[:, None] * (K // 8) + rk8[None, :], word,
             mask=m_ok[:, None] & (rk8 < K // 8)[None, :])
    # scale bytes straight into the tcgen05 scale-factor atom layout (host.sf_atom_offset): a row's four blocks of
    # one atom are four contiguous bytes there, stored as one 32-bit word (block kb % 4 in byte kb % 4)
    sb = tl.reshape(tl.where(bad, 0x7F, s_byte), (BLOCK_M, BLOCK_K // 64, 4))
    sw = tl.sum(sb << (tl.arange(0, 4) * 8)[None, None, :], axis=2)  # bytes <= 0x7F, disjoint: sum = or
    m2 = rm[:, None]
    kw = k0 // 64 + tl.arange(0, BLOCK_K // 64)[None, :]
    woff = ((m2 // 128) * atoms_k + kw) * 128 + (m2 % 32) * 4 + (m2 // 32) % 4
    tl.store(sf_ptr + woff, sw, mask=(m2 < rows_pad) & (kw < atoms_k))


# Rows and columns a program, and warps: measured on the H100 (docs/perf.md, 2026-12-07; the same Triton kernel on
# sm_90): 67-75 % of copy bandwidth at 16 x 256 on 4 warps (8 x 256: 63-68 %), where the first form, one row x 64
# columns a program in strided pairs, ran at 5 %.
BLOCK_M, BLOCK_K, NUM_WARPS = 16, 256, 4


def quantize_act(x: torch.Tensor, smooth_recip: torch.Tensor, want_xs: bool = False, block_m: int | None = None,
                 block_k: int | None = None, num_warps: int | None = None):
    """``x [M, K]`` (bf16/fp16/fp32, unit stride along K) -> ``(codes [M, K/2] uint8, sf flat uint8 in the atom
    layout, xs [M, K] float32 or None)``. ``smooth_recip = 1 / smooth`` (float32, computed once at prepare).
    ``block_m`` x ``block_k`` a program and ``num_warps`` warps (default ``BLOCK_M``, ``BLOCK_K``, ``NUM_WARPS``)."""
    m, k = x.shape
    if k % 32:
        raise ValueError(f"expected in_features % 32 == 0, got {k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m, block_k = block_m or BLOCK_M, block_k or BLOCK_K
    if block_k < 64 or block_k & (block_k - 1):
        raise ValueError(f"expected block_k a power of two >= 64 (whole scale-atom words), got {block_k}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"expected block_m a power of two, got {block_m}")
    rows_pad, kb_pad = host.sf_atom_shape(m, k)
    codes = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    # every byte written by the kernel, the atom's padding (rows past M, blocks past K/16) as scale 0
    sf = torch.empty(rows_pad * kb_pad, dtype=torch.uint8, device=x.device)
    xs = torch.empty(m, k, dtype=torch.float32, device=x.device) if want_xs else codes
    grid = (triton.cdiv(rows_pad, block_m), triton.cdiv(k, block_k))
    if m:
        # no FMA contraction: the contract rounds every multiply on its own. Codes and scales go out as 32-bit
        # words (K % 32 == 0: whole code words a row; an atom row's four scale bytes a word)
        quantize_act_kernel[grid](x, smooth_recip, codes.view(torch.int32), sf.view(torch.int32), xs, m, k,
                                  x.stride(0), kb_pad // 4, rows_pad, WRITE_XS=want_xs, BLOCK_M=block_m,
                                  BLOCK_K=block_k, num_warps=num_warps or NUM_WARPS, enable_fp_fusion=False)
    return codes, sf, (xs if want_xs else None)


def compile_for(arch: str = "sm_100a", x_dtype: str = "bf16"):
    """Compile ``quantize_act_kernel`` for ``arch`` without a GPU; returns the compiled kernel
    (``.asm["sass"]`` when nvdisasm is available, ``.asm["ptx"]`` always)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cap = {"sm_100a": 100, "sm_103a": 103}[arch]
    sig = {"x_ptr": f"*{x_dtype}", "smooth_recip_ptr": "*fp32", "codes_ptr": "*i32", "sf_ptr": "*i32",
           "xs_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32", "atoms_k": "i32", "rows_pad": "i32",
           "WRITE_XS": "constexpr"}
    sig.update(BLOCK_M="constexpr", BLOCK_K="constexpr")
    src = ASTSource(quantize_act_kernel, sig, constexprs={"WRITE_XS": False, "BLOCK_M": BLOCK_M, "BLOCK_K": BLOCK_K})
    return triton.compile(src, target=GPUTarget("cuda", cap, 32),
                          options={"enable_fp_fusion": False, "num_warps": NUM_WARPS})
