"""Host side of the sm90 fast mode: the NVFP4 weight repacked for the FP8 decode, its scale strip, and
the k order the kernel reads.

The fast mode (``svdq_linear.nvfp4``, "The fast mode") multiplies ``a8 [M, K]`` E4M3 activations by
``w8 = e4m3(w / 2**e)``, ``w`` the NVFP4 weight and ``2**e`` a per-row power of two. The weight stays
4-bit in memory; the kernel (``quack_fast``) decodes it in registers as the A operand of Hopper's
FP8 wgmma (``m64nNk32``), one k-tile of 128 at a time, through lookup tables: per row and NVFP4
block, the eight magnitudes ``e4m3(m * g)`` (``g`` the block factor below) are built once as two
registers, and each code is one byte of a ``prmt`` lookup into them.

Fragment (PTX ISA, wgmma ``.e4m3`` A in registers): thread ``t = 32 w + l`` holds, for k32 block ``b``
of the tile, four registers of four consecutive k positions each: ``R0`` row ``16 w + l // 4``,
positions ``32 b + 4 (l % 4) + [0, 4)``; ``R1`` the same positions at row + 8; ``R2``/``R3`` as
``R0``/``R1`` at position + 16. In the natural k order a thread's 32 values of a row touch all
eight NVFP4 blocks of the tile, four values each, and a table per block would cost more than it saves.

**The GEMM's k order.** Within each k-tile the kernel's position ``pos = 32 b + 16 h + 4 c + j``
(``c = l % 4``) holds logical ``k = 32 c + 16 (b // 2) + 8 (b % 2) + 4 h + j`` (``gemm_k_order``):
thread ``c``'s 32 values of a row are then exactly NVFP4 blocks ``2 c`` and ``2 c + 1``, two tables
per row. The sum over k does not care; the activations are written in the same order by the FP8
pass (``kernels.quantize_act_fp8(gemm_order=True)``, the backend's default). As bits of the
in-tile index: logical ``[c1 c0 B b0 h j1 j0]`` sits at position ``[B b0 h c1 c0 j1 j0]``.

**Code words** (``repack_fast_weight``): the thread's 32 bytes are eight 32-bit words, word
``2 b + h`` holding the eight codes of (``R0``, ``R1``) for ``h = 0`` and (``R2``, ``R3``) for
``h = 1``. In a word, the magnitude (3 bits) of the first register's byte ``j`` (row r) is at bits
``4 j``, the second's (row r + 8) at ``16 + 4 j``; the first's sign is at bit ``8 j + 7``, the
second's at ``8 j + 3``. So ``word & 0x77777777`` (and that shifted right by 16) are ``prmt``
selectors that look the four bytes of a register up at once, ``word & 0x80808080`` is the first
register's sign bits in place and ``(word << 4) & 0x80808080`` the second's: seven instructions for
eight codes.

**Scale strip** (``fast_scales``): for each block of 16 weights ``g = s16 / 2**e`` in fp16 (exact:
E4M3 times a power of two, in fp16's range because ``|w| / 2**e <= 448``; 0 for a block whose codes are
all zero, which may hold any scale), stored as its fp16 bits 14..7 (``UE5M3``: fp16 without the sign
and the seven low mantissa bits, which are zero). Per m64 row block and k-tile, thread ``t``'s word
``t`` of the 512-byte strip holds ``[g(2c, r), g(2c, r+8), g(2c+1, r), g(2c+1, r+8)]`` (byte
``2 B + p``: block ``2 c + B`` of the tile, row ``r + 8 p``): one 4-byte shared-memory load a tile.

The table of a block is ``e4m3(m * g)`` for the E2M1 magnitudes ``m`` = 0, 0.5, 1, 1.5, 2, 3, 4, 6:
four fp16x2 multiplies (exact: 2 x 4 significant bits) and four ``cvt.rn.satfinite.e4m3x2.f16x2``;
a code's byte is its magnitude's entry with the code's sign bit: bit for bit ``nvfp4.fast_weight``.
"""

from __future__ import annotations

import torch

from ... import nvfp4

TILE_K = 128  # k per tile: four k32 blocks of fp8 wgmma

# The decode's PTX, shared by the CuTe DSL kernels (quack_fast, small_m_mma) and the Triton one (small_m_fast).
# The E2M1 magnitudes as fp16 pairs (low half first): (0, 0.5), (1, 1.5), (2, 3), (4, 6).
MAG_PAIRS = (0x38000000, 0x3E003C00, 0x42004000, 0x46004400)


