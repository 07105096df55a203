"""Host side of the sm90 fast mode: the NVFP4 weight repacked for the FP8 decode, and its scale strip.

The fast mode (``svdq_linear.nvfp4``, "The fast mode") multiplies ``a8 [M, K]`` E4M3 activations by
``w8 = e4m3(w / 2**e)``, ``w`` the NVFP4 weight and ``2**e`` a per-row power of two. The weight stays
4-bit in memory; the kernel (``quack_fast``) decodes it in registers as the A operand of Hopper's
FP8 wgmma (``m64nNk32``), one k-tile of 128 at a time. Per m64 row block and k-tile each of the 128
threads of a warpgroup owns 32 code bytes and 16 scale bytes, so one 16-byte and two 16-byte shared
memory loads bring everything a thread decodes for the tile.

Fragment (PTX ISA, wgmma ``.e4m3`` A in registers): thread ``t = 32 w + l`` holds, for k32 block ``b``
of the tile, four registers of four consecutive k each: ``R0`` row ``16 w + l // 4``, k ``32 b + 4
(l % 4) + [0, 4)``; ``R1`` the same k at row + 8; ``R2``/``R3`` as ``R0``/``R1`` at k + 16.

Code words (``repack_fast_weight``): the thread's 32 bytes are eight words, word ``2 b + h`` holding
(``R0``, ``R1``) for ``h = 0`` and (``R2``, ``R3``) for ``h = 1``. Byte ``j`` of a word is
``second[j] | first[j] << 4``: the first register's (row r) code in the high nibble, the second's
(row r + 8) in the low nibble. Masking the word with ``0x70707070`` (and the word shifted left by 4)
then gives, two codes at a time, ``prmt`` selectors whose output is an fp16 pair (one lookup byte in
each high half, zeros below), and the sign bits already sit at bit 7 of each byte of the two results.

Scale strip (``fast_scales``): for each block of 16 weights ``g = s16 / 2**e`` in fp16 (exact: E4M3
times a power of two, in fp16's range because ``|w| / 2**e <= 448``; 0 for a block whose codes are all
zero, which may hold any scale), stored as its fp16 bits 14..7 (``UE5M3``: fp16 without the sign and
the seven low mantissa bits, which are zero). Per k-tile a pair slot ``ps = 8 w + l // 4`` (rows r and
r + 8) owns 16 bytes: for k32 block ``b``, ``[g(2b, r), g(2b, r+8), g(2b+1, r), g(2b+1, r+8)]``.

The decode then computes ``e4m3(code_value * g)`` with one fp16 multiply (exact: 2 x 4 significant
bits) and one ``cvt.rn.satfinite.e4m3x2.f16x2``: bit for bit ``nvfp4.fast_weight``.
"""

from __future__ import annotations

import torch

from ... import nvfp4

TILE_K = 128  # k per tile: four k32 blocks of fp8 wgmma
STRIP_BYTES = 512  # scale bytes per m64 row block per k-tile (32 pair slots x 16)
CODE_BYTES = 4096  # code bytes per m64 row block per k-tile (128 threads x 32)

# [g, w, p, rq, kt, b, h, c, j] -> [g, kt, w, rq, c, b, h, j, p]: row = 64 g + 16 w + 8 p + rq,
# k = 128 kt + 32 b + 16 h + 4 c + j; thread = 32 w + 4 rq + c, byte = 8 b + 4 h + j.
_W_PERM = (0, 4, 1, 3, 7, 5, 6, 8, 2)
# [g, w, p, rq, kt, b, q] -> [g, kt, w, rq, b, q, p]: scale column 8 kt + 2 b + q, slot 8 w + rq.
_S_PERM = (0, 4, 1, 3, 5, 6, 2)


def check_shape(n: int, k: int) -> None:
    if n % 64 or k % TILE_K:
        raise ValueError(f"the fast-mode layout needs out_features % 64 == 0 and in_features % {TILE_K} == 0, "
                         f"got {n} x {k}")


