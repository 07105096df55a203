"""The sm90 backend's kernel for a few tokens (M <= 64): one launch that reads the 4-bit weight once.

At a handful of tokens a linear is bound by its weight bytes (3072 x 3072: 5.3 MB of codes and scales,
1.2 us at the H200's 4.3 TB/s), and the tensor-core GEMMs leave most of that bandwidth unused: 48-96
CTAs each walk a serial K-loop (docs/perf.md, 230-910 GB/s). This kernel splits K until the grid
holds about ``CTAS_PER_SM`` CTAs per SM, so every SM has several weight tiles in flight; each split
writes an fp32 partial tile and the last split of a weight tile to finish (an atomic counter per
tile) sums the partials in a fixed order (the result does not depend on scheduling) and applies the
epilogue ``y = acc * colscale[n] + lora_act @ proj_up^T + bias``. The counter is left at zero for
the next call.

It serves W4A16 and the exact W4A4 mode; the fast mode does not use it, because quack's FP8 GEMM
measured faster at every M up to 64 (docs/perf.md, 2026-12-04 crossover). It reads the weight in
either layout those modes hold. The repacked blob is read as it lies, a 64-row group's k-run at a
time (16-byte loads, Triton's pipeliner keeping the next runs in flight), and put in row order by a
register permutation; its columns come out in a permuted k order, and the activations are gathered
in that order instead:

- ``CANONICAL``: ``qweight [N, K/2]`` (low nibble = even k), ``wscales [N, K/16]`` E4M3;
- ``QUACK``: the exact mode's quack blob and scale strip (``quack_gemm.repack_weight`` /
  ``repack_scales``, byte permutations of the canonical tensors).

and its activations as

- ``ACT_X``: ``x`` itself (16-bit; W4A16, or the exact activations ``xq`` from ``quantize_act``);
- ``ACT_NVFP4``: ``x`` quantized to NVFP4 inside the kernel (``x / smooth``, per-16 E4M3 scale, E2M1
  codes: the contract's rules, as ``kernels.quantize_act``), each split quantizing its own k-range
  (NVFP4 blocks are independent): no activation pass at all for the exact mode where ``use_fma``.

Every product of a decoded weight and an activation is exact in fp32 (at most 4 x 11 significant
bits), so the result differs from the reference only in FP32 summation order (the contract's
tensor-core tolerance). Tokens go through multiply-adds where ``use_fma`` (each token is one more
pass over the decoded tile) and through ``tl.dot`` above (padded to 16 rows).

What bounds it is the E2M1 decode's instruction count, not the bytes (docs/perf.md, "Small M").
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .kernels import _nvfp4_block_scales, next_pow2
from .tuning import SM_COUNT, sm_count

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

CANONICAL, QUACK = 0, 1
ACT_X, ACT_NVFP4 = 0, 1
MAX_M = 64  # tokens this kernel serves
FMA_MAX_M = 2  # up to this many tokens: multiply-adds instead of a 16-wide dot (use_fma)
CTAS_PER_SM = 8  # the grid the split-K aims at (docs/perf.md: 8 beat 4 at every measured shape but one)
WORDS_BLOCK_K = 128  # the word decode's k-step where K is no multiple of WORDS_TILE's (docs/perf.md, eighth session)
# (block_n, block_k) of the word decode per activation form, measured on the H200 (docs/perf.md, 2026-12-04
# ninth session): 16-bit activations 32 x 256 (2.02x cuBLAS at adaLN 3072x18432); quantized in the
# kernel 64 x 128 (the k-step 256 lost 40 % there)
WORDS_TILE = {ACT_X: (32, 256), ACT_NVFP4: (64, 128)}
WORDS_CHAIN = True  # the word decode's block chain, k reduced after the loop (CHAIN): 2-10 % faster (ninth session)
CHAIN_MAX_M = 4  # tokens the block chain serves (one per-thread accumulator each)


def use_fma(m: int, n: int, k: int) -> bool:
    """Multiply-adds (and, in the exact mode, the activations quantized in the kernel) rather than the
    dot for ``m`` tokens of an ``n x k`` weight. The word decode's block chain decodes a k-step once for
    its tokens and costs each token one more multiply-add a value; the dot costs the same from 1 to 16
    tokens. On the H200 (docs/perf.md, 2026-12-04 tenth session, kernel alone) the chain won at 1 and 2
    tokens at every shape (2 tokens: 24.4 against 32.0 us at 3072x18432, 16.6 against 24.2 at
    12288x3072, 8.6 against 10.5 at 3072x3072), tied at 3 and lost at 4 (36.2 against 31.7 us)."""
    return m <= FMA_MAX_M  # (no tokens: nothing to launch either way)


def sum_chunk(block_n: int, bm: int, use_dot: bool) -> int:
    """Split-K partials the last split loads at once (``SC``). Multiply-adds (1-2 tokens): up to 16, 4096 floats
    a chunk; on the H100 (docs/perf.md, 2026-12-05 fifteenth session, against loading one at a time) 1.01-1.12x
    at 1-2 tokens. The dot: one a time (1.01-1.09x at 4-16 tokens, with the counter's store reset), since chunks
    of 4 at 16 rows measured 0.92-0.96x there."""
    return 1 if use_dot else max(1, min(16, 4096 // (block_n * bm)))


@triton.jit
def _nvfp4_values(xs, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``xs [ROWS, BLOCK_K]`` fp32 -> its NVFP4 values (per-16 E4M3 scale times the nearest-even E2M1
    code; NaN over a block holding a NaN or an Inf), as ``kernels._quantize_act_kernel`` writes them."""
    xb = tl.reshape(xs, (ROWS, BLOCK_K // 16, 16))
    finite, sf, r = _nvfp4_block_scales(xb)
    q = xb * r[:, :, None]
    a = tl.abs(q)
    v = 0.5 * ((a > 0.25).to(tl.float32) + (a >= 0.75).to(tl.float32) + (a > 1.25).to(tl.float32)
               + (a >= 1.75).to(tl.float32))
    v += (a > 2.5).to(tl.float32) + (a >= 3.5).to(tl.float32) + 2.0 * (a > 5.0).to(tl.float32)
    v = tl.where(q < 0, -v, v) * sf[:, :, None]
    v = tl.where((finite != 0)[:, :, None], v, float("nan"))
    return tl.reshape(v, (ROWS, BLOCK_K))


@triton.jit
def _acts(x_ptr, smooth_ptr, rows, rk, M, K, stride_xm, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
          ACT: tl.constexpr, EVEN_K: tl.constexpr):
    """The activations of ``rows`` (``[ROWS]``) at ``rk`` as fp32 ``[ROWS, BLOCK_K]`` (0 outside).
    ``EVEN_K``: every ``rk < K``, so the mask is constant along k and the loads are vectors."""
    if EVEN_K:
        mask = (rows < M)[:, None] & (rk >= 0)[None, :]
    else:
        mask = (rows < M)[:, None] & (rk < K)[None, :]
    a = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACT == 1:
        sm = tl.load(smooth_ptr + rk, mask=rk < K, other=1.0)
        a = _nvfp4_values(a * tl.math.div_rn(tl.full([BLOCK_K], 1.0, tl.float32), sm)[None, :], ROWS, BLOCK_K)
        a = tl.where(mask, a, 0.0)
    return a


@triton.jit
def _epilogue(acc, rn, rm, M, N, R, cs_ptr, bias_ptr, up_ptr, lora_ptr, out_ptr, stride_lm, stride_om,
              BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, RC: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_LORA: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr):
    n_ok = rn < N
    m_ok = rm < M
    acc = acc * tl.load(cs_ptr + rn, mask=n_ok, other=0.0)[:, None]
    if HAS_LORA:  # [BLOCK_N, R] @ [R, BLOCK_M] in chunks of RC columns
        for r0 in range(0, R, RC):
            rr = r0 + tl.arange(0, RC)
            r_ok = rr < R
            up = tl.load(up_ptr + rn[:, None] * R + rr[None, :], mask=n_ok[:, None] & r_ok[None, :],
                         other=0.0).to(tl.float32)
            if USE_DOT:
                lt = tl.load(lora_ptr + rm[None, :] * stride_lm + rr[:, None], mask=m_ok[None, :] & r_ok[:, None],
                             other=0.0).to(tl.float32)
                if DOT_F32:
                    acc = tl.dot(up, lt, acc, input_precision="ieee")
                else:  # bf16 operands (the contract allows them)
                    acc = tl.dot(up.to(tl.bfloat16), lt.to(tl.bfloat16), acc)
            else:
                for mi in tl.static_range(BLOCK_M):
                    lrow = tl.load(lora_ptr + mi * stride_lm + rr, mask=r_ok & (tl.full([RC], mi, tl.int32) < M),
                                   other=0.0).to(tl.float32)
                    s = tl.sum(up * lrow[None, :], axis=1)
                    acc = tl.where(rm[None, :] == mi, acc + s[:, None], acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _load_tile(w_ptr, s_ptr, pid_n, rn_l, k0, K, stride_w, stride_s, LAYOUT: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr):
    """The bytes of one weight tile (codes and scales) as they lie in memory.

    The repacked layout is read as it lies: a 64-row group's ``BLOCK_K`` columns are one contiguous
    run of the blob (16-byte loads); ``_decode_tile`` puts them in row order."""
    if LAYOUT == 0:
        kc = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        if EVEN_K:
            wb = tl.load(w_ptr + rn_l[:, None] * stride_w + kc[None, :])
            sc = tl.load(s_ptr + rn_l[:, None] * stride_s + ks[None, :])
        else:
            wb = tl.load(w_ptr + rn_l[:, None] * stride_w + kc[None, :], mask=(kc < K // 2)[None, :], other=0)
            sc = tl.load(s_ptr + rn_l[:, None] * stride_s + ks[None, :], mask=(ks < K // 16)[None, :], other=0)
    else:
        KT: tl.constexpr = BLOCK_K // 64
        wb = tl.load(w_ptr + pid_n * (K // 64) * 2048 + (k0 // 64) * 2048 + tl.arange(0, KT * 2048))
        sc = tl.load(s_ptr + pid_n * (K // 64) * 256 + (k0 // 64) * 256 + tl.arange(0, KT * 256))
    return wb, sc


@triton.jit
def _decode_tile(wb, sc, k0, LAYOUT: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_load_tile``'s bytes -> fp32 ``[rows, BLOCK_K]`` E2M1 values in the tile's row order, their
    per-16-block E4M3 scale ``[rows, BLOCK_K / 16]`` (applied by the caller a block sum at a time) and
    the k of each column (``[BLOCK_K]``, absolute).

    A repacked tile is put in row order by a register permutation (Triton moves the bytes through
    shared memory). Its columns come out in the k order the permutation gives, and the activations
    are gathered in that order instead: the sum over k does not care."""
    if LAYOUT == 0:
        kx = k0 + tl.arange(0, BLOCK_K)
    else:
        # blob [N/64, K/64, 128, 16]: row 64 g + 16 t2 + 8 p0 + t1, byte column 32 kt + 8 b + 4 p1 + t0
        # (k 64 kt + 16 b + 8 p1 + 2 t0 + nibble) at [g, kt, 32 t2 + 4 t1 + t0, 4 b + 2 p1 + p0]; strip
        # [N/64, K/64, 32, 4, 2]: that row's scale of block 4 kt + b at [g, kt, 8 t2 + t1, b, p0]
        KT: tl.constexpr = BLOCK_K // 64
        wb = tl.permute(tl.reshape(wb, (KT, 4, 8, 4, 4, 2, 2)), (1, 2, 6, 0, 4, 3, 5))  # t2 t1 p0 | kt b t0 p1
        wb = tl.reshape(wb, (64, KT * 32))
        sc = tl.reshape(tl.permute(tl.reshape(sc, (KT, 4, 8, 4, 2)), (1, 2, 4, 0, 3)), (64, KT * 4))
        q = tl.arange(0, BLOCK_K)  # column 64 kt + 16 b + 4 t0 + 2 p1 + nibble
        kx = k0 + (q // 16) * 16 + ((q // 2) % 2) * 8 + ((q // 4) % 4) * 2 + q % 2
    wi = wb.to(tl.int32)  # E2M1 straight from each nibble; element 2i is the low one
    lo = (((wi & 7) << 22) | ((wi & 8) << 28)).to(tl.float32, bitcast=True)
    hi = (((wi & 0x70) << 18) | ((wi & 0x80) << 24)).to(tl.float32, bitcast=True)
    w = tl.interleave(lo, hi) * 8.507059173023462e37  # x 2**126
    sf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return w, sf, kx


@triton.jit
def _e4m3x4_to_f32(word, ASM: tl.constexpr):
    """The four E4M3 bytes of each int32 ``word`` (byte t at bits 8t..8t+7) as four fp32 tensors.
    ``ASM``: two hardware converts (``cvt.rn.f16x2.e4m3x2``, sm_89+) and four f16 widenings a word;
    else (Triton's interpreter) each byte through Triton's own fp8 conversion: the same values."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi, a0, a1, a2, a3;
            .reg .b32 h01, h23;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 h01, lo;
            cvt.rn.f16x2.e4m3x2 h23, hi;
            mov.b32 {a0, a1}, h01;
            mov.b32 {a2, a3}, h23;
            cvt.f32.f16 $0, a0;
            cvt.f32.f16 $1, a1;
            cvt.f32.f16 $2, a2;
            cvt.f32.f16 $3, a3;
            }""",
            constraints="=r,=r,=r,=r,r", args=[word], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
    f0 = (word & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    f1 = ((word >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    f2 = ((word >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    f3 = ((word >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return f0, f1, f2, f3


@triton.jit
def _split8(a, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``a [ROWS, BLOCK_K]`` -> eight ``[ROWS, BLOCK_K / 8]`` tensors, ``a[:, 8 j + i]`` for i = 0..7."""
    c0, c1 = tl.split(tl.reshape(a, (ROWS, BLOCK_K // 8, 2, 2, 2)))  # k = 8 j + 4 u + 2 v + c
    c0v0, c0v1 = tl.split(c0)
    c1v0, c1v1 = tl.split(c1)
    a0, a4 = tl.split(c0v0)
    a2, a6 = tl.split(c0v1)
    a1, a5 = tl.split(c1v0)
    a3, a7 = tl.split(c1v1)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _word_values(word, ASM: tl.constexpr):
    """The eight E2M1 values x 2**-6 of each int32 ``word`` of canonical codes (byte t: k = 8 j + 2 t in
    the low nibble, 8 j + 2 t + 1 in the high one) as fp32, in k order 0, 2, 4, 6, 1, 3, 5, 7. Each
    nibble becomes an E4M3 byte of the same sign whose exponent and mantissa fields hold the code's (an
    E4M3 number of value E2M1 x 2**-6, subnormals included), four at a time in a 32-bit register: three
    logic ops a word a half instead of several a value."""
    ev = ((word & 0x08080808) << 4) | ((word & 0x07070707) << 2)  # even k: low nibbles
    od = (word & -0x7F7F7F80) | ((word >> 2) & 0x1C1C1C1C)  # odd k: high nibbles (-0x7F7F7F80: 0x80808080)
    e0, e2, e4, e6 = _e4m3x4_to_f32(ev, ASM)
    o1, o3, o5, o7 = _e4m3x4_to_f32(od, ASM)
    return e0, e2, e4, e6, o1, o3, o5, o7


@triton.jit
def _words_dot(word, a, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """Per word (8 consecutive k of a weight row): sum over its 8 columns of E2M1 value x 2**-6 times
    the activation, fp32 ``[BLOCK_N, BLOCK_K / 8]``; ``word [BLOCK_N, BLOCK_K / 8]`` int32 of the
    canonical codes (``_word_values``), ``a [1, BLOCK_K]`` fp32."""
    e0, e2, e4, e6, o1, o3, o5, o7 = _word_values(word, ASM)
    a0, a1, a2, a3, a4, a5, a6, a7 = _split8(a, ROWS, BLOCK_K)
    return (e0 * a0 + e2 * a2 + e4 * a4 + e6 * a6) + (o1 * a1 + o3 * a3 + o5 * a5 + o7 * a7)


@triton.jit
def _block_chain(e0, e2, e4, e6, o1, o3, o5, o7, f0, f2, f4, f6, p1, p3, p5, p7, a, ROWS: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Per 16-k block, the sum of its 16 products of decoded values (``_word_values`` of a block's two
    words: ``e``/``o`` the first, ``f``/``p`` the second) and the activations ``a [1, BLOCK_K]``, in one
    chain of multiply-adds (one multiply, fifteen fused): fp32 ``[BLOCK_N, BLOCK_K / 16]``."""
    a_lo, a_hi = tl.split(tl.permute(tl.reshape(a, (ROWS, BLOCK_K // 16, 2, 8)), (0, 1, 3, 2)))
    a0, a1, a2, a3, a4, a5, a6, a7 = _split8(tl.reshape(a_lo, (ROWS, BLOCK_K // 2)), ROWS, BLOCK_K // 2)
    b0, b1, b2, b3, b4, b5, b6, b7 = _split8(tl.reshape(a_hi, (ROWS, BLOCK_K // 2)), ROWS, BLOCK_K // 2)
    s = e0 * a0
    s = s + o1 * a1
    s = s + e2 * a2
    s = s + o3 * a3
    s = s + e4 * a4
    s = s + o5 * a5
    s = s + e6 * a6
    s = s + o7 * a7
    s = s + f0 * b0
    s = s + p1 * b1
    s = s + f2 * b2
    s = s + p3 * b3
    s = s + f4 * b4
    s = s + p5 * b5
    s = s + f6 * b6
    s = s + p7 * b7
    return s


@triton.jit
def _word_step_inputs(x_ptr, smooth_ptr, s_ptr, rn_l, k0, M, K, stride_xm, stride_s, BLOCK_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, ACT: tl.constexpr):
    """The block scales and the activations of tokens 0 and 1 (token 0's again for one token) of the
    k-step at ``k0``, masked past K: what ``PREFETCH`` loads a step ahead."""
    ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    sc = tl.load(s_ptr + rn_l[:, None] * stride_s + ks[None, :], mask=(ks < K // 16)[None, :], other=0)
    rk = k0 + tl.arange(0, BLOCK_K)
    a0 = _acts(x_ptr, smooth_ptr, tl.full([1], 0, tl.int32), rk, M, K, stride_xm, 1, BLOCK_K, ACT, False)
    a1 = a0
    if BLOCK_M > 1:
        a1 = _acts(x_ptr, smooth_ptr, tl.full([1], 1, tl.int32), rk, M, K, stride_xm, 1, BLOCK_K, ACT, False)
    return sc, a0, a1


@triton.jit
def _small_m_kernel(
    x_ptr, smooth_ptr, w_ptr, s_ptr, cs_ptr, bias_ptr, up_ptr, lora_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, R, stride_xm, stride_lm, stride_om, stride_w, stride_s, k_per_split, SPLIT_K,
    LAYOUT: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, RC: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, IS_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    WORDS: tl.constexpr = False, ASM: tl.constexpr = False, PREFETCH: tl.constexpr = False,
    CHAIN: tl.constexpr = False, SC: tl.constexpr = 1,
):
    # WORDS (canonical layout, multiply-adds, K % BLOCK_K == 0): the codes read and decoded a 32-bit
    # word at a time (_word_values), the activations gathered to match, block scales x 64. PREFETCH
    # (with WORDS): each k-step's activations and block scales loaded one step ahead, in registers
    # (ncu: a third of the word loop's stalls wait on those loads, issued and consumed in the step).
    # CHAIN (with WORDS, up to 4 tokens): the codes decoded once a k-step; per token a block's 16 products
    # in one multiply-add chain (_block_chain), times the block scale into per-thread [BLOCK_N,
    # BLOCK_K / 16] sums, reduced across k once after the loop instead of a cross-thread sum every trip
    if CHAIN:
        tl.static_assert(WORDS and BLOCK_M <= 4, "CHAIN goes with the word decode's one to four tokens")
    if PREFETCH:
        tl.static_assert(WORDS and BLOCK_M <= 2, "PREFETCH goes with the word decode's one or two tokens")
    if WORDS:
        tl.static_assert(not USE_DOT, "the word decode goes with the multiply-add form")
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    ri = tl.arange(0, BLOCK_N)
    if LAYOUT == 0:
        rn = pid_n * BLOCK_N + ri
    else:  # a repacked group (BLOCK_N = 64) comes out as rows 16 t + 2 r + p = row 16 t + 8 p + r
        rn = pid_n * 64 + (ri // 16) * 16 + (ri % 2) * 8 + (ri // 2) % 8
    rn_l = rn % N  # clamped rows for loads; stores are masked
    rm = tl.arange(0, BLOCK_M)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    accb0 = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)  # CHAIN's per-block sums, token 0 ...
    accb1 = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)  # ... token 1 ...
    accb2 = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)  # ... token 2 ...
    accb3 = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)  # ... and token 3 (unused ones cost nothing)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if PREFETCH:  # the first k-step's scales and activations, ahead of the loop
        sc_nx, a0_nx, a1_nx = _word_step_inputs(x_ptr, smooth_ptr, s_ptr, rn_l, k_lo, M, K, stride_xm, stride_s,
                                                BLOCK_K, BLOCK_M, ACT)
    # A few tokens make this loop bound by the weight bytes in flight: Triton's pipeliner keeps
    # NUM_STAGES - 1 tiles of them coming (asynchronous copies to shared memory) while one is decoded.
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        if WORDS:
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
            word = tl.load(w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rn_l[:, None] * (stride_w // 4)
                           + kw[None, :])
            if PREFETCH:  # this step's, loaded during the last one; then the next step's (masked past K)
                sc = sc_nx
                a0 = a0_nx
                a1 = a1_nx
                sc_nx, a0_nx, a1_nx = _word_step_inputs(x_ptr, smooth_ptr, s_ptr, rn_l, k0 + BLOCK_K, M, K, stride_xm,
                                                        stride_s, BLOCK_K, BLOCK_M, ACT)
            else:
                sc = tl.load(s_ptr + rn_l[:, None] * stride_s + ks[None, :])
            sf64 = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0  # the decode's 2**-6 back
            rk = k0 + tl.arange(0, BLOCK_K)
            if CHAIN:  # the codes decoded once a k-step, whatever the tokens (_words_dot decodes per token)
                w_lo, w_hi = tl.split(tl.reshape(word, (BLOCK_N, BLOCK_K // 16, 2)))  # k 16 j + [0, 8) / + [8, 16)
                e0, e2, e4, e6, o1, o3, o5, o7 = _word_values(w_lo, ASM)
                f0, f2, f4, f6, p1, p3, p5, p7 = _word_values(w_hi, ASM)
            for mi in tl.static_range(BLOCK_M):
                if mi < M or mi == 0:
                    if PREFETCH:
                        if mi == 0:
                            a = a0
                        else:
                            a = a1
                    else:
                        a = _acts(x_ptr, smooth_ptr, tl.full([1], mi, tl.int32), rk, M, K, stride_xm, 1, BLOCK_K, ACT,
                                  True)
                    if CHAIN:
                        s = _block_chain(e0, e2, e4, e6, o1, o3, o5, o7, f0, f2, f4, f6, p1, p3, p5, p7, a, 1,
                                         BLOCK_K) * sf64
                        if mi == 0:
                            accb0 = s + accb0
                        elif mi == 1:
                            accb1 = s + accb1
                        elif mi == 2:
                            accb2 = s + accb2
                        else:
                            accb3 = s + accb3
                    else:
                        pw = _words_dot(word, a, 1, BLOCK_K, ASM)
                        blk = tl.sum(tl.reshape(pw, (BLOCK_N, BLOCK_K // 16, 2)), axis=2)
                        s = tl.sum(blk * sf64, axis=1)
                        acc = tl.where(rm[None, :] == mi, acc + s[:, None], acc)
        else:
            wb, sc = _load_tile(w_ptr, s_ptr, pid_n, rn_l, k0, K, stride_w, stride_s, LAYOUT, BLOCK_K, EVEN_K)
            w, sf, rk = _decode_tile(wb, sc, k0, LAYOUT, BLOCK_K)
            if USE_DOT:
                w = tl.reshape(tl.reshape(w, (BLOCK_N, BLOCK_K // 16, 16)) * sf[:, :, None], (BLOCK_N, BLOCK_K))
                a = _acts(x_ptr, smooth_ptr, rm, rk, M, K, stride_xm, BLOCK_M, BLOCK_K, ACT, EVEN_K)
                if DOT_F32:  # the CPU interpreter: exact fp32 values
                    acc = tl.dot(w, tl.trans(a), acc, input_precision="ieee")
                elif ACT == 0:
                    acc = tl.dot(w.to(x_ptr.dtype.element_ty), tl.trans(a).to(x_ptr.dtype.element_ty), acc)
                else:  # NVFP4 values are exact in bf16
                    acc = tl.dot(w.to(tl.bfloat16), tl.trans(a).to(tl.bfloat16), acc)
            else:
                for mi in tl.static_range(BLOCK_M):
                    if mi < M or mi == 0:  # the padded tokens cost nothing
                        a = _acts(x_ptr, smooth_ptr, tl.full([1], mi, tl.int32), rk, M, K, stride_xm, 1, BLOCK_K, ACT,
                                  EVEN_K)
                        # block sums of exact products, then the block scale: one multiply a block, not a value
                        blk = tl.sum(tl.reshape(w * a, (BLOCK_N, BLOCK_K // 16, 16)), axis=2)
                        s = tl.sum(blk * sf, axis=1)
                        acc = tl.where(rm[None, :] == mi, acc + s[:, None], acc)

    if CHAIN:
        acc = tl.where(rm[None, :] == 0, acc + tl.sum(accb0, axis=1)[:, None], acc)
        if BLOCK_M > 1:
            acc = tl.where(rm[None, :] == 1, acc + tl.sum(accb1, axis=1)[:, None], acc)
        if BLOCK_M > 2:
            acc = tl.where(rm[None, :] == 2, acc + tl.sum(accb2, axis=1)[:, None], acc)
            acc = tl.where(rm[None, :] == 3, acc + tl.sum(accb3, axis=1)[:, None], acc)
    if not IS_SPLIT:
        _epilogue(acc, rn, rm, M, N, R, cs_ptr, bias_ptr, up_ptr, lora_ptr, out_ptr, stride_lm, stride_om,
                  BLOCK_N, BLOCK_M, RC, HAS_BIAS, HAS_LORA, USE_DOT, DOT_F32)
    else:
        num_n = tl.num_programs(0)
        tile = BLOCK_N * BLOCK_M
        local = ri[:, None] * BLOCK_M + rm[None, :]
        tl.store(part_ptr + (pid_k * num_n + pid_n) * tile + local, acc)
        tl.debug_barrier()  # every thread's partial is written before the counter moves
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:  # the last split of this tile: the partials' sum, then the epilogue
            # SC partials loaded at once (one round trip to L2 a chunk, not one a split), each chunk added as a
            # tree, chunks in order: a fixed order
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s0 in range(0, SPLIT_K, SC):
                rs = s0 + tl.arange(0, SC)
                acc += tl.sum(tl.load(part_ptr + (rs[:, None, None] * num_n + pid_n) * tile + local[None, :, :],
                                      mask=(rs < SPLIT_K)[:, None, None], other=0.0, cache_modifier=".cg"), axis=0)
            # ready for the next call: a plain store (no other CTA touches the counter again in this launch;
            # the next launch follows this one)
            tl.store(cnt_ptr + pid_n, 0)
            _epilogue(acc, rn, rm, M, N, R, cs_ptr, bias_ptr, up_ptr, lora_ptr, out_ptr, stride_lm,
                      stride_om, BLOCK_N, BLOCK_M, RC, HAS_BIAS, HAS_LORA, USE_DOT, DOT_F32)


# ---- host side ------------------------------------------------------------------------------------

_SYNC_WORDS: dict[tuple, torch.Tensor] = {}
ARENA_WORDS = 1 << 20  # zeroed words a device sets aside for launches captured in CUDA graphs (4 MB)
_ARENAS: dict[torch.device, list] = {}  # device -> [zeroed int32 buffer, next free word]
_CAPTURED: list[torch.Tensor] = []  # words allocated inside a capture (no arena left): kept for the graphs


def _cuda_device(device: torch.device) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


def reserve_sync_words(device: torch.device) -> None:
    """Sets the device's arena aside (once; never inside a capture or a trace): the words launches take."""
    if device.type != "cuda" or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return
    device = _cuda_device(device)
    if device not in _ARENAS:
        _ARENAS[device] = [torch.zeros(ARENA_WORDS, dtype=torch.int32, device=device), 0]


def _carve(device: torch.device, n: int) -> torch.Tensor | None:
    """``n`` words (whole 128-byte lines) of the device's arena never handed out before, or None."""
    arena = _ARENAS.get(_cuda_device(device))
    n32 = -(-max(n, 32) // 32) * 32
    if arena is None or arena[1] + n32 > arena[0].numel():
        return None
    buf = arena[0][arena[1]:arena[1] + n32]
    arena[1] += n32
    return buf


def sync_words(device: torch.device, n: int, name: str = "small_m") -> torch.Tensor:
    """At least ``n`` zeroed int32 words for a kernel that leaves them at zero (split-K counters, tickets).

    Eager launches share one buffer per (device, stream, kernel): they run in stream order. A launch
    captured in a CUDA graph gets words of its own, never handed out again: graphs that share a capture
    stream (PyTorch's default) may be replayed at once on different streams, and a replaced buffer may
    still be referenced by an earlier graph. On CUDA both come from the device's arena, zeroed when it
    was set aside outside any capture (``reserve_sync_words``: the backend's ``prepare`` and the first
    eager call), so a graph holds no memset for them and no buffer lives in a graph's memory pool (a
    pool may hand its memory to other tensors). With the arena used up, words are allocated where the
    call is (inside a capture: zeroed by a memset node, kept for the process)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing:
        buf = _carve(device, n)
        if buf is None:
            buf = torch.zeros(-(-max(n, 32) // 32) * 32, dtype=torch.int32, device=device)
            _CAPTURED.append(buf)
        return buf
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream, name)
    buf = _SYNC_WORDS.get(key)
    if buf is None or buf.numel() < n:
        buf = None
        if device.type == "cuda":
            reserve_sync_words(device)
            buf = _carve(device, max(n, 1024))
        if buf is None:
            buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _SYNC_WORDS[key] = buf
    return buf


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per weight tile (``sync_words``): each launch leaves them at zero."""
    return sync_words(device, n)


def block_k_for(layout: int, k: int, block_k: int = 128) -> int:
    """The k-step: for quack's blob a run of whole 64-k blob tiles that divides K, so its loads need no
    mask; for the canonical layout any power of two (the tail is masked)."""
    if layout == QUACK:
        if k % 128:
            raise ValueError(f"the repacked layout needs in_features % 128 == 0, got {k}")
        bk = max(64, block_k // 64 * 64)
        while k % bk:
            bk //= 2
        return max(bk, 64)
    return min(block_k, max(16, next_pow2(k)))


def split_for(block_m: int, n: int, k: int, block_n: int, block_k: int, sms: int = SM_COUNT) -> int:
    """K splits: about ``CTAS_PER_SM`` CTAs per SM, while the fp32 partials (``block_m`` columns a
    tile, written and read once) stay under half the weight's bytes."""
    tiles = -(-n // block_n)
    steps = -(-k // block_k)
    want = max(1, round(CTAS_PER_SM * sms / tiles))
    cap = max(1, int(0.5 * k * 0.5625 / (8 * block_m)))  # split * M * 8 B <= half of K * 0.5625 B
    split = min(want, cap, steps)
    per = -(-steps // split)
    return -(-steps // per)


def linear(x: torch.Tensor, layout: int, w: torch.Tensor, s: torch.Tensor, colscale: torch.Tensor, n: int, *,
           act: int, out_dtype: torch.dtype, smooth: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           proj_up: torch.Tensor | None = None, lora_act: torch.Tensor | None = None,
           block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
           num_warps: int | None = None, num_stages: int = 3, words: bool | None = None,
           maxnreg: int | None = None, prefetch: bool = False, chain: bool | None = None,
           fma: bool | None = None) -> torch.Tensor:
    """``out [M, N] = (A(x) @ W^T) * colscale + lora_act @ proj_up^T + bias`` for M <= 64.

    ``x [M, K]`` with unit stride along K (16-bit for ``ACT_X``; any float for ``ACT_NVFP4``, which
    needs ``smooth``); ``w``/``s`` the weight in ``layout`` (``CANONICAL`` or ``QUACK``);
    ``colscale [N]`` fp32 (``wcscale``); ``bias [N]``; ``proj_up [N, R]`` contiguous with
    ``lora_act [M, R]`` (unit stride along R). ``words`` (default: on where it applies: the
    canonical layout, multiply-adds, K a multiple of the k-step) decodes the codes a 32-bit word at a
    time. ``maxnreg`` caps the kernel's registers, ``prefetch`` (with the word decode) loads each k-step's
    activations and scales one step ahead: both for measurement. ``chain`` (with the word decode; default
    ``WORDS_CHAIN``; up to ``CHAIN_MAX_M`` tokens) decodes a k-step's codes once, sums each block's products
    per token in one multiply-add chain and reduces across k once after the loop. ``fma`` forces the
    multiply-add form (True) or the dot (False) instead of ``use_fma``'s rule."""
    m, k = x.shape
    if m > MAX_M:
        raise ValueError(f"the small-M kernel serves at most {MAX_M} tokens, got {m}")
    if layout not in (CANONICAL, QUACK) or act not in (ACT_X, ACT_NVFP4):
        raise ValueError(f"expected layout CANONICAL or QUACK and act ACT_X or ACT_NVFP4, got {layout}, {act}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if _INTERPRET and out_dtype != torch.float32:
        # The CPU interpreter's fp32 -> 16-bit conversion does not round to nearest: cast outside.
        return linear(x, layout, w, s, colscale, n, act=act, out_dtype=torch.float32, smooth=smooth, bias=bias,
                      proj_up=proj_up, lora_act=lora_act, block_n=block_n, block_k=block_k, split_k=split_k,
                      num_warps=num_warps, num_stages=num_stages, words=words, maxnreg=maxnreg,
                      prefetch=prefetch, chain=chain, fma=fma).to(out_dtype)
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if m == 0:
        return out
    if act == ACT_NVFP4 and smooth is None:
        raise ValueError("ACT_NVFP4 needs smooth")
    r = 0 if lora_act is None else lora_act.shape[1]
    if r and (proj_up is None or proj_up.shape != (n, r) or not proj_up.is_contiguous() or lora_act.stride(1) != 1):
        raise ValueError(f"proj_up must be a contiguous [{n}, {r}] tensor beside lora_act [M, {r}]")
    if r:  # proj_up's row stride is R: the padded columns of a prepared lora_act are not read
        r = proj_up.shape[1]
    use_dot = not (use_fma(m, n, k) if fma is None else fma)
    # the word decode reads the canonical codes as int32 words: multiply-adds, K a multiple of the k-step (a
    # word decode for the dot measured 1.3-7x slower than the per-byte one: docs/perf.md, tenth session)
    word_ok = layout == CANONICAL and not use_dot and w.data_ptr() % 4 == 0
    wbn, wbk = WORDS_TILE[act]
    wants = (word_ok and k % WORDS_BLOCK_K == 0) if words is None else words
    if block_n is None:  # measured on the H200 (docs/perf.md, 2026-12-04 ninth session)
        block_n = wbn if wants and word_ok and k % wbk == 0 else 64
    if layout == QUACK and block_n != 64:
        raise ValueError(f"the repacked layout is read a 64-row group a tile, got block_n={block_n}")
    # measured on the H200 (docs/perf.md, "Small M", 2026-12-04 eighth and ninth sessions): with the
    # word decode 32 x 256 for 16-bit activations, 64 x 128 when the kernel quantizes them (WORDS_TILE);
    # 64 x 64 with the per-byte decode; 64 x 128 for the dot; 4 warps, three pipeline stages
    if block_k is None:  # the word decode where it applies, at its k-step; else the per-byte one's 64
        block_k = 128 if use_dot else (wbk if k % wbk == 0 else WORDS_BLOCK_K) if wants else 64
    bk = block_k_for(layout, k, block_k)
    num_warps = num_warps or 4
    bm = max(16, next_pow2(m)) if use_dot else next_pow2(m)
    split = split_k or split_for(bm, n, k, block_n, bk, sm_count(x.device))
    steps = -(-k // bk)
    per = -(-steps // split)
    split = -(-steps // per)
    tiles = -(-n // block_n)
    fits = word_ok and k % bk == 0
    if words and not fits:
        raise ValueError(f"the word decode takes the canonical layout, multiply-adds (1-2 tokens, or fma=True), a "
                         f"4-byte aligned qweight and K a multiple of the k-step ({bk}); got K={k}")
    words = fits if words is None else words
    if prefetch and (not words or bm > 2):
        raise ValueError(f"prefetch goes with the word decode (words=True where it applies) and 1-2 tokens, got {m}")
    if chain and (not words or bm > CHAIN_MAX_M):
        raise ValueError(f"chain goes with the word decode (words=True where it applies) and at most {CHAIN_MAX_M} "
                         f"tokens, got {m}")
    chain = bool(words) and bm <= CHAIN_MAX_M and (WORDS_CHAIN if chain is None else chain)
    dummy = colscale
    part = torch.empty(split * tiles * block_n * bm, device=x.device, dtype=torch.float32) if split > 1 else dummy
    cnt = _counters(x.device, tiles) if split > 1 else dummy
    _small_m_kernel[(tiles, split)](
        x, smooth if smooth is not None else dummy, w, s.view(torch.uint8), colscale,
        bias if bias is not None else dummy, proj_up if r else dummy, lora_act if r else dummy, out, part, cnt,
        m, n, k, r, x.stride(0), lora_act.stride(0) if r else 0, out.stride(0), k // 2, k // 16, per * bk, split,
        LAYOUT=layout, ACT=act, BLOCK_N=block_n, BLOCK_M=bm, BLOCK_K=bk,
        RC=min(64, max(16, next_pow2(r or 16))), EVEN_K=k % bk == 0, NUM_STAGES=num_stages,
        IS_SPLIT=split > 1, HAS_BIAS=bias is not None, HAS_LORA=bool(r),
        USE_DOT=use_dot, DOT_F32=_INTERPRET, WORDS=bool(words), ASM=bool(words) and not _INTERPRET,
        PREFETCH=bool(prefetch), CHAIN=chain, SC=sum_chunk(block_n, bm, use_dot) if split > 1 else 1,
        num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    return out