def table_asm(i: int) -> str:
    """PTX: byte ``i`` of a strip word (``$2``: a block factor ``g``, UE5M3) -> the block's two table
    registers ``$0``, ``$1``: bytes ``e4m3(m * g)`` for m = 0, 0.5, 1, 1.5 and for m = 2, 3, 4, 6 (``_tables``)."""
    sel = 0x0404 | (i << 4) | (i << 12)  # bytes [zero, g, zero, g]; >> 1 lands g at fp16 bits 14..7 twice
    return ("{.reg .b32 gg, c, f0, f1, f2, f3; .reg .b16 e0, e1, e2, e3;\n\t"
            f"prmt.b32 gg, $2, 0, {sel:#x};\n\t"
            "shr.b32 gg, gg, 1;\n\t"
            + "".join(f"mov.b32 c, {m:#x};\n\tmul.rn.f16x2 f{q}, gg, c;\n\t" for q, m in enumerate(MAG_PAIRS))
            + "".join(f"cvt.rn.satfinite.e4m3x2.f16x2 e{q}, f{q};\n\t" for q in range(4))
            + "mov.b32 $0, {e0, e1};\n\t"
            "mov.b32 $1, {e2, e3};}")


# PTX: one code word ($2: eight codes, rows r and r + 8) and the two rows' tables ($3, $4 | $5, $6) -> two
# registers of four E4M3 bytes each: two prmt lookups, two sign merges (lop3 0xF8: a | (b & c); the signs
# sit at bit 7 of each byte of the word (row r) and of the word << 4 (row r + 8))
DECODE_ASM = ("{.reg .b32 xm, s1, se, r0, r1;\n\t"
              "and.b32 xm, $2, 0x77777777;\n\t"
              "prmt.b32 r0, $3, $4, xm;\n\t"
              "shr.u32 s1, xm, 16;\n\t"
              "prmt.b32 r1, $5, $6, s1;\n\t"
              "shl.b32 se, $2, 4;\n\t"
              "lop3.b32 $0, r0, $2, 0x80808080, 0xF8;\n\t"
              "lop3.b32 $1, r1, se, 0x80808080, 0xF8;}")
STRIP_BYTES = 512  # scale bytes per m64 row block per k-tile (128 threads x 4)
CODE_BYTES = 4096  # code bytes per m64 row block per k-tile (128 threads x 32)

# codes [g, w, p, rq, kt, c, B, b0, h, j] -> [g, kt, w, rq, c, B, b0, h, p, j]: row = 64 g + 16 w + 8 p +
# rq, logical k = 128 kt + 32 c + 16 B + 8 b0 + 4 h + j; thread = 32 w + 4 rq + c, word = 4 B + 2 b0 + h.
_W_PERM = (0, 4, 1, 3, 5, 6, 7, 8, 2, 9)
# scales [g, w, p, rq, kt, c, B] -> [g, kt, w, rq, c, B, p]: block 8 kt + 2 c + B; byte 4 t + 2 B + p.
_S_PERM = (0, 4, 1, 3, 5, 6, 2)
# a [M, kt, c, B, b0, h, j] (logical) -> [M, kt, B, b0, h, c, j] (the GEMM's positions)
_A_PERM = (0, 1, 3, 4, 5, 2, 6)


def check_shape(n: int, k: int) -> None:
    if n % 64 or k % TILE_K:
        raise ValueError(f"the fast-mode layout needs out_features % 64 == 0 and in_features % {TILE_K} == 0, "
                         f"got {n} x {k}")


