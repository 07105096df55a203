"""The exact mode at large M as decode + dense GEMM: the NVFP4 weight decoded to bf16 once a call.

quack's W4 GEMM decodes the weight in the math warpgroups' registers, between their wgmmas. At
4608 x 15360 -> 3072 that holds the tensor pipe at 79 % where cuBLAS bf16 holds 94 % (docs/perf.md,
seventh session): 0.88x cuBLAS. A GEMM whose operands both come from shared memory has no such
cost, so this path pays the decode once, in its own pass, and runs a dense bf16 GEMM:

- ``decode_weight`` writes ``W [N, K]`` bf16 from quack's repacked ``blob`` / ``sf`` (the prepared
  state holds those, not the canonical layout) into the first K columns of a ``[N, K + W]`` scratch.
  E2M1 values times E4M3 scales are exact in bf16, so the dense product is the one the W4 GEMM
  computes: bf16 operands, fp32 accumulation.
- The low-rank term rides the same K-loop: the last ``W`` columns hold ``proj_up / wcscale`` and the
  activations' last ``W`` columns ``lora_act``, so ``acc * wcscale`` adds the contract's low-rank
  product (the fold the contract allows: ``nvfp4.tolerance``'s low-rank term covers it as it covers
  ``quack_lowrank``).
- The epilogue ``acc * wcscale + bias`` is fused in the dense GEMM.

The scratch is per call (``N * (K + W) * 2`` bytes: 94 MB at 15360 x 3072), freed when the call ends,
so prepared weight memory does not grow. The decode reads 0.56 bytes a weight and writes 2: about
28 us at that shape on the H200, against ~70 us the in-register decode costs there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS = 64  # quack's blob: [N / 64, K / 64, 128, 16] bytes, a 64 x 64 weight tile a [128, 16] chunk
_KT = 64


@triton.jit
def _decode_kernel(blob_ptr, sf_ptr, out_ptr, KT, stride_o, TILES: tl.constexpr):
    # One program: 64 weight rows (g) x TILES k-tiles of 64. quack's permutation, as index arithmetic:
    # row r = 16 t2 + 8 p0 + t1, byte column c = 8 b + 4 p1 + t0 -> chunk [32 t2 + 4 t1 + t0, 4 b + 2 p1 + p0];
    # scales: row r = 16 s1 + 8 i + s0, block b -> [8 s1 + s0, b, i] of a [32, 4, 2] strip.
    g = tl.program_id(0)
    kt0 = tl.program_id(1) * TILES
    r = tl.arange(0, 64)
    c = tl.arange(0, 32)
    t2, p0, t1 = r // 16, (r // 8) % 2, r % 8
    b, p1, t0 = c // 8, (c // 4) % 2, c % 4
    w_off = (32 * t2 + 4 * t1)[:, None] * 16 + (t0 * 16 + 4 * b + 2 * p1)[None, :] + p0[:, None]
    bs = tl.arange(0, 4)
    s_off = ((8 * t2 + t1) * 8 + p0)[:, None] + (bs * 2)[None, :]
    kk = tl.arange(0, 64)
    for i in range(TILES):
        kt = kt0 + i
        if kt < KT:
            chunk = (g * KT + kt).to(tl.int64)
            wp = tl.load(blob_ptr + chunk * 2048 + w_off)  # [64, 32] bytes
            sc = tl.load(sf_ptr + chunk * 256 + s_off)  # [64, 4] E4M3
            code = tl.interleave(wp & 0xF, wp >> 4).to(tl.int32)  # element 2j is the low nibble
            bits = ((code & 7) << 22) | ((code & 8) << 28)
            v = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2**126: the E2M1 value
            scf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            scf = tl.where((sc & 0x7F) == 0x7F, float("nan"), scf)  # NaN as the GPU reads it (the interpreter: 480)
            w = tl.reshape(tl.reshape(v, (64, 4, 16)) * scf[:, :, None], (64, 64))
            rows = (g * 64 + r).to(tl.int64)
            tl.store(out_ptr + rows[:, None] * stride_o + (kt * 64 + kk)[None, :], w.to(tl.bfloat16))


def decode_weight(blob: torch.Tensor, sf: torch.Tensor, out: torch.Tensor, tiles: int = 4) -> torch.Tensor:
    """Write the weight that ``blob`` / ``sf`` (``quack_gemm.repack_*``) hold, as exact bf16 values, into
    ``out[:, :K]`` (``out`` bf16 ``[N, >= K]``, unit stride along K); returns ``out``."""
    if blob.dtype != torch.uint8 or blob.dim() != 4 or tuple(blob.shape[2:]) != (128, 16):
        raise ValueError(f"decode_weight: blob must be uint8 [N/64, K/64, 128, 16], got {blob.dtype} "
                         f"{tuple(blob.shape)}")
    g, kt = blob.shape[:2]
    if tuple(sf.shape) != (g, kt, 32, 4, 2):
        raise ValueError(f"decode_weight: sf must be [{g}, {kt}, 32, 4, 2] for this blob, got {tuple(sf.shape)}")
    n, k = g * _ROWS, kt * _KT
    if out.dtype != torch.bfloat16 or out.dim() != 2 or out.shape[0] != n or out.shape[1] < k or out.stride(1) != 1:
        raise ValueError(f"decode_weight: out must be bf16 [{n}, >= {k}] with unit stride along K, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if not (blob.is_contiguous() and sf.is_contiguous()):
        raise ValueError("decode_weight: blob and sf must be contiguous")
    grid = (g, triton.cdiv(kt, tiles))
    _decode_kernel[grid](blob, sf.view(torch.uint8), out, kt, out.stride(0), TILES=tiles, num_warps=4)
    return out