def repack_fast_weight(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical codes ``[N, K/2] uint8`` -> ``[N/64, K/128, 128, 32] uint8`` (see the module docstring)."""
    n, kb = qweight.shape
    check_shape(n, 2 * kb)
    codes = nvfp4.unpack_e2m1(qweight)  # [N, K], one code a byte
    v = codes.reshape(n // 64, 4, 2, 8, 2 * kb // TILE_K, 4, 2, 4, 4).permute(_W_PERM)
    return (v[..., 1] | (v[..., 0] << 4)).reshape(n // 64, 2 * kb // TILE_K, 128, 32).contiguous()


def unpack_fast_weight(blob: torch.Tensor) -> torch.Tensor:
    """The inverse of ``repack_fast_weight``."""
    g, kt = blob.shape[:2]
    v = blob.reshape(g, kt, 4, 8, 4, 4, 2, 4)  # [g, kt, w, rq, c, b, h, j]
    pair = torch.stack([v >> 4, v & 0xF], dim=-1)  # p = 0: row r (high nibble); p = 1: row r + 8
    inv = sorted(range(9), key=_W_PERM.__getitem__)
    codes = pair.permute(inv).reshape(64 * g, TILE_K * kt)
    return nvfp4.pack_e2m1(codes)


def fast_scales(qweight: torch.Tensor, wscales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(strip [N/64, K/128, 512] uint8, nw [N] float32)``: the UE5M3 block factors and ``2**e``."""
    n, kb = qweight.shape
    check_shape(n, 2 * kb)
    e = nvfp4.fast_weight_exponent(qweight, wscales)
    g = wscales.float() * torch.ldexp(torch.ones_like(e, dtype=torch.float32), -e.float())[:, None]
    nonzero = (nvfp4.unpack_e2m1(qweight) & 0x7).reshape(n, -1, nvfp4.BLOCK_SIZE).amax(dim=2) > 0
    g = torch.where(nonzero, g, torch.zeros_like(g)).to(torch.float16)
    bits = g.view(torch.int16).to(torch.int32) & 0xFFFF
    if bool(((bits & 0x7F) != 0).any()):  # cannot happen for E4M3 scales: a broken invariant
        raise AssertionError("fast-mode block factor does not fit UE5M3")
    ue = (bits >> 7).to(torch.uint8)
    kt = 2 * kb // TILE_K
    strip = ue.reshape(n // 64, 4, 2, 8, kt, 4, 2).permute(_S_PERM).reshape(n // 64, kt, STRIP_BYTES)
    return strip.contiguous(), torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.float())


def strip_factors(strip: torch.Tensor) -> torch.Tensor:
    """The inverse of the strip permutation: ``g [N, K/16] float16`` decoded from UE5M3 bytes."""
    gs, kt = strip.shape[:2]
    v = strip.reshape(gs, kt, 4, 8, 4, 2, 2)  # [g, kt, w, rq, b, q, p]
    inv = sorted(range(7), key=_S_PERM.__getitem__)
    ue = v.permute(inv).reshape(64 * gs, 8 * kt)
    return (ue.to(torch.int16) << 7).view(torch.float16)


def emulate_decode(blob: torch.Tensor, strip: torch.Tensor) -> torch.Tensor:
    """What the kernel's decode produces, ``w8 [N, K] float8_e4m3fn``, by its own arithmetic: the fp16
    lookup of the code magnitude, one fp16 multiply by the block factor, the E4M3 conversion, the sign."""
    codes = nvfp4.unpack_e2m1(unpack_fast_weight(blob))
    lut = torch.tensor([0x00, 0x38, 0x3C, 0x3E, 0x40, 0x42, 0x44, 0x46], dtype=torch.int16)
    mag = (lut[(codes & 0x7).long()] << 8).view(torch.float16)
    g = strip_factors(strip).repeat_interleave(nvfp4.BLOCK_SIZE, dim=1)
    prod = mag * g  # fp16 multiply, rounded to nearest even (exact here)
    w8 = prod.float().to(torch.float8_e4m3fn).view(torch.uint8)  # |prod| <= 448: no saturation to model
    return (w8 | ((codes & 0x8) << 4)).view(torch.float8_e4m3fn)