def _field_shifts(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit positions in a code word of each ``[p, j]`` code's magnitude (3 bits) and sign (1 bit)."""
    j = torch.arange(4, device=device)
    mag = torch.stack([4 * j, 16 + 4 * j])
    sign = torch.stack([8 * j + 7, 8 * j + 3])
    return mag, sign


def repack_fast_weight(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical codes ``[N, K/2] uint8`` -> ``[N/64, K/128, 128, 32] uint8`` (see the module docstring)."""
    n, kb = qweight.shape
    check_shape(n, 2 * kb)
    kt = 2 * kb // TILE_K
    codes = nvfp4.unpack_e2m1(qweight).to(torch.int64)  # [N, K], one code a value
    v = codes.reshape(n // 64, 4, 2, 8, kt, 4, 2, 2, 2, 4).permute(_W_PERM)
    v = v.reshape(n // 64, kt, 128, 8, 2, 4)  # [g, kt, thread, word, p, j]
    mag, sign = _field_shifts(qweight.device)
    word = (((v & 7) << mag) | ((v >> 3) << sign)).sum(dim=(-2, -1))  # disjoint bits: the sum is an OR
    byte = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1)  # little-endian
    return byte.to(torch.uint8).reshape(n // 64, kt, 128, 32).contiguous()


def fast_words(blob: torch.Tensor) -> torch.Tensor:
    """The blob's code words ``[N/64, K/128, 128, 8]`` as non-negative int64."""
    b = blob.to(torch.int64).reshape(*blob.shape[:3], 8, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def unpack_fast_weight(blob: torch.Tensor) -> torch.Tensor:
    """The inverse of ``repack_fast_weight``."""
    g, kt = blob.shape[:2]
    mag, sign = _field_shifts(blob.device)
    word = fast_words(blob)[..., None, None]  # [g, kt, t, word, 1, 1]
    codes = ((word >> mag) & 7) | (((word >> sign) & 1) << 3)  # [g, kt, t, word, p, j]
    v = codes.reshape(g, kt, 4, 8, 4, 2, 2, 2, 2, 4)  # [g, kt, w, rq, c, B, b0, h, p, j]
    inv = sorted(range(10), key=_W_PERM.__getitem__)
    return nvfp4.pack_e2m1(v.permute(inv).reshape(64 * g, TILE_K * kt).to(torch.uint8))


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
    v = strip.reshape(gs, kt, 4, 8, 4, 2, 2)  # [g, kt, w, rq, c, B, p]
    inv = sorted(range(7), key=_S_PERM.__getitem__)
    ue = v.permute(inv).reshape(64 * gs, 8 * kt)
    return (ue.to(torch.int16) << 7).view(torch.float16)


def rebuild_scales(strip: torch.Tensor, nw: torch.Tensor, patch: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> torch.Tensor:
    """The canonical block scales ``[N, K/16] float8_e4m3fn`` from the strip and ``nw = 2**e`` (``fast_scales``):
    each block factor times its row's power of two is the E4M3 scale it came from, exactly, except where
    ``fast_scales`` wrote 0 (a block of zero codes); ``patch = (flat indices, bytes)`` (``scale_patch``)
    puts back the scales of those blocks that were not 0."""
    s = (strip_factors(strip).float() * nw.float()[:, None]).to(torch.float8_e4m3fn)
    if patch is not None and patch[0].numel():
        flat = s.view(torch.uint8).reshape(-1)
        flat[patch[0]] = patch[1]
    return s


def scale_patch(wscales: torch.Tensor, strip: torch.Tensor, nw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat indices int64, bytes uint8)`` of the scales that ``rebuild_scales`` without a patch gets
    wrong (blocks of zero codes with a nonzero scale; none in a converted checkpoint of real weights)."""
    want = wscales.contiguous().view(torch.uint8).reshape(-1)
    idx = (rebuild_scales(strip, nw).view(torch.uint8).reshape(-1) != want).nonzero().reshape(-1)
    return idx, want[idx].clone()


def gemm_k_order(a: torch.Tensor) -> torch.Tensor:
    """``a [M, K]`` (K % 128 == 0) with its columns in the fast GEMM's k order (module docstring):
    what ``quantize_act_fp8(gemm_order=True)`` writes."""
    m, k = a.shape
    if k % TILE_K:
        raise ValueError(f"the fast GEMM's k order needs K % {TILE_K} == 0, got {k}")
    return a.reshape(m, k // TILE_K, 4, 2, 2, 2, 4).permute(_A_PERM).reshape(m, k).contiguous()


def logical_k_order(a: torch.Tensor) -> torch.Tensor:
    """The inverse of ``gemm_k_order``."""
    m, k = a.shape
    inv = sorted(range(7), key=_A_PERM.__getitem__)
    return a.reshape(m, k // TILE_K, 2, 2, 2, 4, 4).permute(inv).reshape(m, k).contiguous()


def _prmt(a: torch.Tensor, b: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """PTX ``prmt.b32 d, a, b, sel`` (default mode) on int64 tensors holding 32-bit values: byte ``i``
    of ``d`` is byte ``sel[4 i : 4 i + 3]`` of the eight bytes ``{b, a}``, or that byte's sign bit
    replicated where ``sel``'s bit ``4 i + 3`` is set."""
    src = a | (b << 32)
    out = torch.zeros_like(sel)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (nib & 7))) & 0xFF
        byte = torch.where(nib >= 8, ((byte >> 7) & 1) * 0xFF, byte)
        out |= byte << (8 * i)
    return out


def _tables(ue: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """UE5M3 bytes -> the decode's two table registers per byte (int64 holding 32 bits): bytes
    ``e4m3(m * g)`` for m = 0, 0.5, 1, 1.5 and m = 2, 3, 4, 6."""
    g = (ue.to(torch.int16) << 7).view(torch.float16)
    mags = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float16, device=ue.device)
    e = (g[..., None] * mags).float().to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)  # fp16 product
    regs = [e[..., 4 * r] | (e[..., 4 * r + 1] << 8) | (e[..., 4 * r + 2] << 16) | (e[..., 4 * r + 3] << 24)
            for r in range(2)]
    return regs[0], regs[1]


def emulate_decode(blob: torch.Tensor, strip: torch.Tensor) -> torch.Tensor:
    """What the kernel's decode produces, ``w8 [N, K] float8_e4m3fn`` in the logical k order, by its own
    instructions: per thread the tables of its strip word's four bytes (fp16 multiplies, E4M3
    conversions: ``_tables``), then per code word two ``prmt`` lookups and two sign merges."""
    g, kt = blob.shape[:2]
    words = fast_words(blob)  # [g, kt, t, 8]
    sw = strip.to(torch.int64).reshape(g, kt, 128, 4)  # [g, kt, t, byte 2 B + p]
    ta, tb = _tables(sw)
    regs = []
    for wi in range(8):  # word 2 b + h: tables of block B = b // 2
        w = words[..., wi]
        big = wi // 4
        xm = w & 0x77777777
        r0 = _prmt(ta[..., 2 * big], tb[..., 2 * big], xm) | (w & 0x80808080)
        r1 = _prmt(ta[..., 2 * big + 1], tb[..., 2 * big + 1], xm >> 16) | ((w << 4) & 0x80808080)
        regs.append(torch.stack([r0, r1], dim=-1))  # [g, kt, t, p]
    r = torch.stack(regs, dim=3)  # [g, kt, t, word, p]
    byte = torch.stack([(r >> (8 * j)) & 0xFF for j in range(4)], dim=-1)  # [g, kt, t, word, p, j]
    v = byte.reshape(g, kt, 4, 8, 4, 2, 2, 2, 2, 4)
    inv = sorted(range(10), key=_W_PERM.__getitem__)
    w8 = v.permute(inv).reshape(64 * g, TILE_K * kt).to(torch.uint8)
    return w8.view(torch.float8_e4m3fn)


def fast_act_ops(x: torch.Tensor, inv_smooth: torch.Tensor, lora: torch.Tensor | None = None):
    """The fast mode's activation pass in PyTorch ops, for torch.compile to fuse into the kernels that
    produce ``x [M, K]`` (a norm, a modulation, an activation function): ``(a8 [M, K] in the GEMM's k
    order, sa [M])`` and, with ``lora [M, R]`` fp32, ``la = lora / sa`` in bf16. Bit for bit what
    ``kernels.quantize_act_fp8(gemm_order=True)`` writes, on any device and compiled or not: the two
    divisions run in float64 and round once to float32, which is the correctly rounded float32
    quotient (an exact quotient of two floats never lies within 2**-49 of a float32 rounding
    boundary, and float64 division is exact to 2**-53; a compiler may lower a float32 division to an
    approximate one). On CUDA inductor turns the division by 448 into a float64 multiplication by
    its reciprocal; rounded to float32 that gives the same bits (checked over every float32 mantissa
    in several binades, subnormal inputs and results included; the GPU test compares with the
    Triton pass)."""
    xs = x.float() * inv_smooth
    amax = xs.abs().amax(dim=-1)  # NaN propagates: such a row gets sa = 1, its NaN codes 0x7F
    sa = torch.where(amax > 0, (amax.double() / 448.0).float(), 1.0)
    r = (1.0 / sa.double()).float().clamp(max=3.4028234663852886e38)  # nvfp4.fast_act's min(1 / sa, FLT_MAX)
    q = xs * r[:, None]
    a8 = torch.where(torch.isfinite(q), q.clamp(-448.0, 448.0), float("nan")).to(torch.float8_e4m3fn)
    a8 = gemm_k_order(a8)
    if lora is None:
        return a8, sa
    return a8, sa, (lora.double() / sa.double()[:, None]).float().to(torch.bfloat16)
