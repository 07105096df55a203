"""A few tokens on warp-level tensor cores: ``mma.sync m16n8k16`` (bf16 x bf16 -> fp32) on the exact
mode's quack blob, split over K (CuTe DSL). **Compiled for sm_90a on the CPU; not yet run on a GPU, and
not routed**: ``small_m.py`` (Triton) serves M <= 64 until this kernel is GPU-tested and measured.

Why: the Triton small-M kernel is bound by instructions, ~9 a weight value (docs/perf.md, "Small M"):
the E2M1 decode to fp32, one FMA a token, the block sums. quack's blob is already laid out as
``mma.sync`` A fragments (a lane's 16-byte run is rows ``g``/``g + 8``, k pairs ``2c``/``2c + 8`` of four
k16 blocks: ``quack_gemm``), so a lane decodes its fragment to bf16 pairs with quack's NVFP4 decode
(``prmt`` table lookups, the E4M3 block scale multiplied in exactly) and issues one HMMA per k16 block
and 8 tokens: about 3 instructions a value, no conversion to fp32, no reduction across lanes.

Work split: a CTA is four warps on one 64-row group of the blob (warp ``w``: rows ``16 w`` to ``16 w +
15``); ``blockIdx.y`` is the K split (an equal number of 64-wide k-tiles each). Each warp walks its
k-tiles with the next tile's 16 code bytes and 8 scale bytes loaded before the current tile's decode.
The tokens are the MMA's N side, padded to ``8 * n_tiles`` rows by the host (zero rows: no
predication in the loop). Partials go to ``part [S, Mp, N]`` fp32; ``kernels._splitk_epilogue_kernel``
sums them in split order (deterministic) and applies ``* wcscale + lora @ proj_up^T + bias``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

K_TILE = 64  # k per blob tile (quack's nvfp4 layout)
ROWS = 64  # weight rows per CTA (one blob group, four warps)


class SmallMMma:
    """``part[s, n, r] = sum over split s's k of W[r, k] * x[n, k]`` for ``n_tiles * 8`` padded tokens."""

    def __init__(self, n_tiles: int):
        if not 1 <= n_tiles <= 8:
            raise ValueError(f"n_tiles must be 1..8 (8 to 64 tokens), got {n_tiles}")
        self.n_tiles = n_tiles
        from quack.operand_transform.formats import decode_format

        self.fmt = decode_format("nvfp4")

    @cute.jit
    def __call__(self, mBlob: cute.Tensor, mSf: cute.Tensor, mX: cute.Tensor, mPart: cute.Tensor,
                 kt_per_split: Int32, stream):
        """``mBlob [G, KT, 128, 4]`` Int32 (the quack blob), ``mSf [G, KT, 32, 2]`` Int32 (its scale
        strip), ``mX [Mp, K / 2]`` Int32 (bf16 pairs of the padded tokens), ``mPart [S, Mp, N]`` fp32."""
        op = warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        tiled_mma = cute.make_tiled_mma(op, cute.make_layout((1, 1, 1)))
        self.kernel(tiled_mma, mBlob, mSf, mX, mPart, kt_per_split).launch(
            grid=[mBlob.shape[0], mPart.shape[0], 1], block=[128, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, mBlob: cute.Tensor, mSf: cute.Tensor, mX: cute.Tensor,
               mPart: cute.Tensor, kt_per_split: Int32):
        nt = const_expr(self.n_tiles)
        tidx, _, _ = cute.arch.thread_idx()
        grp, split, _ = cute.arch.block_idx()
        warp_i = tidx // 32
        lane = tidx % 32
        gq = lane // 4  # fragment row (A, C) and token (B) within the tile
        cq = lane % 4  # k pair (A, B) and token pair (C)
        slot = warp_i * 8 + gq  # the (row g, row g + 8) scale pair of this lane

        thr = tiled_mma.get_slice(lane)
        tCrA = thr.make_fragment_A(thr.partition_shape_A((16, K_TILE)))  # bf16 ((2,2,2),1,4)
        frag_a = cute.recast_tensor(tCrA, Int32)  # ((1,2,2),1,4): [(0, row +8, k +8), 0, k16 block]
        tCrB = thr.make_fragment_B(thr.partition_shape_B((8 * nt, K_TILE)))  # bf16 ((2,2),nt,4)
        frag_b = cute.recast_tensor(tCrB, Int32)  # ((1,2),nt,4): [(0, k +8), token tile, k16 block]
        acc = cute.make_rmem_tensor(thr.partition_shape_C((16, 8 * nt)), Float32)  # ((2,2),1,nt)
        acc.fill(0.0)
        consts = self.fmt.make_consts()

        xw = cute.make_rmem_tensor((4,), Int32)
        sfw = cute.make_rmem_tensor((2,), Int32)
        xw_next = cute.make_rmem_tensor((4,), Int32)
        sfw_next = cute.make_rmem_tensor((2,), Int32)
        kt0 = split * kt_per_split
        # this lane's views, sliced once: its 16-byte run of each k-tile, its scale pair, its tokens' rows
        g_blob = mBlob[grp, None, tidx, None]  # (KT, 4)
        g_sf = mSf[grp, None, slot, None]  # (KT, 2)
        cute.autovec_copy(g_blob[kt0, None], xw_next)
        sfw_next[0] = g_sf[kt0, 0]
        sfw_next[1] = g_sf[kt0, 1]
        for i in cutlass.range(kt_per_split):
            kt = kt0 + i
            for w in cutlass.range_constexpr(4):
                xw[w] = xw_next[w]
            sfw[0] = sfw_next[0]
            sfw[1] = sfw_next[1]
            if i + 1 < kt_per_split:  # the next tile's bytes in flight during this tile's decode
                cute.autovec_copy(g_blob[kt + 1, None], xw_next)
                sfw_next[0] = g_sf[kt + 1, 0]
                sfw_next[1] = g_sf[kt + 1, 1]
            # B: token 8 j + g, k pair 2 c (+ 8) of each k16 block b: Int32 column 32 kt + 8 b + c (+ 4)
            for j in cutlass.range_constexpr(nt):
                g_x = mX[8 * j + gq, None]
                for b in cutlass.range_constexpr(4):
                    for h in cutlass.range_constexpr(2):
                        frag_b[(0, h), j, b] = g_x[32 * kt + 8 * b + cq + 4 * h]
            for b in cutlass.range_constexpr(4):
                r0, r1, r2, r3 = self.fmt.decode_k16(xw, sfw, b, consts)
                frag_a[(0, 0, 0), 0, b] = r0
                frag_a[(0, 1, 0), 0, b] = r1
                frag_a[(0, 0, 1), 0, b] = r2
                frag_a[(0, 1, 1), 0, b] = r3
            cute.gemm(tiled_mma, acc, tCrA, tCrB, acc)

        # C: rows g (+ 8), tokens 8 j + 2 c (+ 1)
        row = grp * ROWS + warp_i * 16 + gq
        for j in cutlass.range_constexpr(nt):
            for v1 in cutlass.range_constexpr(2):
                for v0 in cutlass.range_constexpr(2):
                    mPart[split, 8 * j + 2 * cq + v0, row + 8 * v1] = acc[(v0, v1), 0, j]


# ---- host side ------------------------------------------------------------------------------------

SM_COUNT = 132
CTAS_PER_SM = 4  # four warps a CTA: 16 warps an SM in flight


def split_for(groups: int, k_tiles: int, sms: int = SM_COUNT) -> int:
    """K splits: a divisor of the k-tile count giving about ``CTAS_PER_SM`` CTAs an SM, at least two
    k-tiles a split (the prefetch needs a next tile to overlap)."""
    want = max(1, round(CTAS_PER_SM * sms / groups))
    best = 1
    for s in range(1, k_tiles // 2 + 1):
        if k_tiles % s == 0 and s <= want:
            best = s
    return best


_COMPILED: dict[int, object] = {}


def _compiled(n_tiles: int):
    """The kernel for ``8 * n_tiles`` padded tokens, compiled once per process (tvm-ffi: called with
    torch tensors on the current stream)."""
    fn = _COMPILED.get(n_tiles)
    if fn is None:
        fn = _COMPILED[n_tiles] = compile_kernel(n_tiles)
    return fn


def compile_kernel(n_tiles: int):
    from quack.compile_utils import make_fake_tensor

    g, kt, s, mp, n, kh = (cute.sym_int() for _ in range(6))
    blob = make_fake_tensor(Int32, (g, kt, 128, 4), divisibility=4)
    sf = make_fake_tensor(Int32, (g, kt, 32, 2), divisibility=2)
    x = make_fake_tensor(Int32, (mp, kh), divisibility=4)
    part = make_fake_tensor(Float32, (s, mp, n), divisibility=4)
    return cute.compile(SmallMMma(n_tiles), blob, sf, x, part, Int32(1),
                        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), options="--enable-tvm-ffi")


def linear(xq, blob, sf, wcscale, bias=None, proj_up=None, lora_act=None, out_dtype=None, split: int | None = None):
    """``out [M, N] = (xq @ W^T) * wcscale + lora_act @ proj_up^T + bias`` for M <= 64 on the quack blob
    (``quack_gemm.repack_weight`` / ``repack_scales``) and bf16 ``xq`` (the exact mode's activations, or
    x itself for W4A16)."""
    import torch
    import triton

    from .kernels import _block_r, _splitk_epilogue_kernel

    m, k = xq.shape
    if not 1 <= m <= 64:
        raise ValueError(f"the mma small-M kernel takes 1 to 64 tokens, got {m}")
    if xq.dtype != torch.bfloat16:
        raise ValueError(f"the mma small-M kernel takes bf16 activations, got {xq.dtype}")
    groups, k_tiles = blob.shape[:2]
    n = wcscale.numel()
    if k != K_TILE * k_tiles or n != ROWS * groups:
        raise ValueError(f"x [{m}, {k}] does not match the blob of a {ROWS * groups} x {K_TILE * k_tiles} weight")
    n_tiles = -(-m // 8)
    mp = 8 * n_tiles
    x = xq.contiguous()
    if mp != m:  # zero tokens up to a whole MMA tile: no predication in the loop
        x = torch.cat([x, x.new_zeros(mp - m, k)])
    split = split or split_for(groups, k_tiles)
    if k_tiles % split:
        raise ValueError(f"split {split} does not divide the {k_tiles} k-tiles")
    part = torch.empty(split, mp, n, device=x.device, dtype=torch.float32)
    _compiled(n_tiles)(blob.view(torch.int32), sf.reshape(groups, k_tiles, 32, 8).view(torch.int32),
                       x.view(torch.int32), part, k_tiles // split)
    out = torch.empty(mp, n, device=x.device, dtype=out_dtype or xq.dtype)
    r = 0 if proj_up is None else proj_up.shape[1]
    lora = lora_act
    if r and mp != m:
        lora = torch.cat([lora_act, lora_act.new_zeros(mp - m, r)])
    dummy = part
    bn, bm = 64, min(64, max(16, triton.next_power_of_2(mp)))
    _splitk_epilogue_kernel[(triton.cdiv(n, bn), triton.cdiv(mp, bm))](
        part, wcscale, bias if bias is not None else dummy, proj_up if r else dummy, lora if r else dummy,
        out, mp, n, r, out.stride(0),
        SPLIT_K=split, BLOCK_N=bn, BLOCK_M=bm, BLOCK_R=_block_r(r), HAS_BIAS=bias is not None, HAS_LORA=bool(r),
        DOT_F32=False, num_warps=4)
    return out[:m]


def main(argv=None) -> int:
    """Compile for sm_90a with no GPU and write the cubin:
    ``CUTE_DSL_ARCH=sm_90a CUTE_DSL_KEEP=cubin python -m svdq_linear.backends.sm90.small_m_mma --n-tiles 1 --out F``."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--n-tiles", type=int, default=1)
    p.add_argument("--out", required=True, help="where to write the cubin")
    args = p.parse_args(argv)
    cubin = getattr(compile_kernel(args.n_tiles), "__cubin__", None)
    if not cubin:
        raise SystemExit("no cubin kept: set CUTE_DSL_KEEP=cubin")
    if isinstance(cubin, str):  # a path to the dumped file
        cubin = Path(cubin).read_bytes()
    Path(args.out).write_bytes(cubin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
