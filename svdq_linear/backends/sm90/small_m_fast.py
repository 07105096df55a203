"""The sm90 fast mode at 1 to 64 tokens in one launch: the activation pass, ``lora_act``, the 4-bit x E4M3
product, the split-K sum and the epilogue of ``nvfp4.w4a8_fast_linear`` in one kernel.

At a few tokens a linear is bound by its weight bytes, and the fast mode's routed path is up to five
kernels (the FP8 activation pass, cuBLAS's ``lora_act`` GEMM and its reduction, ``small_m_mma`` or
quack's GEMM, the split-K epilogue). In a CUDA graph each costs ~2 us however little it does
(docs/perf.md: 20.4 us at 12288 x 3072 and one token where ``small_m_mma`` alone took 10.8-12.9), so
the issue's 2x cuBLAS needs them in one launch. The work that the whole row feeds (the token's amax,
``lora_act``'s sum over K, the E4M3 activations) is done by the first CTAs to start, which the others
wait for:

- **Roles by ticket.** Each CTA takes a ticket (an atomic counter) as it starts. The first ``P`` are
  *producers*: each owns a k-chunk (whole k-tiles), publishes the tokens' partial max of
  ``|x / smooth|`` (``atomic_max`` on the float's bits: a NaN's bits exceed +Inf's, so a NaN wins as
  ``amax`` propagates it) and counts itself in, then writes its chunk's ``x @ (proj_down / smooth)``
  partial (slot ``p`` of ``P + 1`` fp32 ``[BM, R]`` slots) and counts itself in again; the last to do so
  adds the ``P`` partials into slot ``P`` (``lora_act``) while the workers run and counts once more. Above
  two tokens the next ``P`` are *quantizers*: once every producer's max is in, each writes its chunk of
  ``a8 = e4m3(x / smooth * r)`` in the GEMM's k order (``fast_layout``) and counts itself in. The rest are
  *workers* ``(64-row group, split)``. Producers wait for nothing, quantizers only for producers, workers only
  for those two: every CTA waited for holds a lower ticket and so is running, whatever the launch order or the
  occupancy. A ticket past the grid (sync words not left at zero) does nothing.
- **Workers** prefetch their split's weight lines into L2, wait, take ``sa`` and ``r = min(1 / sa,
  FLT_MAX)`` as ``nvfp4.fast_act`` does, and walk their k-tiles of the fast blob: per k-tile the
  thread's strip word gives four tables ``e4m3(m * g)`` (four ``HMUL2`` and four
  ``cvt.rn.satfinite.e4m3x2.f16x2`` a table) and each code word two ``prmt`` lookups and two sign
  merges (``quack_fast``'s decode, bit for bit ``nvfp4.fast_weight``). Then
  - above two tokens (``DOT``): the decoded bytes, permuted as rows ``16 w + 8 p + rq`` by positions
    ``16 word + 4 c + j``, are exactly wgmma's register A fragment, so Triton issues FP8 ``wgmma``
    (``QGMMA.64xBMx32``) on them with the quantizers' ``a8`` tile from shared memory: 2.6-3.2
    instructions a weight value whatever the tokens;
  - at one or two tokens: two ``cvt.rn.f16x2.e4m3x2``, widenings and one fp32 FFMA a value a token with
    the token's activations quantized by the worker itself (logical k ``32 c + 4 word + j``), so no
    quantizer phase: 5.1 instructions a value at one token, 6.6 at two.

  E4M3 x E4M3 products are exact in fp32: the multiply-adds differ from the contract only in fp32
  summation order; the FP8 dots accumulate in Hopper's FP8 tensor-core accumulator (fewer than 24
  significant bits between fp32 promotions), the deviation ``nvfp4``'s fast contract allows (the quack
  GEMM's too: ``tests/test_sm90_fast.py``'s bound).
- **The sum and the epilogue.** Each worker writes its fp32 partial ``[64, BM]``; the last worker of a
  group (a counter) adds the partials in a fixed order (chunks loaded at once, each summed as a tree,
  chunks in order: the result does not depend on scheduling; the producers' sum likewise), waits for
  ``lora_act`` and writes ``acc * sa * (2**e * wcscale) + bias + lora_act @ proj_up^T`` (above two
  tokens on bf16 tensor cores: proj_up in bf16, ``lora_act`` as two bf16 parts). The last CTA to
  finish zeroes the ticket, the counts and the
  amax words, so the next launch on the stream needs no memset; a launch captured in a CUDA graph has
  words of its own (``small_m.sync_words``: zeroed beforehand, outside the capture).

**The exact mode at one or two tokens** (``linear_exact``, ``EXACT``) runs in the same launch structure on
quack's exact blob and strip (what the exact mode's prepared state holds). NVFP4 blocks need no token-wide
amax, so the producers write their chunk's activations at once: per token and 16-block the E4M3 scale and the
E2M1 codes times 2 as int8, four to a word in the blob's k order, and the words' negations (``_exact_acts``).
The workers look each weight code up as its magnitude times 2 with ``prmt`` (a negative code reads 0 in the
sign-replicate mode; with the sign bits flipped, the positive ones do) and take ``dp4a`` products with the
activation words and their negations: 12 instructions for 8 weight values. A block's four words are one
thread's and add as integers; then one convert and one FFMA a block and row with its two scales (``_idp``,
``_product_exact``). A block's sum is exact in int32 and its
scaling exact in fp32, so the result differs from the contract only in fp32 summation order (and in
``lora_act``'s bf16 operands, as everywhere). The epilogue is the fast mode's with 1/4 as the tokens' scale.

Under Triton's interpreter the programs run one after another in ticket order (producers, quantizers,
workers), so no wait ever spins there; the E4M3 conversions and the code-word lookups are done by
arithmetic there, and the permutation into the dot's operand is the GPU's own code.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fast_layout import DECODE_ASM, TILE_K, table_asm
from .kernels import _e2m1_mag, _e4m3_bits, _gemm_k, _nvfp4_block_scales, _rne_bf16, _round_e4m3, next_pow2
from .small_m import _e4m3x4_to_f32, sync_words
from .tuning import SM_COUNT, sm_count

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

MAX_M = 64  # tokens this kernel serves
FMA_MAX_M = 2  # up to this many tokens the workers quantize their own activations and multiply-add (else FP8 dots)
DOTS_AT_2_MIN_WEIGHTS = 1 << 24  # at 2 tokens, weights of at least this many values take the FP8 dots (use_dots)
# Workers an SM the split-K aims at. By default ``linear`` takes as many as the compiled kernel's registers and
# shared memory let stay resident on an SM (``fitted_ctas_per_sm``), up to CTAS_PER_SM_MAX (a grid planned for
# more than fits runs its last workers in a second wave: traced on the H200, thirteenth session, 8 an SM
# started the last CTAs 10-16 us late). Same run on the H100 (docs/perf.md, seventeenth session,
# ``bench_small_m_fast.py --configs``): the fixed 5 it replaces was up to 1.17x slower where 4 or 6 fit; 7 or 8
# under a register cap spilled and lost up to 40 %; eight warps a CTA lost at 1-2 tokens and on the large
# layers at 16 (won up to 1.09x at 64 tokens and at the 3072 x 3072 layer with 16).
# CTAS_PER_SM stays the target where no compiled kernel says what fits (the interpreter, ``grid_size``).
CTAS_PER_SM = 5
CTAS_PER_SM_MAX = 6
PRODUCERS_MAX = 32  # k-chunks of the row-wide work (amax, lora_act)
SPLIT_ROWS = 512  # splits x token rows at most (plan): the partials one CTA a group adds up
# sync words: ticket, amax count, lora count, done count, the tokens' amax bits, then a counter a group
# (each polled or updated word on its own 128-byte line)
_TICKET, _AMAX_CNT, _LORA_CNT, _A8_CNT, _DONE = (tl.constexpr(32 * i) for i in range(5))
_AMAX = tl.constexpr(160)  # the tokens' amax bits (up to MAX_M)
_GROUPS_AT = 256
_GROUPS = tl.constexpr(_GROUPS_AT)
_TK = tl.constexpr(TILE_K)
TRACE_COLS = 16  # a traced launch's int64 columns a CTA (linear's ``trace``)
_TRACE_COLS = tl.constexpr(TRACE_COLS)

# the decode's PTX (fast_layout): the tables of strip bytes 0-3 and the code-word lookup
_TABLE0, _TABLE1, _TABLE2, _TABLE3 = (tl.constexpr(table_asm(q)) for q in range(4))
_DECODE_ASM = tl.constexpr(DECODE_ASM)


@triton.jit
def _tables(sw, Q: tl.constexpr):
    """Strip words -> the two table registers of byte ``Q`` (block ``2 c + Q // 2``, row ``r + 8 (Q % 2)``)."""
    if Q == 0:
        return tl.inline_asm_elementwise(asm=_TABLE0, constraints="=r,=r,r", args=[sw], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    elif Q == 1:
        return tl.inline_asm_elementwise(asm=_TABLE1, constraints="=r,=r,r", args=[sw], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    elif Q == 2:
        return tl.inline_asm_elementwise(asm=_TABLE2, constraints="=r,=r,r", args=[sw], dtype=(tl.int32, tl.int32),
                                         is_pure=True, pack=1)
    return tl.inline_asm_elementwise(asm=_TABLE3, constraints="=r,=r,r", args=[sw], dtype=(tl.int32, tl.int32),
                                     is_pure=True, pack=1)


@triton.jit
def _e2m1_times(mag, g):
    """E2M1 magnitude codes (0..7) times ``g`` in fp32 (exact: 2 x 4 significant bits)."""
    m = (mag << 22).to(tl.float32, bitcast=True) * 8.507059173023462e37  # x 2**126: 0, 0.5, 1, ..., 6
    return m * g


@triton.jit
def _decode_values(word, sw, B: tl.constexpr, ASM: tl.constexpr):
    """Code words of block half ``B`` (``[..., 4]`` int32) and the strip words (``[..., 1]``) -> the 8 E4M3
    values of each word as fp32: rows r (p = 0) and r + 8 (p = 1), positions j = 0..3, in the order
    p0j0, p0j1, p0j2, p0j3, p1j0, ..., p1j3."""
    if ASM:
        ta, tb = _tables(sw, 2 * B)
        ta8, tb8 = _tables(sw, 2 * B + 1)
        r0, r1 = tl.inline_asm_elementwise(asm=_DECODE_ASM, constraints="=r,=r,r,r,r,r,r",
                                           args=[word, ta, tb, ta8, tb8], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=1)
        a0, a1, a2, a3 = _e4m3x4_to_f32(r0, True)
        b0, b1, b2, b3 = _e4m3x4_to_f32(r1, True)
        return a0, a1, a2, a3, b0, b1, b2, b3
    # the interpreter: the same values by arithmetic (the tables' fp16 product is exact, so is fp32's)
    g0 = (((sw >> (16 * B)) & 0xFF) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    g1 = (((sw >> (16 * B + 8)) & 0xFF) << 7).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    a0 = _signed(_round_e4m3(_e2m1_times(word & 7, g0)), word >> 7)
    a1 = _signed(_round_e4m3(_e2m1_times((word >> 4) & 7, g0)), word >> 15)
    a2 = _signed(_round_e4m3(_e2m1_times((word >> 8) & 7, g0)), word >> 23)
    a3 = _signed(_round_e4m3(_e2m1_times((word >> 12) & 7, g0)), word >> 31)
    b0 = _signed(_round_e4m3(_e2m1_times((word >> 16) & 7, g1)), word >> 3)
    b1 = _signed(_round_e4m3(_e2m1_times((word >> 20) & 7, g1)), word >> 11)
    b2 = _signed(_round_e4m3(_e2m1_times((word >> 24) & 7, g1)), word >> 19)
    b3 = _signed(_round_e4m3(_e2m1_times((word >> 28) & 7, g1)), word >> 27)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _signed(v, s):
    return tl.where((s & 1) != 0, -v, v)


@triton.jit
def _act_e4m3(q, ASM: tl.constexpr):
    """fp32 ``q`` -> its E4M3 value as fp32 (nearest even, saturating at 448, NaN for NaN and +-Inf:
    ``nvfp4.round_e4m3``)."""
    finite = tl.abs(q) < float("inf")
    if ASM:
        v = q.to(tl.float8e4nv).to(tl.float32)
    else:
        v = _signed(_round_e4m3(tl.where(finite, tl.abs(q), 0.0)), q.to(tl.int32, bitcast=True) >> 31)
    return tl.where(finite, v, float("nan"))


@triton.jit
def _split4(a):
    """``a [4, 4, 4]`` -> its four ``[4, 4]`` slices along the last axis, in order."""
    lo, hi = tl.split(tl.reshape(a, [4, 4, 2, 2]))  # [c, word, j = 2 u + v]: split v, then u
    a0, a2 = tl.split(lo)
    a1, a3 = tl.split(hi)
    return a0, a1, a2, a3


@triton.jit
def _tile_acts(x_ptr, inv_ptr, m, k0, stride_xm, r, ASM: tl.constexpr):
    """One token's E4M3 activations of the k-tile at ``k0`` as fp32, ``[8 slices (B, j)]`` of ``[4 (c),
    4 (word in the block half)]``: logical k = ``k0 + 32 c + 16 B + 4 word + j``."""
    rk = k0 + tl.arange(0, _TK)
    xs = tl.load(x_ptr + m * stride_xm + rk).to(tl.float32) * tl.load(inv_ptr + rk)
    a = _act_e4m3(xs * r, ASM)
    a = tl.permute(tl.reshape(a, [4, 2, 4, 4]), [0, 2, 3, 1])  # [c, word, j, B]
    h0, h1 = tl.split(a)  # B = 0 / 1: [c, word, j]
    a00, a01, a02, a03 = _split4(h0)
    a10, a11, a12, a13 = _split4(h1)
    return a00, a01, a02, a03, a10, a11, a12, a13


@triton.jit
def _half_fma(word, sw, a0, a1, a2, a3, acc0, acc1, B: tl.constexpr, ASM: tl.constexpr):
    """Rows r (``acc0``) and r + 8 (``acc1``), ``[32, 4, 4]`` per word slot: each word's four products
    multiply-added into its slot (one FFMA a value; the slots are summed once, after the k-loop)."""
    v0, v1, v2, v3, u0, u1, u2, u3 = _decode_values(word, sw, B, ASM)
    acc0 = acc0 + v0 * a0[None, :, :]
    acc0 = acc0 + v1 * a1[None, :, :]
    acc0 = acc0 + v2 * a2[None, :, :]
    acc0 = acc0 + v3 * a3[None, :, :]
    acc1 = acc1 + u0 * a0[None, :, :]
    acc1 = acc1 + u1 * a1[None, :, :]
    acc1 = acc1 + u2 * a2[None, :, :]
    acc1 = acc1 + u3 * a3[None, :, :]
    return acc0, acc1


@triton.jit
def _slots(c0, c1):
    """Two block halves' ``[32, 4, 4]`` slots -> their sum per row slot ``[32]``."""
    return tl.sum(tl.sum(c0 + c1, axis=2), axis=1)


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """``prefetch.global.L2`` of the 128-byte lines of ``[ptr, ptr + nbytes)``, a line a thread a round."""
    for i in range(0, nbytes, 128 * 128):
        off = tl.minimum(i + tl.arange(0, 128) * 128, nbytes - 1)  # past the end: the last line again
        tl.inline_asm_elementwise(asm="prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", constraints="=r,l",
                                  args=[ptr + off], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait(ptr, target, POLL: tl.constexpr = 0):
    """Spin until the counter at ``ptr`` reaches ``target``: relaxed polls (no L1 invalidation a pass), then
    one acquire (what was written before each count is visible after it). ``POLL`` 0 polls with atomics
    (read-modify-writes at L2: every poller of a word queues on its one atomic unit), 1 with volatile loads
    and a short ``nanosleep`` between them (for measurement)."""
    if POLL == 1:
        c = tl.load(ptr, volatile=True)
        while c < target:
            tl.inline_asm_elementwise(asm="nanosleep.u32 64;\n\tmov.u32 $0, 0;", constraints="=r,r", args=[c],
                                      dtype=tl.int32, is_pure=False, pack=1)
            c = tl.load(ptr, volatile=True)
    else:
        c = tl.atomic_add(ptr, 0, sem="relaxed")
        while c < target:
            c = tl.atomic_add(ptr, 0, sem="relaxed")
    c = tl.atomic_add(ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _now(dep):
    """The global timer (ns); ``dep`` orders the read after the value it depends on."""
    return tl.inline_asm_elementwise(asm="mov.u64 $0, %globaltimer;", constraints="=l,r", args=[dep],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _stamp(trace_ptr, slot, t, TRACE: tl.constexpr):
    """With ``TRACE``: the global timer (ns) into ``trace[program, slot]`` (``[grid, TRACE_COLS]`` int64,
    for measurement: where a launch's time goes)."""
    if TRACE:
        tl.store(trace_ptr + tl.program_id(0) * _TRACE_COLS + slot, _now(t))


@triton.jit
def _probe(trace_ptr, slot, ptr, TRACE: tl.constexpr):
    """With ``TRACE``: one int32 load at ``ptr`` past L1 and the global timer when it has arrived into
    ``trace[program, slot]`` (whether a split's weight lines were in L2 yet, or still coming from DRAM)."""
    if TRACE:
        w = tl.load(ptr, cache_modifier=".cg")
        tl.store(trace_ptr + tl.program_id(0) * _TRACE_COLS + slot, _now(w))


@triton.jit
def _sleep(ns: tl.constexpr):
    """Spin on the global timer for ``ns`` nanoseconds (a test's delay)."""
    t0 = _now(ns)
    now = t0
    while now - t0 < ns:
        now = _now(t0)


@triton.jit
def _token_scales(sync_ptr, rm, m_ok, BM: tl.constexpr):
    """The tokens' ``(sa, r)`` from the published amax bits, as ``nvfp4.fast_act``: ``sa = amax / 448`` (1 for
    an all-zero row and where a NaN is in the row), ``r = min(1 / sa, FLT_MAX)``."""
    mx = tl.load(sync_ptr + _AMAX + rm, mask=m_ok, other=0, cache_modifier=".cg")  # (after an acquire)
    ok = (mx > 0) & (mx <= 0x7F800000)
    sa = tl.where(ok, tl.math.div_rn(mx.to(tl.float32, bitcast=True), tl.full([BM], 448.0, tl.float32)), 1.0)
    r = tl.minimum(tl.math.div_rn(tl.full([BM], 1.0, tl.float32), sa), 3.4028234663852886e38)
    return sa, r


@triton.jit
def _bf16(v, ASM: tl.constexpr):
    """fp32 ``v`` rounded to bf16 (nearest even) and back (the interpreter's cast truncates: by arithmetic)."""
    if ASM:
        return v.to(tl.bfloat16).to(tl.float32)
    return _rne_bf16(v)


# ---- the exact mode (``linear_exact``): NVFP4 x NVFP4 as integer dot products -----------------------
# quack's nvfp4 blob (``quack_gemm.repack_weight``) as int32 words: [N/64, K/64, 128 slots (32 t2 + 4 t1 + t0),
# 4 words (b)]; word b of a slot holds byte 2 p1 + p0 = the codes of row 16 t2 + 8 p0 + t1 at k 16 b + 8 p1 +
# 2 t0 + nibble of its 64-k tile. So the low halves of bytes (0, 2) are row r's four codes at k 16 b + 2 t0 +
# (0, 1, 8, 9), bytes (1, 3) row r + 8's at the same k. An activation word (int8 x 4) holds the token's codes
# times 2 at those four k; its negation is kept beside it.
_TABLE_LO = tl.constexpr(0x03020100)  # E2M1 magnitudes 0..7 times 2, a byte each: 0, 1, 2, 3 | 4, 6, 8, 12
_TABLE_HI = tl.constexpr(0x0C080604)
_IDP_ASM = tl.constexpr("""{
    .reg .b32 cr, cq, xr, xq, t0, t1, t2, t3;
    prmt.b32 cr, $2, 0, 0x0020;
    prmt.b32 cq, $2, 0, 0x0031;
    xor.b32 xr, cr, 0x8888;
    xor.b32 xq, cq, 0x8888;
    prmt.b32 t0, $5, $6, cr;
    prmt.b32 t1, $5, $6, xr;
    prmt.b32 t2, $5, $6, cq;
    prmt.b32 t3, $5, $6, xq;
    dp4a.s32.s32 $0, t0, $3, 0;
    dp4a.s32.s32 $0, t1, $4, $0;
    dp4a.s32.s32 $1, t2, $3, 0;
    dp4a.s32.s32 $1, t3, $4, $1;
    }""")


@triton.jit
def _e2m1x2(code):
    """E2M1 codes (sign in bit 3) -> their values times 2 as integers (-12..12)."""
    mag = code & 7
    v = tl.where(mag < 4, mag, (2 + (mag & 1)) << tl.maximum((mag >> 1) - 1, 0))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _sbyte(w, j: tl.constexpr):
    """Signed byte ``j`` of int32 ``w``."""
    return (w << (24 - 8 * j)) >> 24


@triton.jit
def _idp(word, aw, an, lo, hi, ASM: tl.constexpr):
    """Blob words x activation words -> ``(row r, row r + 8)`` int32 sums of the four products each (codes
    times 2 on both sides: 4x the value). On the GPU ``prmt`` looks the codes up as magnitudes; a code with its
    sign bit set reads 0 there (``prmt``'s sign-replicate mode on a table of non-negative bytes), so the
    positive codes dot the activations and, with the sign bits flipped, the negative ones dot their negation:
    two ``dp4a`` a row. ``lo`` / ``hi``: the table (``_TABLE_LO`` / ``_TABLE_HI``), loaded from memory so that
    ptxas keeps it in two registers (as an immediate it re-made it before each lookup: 22 more instructions a
    k-tile). The interpreter: the same sums by arithmetic."""
    if ASM:
        return tl.inline_asm_elementwise(asm=_IDP_ASM, constraints="=r,=r,r,r,r,r,r", args=[word, aw, an, lo, hi],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    s_r = (_e2m1x2(word & 15) * _sbyte(aw, 0) + _e2m1x2((word >> 4) & 15) * _sbyte(aw, 1)
           + _e2m1x2((word >> 16) & 15) * _sbyte(aw, 2) + _e2m1x2((word >> 20) & 15) * _sbyte(aw, 3))
    s_q = (_e2m1x2((word >> 8) & 15) * _sbyte(aw, 0) + _e2m1x2((word >> 12) & 15) * _sbyte(aw, 1)
           + _e2m1x2((word >> 24) & 15) * _sbyte(aw, 2) + _e2m1x2((word >> 28) & 15) * _sbyte(aw, 3))
    return s_r, s_q


@triton.jit
def _pack_bytes(v):
    """int ``[..., 4 t0, 2 p1, 2 nibble]`` (each -128..127) -> int32 ``[..., 4 t0]``: byte 2 p1 + nibble."""
    n0, n1 = tl.split(v)  # nibble 0 / 1: [..., t0, p1]
    b0, b2 = tl.split(n0)
    b1, b3 = tl.split(n1)
    return (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | (b3 << 24)


@triton.jit
def _exact_acts(x_ptr, smooth_ptr, a8_ptr, kt0, kt_hi, M, K, stride_xm, BM: tl.constexpr, NT: tl.constexpr):
    """The 128-k tiles ``[kt0, min(kt0 + NT, kt_hi))`` of every token row's NVFP4 activations
    (``kernels.quantize_act``'s rules: ``x * (1 / smooth)``, the E4M3 block scale of ``amax / 6`` nearest even,
    the nearest-even E2M1 code of ``xs * (1 / scale)``) into ``a8``: int32 words ``[BM, K / 128, 2 (codes x 2,
    negated), 2 h, 4 t0, 4 b]`` (the blob's k order: ``_idp``; b innermost as in the blob's words, so a worker's
    load of a tile's words is vectorized: with t0 innermost Triton 3.6 copied them one word at a time), then the
    block scales ``[BM, K / 16]`` fp32 (NaN for a block holding a NaN or an Inf), then the lookup table's two
    words (``_idp``). Rows past ``M`` are written as zeros. Another CTA writing the same tiles writes the same
    bytes."""
    rm = tl.arange(0, BM)
    rt = tl.arange(0, NT)
    t_ok = kt0 + rt < kt_hi
    rk = kt0 * _TK + tl.arange(0, NT * _TK)
    k_ok = rk < kt_hi * _TK
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm < M)[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    inv = tl.math.div_rn(tl.full([NT * _TK], 1.0, tl.float32), tl.load(smooth_ptr + rk, mask=k_ok, other=1.0))
    xs = x * inv[None, :]
    xb = tl.reshape(xs, (BM, NT * 8, 16))
    finite, sf, r = _nvfp4_block_scales(xb)
    q = xb * r[:, :, None]
    v = _e2m1x2(_e2m1_mag(tl.abs(q)) | ((q < 0).to(tl.int32) << 3))  # the code, then its value times 2
    # k = 128 nt + 64 h + 16 b + 8 p1 + 2 t0 + nibble -> [BM, nt, h, t0, b, p1, nibble]
    v = tl.permute(tl.reshape(v, (BM, NT, 2, 4, 2, 4, 2)), (0, 1, 2, 5, 3, 4, 6))
    KT = K // _TK
    ro = tl.arange(0, 32)
    base = (a8_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (rm[:, None, None] * KT + kt0 + rt[None, :, None]) * 64
            + ro[None, None, :])
    w_ok = t_ok[None, :, None] & (ro >= 0)[None, None, :]
    tl.store(base, tl.reshape(_pack_bytes(v), (BM, NT, 32)), mask=w_ok)
    tl.store(base + 32, tl.reshape(_pack_bytes(-v), (BM, NT, 32)), mask=w_ok)
    sa_ptr = a8_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + BM * KT * 64
    rb = tl.arange(0, NT * 8)
    tl.store(sa_ptr + rm[:, None] * (K // 16) + kt0 * 8 + rb[None, :], tl.where(finite, sf, float("nan")),
             mask=(kt0 * 8 + rb < kt_hi * 8)[None, :])
    tab = a8_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + BM * (KT * 64 + K // 16)
    tl.store(tab + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, _TABLE_LO, _TABLE_HI))


@triton.jit
def _t0_sum(d):
    """``[2, 32, 4 t0, 4 b]`` -> the sums over t0 ``[2, 32, 4 b]``, by splits (in a thread where it holds t0)."""
    a, b = tl.split(tl.reshape(tl.permute(d, [0, 1, 3, 2]), [2, 32, 4, 2, 2]))
    c, e = tl.split(a + b)
    return c + e


@triton.jit
def _slot_sums(c):
    """``[2 h, 32 slots, 4 b]`` -> the sum per slot ``[32]``."""
    return tl.sum(tl.sum(c, axis=2), axis=0)


@triton.jit
def _product_exact(blob_ptr, strip_ptr, a8_ptr, g, kt_lo, kt_hi, KT, K, rm, BM: tl.constexpr,
                   NUM_STAGES: tl.constexpr, ASM: tl.constexpr):
    """The exact mode's partial product ``[64, BM]`` (fp32, 4x the value: ``linear_exact`` passes 1/4 as the
    tokens' scale): group ``g``'s rows over 128-k tiles ``[kt_lo, kt_hi)`` of quack's blob and strip, on the
    activation words (``_exact_acts``: the producers', or with ``SELF_ACTS`` the worker's own). A block's 16
    products sum exactly (int32, at most 16 x 144 in all; its four words are one thread's), times its two scales
    (exact in fp32): the fp32 sum order is the only difference from the contract."""
    # a 128-k tile: blob words [2 h, 32 (8 t2 + t1), 4 t0, 4 b]; strip words [2 h, 32, 2] (bytes [4 b, 2 p0])
    hh = tl.arange(0, 2)[:, None, None, None]
    o_w = ((hh * 32 + tl.arange(0, 32)[None, :, None, None]) * 4 + tl.arange(0, 4)[None, None, :, None]) * 4 \
        + tl.arange(0, 4)[None, None, None, :]
    o_a = hh * 16 + tl.arange(0, 4)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]  # [2, 1, t0, b]
    o_s = (tl.arange(0, 2)[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]) * 2 + tl.arange(0, 2)[None, None, :]
    o_b = tl.arange(0, 2)[:, None, None] * 4 + tl.arange(0, 4)[None, None, :]  # [2, 1, 4]: block 4 h + b
    wbase = blob_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    sbase = strip_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    abase = a8_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    sa_ptr = a8_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + BM * KT * 64
    # fp32 sums a (h, slot, b): a block's four words (t0) are one thread's, added as integers first
    c00 = tl.zeros([2, 32, 4], tl.float32)  # token 0, row r
    c01 = tl.zeros([2, 32, 4], tl.float32)  # token 0, row r + 8
    c10 = tl.zeros([2, 32, 4], tl.float32)  # token 1 (its sums cost nothing at one token)
    c11 = tl.zeros([2, 32, 4], tl.float32)
    lo = tl.load(abase + BM * (KT * 64 + K // 16))  # the lookup table (_idp)
    hi = tl.load(abase + BM * (KT * 64 + K // 16) + 1)
    # pointers advanced a tile each step (Triton 3.6 rebuilt each 64-bit address from the tile index: ~20
    # address instructions a k-tile more than 3.9)
    w_p = wbase + (g * KT + kt_lo) * 1024 + o_w
    s_p = sbase + (g * KT + kt_lo) * 128 + o_s
    a_p = abase + kt_lo * 64 + o_a  # token 0's words; token 1's are KT * 64 further
    b_p = sa_ptr + kt_lo * 8 + o_b  # token 0's block scales; token 1's are K / 16 further
    for kt in tl.range(kt_lo, kt_hi, num_stages=NUM_STAGES):
        word = tl.load(w_p)
        # the strip as int32 words (pipelined like the blob; byte loads were not): word j of a slot holds blocks
        # 2 j, 2 j + 1 of rows r and r + 8 -> [2, 32, 1, 4 b] scales of each row
        f0, f1, f2, f3 = _e4m3x4_to_f32(tl.load(s_p), ASM)
        s0 = tl.reshape(tl.join(f0, f2), [2, 32, 4])
        s1 = tl.reshape(tl.join(f1, f3), [2, 32, 4])
        aw = tl.load(a_p, cache_modifier=".cg")
        an = tl.load(a_p + 32, cache_modifier=".cg")
        sa = tl.load(b_p, cache_modifier=".cg")
        d0, d1 = _idp(word, aw, an, lo, hi, ASM)
        c00 += _t0_sum(d0).to(tl.float32) * (s0 * sa)
        c01 += _t0_sum(d1).to(tl.float32) * (s1 * sa)
        if BM > 1:
            aw = tl.load(a_p + KT * 64, cache_modifier=".cg")
            an = tl.load(a_p + KT * 64 + 32, cache_modifier=".cg")
            sa = tl.load(b_p + K // 16, cache_modifier=".cg")
            d0, d1 = _idp(word, aw, an, lo, hi, ASM)
            c10 += _t0_sum(d0).to(tl.float32) * (s0 * sa)
            c11 += _t0_sum(d1).to(tl.float32) * (s1 * sa)
        w_p += 1024
        s_p += 128
        a_p += 64
        b_p += 8
    # slot i = 8 t2 + t1 holds rows 16 t2 + t1 (r) and + 8: [64] rows in order, a token each
    a_0 = tl.reshape(tl.permute(tl.reshape(tl.join(_slot_sums(c00), _slot_sums(c01)), [4, 8, 2]), [0, 2, 1]), [64])
    a_1 = tl.reshape(tl.permute(tl.reshape(tl.join(_slot_sums(c10), _slot_sums(c11)), [4, 8, 2]), [0, 2, 1]), [64])
    return tl.where(rm[None, :] == 0, a_0[:, None], a_1[:, None])  # [64, BM]


@triton.jit
def _producer(x_ptr, inv_ptr, pd_ptr, lpart_ptr, a8_ptr, sync_ptr, trace_ptr, p, P, M, K, R, stride_xm, stride_pd,
              k_per_prod, BM: tl.constexpr, RB: tl.constexpr, RC: tl.constexpr, CK: tl.constexpr, CKA: tl.constexpr,
              PC: tl.constexpr, HAS_LORA: tl.constexpr, DOT: tl.constexpr, ASM: tl.constexpr, TRACE: tl.constexpr,
              DELAY: tl.constexpr = 0, EXACT: tl.constexpr = False, SELF_ACTS: tl.constexpr = False,
              ACT_NT: tl.constexpr = 4):
    """Chunk ``p`` of K: the tokens' partial max of ``|x / smooth|`` (``EXACT``: its NVFP4 activations,
    ``_exact_acts``, unless the workers write their own: ``SELF_ACTS``), then its ``x @ (proj_down / smooth)``
    partial ``[BM, RB]`` (R in chunks of RC columns), each published with a count. The last producer to count
    its partial adds the ``P`` partials (PC at a time, each chunk as a tree, chunks in order) into
    ``lora_act`` (slot ``P``) while the workers run, and counts once more. Waits for nothing. ``DELAY`` (ns,
    for tests) holds that last producer back before its sum, so the epilogues run first and must wait."""
    k_lo = p * k_per_prod
    k_hi = tl.minimum(K, k_lo + k_per_prod)
    rm = tl.arange(0, BM)
    m_ok = rm < M
    if EXACT:  # the chunk's NVFP4 activations (no token-wide amax: every worker waits for these)
        if not SELF_ACTS:  # ACT_NT tiles a pass: the chunk's tiles up to 4 (one at K = 3072: none masked off)
            for kt0 in range(k_lo // _TK, k_hi // _TK, ACT_NT):
                _exact_acts(x_ptr, inv_ptr, a8_ptr, kt0, k_hi // _TK, M, K, stride_xm, BM, ACT_NT)
    else:
        mx = tl.zeros([BM], tl.int32)
        for k0 in range(k_lo, k_hi, CKA):  # (every worker waits for this: one load a chunk of up to CKA)
            rk = k0 + tl.arange(0, CKA)
            k_ok = rk < k_hi
            mask = m_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
            xs = x * tl.load(inv_ptr + rk, mask=k_ok, other=0.0)[None, :]
            mx = tl.maximum(mx, tl.max(xs.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))  # NaN's bits win
        tl.atomic_max(sync_ptr + _AMAX + rm, mx, mask=m_ok, sem="relaxed")
    tl.debug_barrier()
    tl.atomic_add(sync_ptr + _AMAX_CNT, 1, sem="release")
    _stamp(trace_ptr, 1, p, TRACE)
    if HAS_LORA:  # x rounded to bf16 as the backend's cuBLAS GEMM reads it; exact products, fp32 sums
        for r0 in tl.static_range(0, RB, RC):
            rr = r0 + tl.arange(0, RC)
            r_ok = rr < R
            if DOT:  # 16 to 64 token rows: tensor cores
                acc = tl.zeros([BM, RC], tl.float32)
                for k0 in range(k_lo, k_hi, CK):
                    rk = k0 + tl.arange(0, CK)
                    k_ok = rk < k_hi
                    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                                other=0.0)
                    pd = tl.load(pd_ptr + rk[:, None] * stride_pd + rr[None, :], mask=k_ok[:, None] & r_ok[None, :],
                                 other=0.0)
                    if ASM:
                        acc = tl.dot(x.to(tl.bfloat16), pd.to(tl.bfloat16), acc)
                    else:
                        acc = tl.dot(_rne_bf16(x.to(tl.float32)), pd.to(tl.float32), acc, input_precision="ieee")
                tl.store(lpart_ptr + (p * BM + rm[:, None]) * RB + rr[None, :], acc)
            else:
                for mi in tl.static_range(BM):
                    if mi < M:
                        acc1 = tl.zeros([RC], tl.float32)
                        for k0 in range(k_lo, k_hi, CK):
                            rk = k0 + tl.arange(0, CK)
                            k_ok = rk < k_hi
                            x1 = _bf16(tl.load(x_ptr + mi * stride_xm + rk, mask=k_ok, other=0.0).to(tl.float32), ASM)
                            pd = tl.load(pd_ptr + rk[:, None] * stride_pd + rr[None, :],
                                         mask=k_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                            acc1 += tl.sum(x1[:, None] * pd, axis=0)
                        tl.store(lpart_ptr + (p * BM + mi) * RB + rr, acc1)
        tl.debug_barrier()
        c = tl.atomic_add(sync_ptr + _LORA_CNT, 1, sem="acq_rel")
        if c == P - 1:  # every partial is in: their sum, off the epilogue's path (it read them one by one)
            if DELAY > 0:
                _sleep(DELAY)
            for r0 in tl.static_range(0, RB, RC):
                rr = r0 + tl.arange(0, RC)
                la = tl.zeros([BM, RC], tl.float32)
                for p0 in range(0, P, PC):
                    rp = p0 + tl.arange(0, PC)
                    la += tl.sum(tl.load(lpart_ptr + (rp[:, None, None] * BM + rm[None, :, None]) * RB
                                         + rr[None, None, :], mask=(rp < P)[:, None, None], other=0.0,
                                         cache_modifier=".cg"), axis=0)
                tl.store(lpart_ptr + (P * BM + rm[:, None]) * RB + rr[None, :], la)
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + _LORA_CNT, 1, sem="release")
        _stamp(trace_ptr, 2, p, TRACE)


@triton.jit
def _quantizer(x_ptr, inv_ptr, a8_ptr, sync_ptr, trace_ptr, q, P, M, K, stride_xm, k_per_prod, BM: tl.constexpr,
               CK: tl.constexpr, ASM: tl.constexpr, POLL: tl.constexpr, TRACE: tl.constexpr):
    """Chunk ``q`` of K (whole k-tiles) as E4M3 activations in the GEMM's k order, once every producer's max
    is in (the producers hold lower tickets: they are running), published with a count. All ``BM`` rows are
    written, the padding rows past ``M`` as zeros, so the workers load whole tiles with no row mask."""
    _wait(sync_ptr + _AMAX_CNT, P, POLL)
    _stamp(trace_ptr, 1, q, TRACE)
    rm = tl.arange(0, BM)
    m_ok = rm < M
    sa, r = _token_scales(sync_ptr, rm, m_ok, BM)
    k_lo = q * k_per_prod
    k_hi = tl.minimum(K, k_lo + k_per_prod)
    for k0 in range(k_lo, k_hi, CK):  # positions k0 + [0, CK) of the GEMM's k order (CK divides 128)
        pos = k0 + tl.arange(0, CK)
        lk = _gemm_k(pos, True)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + lk[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        v = x * tl.load(inv_ptr + lk)[None, :] * r[:, None]
        ptrs = a8_ptr + rm[:, None] * K + pos[None, :]
        if ASM:  # the hardware convert saturates +-Inf at 448: the contract's NaN (0x7F) instead
            v = tl.where(tl.abs(v) < float("inf"), v, float("nan"))
            tl.store(ptrs, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        else:
            tl.store(ptrs, _e4m3_bits(v))
    tl.debug_barrier()
    tl.atomic_add(sync_ptr + _A8_CNT, 1, sem="release")
    _stamp(trace_ptr, 2, q, TRACE)


@triton.jit
def _decode_tile(word, sw, ASM: tl.constexpr):
    """One k-tile of a 64-row group (``word [32, 4, 8]``, ``sw [32, 4, 1]``) -> its E4M3 weights ``[64 rows,
    128 positions]`` (row ``16 w + 8 p + rq``, position ``16 word + 4 c + j``: the GEMM's k order), as
    E4M3 on the GPU (the layout lands in wgmma's register operand) and as their fp32 values in the
    interpreter. Each code word becomes two registers of four E4M3 bytes (rows r and r + 8): by the
    tables and ``prmt`` on the GPU, by arithmetic in the interpreter; the rest is the same code."""
    w_lo, w_hi = tl.split(tl.permute(tl.reshape(word, [32, 4, 2, 4]), [0, 1, 3, 2]))  # block half B = 0 / 1
    if ASM:
        ta, tb = _tables(sw, 0)
        ta8, tb8 = _tables(sw, 1)
        r0l, r1l = tl.inline_asm_elementwise(asm=_DECODE_ASM, constraints="=r,=r,r,r,r,r,r",
                                             args=[w_lo, ta, tb, ta8, tb8], dtype=(tl.int32, tl.int32),
                                             is_pure=True, pack=1)
        ta, tb = _tables(sw, 2)
        ta8, tb8 = _tables(sw, 3)
        r0h, r1h = tl.inline_asm_elementwise(asm=_DECODE_ASM, constraints="=r,=r,r,r,r,r,r",
                                             args=[w_hi, ta, tb, ta8, tb8], dtype=(tl.int32, tl.int32),
                                             is_pure=True, pack=1)
    else:
        v0, v1, v2, v3, u0, u1, u2, u3 = _decode_values(w_lo, sw, 0, False)
        r0l, r1l = _pack4(v0, v1, v2, v3), _pack4(u0, u1, u2, u3)
        v0, v1, v2, v3, u0, u1, u2, u3 = _decode_values(w_hi, sw, 1, False)
        r0h, r1h = _pack4(v0, v1, v2, v3), _pack4(u0, u1, u2, u3)
    r = tl.join(_words(r0l, r0h), _words(r1l, r1h))  # [wrq, c, word, p]
    b0 = (r & 0xFF).to(tl.uint8)
    b1 = ((r >> 8) & 0xFF).to(tl.uint8)
    b2 = ((r >> 16) & 0xFF).to(tl.uint8)
    b3 = ((r >> 24) & 0xFF).to(tl.uint8)
    by = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [wrq, c, word, p, j1, j0]: j = 2 j1 + j0
    by = tl.reshape(by, [4, 8, 4, 8, 2, 4])  # [w, rq, c, word, p, j]
    w8 = tl.reshape(tl.permute(by, [0, 4, 1, 3, 2, 5]), [64, 128]).to(tl.float8e4nv, bitcast=True)
    if not ASM:  # (no NaN among decoded weights: the interpreter's cast is right for every other byte)
        w8 = w8.to(tl.float32)
    return w8


@triton.jit
def _pack4(v0, v1, v2, v3):
    """Four E4M3 values (fp32) -> their bytes in one int32 (``v0`` in the low byte)."""
    return (_e4m3_bits(v0).to(tl.int32) | (_e4m3_bits(v1).to(tl.int32) << 8) | (_e4m3_bits(v2).to(tl.int32) << 16)
            | (_e4m3_bits(v3).to(tl.int32) << 24))


@triton.jit
def _words(lo, hi):
    """Block halves ``[32, 4, 4]`` (word in the half) -> ``[32, 4, 8]`` (word ``4 B + i``)."""
    return tl.reshape(tl.permute(tl.join(lo, hi), [0, 1, 3, 2]), [32, 4, 8])


@triton.jit
def _product(x_ptr, inv_ptr, blob_ptr, strip_ptr, a8_ptr, g, kt_lo, kt_hi, KT, K, stride_xm, rm, m_ok, rinv,
             BM: tl.constexpr, ASM: tl.constexpr, NUM_STAGES: tl.constexpr, DOT: tl.constexpr):
    """One chunk's partial product ``[64, BM]`` (fp32): group ``g``'s weight rows over k-tiles ``[kt_lo,
    kt_hi)``, the FP8 dots on the quantizers' activations (``DOT``) or the multiply-adds on activations
    quantized here (``rinv``: the tokens' ``1 / sa``)."""
    # a thread-slot's words: blob [G, KT, 128 (32 wrq + c), 8 (4 B + word)] int32; strip [G, KT, 128]
    o_w = (tl.arange(0, 32)[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]) * 8 + tl.arange(0, 8)[None, None, :]
    o_s = tl.arange(0, 32)[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]  # [32, 4, 1]
    wbase = blob_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    sbase = strip_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    if DOT:
        acc = tl.zeros([64, BM], tl.float32)
        pos = tl.arange(0, 128)
        for kt in tl.range(kt_lo, kt_hi, num_stages=NUM_STAGES):
            tile = g * KT + kt
            word = tl.load(wbase + tile * 1024 + o_w)  # [32, 4, 8]
            sw = tl.load(sbase + tile * 128 + o_s)  # [32, 4, 1]
            # [128, BM], written by the quantizers in this launch: all BM rows, no row mask (1.02-1.09x at 9
            # and 17 tokens on the H100: docs/perf.md, eighteenth session)
            a = tl.load(a8_ptr + rm[None, :] * K + pos[:, None] + kt * _TK, cache_modifier=".cg")
            w8 = _decode_tile(word, sw, ASM)
            if ASM:
                acc = tl.dot(w8, a.to(tl.float8e4nv, bitcast=True), acc)
            else:  # the interpreter: E4M3 values in fp32, exact products (its cast reads 0x7F as 480, not NaN)
                av = tl.where((a & 0x7F) == 0x7F, float("nan"), a.to(tl.float8e4nv, bitcast=True).to(tl.float32))
                acc = tl.dot(w8, av, acc, input_precision="ieee")
    else:
        r0 = tl.sum(tl.where(rm == 0, rinv, 0.0), axis=0)
        r1 = tl.sum(tl.where(rm == 1, rinv, 0.0), axis=0)
        # per token, rows r / r + 8 (p), block half B: [32 (8 w + rq), 4 (c), 4 (word)] multiply-add slots
        c000 = tl.zeros([32, 4, 4], tl.float32)  # token 0: p = 0, B = 0
        c001 = tl.zeros([32, 4, 4], tl.float32)  # p = 0, B = 1
        c010 = tl.zeros([32, 4, 4], tl.float32)  # p = 1, B = 0
        c011 = tl.zeros([32, 4, 4], tl.float32)  # p = 1, B = 1
        c100 = tl.zeros([32, 4, 4], tl.float32)  # token 1 (a second token's slots cost nothing at one)
        c101 = tl.zeros([32, 4, 4], tl.float32)
        c110 = tl.zeros([32, 4, 4], tl.float32)
        c111 = tl.zeros([32, 4, 4], tl.float32)
        for kt in tl.range(kt_lo, kt_hi, num_stages=NUM_STAGES):
            tile = g * KT + kt
            word = tl.load(wbase + tile * 1024 + o_w)  # [32, 4, 8]
            sw = tl.load(sbase + tile * 128 + o_s)  # [32, 4, 1]
            w_lo, w_hi = tl.split(tl.permute(tl.reshape(word, [32, 4, 2, 4]), [0, 1, 3, 2]))  # B = 0 / 1
            a00, a01, a02, a03, a10, a11, a12, a13 = _tile_acts(x_ptr, inv_ptr, 0, kt * _TK, stride_xm, r0, ASM)
            c000, c010 = _half_fma(w_lo, sw, a00, a01, a02, a03, c000, c010, 0, ASM)
            c001, c011 = _half_fma(w_hi, sw, a10, a11, a12, a13, c001, c011, 1, ASM)
            if BM > 1:  # (BM = 2 only for two tokens)
                a00, a01, a02, a03, a10, a11, a12, a13 = _tile_acts(x_ptr, inv_ptr, 1, kt * _TK, stride_xm, r1,
                                                                    ASM)
                c100, c110 = _half_fma(w_lo, sw, a00, a01, a02, a03, c100, c110, 0, ASM)
                c101, c111 = _half_fma(w_hi, sw, a10, a11, a12, a13, c101, c111, 1, ASM)
        # slot i = 8 w + rq holds rows 16 w + rq (p = 0) and + 8 (p = 1): [64] rows in order, a token each
        a_0 = tl.reshape(tl.permute(tl.reshape(tl.join(_slots(c000, c001), _slots(c010, c011)), [4, 8, 2]),
                                    [0, 2, 1]), [64])
        a_1 = tl.reshape(tl.permute(tl.reshape(tl.join(_slots(c100, c101), _slots(c110, c111)), [4, 8, 2]),
                                    [0, 2, 1]), [64])
        acc = tl.where(rm[None, :] == 0, a_0[:, None], a_1[:, None])  # [64, BM]
    return acc


@triton.jit
def _fast_small_m_kernel(
    x_ptr, inv_ptr, blob_ptr, strip_ptr, cs_ptr, bias_ptr, pd_ptr, up_ptr, out_ptr, part_ptr, lpart_ptr, a8_ptr,
    sync_ptr, trace_ptr, M, N, K, R, stride_xm, stride_pd, stride_om, tiles_per_split, S, P, k_per_prod,
    BM: tl.constexpr, RB: tl.constexpr, RC: tl.constexpr, CK: tl.constexpr, CKA: tl.constexpr, SC: tl.constexpr,
    PC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, ASM: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT: tl.constexpr, POLL: tl.constexpr = 0, TRACE: tl.constexpr = False, DELAY: tl.constexpr = 0,
    EXACT: tl.constexpr = False, SELF_ACTS: tl.constexpr = False, ACT_NT: tl.constexpr = 4,
):
    # CK: the k-chunk of the producers' low-rank and the quantizers' [BM, CK] tiles (at most 2048 elements: no
    # spills at 64 rows); CKA the producers' amax chunk (up to 512: one load at a few tokens); SC: the split
    # partials the epilogue loads at once (``_finish``); PC: the producers' lora_act partials the last producer
    # loads at once (``_producer``)
    # Roles by ticket: [0, P) producers; with DOT (16-64 token rows) [P, 2 P) quantizers, which write the
    # E4M3 activations (the GEMM's k order) for workers that run FP8 dots on the decoded tile; the rest
    # workers (without DOT, 1-2 tokens, they quantize their own activations and multiply-add). A chunk is a
    # group's split (G x S of them, one a worker by ticket).
    G = N // 64
    KT = K // _TK
    Q = P if DOT else 0
    total = P + Q + G * S
    t = tl.atomic_add(sync_ptr + _TICKET, 1, sem="relaxed")
    _stamp(trace_ptr, 0, t, TRACE)
    if TRACE:  # the ticket, and above it the SM the CTA runs on
        sm = tl.inline_asm_elementwise(asm="mov.u32 $0, %smid;", constraints="=r,r", args=[t], dtype=tl.int32,
                                       is_pure=False, pack=1)
        tl.store(trace_ptr + tl.program_id(0) * _TRACE_COLS + 7, t.to(tl.int64) | (sm.to(tl.int64) << 32))
    if t < P:
        _producer(x_ptr, inv_ptr, pd_ptr, lpart_ptr, a8_ptr, sync_ptr, trace_ptr, t, P, M, K, R, stride_xm,
                  stride_pd, k_per_prod, BM, RB, RC, CK, CKA, PC, HAS_LORA, DOT, ASM, TRACE, DELAY, EXACT,
                  SELF_ACTS, ACT_NT)
    elif t < P + Q:
        _quantizer(x_ptr, inv_ptr, a8_ptr, sync_ptr, trace_ptr, t - P, P, M, K, stride_xm, k_per_prod, BM, CK, ASM,
                   POLL, TRACE)
    elif t < total:  # (a ticket past the grid would mean sync words not left at zero: such a CTA does nothing)
        c = t - P - Q
        rm = tl.arange(0, BM)
        m_ok = rm < M
        g = c // S
        kt_lo = (c - g * S) * tiles_per_split
        kt_hi = tl.minimum(KT, kt_lo + tiles_per_split)
        if ASM:  # the chunk's weight bytes start coming into L2 while the producers publish
            _prefetch_l2(blob_ptr + (g * KT + kt_lo) * 4096, (kt_hi - kt_lo) * 4096)
            _prefetch_l2(strip_ptr + (g * KT + kt_lo) * 512, (kt_hi - kt_lo) * 512)
        wbase = blob_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        if DOT:
            _wait(sync_ptr + _A8_CNT, P, POLL)
        elif EXACT and SELF_ACTS:  # its own k-range's activations (the same bytes as any other worker's of it)
            for kt0 in range(kt_lo, kt_hi, 4):
                _exact_acts(x_ptr, inv_ptr, a8_ptr, kt0, kt_hi, M, K, stride_xm, BM, 4)
            tl.debug_barrier()  # the CTA's writes are visible to its threads' loads after the barrier
        else:
            _wait(sync_ptr + _AMAX_CNT, P, POLL)
        _stamp(trace_ptr, 1, t, TRACE)
        _probe(trace_ptr, 8, wbase + (g * KT + kt_lo) * 1024, TRACE)  # the chunk's first and last k-tile
        _probe(trace_ptr, 9, wbase + (g * KT + kt_hi - 1) * 1024, TRACE)
        if EXACT:  # (the products are 4x the value: codes times 2 on both sides)
            sa = tl.full([BM], 0.25, tl.float32)
            acc = _product_exact(blob_ptr, strip_ptr, a8_ptr, g, kt_lo, kt_hi, KT, K, rm, BM, NUM_STAGES, ASM)
        else:
            sa, rinv = _token_scales(sync_ptr, rm, m_ok, BM)
            acc = _product(x_ptr, inv_ptr, blob_ptr, strip_ptr, a8_ptr, g, kt_lo, kt_hi, KT, K, stride_xm, rm, m_ok,
                           rinv, BM, ASM, NUM_STAGES, DOT)
        _stamp(trace_ptr, 2, t, TRACE)
        _finish(acc, sa, g, c - g * S, G, S, P, R, M, rm, m_ok, cs_ptr, bias_ptr, up_ptr, out_ptr, part_ptr,
                lpart_ptr, sync_ptr, trace_ptr, t, stride_om, BM, RB, RC, SC, HAS_BIAS, HAS_LORA, ASM, POLL, TRACE)
    # the last CTA to finish leaves the sync words at zero for the next launch
    tl.debug_barrier()
    fin = tl.atomic_add(sync_ptr + _DONE, 1, sem="acq_rel")
    _stamp(trace_ptr, 6, t, TRACE)
    if fin == total - 1:  # every CTA has counted itself out: plain stores (the next launch follows this one;
        # six acq_rel exchanges, each a fence and a round trip, were on the launch's tail)
        rz = tl.arange(0, _GROUPS)
        tl.store(sync_ptr + rz, tl.zeros([_GROUPS], tl.int32))  # ticket, counts, done, amax


@triton.jit
def _finish(acc, sa, g, s, G, S, P, R, M, rm, m_ok, cs_ptr, bias_ptr, up_ptr, out_ptr, part_ptr, lpart_ptr, sync_ptr,
            trace_ptr, t, stride_om, BM: tl.constexpr, RB: tl.constexpr, RC: tl.constexpr, SC: tl.constexpr,
            HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, ASM: tl.constexpr, POLL: tl.constexpr,
            TRACE: tl.constexpr):
    """A worker's fp32 partial ``[64, BM]`` written; the last of its group sums the partials and writes ``acc
    * sa * (2**e * wcscale) + bias + lora_act @ proj_up^T`` (``lora_act`` summed by the last producer, R in
    chunks of RC columns). The partials load SC splits at once (one round trip to L2 a chunk: a partial at a
    time, with the producers' partials after them, made the epilogue a chain of S + P round trips, 3.5 us of
    a 10 us launch), each chunk added as a tree, chunks in order: a fixed order, whatever the scheduling."""
    rl = tl.arange(0, 64)
    local = rl[:, None] * BM + rm[None, :]
    tl.store(part_ptr + (s * G + g) * (64 * BM) + local, acc)
    tl.debug_barrier()  # every thread's partial is written before the counter moves
    done = tl.atomic_add(sync_ptr + _GROUPS + g, 1, sem="acq_rel")
    _stamp(trace_ptr, 3, t, TRACE)
    if done == S - 1:  # the last split of this group: the partials' sum, then the epilogue
        y = tl.zeros([64, BM], tl.float32)
        for s0 in range(0, S, SC):
            rs = s0 + tl.arange(0, SC)
            y += tl.sum(tl.load(part_ptr + (rs[:, None, None] * G + g) * (64 * BM) + local[None, :, :],
                                mask=(rs < S)[:, None, None], other=0.0, cache_modifier=".cg"), axis=0)
        tl.store(sync_ptr + _GROUPS + g, 0)  # ready for the next launch (no CTA touches it again in this one)
        rn = g * 64 + rl
        y = y * sa[None, :] * tl.load(cs_ptr + rn)[:, None]
        if HAS_BIAS:
            y += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        _stamp(trace_ptr, 4, t, TRACE)
        if HAS_LORA:
            _wait(sync_ptr + _LORA_CNT, P + 1, POLL)  # the last producer's sum is in
            for r0 in tl.static_range(0, RB, RC):
                rr = r0 + tl.arange(0, RC)
                la = tl.load(lpart_ptr + (P * BM + rm[:, None]) * RB + rr[None, :], cache_modifier=".cg")
                up = tl.load(up_ptr + rn[:, None] * R + rr[None, :], mask=(rr < R)[None, :], other=0.0).to(tl.float32)
                if BM >= 16:  # bf16 tensor cores: proj_up in bf16 (the contract's allowance), lora_act as two bf16
                    lh = _bf16(la, ASM)  # parts (hi + lo: 16 significant bits), exact products, fp32 sums
                    ll = _bf16(la - lh, ASM)
                    ub = _bf16(up, ASM)
                    if ASM:
                        ub = ub.to(tl.bfloat16)
                        y = tl.dot(ub, tl.trans(lh.to(tl.bfloat16)), y)
                        y = tl.dot(ub, tl.trans(ll.to(tl.bfloat16)), y)
                    else:
                        y = tl.dot(ub, tl.trans(lh), y, input_precision="ieee")
                        y = tl.dot(ub, tl.trans(ll), y, input_precision="ieee")
                else:
                    for mi in tl.static_range(BM):
                        lrow = tl.sum(tl.where(rm[:, None] == mi, la, 0.0), axis=0)  # [RC]
                        y = tl.where(rm[None, :] == mi, y + tl.sum(up * lrow[None, :], axis=1)[:, None], y)
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], y.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
        _stamp(trace_ptr, 5, t, TRACE)


# ---- host side ------------------------------------------------------------------------------------

def _sync(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 sync words (ticket, counts, amax, a counter a group) that each launch leaves at zero
    (``small_m.sync_words``: one buffer per device and stream, a buffer of its own per captured launch)."""
    return sync_words(device, _GROUPS_AT + groups, "small_m_fast")


def use_dots(m: int, n: int, k: int) -> bool:
    """The FP8 dots (else the multiply-adds) for ``m`` tokens of an ``n x k`` weight: above ``FMA_MAX_M``
    tokens, and at 2 tokens for weights of ``DOTS_AT_2_MIN_WEIGHTS`` values or more. Same run on the H100
    (docs/perf.md, 2026-12-05 fifteenth session, ``bench_small_m_fast.py --tokens 2,1``), multiply-adds
    against dots, us, at 2 tokens (N x K): attn 3072x3072 14.9 / 16.8, ff up 12288x3072 28.2 / 20.0, ff
    down 3072x12288 29.8 / 26.6, single out 3072x15360 32.6 / 30.8; at one token the multiply-adds won at
    every layer (attn 10.3 / 15.5 to single out 21.3 / 29.3)."""
    return m > FMA_MAX_M or (m == FMA_MAX_M and n * k >= DOTS_AT_2_MIN_WEIGHTS)


def rows(m: int, dot: bool) -> int:
    """Token rows a tile holds (``BM``) for ``m`` tokens: a power of two, at least 16 for the FP8 dots
    (``dot``, as ``use_dots`` picks by default)."""
    return max(16, next_pow2(m)) if dot else next_pow2(m)


def plan(m: int, n: int, k: int, sms: int = SM_COUNT, ctas_per_sm: int = CTAS_PER_SM,
         dot: bool | None = None) -> tuple[int, int, int, int]:
    """``(split, k-tiles a split, producers, k a producer)`` for ``m`` tokens of an ``n x k`` weight: up to
    ``PRODUCERS_MAX`` producers of whole k-tiles, and about ``ctas_per_sm`` workers an SM (rounded to the
    nearest split: rounding down would leave a 21504-wide layer one worker a group), every split holding a
    k-tile (no empty split). The whole grid stays resident: where the rounding would take the workers past
    the ``ctas_per_sm x sms`` slots less the producers' and quantizers', the split is rounded down (those
    CTAs hold their slots for most of a launch above two tokens: traced on the H100, eighteenth session, at
    17-32 tokens the last workers of an 832-CTA grid at 6 an SM started 21-22 us late, after the
    producers' ``lora_act``). At most ``SPLIT_ROWS // rows(m, dot)`` splits (the padded rows a partial
    holds): one CTA a group reads every split's ``[64, rows]`` partial (traced on the H200 at 64 tokens and
    14 splits, that sum took 13 of the launch's 33 us)."""
    groups, kt = n // 64, k // TILE_K
    dot = use_dots(m, n, k) if dot is None else dot
    p_tiles = -(-kt // min(PRODUCERS_MAX, kt))
    producers = -(-kt // p_tiles)
    slots = ctas_per_sm * sms - _row_ctas(producers, dot)  # the workers' resident slots
    want = round(ctas_per_sm * sms / groups)
    if want * groups > slots:
        want = slots // groups
    want = max(1, min(want, SPLIT_ROWS // rows(m, dot)))
    per = -(-kt // min(want, kt))
    split = -(-kt // per)
    return split, per, producers, p_tiles * TILE_K


def check(x: torch.Tensor, inv_smooth: torch.Tensor, blob: torch.Tensor, strip: torch.Tensor, cs: torch.Tensor,
          bias: torch.Tensor | None, proj_down: torch.Tensor | None, proj_up: torch.Tensor | None) -> None:
    """Refuses what the kernel would read wrongly (its pointers assume these shapes, dtypes and strides)."""
    _check_shapes(x, cs, blob, strip, MAX_M, "one-launch fast kernel",
                  "the fast blob [N/64, K/128, 128, 32] and strip [N/64, K/128, 512]",
                  lambda n, k: ((n // 64, k // TILE_K, 128, 32), (n // 64, k // TILE_K, 512)))
    _check_operands(x, ("inv_smooth", inv_smooth), blob, strip, cs, bias, proj_down, proj_up)


def _check_shapes(x: torch.Tensor, cs: torch.Tensor, blob: torch.Tensor, strip: torch.Tensor, max_m: int, what: str,
                  layout: str, shapes) -> None:
    """x is ``[M, K]`` with 1 to ``max_m`` tokens, and ``blob`` / ``strip`` have the ``shapes(N, K)`` of the
    ``layout`` the ``what`` kernel reads (N from ``cs``)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    n = cs.numel()
    if not 1 <= m <= max_m:
        raise ValueError(f"the {what} serves 1 to {max_m} tokens, got {m}")
    if n < 64 or k < TILE_K or n % 64 or k % TILE_K or (tuple(blob.shape), tuple(strip.shape)) != shapes(n, k):
        raise ValueError(f"expected {layout} of a {n} x {k} weight (N, K > 0, N % 64 == 0, K % {TILE_K} == 0), got "
                         f"{tuple(blob.shape)} and {tuple(strip.shape)}")


def _check_operands(x: torch.Tensor, vec: tuple[str, torch.Tensor], blob: torch.Tensor, strip: torch.Tensor,
                    cs: torch.Tensor, bias: torch.Tensor | None, proj_down: torch.Tensor | None,
                    proj_up: torch.Tensor | None) -> None:
    """What ``check`` and ``check_exact`` share: devices, x's dtype, the weight's bytes, the fp32 vectors (``vec``:
    the [K] one's name and tensor), the low-rank pair."""
    m, k = x.shape
    n = cs.numel()
    others = [t for t in (vec[1], blob, strip, cs, bias, proj_down, proj_up) if t is not None]
    if any(t.device != x.device for t in others):
        raise ValueError(f"every operand must be on x's device ({x.device})")
    if not x.is_floating_point():
        raise ValueError(f"x must be a float tensor, got {x.dtype}")
    if blob.dtype != torch.uint8 or strip.dtype != torch.uint8 or not (blob.is_contiguous() and strip.is_contiguous()):
        raise ValueError(f"the blob and strip must be contiguous uint8, got {blob.dtype} / {strip.dtype}")
    for name, t, length in (("cs", cs, n), (vec[0], vec[1], k), ("bias", bias, n)):
        if t is not None and (t.dtype != torch.float32 or t.numel() != length or not t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous float32 tensor of {length} elements, got {t.dtype} "
                             f"{tuple(t.shape)} (contiguous: {t.is_contiguous()})")
    if (proj_down is None) != (proj_up is None):
        raise ValueError("proj_down and proj_up come together (a low-rank branch) or not at all")
    if proj_up is not None:
        r = proj_up.shape[1] if proj_up.dim() == 2 else -1
        if (proj_up.shape != (n, r) or not proj_up.is_contiguous() or proj_down.dim() != 2 or proj_down.shape[0] != k
                or proj_down.shape[1] < r or proj_down.stride(1) != 1 or proj_down.dtype != torch.bfloat16):
            raise ValueError(f"proj_up must be a contiguous [{n}, R] tensor beside a bf16 proj_down [{k}, >= R] with "
                             f"unit stride along R, got {tuple(proj_up.shape)} and {proj_down.dtype} "
                             f"{tuple(proj_down.shape)}")


def linear(x: torch.Tensor, inv_smooth: torch.Tensor, blob: torch.Tensor, strip: torch.Tensor, cs: torch.Tensor,
           bias: torch.Tensor | None = None, proj_down: torch.Tensor | None = None,
           proj_up: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           num_stages: int = 3, sms: int | None = None, ctas_per_sm: int | None = None,
           dot: bool | None = None, poll: int = 0, trace: torch.Tensor | None = None,
           delay_ns: int = 0, num_warps: int = 4,
           maxnreg: int | None = None) -> torch.Tensor:
    """``nvfp4.w4a8_fast_linear`` for 1 to ``MAX_M`` tokens in one launch.

    ``x [M, K]`` (any float, unit stride along K); ``inv_smooth [K]`` fp32 ``1 / smooth``; ``blob`` /
    ``strip`` the fast layout's (``fast_layout.repack_fast_weight`` / ``fast_scales``); ``cs [N]`` fp32
    ``2**e * wcscale``; ``bias [N]``; ``proj_down [K, >= R]`` the smoothed ``proj_down / smooth`` (its
    first ``R`` columns are read) with ``proj_up [N, R]`` contiguous. The output is ``out_dtype`` (x's
    by default). ``dot`` picks the FP8 dots or the multiply-adds (at most ``FMA_MAX_M`` tokens; default
    ``use_dots``); ``num_stages`` (k-tiles in flight), ``ctas_per_sm`` (the split's target; by default what
    the compiled kernel lets stay resident, at most ``CTAS_PER_SM_MAX``: ``fitted_ctas_per_sm``),
    ``poll`` (how waits poll: ``_wait``) and ``trace`` (an int64 tensor of ``grid x TRACE_COLS``
    elements or more, ``grid_size``: each CTA's global-timer stamps at its phase ends, its ticket in column
    7's low 32 bits and its SM above them, a worker's two weight probes in columns 8 and 9; ``_stamp``,
    ``_probe``)
    are for measurement; ``delay_ns`` holds the last producer back before its ``lora_act`` sum (a test of
    the epilogue's wait: ``_producer``). ``num_warps`` (4 or 8) and ``maxnreg`` (a register cap) are
    for measurement too: the occupancy the split's ``ctas_per_sm`` can count on."""
    check(x, inv_smooth, blob, strip, cs, bias, proj_down, proj_up)
    return _run(x, inv_smooth, blob, strip, cs, bias, proj_down, proj_up, out_dtype, num_stages, sms, ctas_per_sm, dot,
                poll, trace, delay_ns, num_warps, maxnreg, False)


def check_exact(x: torch.Tensor, smooth: torch.Tensor, blob: torch.Tensor, strip: torch.Tensor, cs: torch.Tensor,
                bias: torch.Tensor | None, proj_down: torch.Tensor | None, proj_up: torch.Tensor | None) -> None:
    """``check`` for ``linear_exact``: quack's blob and strip, one or two tokens."""
    _check_shapes(x, cs, blob, strip, FMA_MAX_M, "exact one-launch kernel",
                  "quack's nvfp4 blob [N/64, K/64, 128, 16] and strip [N/64, K/64, 32, 4, 2]",
                  lambda n, k: ((n // 64, k // 64, 128, 16), (n // 64, k // 64, 32, 4, 2)))
    _check_operands(x, ("smooth", smooth), blob, strip, cs, bias, proj_down, proj_up)


def linear_exact(x: torch.Tensor, smooth: torch.Tensor, blob: torch.Tensor, strip: torch.Tensor, cs: torch.Tensor,
                 bias: torch.Tensor | None = None, proj_down: torch.Tensor | None = None,
                 proj_up: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, num_stages: int = 3,
                 sms: int | None = None, ctas_per_sm: int | None = None, poll: int = 0,
                 trace: torch.Tensor | None = None, num_warps: int = 4, self_acts: bool = False) -> torch.Tensor:
    """The exact W4A4 linear (the contract, ``nvfp4.w4a4_linear``) for one or two tokens in one launch.

    ``x [M, K]``; ``smooth [K]`` fp32; ``blob`` / ``strip`` quack's nvfp4 repack of the weight
    (``quack_gemm.repack_weight`` / ``repack_scales``: what the exact mode's prepared state holds); ``cs [N]``
    fp32 ``wcscale``; ``bias [N]``; ``proj_down [K, >= R]`` the smoothed ``proj_down / smooth`` (bf16) with
    ``proj_up [N, R]``. The producers write the activations' NVFP4 codes and scales (``_exact_acts``) and the
    ``lora_act`` partials; the workers take integer dot products of the weight's and the activations' codes
    (``_idp``, ``_product_exact``); the epilogue is the fast kernel's with 1/4 as the tokens' scale. Each block's
    sum is exact, so the result differs from the reference only in the blocks' fp32 summation order and in
    ``lora_act``'s bf16 operands (the contract's tensor-core allowance). ``self_acts`` (for measurement): each
    worker quantizes its own k-range's activations before its loop (the same bytes as every other worker of
    that range writes) instead of waiting for the producers'. The other arguments as ``linear``'s."""
    check_exact(x, smooth, blob, strip, cs, bias, proj_down, proj_up)
    return _run(x, smooth, blob, strip, cs, bias, proj_down, proj_up, out_dtype, num_stages, sms, ctas_per_sm, False,
                poll, trace, 0, num_warps, None, True, self_acts)


def _run(x, inv_smooth, blob, strip, cs, bias, proj_down, proj_up, out_dtype, num_stages, sms, ctas_per_sm, dot,
         poll, trace, delay_ns, num_warps, maxnreg, exact: bool, self_acts: bool = False) -> torch.Tensor:
    """``linear`` (``exact``: ``linear_exact``, ``inv_smooth`` then being ``smooth``) after its checks (``sms``
    None: the device's SMs, ``tuning.sm_count``)."""
    m, k = x.shape
    n = cs.numel()
    sms = sms or sm_count(x.device)
    out_dtype = out_dtype or x.dtype
    if trace is not None and (_INTERPRET or trace.dtype != torch.int64 or trace.device != x.device):
        raise ValueError("trace needs an int64 tensor on x's GPU (the global timer is read by PTX)")
    if delay_ns and (_INTERPRET or delay_ns < 0):
        raise ValueError(f"delay_ns reads the GPU's global timer: a positive delay on a GPU, got {delay_ns}")
    if _INTERPRET and out_dtype != torch.float32:
        # the CPU interpreter's fp32 -> 16-bit conversion does not round to nearest: cast outside
        return _run(x, inv_smooth, blob, strip, cs, bias, proj_down, proj_up, torch.float32, num_stages, sms,
                    ctas_per_sm, dot, poll, None, 0, num_warps, maxnreg, exact, self_acts).to(out_dtype)
    dot = use_dots(m, n, k) if dot is None else dot
    if not dot and m > FMA_MAX_M:
        raise ValueError(f"the multiply-add form serves at most {FMA_MAX_M} tokens, got {m}")
    if num_warps not in (4, 8):
        raise ValueError(f"num_warps must be 4 or 8 (a warpgroup's multiple), got {num_warps}")
    if x.stride(1) != 1:
        x = x.contiguous()
    r = 0 if proj_up is None else proj_up.shape[1]
    groups = n // 64
    bm = rows(m, dot)
    rb = max(16, next_pow2(r)) if r else 16
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if exact:  # the activations' words and block scales (_exact_acts)
        a8 = torch.empty(bm * (k // TILE_K * 64 + k // 16) + 2, device=x.device, dtype=torch.int32)
    else:
        a8 = torch.empty(bm, k, device=x.device, dtype=torch.uint8) if dot else None  # (padding rows: zeros)
    sync = _sync(x.device, groups)
    dummy = cs
    meta = dict(BM=bm, RB=rb, RC=min(rb, 32), **chunks(bm, rb), HAS_BIAS=bias is not None, HAS_LORA=bool(r),
                ASM=not _INTERPRET, NUM_STAGES=num_stages, DOT=dot, POLL=poll, TRACE=trace is not None, DELAY=delay_ns,
                EXACT=exact, SELF_ACTS=bool(self_acts), ACT_NT=act_tiles(k) if exact else 4,
                num_warps=num_warps, **({} if maxnreg is None else {"maxnreg": maxnreg}))

    def launch_args(ctas: int, default_build: bool = False) -> tuple[int, tuple]:
        split, per, producers, k_per_prod = plan(m, n, k, sms, ctas, dot)
        part = torch.empty(split * n * bm, device=x.device, dtype=torch.float32)
        lpart = torch.empty((producers + 1) * bm * rb, device=x.device, dtype=torch.float32) if r else part
        return _row_ctas(producers, dot) + groups * split, (
            x, inv_smooth, blob, strip, cs, bias if bias is not None else dummy,
            proj_down if r else dummy, proj_up if r else dummy, out, part, lpart, part if a8 is None else a8, sync,
            sync if trace is None or default_build else trace, m, n, k, r, x.stride(0),
            proj_down.stride(0) if r else 0, out.stride(0), per, split, producers, k_per_prod)

    if ctas_per_sm is None:
        ctas_per_sm = CTAS_PER_SM if _INTERPRET else fitted_ctas_per_sm(
            meta, lambda: launch_args(CTAS_PER_SM, default_build=True)[1], x.device, (x.dtype, out_dtype))
    grid, args = launch_args(ctas_per_sm)
    if trace is not None and trace.numel() < grid * TRACE_COLS:
        raise ValueError(f"trace needs {grid * TRACE_COLS} elements (grid_size x TRACE_COLS), got {trace.numel()}")
    _fast_small_m_kernel[(grid,)](*args, **meta)
    return out


def act_tiles(k: int) -> int:
    """The 128-k tiles a pass of the exact producers' activations (``_exact_acts``): their chunk's tiles
    (``plan``'s, which do not depend on the split), rounded up to a power of two, at most 4."""
    kt = k // TILE_K
    return min(4, next_pow2(-(-kt // min(PRODUCERS_MAX, kt))))


def resident(n_regs: int, num_warps: int, shared: int, sm_regs: int = 65536, sm_shared: int = 233472,
             sm_threads: int = 2048) -> int:
    """CTAs of ``num_warps`` warps, ``n_regs`` registers a thread and ``shared`` bytes of shared memory that
    one SM holds at once (Hopper's rules: registers allocated 256 a warp, 1 KiB of shared memory reserved a
    CTA, at most 32 CTAs; defaults: an H100 / H200 SM)."""
    per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = sm_regs // per_warp // num_warps if n_regs else 32
    return max(0, min(by_regs, sm_shared // (shared + 1024), sm_threads // (32 * num_warps), 32))


_FITTED: dict[tuple, int] = {}


_MEASURE = dict(POLL=0, TRACE=False, DELAY=0)  # the measurement constexprs' default values


def fitted_ctas_per_sm(meta: dict, args, device: torch.device, dtypes: tuple = ()) -> int:
    """The split's target for a build (``meta``: its constexprs and launch options): the CTAs of the compiled
    kernel that stay resident on one of ``device``'s SMs (``resident``), at most ``CTAS_PER_SM_MAX`` and at
    least 1. It is the default build's (the measurement constexprs ``_MEASURE`` at their defaults), so a
    traced, polled or delayed launch splits as the default does and gives its bits; ``args()``
    gives the default build's arguments to compile it with (a provisional plan's: the registers do not depend
    on the plan's numbers). Kept per device, build and ``dtypes`` (the input's and output's: ``_FITTED``)."""
    meta = {**meta, **_MEASURE}
    key = (device.index, dtypes, tuple(meta.items()))  # (linear builds meta in one order: no sort a call)
    if key not in _FITTED:
        use = compiled_resources(_fast_small_m_kernel.warmup(*args(), grid=(1,), **meta))
        if use is None:  # a Triton that does not say: the fixed target (a second wave at worst, never wrong)
            _FITTED[key] = CTAS_PER_SM
        else:
            props = torch.cuda.get_device_properties(device)
            fit = resident(use[0], meta["num_warps"], use[1],
                           getattr(props, "regs_per_multiprocessor", 65536),
                           getattr(props, "shared_memory_per_multiprocessor", 233472),
                           getattr(props, "max_threads_per_multi_processor", 2048))
            _FITTED[key] = max(1, min(CTAS_PER_SM_MAX, fit))
    return _FITTED[key]


def compiled_resources(ck) -> tuple[int, int] | None:
    """``(registers a thread, shared memory bytes)`` of a compiled Triton kernel, or None (with one warning) where
    this Triton does not expose them: ``_init_handles`` (it loads the module and reads its register count) and
    ``n_regs`` are Triton internals (3.6 and 3.9 have them)."""
    try:
        ck._init_handles()
        return int(ck.n_regs), int(ck.metadata.shared)
    except AttributeError as e:
        from .. import _warn_once

        _warn_once(("small_m_fast", "resources"), f"small_m_fast: this Triton does not give a kernel's registers "
                   f"({e}); the split aims at the fixed {CTAS_PER_SM} CTAs an SM", RuntimeWarning)
        return None


def chunks(bm: int, rb: int) -> dict[str, int]:
    """The kernel's chunk sizes for ``bm`` token rows and ``rb`` low-rank columns: ``CK`` (producers' low-rank
    and quantizers' k-chunk: [bm, CK] tiles of at most 2048 elements, 16 to 128), ``CKA`` (the amax's, up to
    512), ``SC`` (split partials the epilogue loads at once: at most 4096 elements, 16 partials) and ``PC``
    (producer partials the last producer loads at once for ``lora_act``: at most 2048 elements)."""
    rc = min(rb, 32)
    return dict(CK=max(16, min(128, 2048 // bm)), CKA=max(16, min(512, 2048 // bm)),
                SC=max(1, min(16, 4096 // (64 * bm))), PC=max(1, min(PRODUCERS_MAX, 2048 // (bm * rc))))


def grid_size(m: int, n: int, k: int, sms: int = SM_COUNT, ctas_per_sm: int = CTAS_PER_SM,
              dot: bool | None = None) -> int:
    """CTAs of one launch (producers, quantizers with the dots, workers): the rows of a ``trace``. Pass the
    launch's own ``ctas_per_sm``: a launch left at the default splits for ``fitted_ctas_per_sm``, not for
    ``CTAS_PER_SM`` (``linear`` refuses a trace too short for its grid)."""
    dot = use_dots(m, n, k) if dot is None else dot
    split, _, producers, _ = plan(m, n, k, sms, ctas_per_sm, dot)
    return _row_ctas(producers, dot) + n // 64 * split


def _row_ctas(producers: int, dot: bool) -> int:
    """The CTAs of a launch that are not workers: the producers, and as many quantizers with the FP8 dots."""
    return producers * (2 if dot else 1)
