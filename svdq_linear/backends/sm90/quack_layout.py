"""quack-kernels' nvfp4 weight layout (``prepare_w4_weight(q, sf, "nvfp4")``) from and back to our canonical one.

Plain torch, no quack import: the one-launch small-M kernels and the benchmarks that time them alone read this
layout where quack is not installed. ``quack_gemm`` re-exports these functions.
"""

from __future__ import annotations

import torch

# quack's nvfp4 repack is a pure byte permutation. For the weight, canonical row r = 64 g + 16 t2 + 8 p0
# + t1 and byte column c = 32 kt + 8 b + 4 p1 + t0 land at blob[g, kt, 32 t2 + 4 t1 + t0, 4 b + 2 p1 + p0];
# for the scales, row r = 64 g + 16 s1 + 8 i + s0 and column c = 4 kt + b land at sf[g, kt, 8 s1 + s0, b, i].
# As view + permute it needs no index tensors (quack's own repack gathers through two int64 index
# tensors of the weight's size: 0.4 GB for a 15360 x 3072 layer) and it inverts exactly.
_W_PERM = (0, 4, 1, 3, 7, 5, 6, 2)  # [g, t2, p0, t1, kt, b, p1, t0] -> [g, kt, t2, t1, t0, b, p1, p0]
_SF_PERM = (0, 4, 1, 3, 5, 2)  # [g, s1, i, s0, kt, b] -> [g, kt, s1, s0, b, i]


def repack_weight(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical ``[N, K/2]`` uint8 -> quack's ``[N/64, K/64, 128, 16]`` blob (N % 64 == 0, K % 64 == 0)."""
    n, kb = qweight.shape
    g, kt = n // 64, kb // 32
    v = qweight.reshape(g, 4, 2, 8, kt, 4, 2, 4).permute(_W_PERM)
    return v.reshape(g, kt, 128, 16).contiguous()


def unpack_weight(blob: torch.Tensor) -> torch.Tensor:
    """The inverse of ``repack_weight``."""
    g, kt = blob.shape[:2]
    inv = sorted(range(8), key=_W_PERM.__getitem__)
    return blob.reshape(g, kt, 4, 8, 4, 4, 2, 2).permute(inv).reshape(64 * g, 32 * kt).contiguous()


def repack_scales(wscales: torch.Tensor) -> torch.Tensor:
    """Canonical ``[N, K/16]`` E4M3 -> quack's ``[N/64, K/64, 32, 4, 2]`` uint8 strip."""
    n, ns = wscales.shape
    g, kt = n // 64, ns // 4
    v = wscales.view(torch.uint8).reshape(g, 4, 2, 8, kt, 4).permute(_SF_PERM)
    return v.reshape(g, kt, 32, 4, 2).contiguous()


def unpack_scales(sf: torch.Tensor) -> torch.Tensor:
    """The inverse of ``repack_scales`` (float8_e4m3fn)."""
    g, kt = sf.shape[:2]
    inv = sorted(range(6), key=_SF_PERM.__getitem__)
    return sf.reshape(g, kt, 4, 8, 4, 2).permute(inv).reshape(64 * g, 4 * kt).contiguous().view(torch.float8_e4m3fn)
