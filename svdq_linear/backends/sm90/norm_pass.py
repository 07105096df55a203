"""The activation pass fused into the adaLN norm that produces a linear's input (Flux).

diffusers' ``AdaLayerNormZero`` / ``AdaLayerNormZeroSingle`` hand the q/k/v (and a single block's MLP, a
feed-forward's first linear) ``layer_norm(x) * (1 + scale) + shift`` (``nvfp4.ada_norm``): a norm kernel writes
that [M, K] tensor and the linear's activation pass reads it again. These kernels read the norm's input ``x``
instead and write what the pass writes, so the normed tensor is never stored. Two launches:

1. ``_ada_stats_kernel``, a few rows a program: each row's mean and ``1 / sqrt(var + eps)`` (chunks combined as
   Chan et al.: no cancellation on rows with a large mean); in the fast mode also the row scale ``sa`` of the
   normalized, modulated, smoothed row, from a second walk along them (from L1 / L2; holding rows of up to 4096
   columns in registers instead measured no faster: docs/perf.md, twenty-ninth session);
2. ``_ada_apply_kernel``, split-K tiles: each value normalized, scaled and shifted with the roundings of the eager
   diffusers code (the norm's output, ``1 + scale``, the product and the sum each rounded to x's dtype), then the
   pass's arithmetic: the exact mode's dequantized NVFP4 values ``xq`` and ``lora_act = input.to(bf16) @ pds``
   (``ada_norm_exact``), or the fast mode's E4M3 ``a8`` in the fast GEMM's k order and ``la = lora_act / sa``
   (``ada_norm_fast``); ``lora_act``'s partial sums on tensor cores, added in split order.

The pair form (``form="pair"``; the backend's default, ``SVDQ_SM90_ADA_NORM_FORM``) keeps the statistics launch and
splits the second in two, as the written input's path runs its pass: ``_ada_lora_kernel`` (``lora_act``'s partial
sums in 64-row blocks, wgmma) and ``_ada_pass_kernel`` (one 8 x 256 tile a program, the grid filling the GPU), a PDL
pair that reads x at once where the backend takes PDL (captured graphs by default), the pass's last k-tile adding
the partials. The same ``xq`` / ``a8`` / ``sa`` bits as the split form; ``lora_act`` summed in another order.

The rows form (``form="rows"``, forty-first session) reads x once for the statistics and the pass: whole rows a
program in registers (``_ada_rows_kernel``, the one-pass FP8 kernel's blocks: 2 rows on 8 warps at 3072 columns)
sum each row, then its squared deviations, normalize, and write ``xq`` or (fast) ``sa`` and ``a8``; then
``_ada_lora_kernel`` (as the pair form launches it, as a PDL dependent where the backend takes PDL) reads x again with
those statistics and adds its own partial sums into ``lora`` / ``la``. Its statistics are summed in another order than
the other forms' (the same bits where the sums are exact); rows past ``kernels.ROW_MAX_K`` columns take the pair
form.

The row statistics are summed in another order than PyTorch's layer norm (and the compiler's), so a normalized
value may differ from the tensor's by one unit of its last place: the contract's "Inputs made by an adaLN norm".
A first form (one launch, a 16-32-row block a program walking K) measured 2x slower than the compiled norm plus
the pass on the H100 (docs/perf.md, twenty-seventh session); this one measured 0.92-1.02x of it (twenty-eighth:
its ``lora_act`` on 32-row tiles reloads ``proj_down`` from L2 every step). The pair form measured ahead of the
written norm (thirty-ninth session, ah-2: 345 us against 361 at the exact fused q/k/v, in graphs), so
``forward_ada_norm`` takes it by default (``SVDQ_SM90_ADA_NORM=0`` writes the norm's output instead).
``benchmarks/bench_norm_in.py`` measures both forms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import nvfp4
from ..._env import getenv
from .kernels import (_INTERPRET, _block_r, _check_pdl, _e4m3_bits, _gemm_k, _lora_dot, _nvfp4_dequant, _nvfp4_tile,
                      ROW_MAX_K, _pdl_opts, _round_to, _split_total, cdiv, fp8_rows_config, gdc_launch_dependents,
                      gdc_wait, next_pow2, setting_launch)
from .tuning import (ADA_NORM_FORMS, ENV_ADA_NORM_TILE, ENV_ADA_PAIR_LORA, ENV_ADA_ROWS_TILE, fit_split,
                     parse_ada_norm_tile, parse_ada_pair_lora, parse_ada_rows_tile)


@triton.jit
def _row_stats(x_ptr, rm, m_ok, K, stride_xm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # mean and (biased) variance of rows rm over K columns, fp32: each chunk's mean and sum of squared
    # deviations, combined as Chan et al. (no cancellation of E[x^2] - E[x]^2 on rows with a large mean)
    mean = tl.zeros([BLOCK_M], tl.float32)
    m2 = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        n_c = tl.minimum(K - k0, BLOCK_K).to(tl.float32)
        c_mean = tl.sum(x, axis=1) / n_c
        d = tl.where(k_ok[None, :], x - c_mean[:, None], 0.0)
        c_m2 = tl.sum(d * d, axis=1)
        n_prev = k0 * 1.0
        n = n_prev + n_c
        delta = c_mean - mean
        mean = mean + delta * (n_c / n)
        m2 = m2 + c_m2 + delta * delta * (n_prev * n_c / n)
    return mean, m2 / K


@triton.jit
def _round_kept(v, like_ptr, RNE_BITS: tl.constexpr):
    # _round_to, but a rounding the compiler cannot fold into the next operation. Compiled, LLVM turns a product of
    # two 16-bit values rounded to 16 bits into a 16-bit multiply (exact to do) and then contracts it with the add
    # after it into one fma.rn.bf16x2: one rounding where the eager code rounds twice, a bf16 unit off in about a
    # quarter of the modulated values (measured on the H100, benchmarks/diag_fast_rows.py). A cvt in inline PTX is
    # opaque to both steps (enable_fp_fusion=False on the launch would stop the contraction too, and every fp32 fma
    # of the kernel with it); the interpreter (RNE_BITS) runs no such passes.
    if RNE_BITS or like_ptr.dtype.element_ty == tl.float32:
        return _round_to(v, like_ptr, RNE_BITS)
    tl.static_assert(like_ptr.dtype.element_ty == tl.bfloat16 or like_ptr.dtype.element_ty == tl.float16)
    if like_ptr.dtype.element_ty == tl.bfloat16:
        h = tl.inline_asm_elementwise("cvt.rn.bf16.f32 $0, $1;", "=h,r", [v], dtype=tl.bfloat16, is_pure=True,
                                      pack=1)
    else:
        h = tl.inline_asm_elementwise("cvt.rn.f16.f32 $0, $1;", "=h,r", [v], dtype=tl.float16, is_pure=True, pack=1)
    return h.to(tl.float32)


@triton.jit
def _ada_apply(x, mean, rstd, rm, lk, mask, shift_ptr, scale_ptr, S, stride_mod, like_ptr, RNE_BITS: tl.constexpr,
               UNIFORM: tl.constexpr = False, k_ok=None):
    # layer_norm(x) * (1 + scale) + shift of fp32 x [rows, cols] at columns lk, each step rounded to like_ptr's
    # dtype as the eager diffusers code's tensors hold it; rows rm of batch element rm // S. UNIFORM: every row of
    # rm lies in the first one's batch element (the launch's tokens a multiple of its rows), so scale and shift are
    # one [cols] row each (columns k_ok), 1 + scale rounded once a column; else gathered a value at a time.
    v = _round_to((x - mean[:, None]) * rstd[:, None], like_ptr, RNE_BITS)
    if UNIFORM:
        off = (tl.min(rm, axis=0) // S) * stride_mod + lk
        sc = tl.load(scale_ptr + off, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        sh = tl.load(shift_ptr + off, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    else:
        off = (rm // S)[:, None] * stride_mod + lk[None, :]
        sc = tl.load(scale_ptr + off, mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(shift_ptr + off, mask=mask, other=0.0).to(tl.float32)
    v = _round_kept(v * _round_to(sc + 1.0, like_ptr, RNE_BITS), like_ptr, RNE_BITS)
    return _round_to(v + sh, like_ptr, RNE_BITS)


@triton.jit
def _ada_tile(x_ptr, shift_ptr, scale_ptr, mean, rstd, rm, m_ok, lk, K, S, stride_xm, stride_mod,
              RNE_BITS: tl.constexpr, UNIFORM: tl.constexpr = False):
    # columns lk of rows rm, normalized and modulated (_ada_apply); 0 outside the tensor
    k_ok = lk < K
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_xm + lk[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, _ada_apply(x, mean, rstd, rm, lk, mask, shift_ptr, scale_ptr, S, stride_mod, x_ptr,
                                     RNE_BITS, UNIFORM, k_ok), 0.0), mask


@triton.jit
def _ada_stats_kernel(x_ptr, shift_ptr, scale_ptr, inv_ptr, mean_ptr, rstd_ptr, sa_ptr, M, K, S, stride_xm, stride_mod,
                      eps, ROWS: tl.constexpr, CHUNK: tl.constexpr, FAST: tl.constexpr, DOT_F32: tl.constexpr,
                      UNIFORM: tl.constexpr = False):
    # Both forms' first launch: ROWS rows a program (many programs, so the read of x runs at HBM speed), each
    # row's mean and 1 / sqrt(var + eps); FAST: also the row scale sa of the normalized, modulated, smoothed row, as
    # nvfp4.fast_act sets it, from a second walk along the rows in chunks of CHUNK columns (from L1 / L2)
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_ok = rm < M
    mean, var = _row_stats(x_ptr, rm, m_ok, K, stride_xm, ROWS, CHUNK)
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    tl.store(mean_ptr + rm, mean, mask=m_ok)
    tl.store(rstd_ptr + rm, rstd, mask=m_ok)
    if FAST:
        mx = tl.zeros([ROWS], tl.int32)
        for k0 in range(0, K, CHUNK):
            rk = k0 + tl.arange(0, CHUNK)
            v, _ = _ada_tile(x_ptr, shift_ptr, scale_ptr, mean, rstd, rm, m_ok, rk, K, S, stride_xm, stride_mod,
                             DOT_F32, UNIFORM)
            inv = tl.load(inv_ptr + rk, mask=rk < K, other=1.0)
            mx = tl.maximum(mx, tl.max((v * inv[None, :]).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
        tl.store(sa_ptr + rm, _sa_of(mx, ROWS), mask=m_ok)


@triton.jit
def _sa_of(mx, ROWS: tl.constexpr):
    # the row scale sa from the bits of the rows' largest |value / smooth| (mx [ROWS]), as nvfp4.fast_act sets it:
    # max / 448, 1 for an all-zero row and where a NaN is in the row
    ok = (mx > 0) & (mx <= 0x7F800000)
    return tl.where(ok, tl.math.div_rn(mx.to(tl.float32, bitcast=True), tl.full([ROWS], 448.0, tl.float32)), 1.0)


@triton.jit
def _inv_sa(sa, ROWS: tl.constexpr):
    # 1 / sa kept finite (a row max below 448 / FLT_MAX would overflow it; a zero sa's row is zeros)
    return tl.minimum(tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), sa), 3.4028234663852886e38)


@triton.jit
def _rows_of(mean_ptr, rstd_ptr, sa_ptr, rm, m_ok, BLOCK_M: tl.constexpr, FAST: tl.constexpr):
    # rows rm's statistics from the first launch: (mean, rstd, sa, 1 / sa); FAST: sa, and 1 / sa kept finite (a
    # zero sa's row is zeros); the exact mode reads neither (mean stands in for both)
    mean = tl.load(mean_ptr + rm, mask=m_ok, other=0.0)
    rstd = tl.load(rstd_ptr + rm, mask=m_ok, other=0.0)
    if FAST:
        sa = tl.load(sa_ptr + rm, mask=m_ok, other=1.0)
        r = _inv_sa(sa, BLOCK_M)
    else:
        sa = mean
        r = mean
    return mean, rstd, sa, r


@triton.jit
def _ada_apply_kernel(
    x_ptr, shift_ptr, scale_ptr, inv_ptr, mean_ptr, rstd_ptr, sa_ptr, out_ptr, pd_ptr, lora_ptr, part_ptr, cnt_ptr,
    M, K, R, S, stride_xm, stride_mod, K_SPLIT, SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, HAS_LORA: tl.constexpr,
    IS_SPLIT: tl.constexpr, FAST: tl.constexpr, GEMM_ORDER: tl.constexpr, HW_CVT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # The split form's second launch: program (i, s) takes rows [i BLOCK_M, (i + 1) BLOCK_M) and the columns [s K_SPLIT,
    # (s + 1) K_SPLIT) in BLOCK_K steps, normalizes and modulates each tile with its rows' statistics, and writes the
    # exact mode's dequantized NVFP4 values (out: xq) or the fast mode's E4M3 codes (out: a8, in the fast GEMM's k order
    # with GEMM_ORDER; sa from the first launch). lora_act's partial sums on tensor cores; with SPLIT > 1 the last
    # program of a row block to count itself in (an atomic counter, left at zero) adds the partials in split order
    # (kernels._split_total, as kernels.quantize_act_lora) and writes lora (exact: bf16) or la = lora / sa (fast: bf16).
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    mean, rstd, sa, r = _rows_of(mean_ptr, rstd_ptr, sa_ptr, rm, m_ok, BLOCK_M, FAST)
    rr = tl.arange(0, BLOCK_R)
    r_ok = rr < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    kb = pid_s * K_SPLIT
    for k0 in range(kb, tl.minimum(kb + K_SPLIT, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        v, lk = _ada_pass_tile(x_ptr, shift_ptr, scale_ptr, inv_ptr, out_ptr, mean, rstd, r, rm, m_ok, rk, k_ok, K, S,
                               stride_xm, stride_mod, BLOCK_M, BLOCK_K, FAST, GEMM_ORDER, HW_CVT, DOT_F32)
        if HAS_LORA:
            w = tl.load(pd_ptr + lk[:, None] * R + rr[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
            acc = _lora_dot(v, w, acc, DOT_F32)
    if HAS_LORA:
        out_mask = m_ok[:, None] & r_ok[None, :]
        if IS_SPLIT:
            total, last = _split_total(acc, part_ptr, cnt_ptr, pid_m, pid_s, rm, rr, out_mask, M, R, SPLIT, BLOCK_M,
                                       BLOCK_R)
            if last:
                _store_lora(total, sa, lora_ptr, rm, rr, out_mask, R, BLOCK_M, BLOCK_R, FAST, DOT_F32)
        else:
            _store_lora(acc, sa, lora_ptr, rm, rr, out_mask, R, BLOCK_M, BLOCK_R, FAST, DOT_F32)


@triton.jit
def _store_lora(acc, sa, lora_ptr, rm, rr, out_mask, R, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                FAST: tl.constexpr, DOT_F32: tl.constexpr):
    # lora_act's sums as the GEMM reads them: la = lora_act / sa rounded once to bf16 (FAST), else lora_act
    # rounded once to lora_ptr's dtype
    if FAST:
        val = tl.math.div_rn(acc, tl.broadcast_to(sa[:, None], (BLOCK_M, BLOCK_R))).to(tl.bfloat16)
    else:
        val = _round_to(acc, lora_ptr, DOT_F32).to(lora_ptr.dtype.element_ty)
    tl.store(lora_ptr + rm[:, None] * R + rr[None, :], val, mask=out_mask)


@triton.jit
def _ada_lora_kernel(x_ptr, shift_ptr, scale_ptr, mean_ptr, rstd_ptr, pd_ptr, part_ptr, sa_ptr, lora_ptr, cnt_ptr, M,
                     K, R, S, stride_xm, stride_mod, K_SPLIT, SPLIT, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_R: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr, DOT_F32: tl.constexpr,
                     UNIFORM: tl.constexpr, FINISH: tl.constexpr = False, FAST: tl.constexpr = False):
    # The pair form's second launch: lora_act's fp32 partial sums [SPLIT, M, R] of the normalized, modulated rows,
    # program (i, s) over rows [i BLOCK_M, (i + 1) BLOCK_M) and the columns [s K_SPLIT, (s + 1) K_SPLIT) (whole
    # BLOCK_K steps; an empty range writes zeros), as kernels._lora_act_kernel on the written input. PDL: launched as
    # the statistics' programmatic dependent; it waits for them, then lets the pass (_ada_pass_kernel) start
    # beside it. FINISH (the rows form's second launch, after the pass): the last program of a row block adds the
    # SPLIT partials in split order (kernels._split_total) and writes lora (exact) or la = lora / sa (FAST), as the
    # pair form's pass does; PDL then lets the GEMM start.
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)
    m_ok = rm < M
    mean, rstd, no_sa, no_r = _rows_of(mean_ptr, rstd_ptr, mean_ptr, rm, m_ok, BLOCK_M, False)  # (exact: no sa)
    kb = tl.program_id(1) * K_SPLIT
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in tl.range(kb, tl.minimum(kb + K_SPLIT, K), BLOCK_K, num_stages=NUM_STAGES):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        v, _ = _ada_tile(x_ptr, shift_ptr, scale_ptr, mean, rstd, rm, m_ok, rk, K, S, stride_xm, stride_mod, DOT_F32,
                         UNIFORM)
        w = tl.load(pd_ptr + rk[:, None] * R + rr[None, :], mask=k_ok[:, None] & (rr < R)[None, :], other=0.0)
        acc = _lora_dot(v, w, acc, DOT_F32)
    out_mask = m_ok[:, None] & (rr < R)[None, :]
    if FINISH:
        total, last = _split_total(acc, part_ptr, cnt_ptr, tl.program_id(0), tl.program_id(1), rm, rr, out_mask, M, R,
                                   SPLIT, BLOCK_M, BLOCK_R)
        if last:
            sa = mean
            if FAST:
                sa = tl.load(sa_ptr + rm, mask=m_ok, other=1.0)
            _store_lora(total, sa, lora_ptr, rm, rr, out_mask, R, BLOCK_M, BLOCK_R, FAST, DOT_F32)
    else:
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * M * R + rm[:, None] * R + rr[None, :], acc, mask=out_mask)


@triton.jit
def _ada_pass_kernel(
    x_ptr, shift_ptr, scale_ptr, inv_ptr, mean_ptr, rstd_ptr, sa_ptr, out_ptr, part_ptr, lora_ptr,
    M, K, R, S, stride_xm, stride_mod, NSPLIT,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, HAS_LORA: tl.constexpr,
    FAST: tl.constexpr, GEMM_ORDER: tl.constexpr, HW_CVT: tl.constexpr, PDL: tl.constexpr, DOT_F32: tl.constexpr,
):
    # The pair form's third launch: one [BLOCK_M, BLOCK_K] tile a program (every byte of x read once, the grid
    # filling the GPU, as kernels._quantize_act_kernel), normalized and modulated with its rows' statistics, then
    # the mode's pass arithmetic (_ada_apply_kernel's: xq, or a8 in the fast GEMM's k order with GEMM_ORDER).
    # HAS_LORA: the programs of the last k-tile (the grid's last to start) add _ada_lora_kernel's NSPLIT partials of
    # their rows in split order and write lora (exact) or la = lora / sa (fast), bf16, one rounding. PDL: launched as
    # that grid's programmatic dependent (which waited for the statistics before it let this grid start): the tiles
    # are read without a wait and only those programs wait for the partials; it lets the GEMM after it start.
    if PDL:
        gdc_launch_dependents()
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    mean, rstd, sa, r = _rows_of(mean_ptr, rstd_ptr, sa_ptr, rm, m_ok, BLOCK_M, FAST)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = rk < K  # K % 16 == 0 (K % 128 in the GEMM's order): whole blocks are in or out
    _ada_pass_tile(x_ptr, shift_ptr, scale_ptr, inv_ptr, out_ptr, mean, rstd, r, rm, m_ok, rk, k_ok, K, S, stride_xm,
                   stride_mod, BLOCK_M, BLOCK_K, FAST, GEMM_ORDER, HW_CVT, DOT_F32)
    if HAS_LORA:
        if tl.program_id(1) == tl.num_programs(1) - 1:
            if PDL:
                gdc_wait()
            rr = tl.arange(0, BLOCK_R)
            out_mask = m_ok[:, None] & (rr < R)[None, :]
            part = part_ptr + rm[:, None] * R + rr[None, :]
            total = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
            for _ in range(NSPLIT):
                total += tl.load(part, mask=out_mask, other=0.0)
                part += M * R  # (pointer arithmetic: 64-bit)
            _store_lora(total, sa, lora_ptr, rm, rr, out_mask, R, BLOCK_M, BLOCK_R, FAST, DOT_F32)


@triton.jit
def _ada_pass_tile(x_ptr, shift_ptr, scale_ptr, inv_ptr, out_ptr, mean, rstd, r, rm, m_ok, rk, k_ok, K, S, stride_xm,
                   stride_mod, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FAST: tl.constexpr,
                   GEMM_ORDER: tl.constexpr, HW_CVT: tl.constexpr, DOT_F32: tl.constexpr):
    # positions rk of rows rm: the columns they hold (lk: the fast GEMM's k order with GEMM_ORDER) normalized and
    # modulated (_ada_tile), then written as the mode's pass writes them: xq (exact) or the E4M3 codes over the
    # rows' sa (FAST: r = 1 / sa). Returns (the normalized, modulated values, lk).
    lk = _gemm_k(rk, GEMM_ORDER)
    # (the gathered modulation: one row of it for a uniform tile compiled to more instructions here, a layout
    # conversion through shared memory among them, where the statistics' walk and lora_act's loop take fewer)
    v, mask = _ada_tile(x_ptr, shift_ptr, scale_ptr, mean, rstd, rm, m_ok, lk, K, S, stride_xm, stride_mod, DOT_F32)
    if FAST:
        _fast_store(v, inv_ptr, lk, k_ok, r, out_ptr + rm[:, None] * K + rk[None, :], mask, HW_CVT)
    else:
        finite, sf, q = _nvfp4_tile(v, inv_ptr, rk, k_ok, BLOCK_M, BLOCK_K, True)
        xq = _nvfp4_dequant(q, finite, sf)
        tl.store(out_ptr + rm[:, None] * K + rk[None, :],
                 tl.reshape(xq, (BLOCK_M, BLOCK_K)).to(out_ptr.dtype.element_ty), mask=mask)
    return v, lk


@triton.jit
def _fast_store(v, inv_ptr, lk, k_ok, r, ptrs, mask, HW_CVT: tl.constexpr):
    # the fast mode's E4M3 codes of v [rows, cols] (the normalized, modulated values at columns lk) over smooth
    # (inv_ptr: 1 / smooth) and the rows' sa (r = 1 / sa), nvfp4.fast_act's rounding, stored at ptrs
    inv = tl.load(inv_ptr + lk, mask=k_ok, other=1.0)
    q = (v * inv[None, :]) * r[:, None]
    if HW_CVT:  # nearest even, saturating at 448; +-Inf -> NaN, every NaN the positive one (round_e4m3)
        q = q + q * 0.0
        tl.store(ptrs, tl.where(q == q, q, float("nan")).to(tl.float8e4nv), mask=mask)
    else:
        tl.store(ptrs.to(tl.pointer_type(tl.uint8), bitcast=True), _e4m3_bits(q), mask=mask)


@triton.jit
def _rows_load(x_ptr, rm, m_ok, K, stride_xm, J: tl.constexpr, C: tl.constexpr, GEMM_ORDER: tl.constexpr):
    # positions [J C, (J + 1) C) of rows rm (the columns the fast GEMM's k order puts there with GEMM_ORDER), fp32,
    # 0 outside the tensor
    rk = J * C + tl.arange(0, C)
    lk = _gemm_k(rk, GEMM_ORDER)
    mask = m_ok[:, None] & (rk < K)[None, :]
    return tl.load(x_ptr + rm[:, None] * stride_xm + lk[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rows_sq(x, mean, K, J: tl.constexpr, C: tl.constexpr):
    # the sum of squared deviations from mean of chunk J's columns in the tensor
    rk = J * C + tl.arange(0, C)
    d = tl.where((rk < K)[None, :], x - mean[:, None], 0.0)
    return tl.sum(d * d, axis=1)


@triton.jit
def _rows_apply(x, mean, rstd, rm, m_ok, K, S, stride_mod, shift_ptr, scale_ptr, like_ptr, J: tl.constexpr,
                C: tl.constexpr, GEMM_ORDER: tl.constexpr, RNE_BITS: tl.constexpr, UNIFORM: tl.constexpr):
    # chunk J of the rows normalized and modulated (_ada_apply), 0 outside the tensor
    rk = J * C + tl.arange(0, C)
    k_ok = rk < K
    lk = _gemm_k(rk, GEMM_ORDER)
    mask = m_ok[:, None] & k_ok[None, :]
    return tl.where(mask, _ada_apply(x, mean, rstd, rm, lk, mask, shift_ptr, scale_ptr, S, stride_mod, like_ptr,
                                     RNE_BITS, UNIFORM, k_ok), 0.0)


@triton.jit
def _rows_max(v, inv_ptr, K, J: tl.constexpr, C: tl.constexpr, GEMM_ORDER: tl.constexpr):
    # the bits of each row's largest |v / smooth| over chunk J (the statistics kernel's FAST walk)
    rk = J * C + tl.arange(0, C)
    inv = tl.load(inv_ptr + _gemm_k(rk, GEMM_ORDER), mask=rk < K, other=1.0)
    return tl.max((v * inv[None, :]).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def _rows_store(v, inv_ptr, out_ptr, r, rm, m_ok, K, J: tl.constexpr, C: tl.constexpr, ROWS: tl.constexpr,
                FAST: tl.constexpr, GEMM_ORDER: tl.constexpr, HW_CVT: tl.constexpr):
    # chunk J written as the pair form's pass writes a tile (_ada_pass_tile): the fast mode's E4M3 codes over the rows'
    # sa (r = 1 / sa) at positions rk, else the exact mode's dequantized NVFP4 values
    rk = J * C + tl.arange(0, C)
    k_ok = rk < K
    mask = m_ok[:, None] & k_ok[None, :]
    if FAST:
        _fast_store(v, inv_ptr, _gemm_k(rk, GEMM_ORDER), k_ok, r, out_ptr + rm[:, None] * K + rk[None, :], mask,
                    HW_CVT)
    else:
        finite, sf, q = _nvfp4_tile(v, inv_ptr, rk, k_ok, ROWS, C, True)
        xq = _nvfp4_dequant(q, finite, sf)
        tl.store(out_ptr + rm[:, None] * K + rk[None, :], tl.reshape(xq, (ROWS, C)).to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _ada_rows_kernel(x_ptr, shift_ptr, scale_ptr, inv_ptr, mean_ptr, rstd_ptr, sa_ptr, out_ptr, M, K, S, stride_xm,
                     stride_mod, eps, ROWS: tl.constexpr, C: tl.constexpr, NCH: tl.constexpr, FAST: tl.constexpr,
                     GEMM_ORDER: tl.constexpr, HW_CVT: tl.constexpr, RELEASE: tl.constexpr, DOT_F32: tl.constexpr,
                     UNIFORM: tl.constexpr):
    # The rows form's first launch: ROWS whole rows a program, held in registers (NCH <= 4 chunks of C columns) and x
    # read once for the statistics and the pass. The rows' mean and 1 / sqrt(var + eps) (two sweeps over the
    # registers: the sum, then the squared deviations), stored for lora_act; each value normalized and modulated
    # (_ada_apply); then the exact mode's xq a chunk at a time, or (FAST) the row scale sa from the rows' largest
    # |v / smooth| and the E4M3 codes in the fast GEMM's k order (GEMM_ORDER). RELEASE: lets a programmatic dependent
    # (_ada_lora_kernel, which waits for this grid) start.
    if RELEASE:
        gdc_launch_dependents()
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_ok = rm < M
    x0 = _rows_load(x_ptr, rm, m_ok, K, stride_xm, 0, C, GEMM_ORDER)
    if NCH > 1:
        x1 = _rows_load(x_ptr, rm, m_ok, K, stride_xm, 1, C, GEMM_ORDER)
    if NCH > 2:
        x2 = _rows_load(x_ptr, rm, m_ok, K, stride_xm, 2, C, GEMM_ORDER)
    if NCH > 3:
        x3 = _rows_load(x_ptr, rm, m_ok, K, stride_xm, 3, C, GEMM_ORDER)
    s = tl.sum(x0, axis=1)
    if NCH > 1:
        s += tl.sum(x1, axis=1)
    if NCH > 2:
        s += tl.sum(x2, axis=1)
    if NCH > 3:
        s += tl.sum(x3, axis=1)
    mean = s / K
    q = _rows_sq(x0, mean, K, 0, C)
    if NCH > 1:
        q += _rows_sq(x1, mean, K, 1, C)
    if NCH > 2:
        q += _rows_sq(x2, mean, K, 2, C)
    if NCH > 3:
        q += _rows_sq(x3, mean, K, 3, C)
    rstd = 1.0 / tl.sqrt_rn(q / K + eps)
    tl.store(mean_ptr + rm, mean, mask=m_ok)
    tl.store(rstd_ptr + rm, rstd, mask=m_ok)
    v0 = _rows_apply(x0, mean, rstd, rm, m_ok, K, S, stride_mod, shift_ptr, scale_ptr, x_ptr, 0, C, GEMM_ORDER,
                     DOT_F32, UNIFORM)
    if NCH > 1:
        v1 = _rows_apply(x1, mean, rstd, rm, m_ok, K, S, stride_mod, shift_ptr, scale_ptr, x_ptr, 1, C, GEMM_ORDER,
                         DOT_F32, UNIFORM)
    if NCH > 2:
        v2 = _rows_apply(x2, mean, rstd, rm, m_ok, K, S, stride_mod, shift_ptr, scale_ptr, x_ptr, 2, C, GEMM_ORDER,
                         DOT_F32, UNIFORM)
    if NCH > 3:
        v3 = _rows_apply(x3, mean, rstd, rm, m_ok, K, S, stride_mod, shift_ptr, scale_ptr, x_ptr, 3, C, GEMM_ORDER,
                         DOT_F32, UNIFORM)
    r = mean  # (the exact mode has no row scale)
    if FAST:
        mx = _rows_max(v0, inv_ptr, K, 0, C, GEMM_ORDER)
        if NCH > 1:
            mx = tl.maximum(mx, _rows_max(v1, inv_ptr, K, 1, C, GEMM_ORDER))
        if NCH > 2:
            mx = tl.maximum(mx, _rows_max(v2, inv_ptr, K, 2, C, GEMM_ORDER))
        if NCH > 3:
            mx = tl.maximum(mx, _rows_max(v3, inv_ptr, K, 3, C, GEMM_ORDER))
        sa = _sa_of(mx, ROWS)  # and 1 / sa, as the statistics kernel and _rows_of make them
        tl.store(sa_ptr + rm, sa, mask=m_ok)
        r = _inv_sa(sa, ROWS)
    _rows_store(v0, inv_ptr, out_ptr, r, rm, m_ok, K, 0, C, ROWS, FAST, GEMM_ORDER, HW_CVT)
    if NCH > 1:
        _rows_store(v1, inv_ptr, out_ptr, r, rm, m_ok, K, 1, C, ROWS, FAST, GEMM_ORDER, HW_CVT)
    if NCH > 2:
        _rows_store(v2, inv_ptr, out_ptr, r, rm, m_ok, K, 2, C, ROWS, FAST, GEMM_ORDER, HW_CVT)
    if NCH > 3:
        _rows_store(v3, inv_ptr, out_ptr, r, rm, m_ok, K, 3, C, ROWS, FAST, GEMM_ORDER, HW_CVT)


def _stats_launch(x, shift, scale, eps, inv_smooth, tokens, fast, rows=4):
    """Both forms' first launch, ``_ada_stats_kernel`` at ``rows`` rows a program: ``(mean, rstd, sa)`` [M] fp32
    (``sa`` is ``mean`` in the exact mode, which has none)."""
    m, k = x.shape
    mean = torch.empty(m, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    sa = torch.empty_like(mean) if fast else mean
    _ada_stats_kernel[(cdiv(m, rows),)](x, shift, scale, inv_smooth, mean, rstd, sa, m, k, tokens, x.stride(0),
                                        shift.stride(0), float(eps), ROWS=rows, CHUNK=min(1024, next_pow2(k)),
                                        FAST=fast, DOT_F32=_INTERPRET, UNIFORM=tokens % rows == 0)
    return mean, rstd, sa


def _split_launch(x, shift, scale, eps, inv_smooth, pds, tokens, out, lora, fast, gemm_order, split, block_m, block_k,
                  num_warps):
    """The split form: ``_ada_stats_kernel`` then ``_ada_apply_kernel`` over ``split`` ranges of K."""
    m, k = x.shape
    r = 0 if pds is None else pds.shape[1]
    mean, rstd, sa = _stats_launch(x, shift, scale, eps, inv_smooth, tokens, fast)
    block_k = min(block_k, next_pow2(k))
    k_split = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_split)
    rows = cdiv(m, block_m)
    part = cnt = mean
    if r and split > 1:
        from .small_m import sync_words

        part = torch.empty(split, m, r, device=x.device, dtype=torch.float32)
        cnt = sync_words(x.device, rows, "norm_pass")
    with setting_launch(ENV_ADA_NORM_TILE, lambda: _tile_setting(block_m, num_warps),
                        "the split form's apply launch at {} x {} (rows x warps), {}-column steps and R = {}",
                        block_m, num_warps, block_k, r, hint="take a smaller tile"):
        _ada_apply_kernel[(rows, split)](
            x, shift, scale, inv_smooth, mean, rstd, sa, out, mean if pds is None else pds,
            mean if lora is None else lora, part, cnt, m, k, r, tokens, x.stride(0), shift.stride(0), k_split, split,
            BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=_block_r(r), HAS_LORA=r > 0, IS_SPLIT=split > 1, FAST=fast,
            GEMM_ORDER=gemm_order, HW_CVT=not _INTERPRET, DOT_F32=_INTERPRET, num_warps=num_warps)
    return sa


def _tile_setting(block_m: int, num_warps: int) -> str | None:
    """``SVDQ_SM90_ADA_NORM_TILE``'s value where it names this apply tile (the backend hands the split form the
    setting's tile, ``tuning.ada_norm_tile``), else None: a direct call at a tile of its own, or the setting unset or
    malformed, did not take its tile from the setting."""
    v = getenv(ENV_ADA_NORM_TILE)
    if not v:
        return None
    try:
        return v if parse_ada_norm_tile(v) == (block_m, num_warps) else None
    except ValueError:
        return None


# The pair form's launches: lora_act at tuning.ada_pair_lora (by default kernels.lora_act's plan,
# tuning.LORA_ACT_CONFIG: 64-row blocks on wgmma over four K ranges, fewer where a range would hold fewer than two
# steps; 128-column steps up to R = 64, 64 above); the pass in kernels.quantize_act's 8 x 256 tiles on 4 warps.
PAIR_PASS = (8, 256, 4)  # block_m, block_k, warps


def _lora_launch(x, shift, scale, mean, rstd, pds, tokens, pdl, finish=None):
    """``_ada_lora_kernel`` at ``tuning.ada_pair_lora``'s launch (both forms' ``lora_act``), launched as a PDL
    dependent with ``pdl``. Returns ``(part, nsplit)``, the fp32 partials the pair form's pass adds; ``finish``
    (the rows form): ``(sa, lora, fast)``, the kernel writes ``lora`` itself (``sa``: the fast mode's row scales)."""
    m, k = x.shape
    r = pds.shape[1]
    env = getenv(ENV_ADA_PAIR_LORA)  # tuning.ada_pair_lora: LORA_ACT_CONFIG unless the setting says
    bm, s, warps, stages = parse_ada_pair_lora(env or "")
    block_k = 128 if _block_r(r) <= 64 else 64
    s = fit_split(s, k, block_k)
    k_split = cdiv(cdiv(k, s), block_k) * block_k
    nsplit = cdiv(k, k_split)
    part = torch.empty(nsplit, m, r, device=x.device, dtype=torch.float32)
    sa, lora, fast = finish or (mean, mean, False)
    if finish is not None:
        from .small_m import sync_words

        cnt = sync_words(x.device, cdiv(m, bm), "norm_pass")
    else:
        cnt = mean
    with setting_launch(ENV_ADA_PAIR_LORA, env, "the norm pass's lora_act at block_m={}, stages={} and R = {}", bm,
                        stages, r, hint="take fewer rows or stages"):
        _ada_lora_kernel[(cdiv(m, bm), nsplit)](
            x, shift, scale, mean, rstd, pds, part, sa, lora, cnt, m, k, r, tokens, x.stride(0), shift.stride(0),
            k_split, nsplit, BLOCK_M=bm, BLOCK_K=block_k, BLOCK_R=_block_r(r), NUM_STAGES=stages, PDL=pdl,
            DOT_F32=_INTERPRET, UNIFORM=tokens % bm == 0, FINISH=finish is not None, FAST=fast, num_warps=warps,
            **_pdl_opts(pdl))
    return part, nsplit


def _pair_launch(x, shift, scale, eps, inv_smooth, pds, tokens, out, lora, fast, gemm_order, pdl):
    """The pair form: ``_ada_stats_kernel``, then ``_ada_lora_kernel`` and ``_ada_pass_kernel``, the last two a PDL
    pair with ``pdl`` (the pass beside ``lora_act``, as the written input's path runs them), else one after the
    other. ``mean``, ``rstd`` and the partials are freed on return while the grids may still run, as the written
    path's pair frees its partials: the caching allocator hands their memory only to work queued after them on this
    stream, and a PDL dependent of the pass (the GEMM) waits for it before its first access."""
    m, k = x.shape
    r = 0 if pds is None else pds.shape[1]
    mean, rstd, sa = _stats_launch(x, shift, scale, eps, inv_smooth, tokens, fast)
    part, nsplit, pdl = mean, 1, pdl and r > 0
    if r:
        part, nsplit = _lora_launch(x, shift, scale, mean, rstd, pds, tokens, pdl)
    bm, block_k, warps = PAIR_PASS
    block_k = min(block_k, next_pow2(k))
    _ada_pass_kernel[(cdiv(m, bm), cdiv(k, block_k))](
        x, shift, scale, inv_smooth, mean, rstd, sa, out, part, mean if lora is None else lora, m, k, r, tokens,
        x.stride(0), shift.stride(0), nsplit, BLOCK_M=bm, BLOCK_K=block_k, BLOCK_R=_block_r(r), HAS_LORA=r > 0,
        FAST=fast, GEMM_ORDER=gemm_order, HW_CVT=not _INTERPRET, PDL=pdl, DOT_F32=_INTERPRET, num_warps=warps,
        **_pdl_opts(pdl))
    return sa


def rows_config(k: int) -> tuple[int, int, int, int]:
    """``(rows, C, NCH, num_warps)`` of the rows form's first launch for rows of ``k`` columns: a row in at most 4
    power-of-two chunks of at least 16 columns (whole NVFP4 blocks), and the one-pass FP8 kernel's block
    (``kernels.fp8_rows_config``: 2 rows on 8 warps up to 3072 columns, 1 row on 4 warps up to 4096, on 8 above)."""
    c = max(16, next_pow2(cdiv(k, 4)))
    rows, _, _, warps = fp8_rows_config(k)
    return rows, c, cdiv(k, c), warps


def _rows_launch(x, shift, scale, eps, inv_smooth, pds, tokens, out, lora, fast, gemm_order, pdl):
    """The rows form: ``_ada_rows_kernel`` (whole rows a program: the statistics and the pass from one read of x),
    then ``_ada_lora_kernel`` with the statistics it wrote, adding its own partials; with ``pdl`` the second is the
    first's programmatic dependent (it waits for the statistics, then lets the GEMM start), else one after the
    other. Temporaries are freed on return as in ``_pair_launch``."""
    m, k = x.shape
    r = 0 if pds is None else pds.shape[1]
    rows, c, nch, warps = rows_config(k)
    env = getenv(ENV_ADA_ROWS_TILE)
    rows, warps = parse_ada_rows_tile(env or "") or (rows, warps)  # tuning.ada_rows_tile
    mean = torch.empty(m, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    sa = torch.empty_like(mean) if fast else mean
    pdl = pdl and r > 0
    with setting_launch(ENV_ADA_ROWS_TILE, env, "the rows form's pass at {} x {} (rows x warps) and K = {}", rows,
                        warps, k, hint="take fewer rows"):
        _ada_rows_kernel[(cdiv(m, rows),)](
            x, shift, scale, inv_smooth, mean, rstd, sa, out, m, k, tokens, x.stride(0), shift.stride(0), float(eps),
            ROWS=rows, C=c, NCH=nch, FAST=fast, GEMM_ORDER=gemm_order, HW_CVT=not _INTERPRET, RELEASE=pdl,
            DOT_F32=_INTERPRET, UNIFORM=tokens % rows == 0, num_warps=warps)
    if r:
        _lora_launch(x, shift, scale, mean, rstd, pds, tokens, pdl, finish=(sa, lora, fast))
    return sa


FORMS = ADA_NORM_FORMS  # ("split", "pair", "rows")
_FORM_LAUNCH = {"pair": _pair_launch, "rows": _rows_launch}


def _form_for(form: str, k: int) -> str:
    """The form that launches ``form`` at rows of ``k`` columns: the rows form's rows past ``kernels.ROW_MAX_K``
    columns (more than a program's registers hold) take the pair form, the same arithmetic."""
    return "pair" if form == "rows" and k > ROW_MAX_K else form


def _check_form(form: str, pdl: bool, device: torch.device, m: int, k: int, block_m: int, block_k: int,
                split: int | None) -> int:
    """The split form's ``_check_blocks`` (0 for the pair form, whose tiles are its own) after checking ``form``
    (one of ``FORMS``) and ``pdl`` (the pair form on a device that launches PDL pairs)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if pdl:
        if form == "split":
            raise ValueError("pdl=True launches the pair form's lora_act and pass as a PDL pair (the rows form's pass "
                             "and lora_act): pass form='pair' or form='rows'")
        _check_pdl(device, f"the norm pass's {form} form")
    return _check_blocks(m, k, device, block_m, block_k, split) if form == "split" else 0


def _check_blocks(m: int, k: int, device: torch.device, block_m: int, block_k: int, split: int | None) -> int:
    """The split to launch (``auto_split`` for None), after checking the blocks."""
    if block_m < 16 or block_m & (block_m - 1) or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"need power-of-two blocks of at least 16 (tensor-core rows), got {block_m} x {block_k}")
    if split is not None and split < 1:
        raise ValueError(f"expected split >= 1, got {split}")
    return auto_split(m, k, device, block_m, block_k) if split is None else split


def auto_split(m: int, k: int, device: torch.device, block_m: int = 32, block_k: int = 64) -> int:
    """The split form's K ranges: about four programs an SM (32-row blocks), whole ``block_k`` steps each."""
    from .tuning import sm_count

    return max(1, min(cdiv(k, block_k), round(4 * sm_count(device) / max(1, cdiv(m, block_m)))))


def _check(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, tokens: int, inv_smooth: torch.Tensor,
           pds: torch.Tensor | None) -> tuple[int, int, int]:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"expected a 2-D bf16 or fp16 x [M, K], got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if k % nvfp4.BLOCK_SIZE:
        raise ValueError(f"expected K % 16 == 0, got {k}")
    if tokens < 1 or m % tokens:
        raise ValueError(f"x's {m} rows are not whole batch elements of {tokens} tokens")
    want = (m // tokens, k)
    for name, t in (("shift", shift), ("scale", scale)):
        if tuple(t.shape) != want or t.dtype != x.dtype or t.stride(1) != 1:
            raise ValueError(f"{name} must be [{want[0]}, {k}] {x.dtype} with unit stride along K, got "
                             f"{tuple(t.shape)} {t.dtype}")
    if shift.stride(0) != scale.stride(0):
        raise ValueError("shift and scale must share their row stride (chunks of one modulation tensor)")
    if inv_smooth.shape != (k,) or inv_smooth.dtype != torch.float32 or not inv_smooth.is_contiguous():
        raise ValueError(f"inv_smooth must be a contiguous [{k}] float32 tensor (1 / smooth)")
    r = 0
    if pds is not None:
        if pds.dim() != 2 or pds.shape[0] != k or pds.dtype != torch.bfloat16 or not pds.is_contiguous():
            raise ValueError(f"pds must be a contiguous [{k}, R] bf16 tensor, got {tuple(pds.shape)} {pds.dtype}")
        r = pds.shape[1]
    return m, k, r


def ada_norm_exact(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, inv_smooth: torch.Tensor,
                   pds: torch.Tensor | None = None, *, tokens: int | None = None, out_dtype: torch.dtype | None = None,
                   block_m: int = 32, block_k: int = 64, num_warps: int = 4, split: int | None = None,
                   form: str = "split", pdl: bool = False):
    """``(xq, lora)`` of the exact mode for the input ``nvfp4.ada_norm(x, shift, scale, eps)`` read from ``x [M, K]``
    (bf16 / fp16, unit stride along K): ``xq`` the dequantized NVFP4 values of ``input / smooth``
    (``inv_smooth = 1 / smooth``, fp32), ``lora = input.to(bf16) @ pds`` in bf16 (None without ``pds``). ``shift``
    and ``scale`` are ``[B, K]`` (x's dtype), x's rows ``tokens`` (default all M) per batch element.

    Two launches: the statistics (a few rows a program), then ``block_m`` x K / ``split`` tiles a program in
    ``block_k``-column steps (64 by default: at R = 128 the apply kernel holds 60 KB of shared memory and 142-152
    registers a program against 120 KB and 198-250 at 128 columns, svdq-precompile's counts), their
    ``lora_act`` partial sums added in split order by the last of a row block (the same bits for any ``split`` but
    lora_act's fp32 summation order; None: ``auto_split``).

    ``form="pair"``: the statistics, then ``lora_act`` alone (``tuning.ada_pair_lora``) and the pass alone in small
    tiles that fill the GPU (``PAIR_PASS``), with ``pdl`` as a PDL pair that reads x at once (CUDA, capability 9.0 or
    later), else one after the other; the tile arguments do not apply. The same ``xq`` bits as ``"split"``;
    ``lora_act`` summed in another order. ``form="rows"``: whole rows a program (``rows_config``, or
    ``SVDQ_SM90_ADA_ROWS_TILE``'s rows x warps) for the statistics and the pass from one read of x, then ``lora_act``
    with those statistics (with ``pdl`` its PDL dependent); the row statistics summed in another order, so a value
    may round the other way (the same bits as ``"pair"`` where the sums are exact); rows past ``kernels.ROW_MAX_K``
    columns take the pair form. (``form`` defaults to "split" for direct callers such as
    ``svdq-precompile``; the backend always passes ``tuning.ada_norm_form()``, "pair" unless set.)"""
    tokens = tokens or x.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k, r = _check(x, shift, scale, tokens, inv_smooth, pds)
    split = _check_form(form, pdl, x.device, m, k, block_m, block_k, split)
    xq = torch.empty(m, k, device=x.device, dtype=out_dtype or x.dtype)
    lora = torch.empty(m, r, device=x.device, dtype=torch.bfloat16) if r else None
    if m and form != "split":
        _FORM_LAUNCH[_form_for(form, k)](x, shift, scale, eps, inv_smooth, pds, tokens, xq, lora, False, False, pdl)
    elif m:
        _split_launch(x, shift, scale, eps, inv_smooth, pds, tokens, xq, lora, False, False, split, block_m, block_k,
                      num_warps)
    return xq, lora


def ada_norm_fast(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, inv_smooth: torch.Tensor,
                  pds: torch.Tensor | None = None, *, tokens: int | None = None, gemm_order: bool = True,
                  block_m: int = 32, block_k: int = 64, num_warps: int = 4, split: int | None = None,
                  form: str = "split", pdl: bool = False):
    """``(a8, sa, la)`` of the fast mode for the input ``nvfp4.ada_norm(x, shift, scale, eps)`` read from
    ``x [M, K]``: ``nvfp4.fast_act`` of ``input / smooth`` (``a8`` in the fast GEMM's k order with
    ``gemm_order``, K % 128 == 0) and ``la = (input.to(bf16) @ pds) / sa`` in bf16 (None without ``pds``).
    Arguments as ``ada_norm_exact``'s (``form="pair"``: the same ``a8`` and ``sa`` bits as ``"split"``)."""
    tokens = tokens or x.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k, r = _check(x, shift, scale, tokens, inv_smooth, pds)
    if gemm_order and k % 128:
        raise ValueError(f"the fast GEMM's k order needs K % 128 == 0, got {k}")
    split = _check_form(form, pdl, x.device, m, k, block_m, block_k, split)
    a8 = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    sa = torch.empty(0, device=x.device, dtype=torch.float32)
    la = torch.empty(m, r, device=x.device, dtype=torch.bfloat16) if r else None
    if m and form != "split":
        sa = _FORM_LAUNCH[_form_for(form, k)](x, shift, scale, eps, inv_smooth, pds, tokens, a8, la, True, gemm_order,
                                              pdl)
    elif m:
        sa = _split_launch(x, shift, scale, eps, inv_smooth, pds, tokens, a8, la, True, gemm_order, split, block_m,
                           block_k, num_warps)
    return a8, sa, la

