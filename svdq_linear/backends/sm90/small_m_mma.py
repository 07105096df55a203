"""A few tokens on warp-level tensor cores, split over K (CuTe DSL). Conformant on the
H200; the backend routes it where it measured faster (``tuning.use_small_m_mma``: up to 8 tokens in the
exact mode, and in the fast mode where K >= 2 N; docs/perf.md, 2026-12-04 fourth session).

Why: the Triton small-M kernel is bound by instructions, ~9 a weight value (docs/perf.md, "Small M"):
the E2M1 decode to fp32, one FMA a token, the block sums. Both modes' blobs are already laid out as
``mma.sync`` A fragments, so a lane decodes its fragment in registers and issues the MMA with the
tokens as its 8-wide N side, no conversion to fp32, no reduction across lanes:

- exact (W4A4 exact, or W4A16 on x itself): quack's nvfp4 blob (a lane's 16 bytes of a 64-wide k-tile
  are rows ``g``/``g + 8``, k pairs ``2c``/``2c + 8`` of four k16 blocks: ``quack_gemm``), quack's NVFP4
  decode (``prmt`` lookups, the E4M3 scale multiplied in exactly), ``mma.sync m16n8k16`` bf16;
- fast: ``fast_layout``'s blob and tables (``quack_fast``: the weight as ``e4m3(code * g)``), E4M3 tokens
  in the fast GEMM's k order, ``mma.sync m16n8k32`` E4M3. Hopper has no FP8 ``mma.sync``: ptxas
  lowers it to E4M3 -> f16 conversions and two f16 ``HMMA.16816`` a k32 block (exact: E4M3 values are
  f16 values), so its operands cost conversions the exact kernel does not pay.

Work split: a CTA is four warps on one 64-row group of the blob (warp ``w``: rows ``16 w`` to ``16 w +
15``); ``blockIdx.y`` is the K split (an equal number of k-tiles each). Each warp walks its k-tiles
with the code and scale words of the next ``DEPTH`` tiles and the token words of the next one in
flight during the current tile's decode. Token rows past M read the last token again (no bounds test in the
loop; their sums are never stored), so the host pads nothing. Partials go to ``part [S, M, N]`` fp32; ``kernels._splitk_epilogue_kernel`` sums them in split order
(deterministic) and applies ``(* sa) * colscale + lora @ proj_up^T + bias``.

``fused=True`` (``linear_fused`` / ``linear_fast_fused``; the backend takes it with
``SVDQ_SM90_MMA_FUSED=1`` until the H200 has timed it): one launch instead of two. Split 0 issues the
low-rank MMA into its accumulator (bf16 ``m16n8k16``, ``proj_up`` divided by the column factor and
``lora_act`` by the token factor, the quack paths' fold), every CTA writes its partial, fences and
counts itself in on its row group's counter; the last one sums the partials in split order (L2
loads after an acquire fence) and writes ``(* sa) * colscale + bias``, then zeroes the counter for the
next launch.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from .tuning import MMA_TOKENS, SM_COUNT, sm_count

ROWS = 64  # weight rows per CTA (one blob group, four warps)
MAX_M = MMA_TOKENS  # tokens: up to eight 8-token MMA tiles
K_TILE = {"exact": 64, "fast": 128}  # k per blob tile: quack's nvfp4 layout; fast_layout's


class SmallMMma:
    """``part[s, n, r] = sum over split s's k of W[r, k] * x[n, k]`` for up to ``n_tiles * 8`` tokens.

    ``mode="exact"``: quack's nvfp4 blob, bf16 tokens, ``mma.sync m16n8k16`` bf16. ``mode="fast"``:
    ``fast_layout``'s blob (the weight as ``e4m3(code * g)`` by table lookup), E4M3 tokens in the fast
    GEMM's k order, ``mma.sync m16n8k32`` E4M3. In both, a lane's Int32 word ``32 kt + 8 b + c + 4 h``
    of a token row holds the B fragment of k block ``b`` (``h``: its upper half)."""

    def __init__(self, n_tiles: int, mode: str = "exact", depth: int = 2, unroll: bool = False,
                 fused: bool = False, out_dtype=None, has_rs: bool = False):
        if not 1 <= n_tiles <= 8:
            raise ValueError(f"n_tiles must be 1..8 (8 to 64 tokens), got {n_tiles}")
        if not 1 <= depth <= 4:
            raise ValueError(f"depth (k-tiles of weight bytes in flight) must be 1..4, got {depth}")
        self.depth, self.unroll = depth, unroll
        # fused: the low-rank MMA (split 0) and the ordered split-K sum with the epilogue in this kernel
        # (the last CTA of each row group finishes it: an atomic counter a group), writing out directly
        self.fused, self.out_dtype, self.has_rs = fused, out_dtype or BFloat16, has_rs
        if mode not in K_TILE:
            raise ValueError(f"mode must be 'exact' or 'fast', got {mode!r}")
        self.n_tiles, self.mode = n_tiles, mode
        self.k_tile = K_TILE[mode]
        self.words = 4 if mode == "exact" else 8  # code words a lane loads per k-tile
        self.sf_words = 2 if mode == "exact" else 1  # scale words a lane loads per k-tile
        if mode == "exact":
            from quack.operand_transform.formats import decode_format

            self.fmt = decode_format("nvfp4")

    @cute.jit
    def __call__(self, mBlob: cute.Tensor, mSf: cute.Tensor, mX: cute.Tensor, mPart: cute.Tensor,
                 kt_per_split: Int32, m_tokens: Int32, stream):
        """``mBlob [G, KT, 128, words]`` Int32, ``mSf [G, KT, slots, sf_words]`` Int32 (exact: quack's
        32 scale-pair slots; fast: one strip word per thread), ``mX [M, K * bytes / 4]`` Int32 (the
        tokens, ``m_tokens`` = M <= 8 * n_tiles), ``mPart [S, M, N]`` fp32."""
        if const_expr(self.mode == "exact"):
            op = warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        else:
            op = warp.MmaFP8Op(cutlass.Float8E4M3FN, Float32, (16, 8, 32))
        tiled_mma = cute.make_tiled_mma(op, cute.make_layout((1, 1, 1)))
        self.kernel(tiled_mma, mBlob, mSf, mX, mPart, kt_per_split, m_tokens).launch(
            grid=[mBlob.shape[0], mPart.shape[0], 1], block=[128, 1, 1], stream=stream)

    @cute.jit
    def call_fused(self, mBlob: cute.Tensor, mSf: cute.Tensor, mX: cute.Tensor, mPart: cute.Tensor,
                   kt_per_split: Int32, m_tokens: Int32, mCnt: cute.Tensor, mOut: cute.Tensor, mCs: cute.Tensor,
                   mRs: cute.Tensor, mBias: cute.Tensor, mUp: cute.Tensor, mLa: cute.Tensor, mSeg: cute.Tensor,
                   w_lr: Int32, stream):
        """The fused kernel (``fused=True``): as ``__call__``, then ``mOut [M, N] = (sum_s mPart[s]) (* mRs[m])
        * mCs[n] + mBias[n]`` written by the last CTA of each row group (``mCnt [G]`` Int32 counters, zero
        before the launch and after it). ``w_lr`` > 0: split 0 adds the low-rank term in its accumulator,
        ``mUp [N, W / 2]`` (``proj_up / (colscale)``, bf16 pairs as Int32) times ``mLa [M, LW / 2]``
        (``lora_act (/ rowscale)``, bf16 pairs), row group g reading the ``W = w_lr`` columns from
        ``mSeg[g] * W`` (``plan_lowrank``'s windows; W <= 64)."""
        if const_expr(self.mode == "exact"):
            op = warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16))
        else:
            op = warp.MmaFP8Op(cutlass.Float8E4M3FN, Float32, (16, 8, 32))
        tiled_mma = cute.make_tiled_mma(op, cute.make_layout((1, 1, 1)))
        lr_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)), cute.make_layout((1, 1, 1)))
        self.kernel_fused(tiled_mma, lr_mma, mBlob, mSf, mX, mPart, kt_per_split, m_tokens, mCnt, mOut, mCs, mRs,
                          mBias, mUp, mLa, mSeg, w_lr).launch(
            grid=[mBlob.shape[0], mPart.shape[0], 1], block=[128, 1, 1], stream=stream)

    @cute.jit
    def _decode(self, xw, sfw, ts, frag_a):
        """The k-tile's A fragments (four k blocks) from the lane's code and scale words."""
        if const_expr(self.mode == "exact"):
            consts = self.fmt.make_consts()
            for b in cutlass.range_constexpr(4):
                r0, r1, r2, r3 = self.fmt.decode_k16(xw, sfw, b, consts)
                frag_a[(0, 0, 0), 0, b] = r0
                frag_a[(0, 1, 0), 0, b] = r1
                frag_a[(0, 0, 1), 0, b] = r2
                frag_a[(0, 1, 1), 0, b] = r3
        else:
            from .quack_fast import _decode_word, _table

            for i in cutlass.range_constexpr(4):  # rows r, r + 8 of NVFP4 blocks 2 c, 2 c + 1
                ta, tb = _table(sfw[0], i)
                ts[2 * i] = ta
                ts[2 * i + 1] = tb
            for b in cutlass.range_constexpr(4):
                t0 = 4 * (b // 2)
                r0, r1 = _decode_word(xw[2 * b], ts[t0], ts[t0 + 1], ts[t0 + 2], ts[t0 + 3])
                r2, r3 = _decode_word(xw[2 * b + 1], ts[t0], ts[t0 + 1], ts[t0 + 2], ts[t0 + 3])
                frag_a[(0, 0, 0), 0, b] = r0
                frag_a[(0, 1, 0), 0, b] = r1
                frag_a[(0, 0, 1), 0, b] = r2
                frag_a[(0, 1, 1), 0, b] = r3

    @cute.jit
    def _mainloop(self, tiled_mma: cute.TiledMma, mBlob: cute.Tensor, mSf: cute.Tensor, mX: cute.Tensor,
                  kt_per_split: Int32, m_tokens: Int32, acc: cute.Tensor):
        """This lane's share of its warp's 16 rows x tokens over the split's k-tiles, added into ``acc``."""
        nt = const_expr(self.n_tiles)
        nw = const_expr(self.words)
        nsf = const_expr(self.sf_words)
        depth = const_expr(self.depth)
        shifts = const_expr(self.depth - 1)  # ring moves a k-tile
        tidx, _, _ = cute.arch.thread_idx()
        grp, split, _ = cute.arch.block_idx()
        warp_i = tidx // 32
        lane = tidx % 32
        gq = lane // 4  # fragment row (A, C) and token (B) within the tile
        cq = lane % 4  # k group (A, B) and token pair (C)
        # exact: the (row g, row g + 8) scale pair slot of quack's strip; fast: the thread's strip word
        sf_slot = warp_i * 8 + gq if const_expr(self.mode == "exact") else tidx

        thr = tiled_mma.get_slice(lane)
        tCrA = thr.make_fragment_A(thr.partition_shape_A((16, self.k_tile)))
        frag_a = cute.recast_tensor(tCrA, Int32)  # ((1,2,2),1,4): [(0, row +8, k upper half), 0, k block]
        tCrB = thr.make_fragment_B(thr.partition_shape_B((8 * nt, self.k_tile)))
        frag_b = cute.recast_tensor(tCrB, Int32)  # ((1,2),nt,4): [(0, k upper half), token tile, k block]

        xw = cute.make_rmem_tensor((nw,), Int32)
        sfw = cute.make_rmem_tensor((nsf,), Int32)
        # a ring of the next `depth` k-tiles' code and scale words: that many tiles of weight bytes in flight
        ring_x = [cute.make_rmem_tensor((nw,), Int32) for _ in range(depth)]
        ring_sf = [cute.make_rmem_tensor((nsf,), Int32) for _ in range(depth)]
        last_x = ring_x[depth - 1]  # where the loop's loads land (no list index inside a dynamic if)
        last_sf = ring_sf[depth - 1]
        xb_n1 = cute.make_rmem_tensor((nt * 8,), Int32)  # the next k-tile's token words (B fragments)
        ts = cute.make_rmem_tensor((8,), Int32)  # the fast decode's tables
        kt0 = split * kt_per_split
        # this lane's views, sliced once: its code run of each k-tile, its scale words, its token rows
        # (tokens past m_tokens read the last token again: no bounds test in the loop, never stored)
        g_blob = mBlob[grp, None, tidx, None]  # (KT, nw)
        g_sf = mSf[grp, None, sf_slot, None]  # (KT, nsf)
        g_xs = [mX[cutlass.min(8 * j + gq, m_tokens - 1), None] for j in range(nt)]
        for d in cutlass.range_constexpr(depth):
            if kt_per_split > d:
                cute.autovec_copy(g_blob[kt0 + d, None], ring_x[d])
                for w in cutlass.range_constexpr(nsf):
                    ring_sf[d][w] = g_sf[kt0 + d, w]
        # B: token 8 j + g, k group c of each k block b (h: its upper half): Int32 32 kt + 8 b + c + 4 h
        for j in cutlass.range_constexpr(nt):
            for b in cutlass.range_constexpr(4):
                for h in cutlass.range_constexpr(2):
                    xb_n1[8 * j + 2 * b + h] = g_xs[j][32 * kt0 + 8 * b + cq + 4 * h]
        if const_expr(self.unroll):
            # the loop unrolled by `depth`: slot d of the ring always holds tile d (mod depth) of the split,
            # so a load is waited on `depth` tiles after it is issued; kt_per_split % depth == 0 (host), and
            # the loads past the split's last tile re-read it (in bounds, no branch)
            kt_last = kt0 + kt_per_split - 1
            for g in cutlass.range(kt_per_split // depth):
                for d in cutlass.range_constexpr(depth):
                    kt = kt0 + g * depth + d
                    for j in cutlass.range_constexpr(nt):
                        for b in cutlass.range_constexpr(4):
                            for h in cutlass.range_constexpr(2):
                                frag_b[(0, h), j, b] = xb_n1[8 * j + 2 * b + h]
                    kt_next = cutlass.min(kt + 1, kt_last)
                    for j in cutlass.range_constexpr(nt):
                        for b in cutlass.range_constexpr(4):
                            for h in cutlass.range_constexpr(2):
                                xb_n1[8 * j + 2 * b + h] = g_xs[j][32 * kt_next + 8 * b + cq + 4 * h]
                    self._decode(ring_x[d], ring_sf[d], ts, frag_a)
                    kt_ahead = cutlass.min(kt + depth, kt_last)
                    cute.autovec_copy(g_blob[kt_ahead, None], ring_x[d])
                    for w in cutlass.range_constexpr(nsf):
                        ring_sf[d][w] = g_sf[kt_ahead, w]
                    cute.gemm(tiled_mma, acc, tCrA, tCrB, acc)
        else:
            for i in cutlass.range(kt_per_split):
                kt = kt0 + i
                for w in cutlass.range_constexpr(nw):
                    xw[w] = ring_x[0][w]
                    for q in cutlass.range_constexpr(shifts):
                        ring_x[q][w] = ring_x[q + 1][w]
                for w in cutlass.range_constexpr(nsf):
                    sfw[w] = ring_sf[0][w]
                    for q in cutlass.range_constexpr(shifts):
                        ring_sf[q][w] = ring_sf[q + 1][w]
                for j in cutlass.range_constexpr(nt):
                    for b in cutlass.range_constexpr(4):
                        for h in cutlass.range_constexpr(2):
                            frag_b[(0, h), j, b] = xb_n1[8 * j + 2 * b + h]
                if i + depth < kt_per_split:  # the weight bytes `depth` tiles ahead
                    cute.autovec_copy(g_blob[kt + depth, None], last_x)
                    for w in cutlass.range_constexpr(nsf):
                        last_sf[w] = g_sf[kt + depth, w]
                if i + 1 < kt_per_split:  # the next tile's token words, in flight during this tile's decode
                    for j in cutlass.range_constexpr(nt):
                        for b in cutlass.range_constexpr(4):
                            for h in cutlass.range_constexpr(2):
                                xb_n1[8 * j + 2 * b + h] = g_xs[j][32 * (kt + 1) + 8 * b + cq + 4 * h]
                self._decode(xw, sfw, ts, frag_a)
                cute.gemm(tiled_mma, acc, tCrA, tCrB, acc)


    @cute.jit
    def _store_partial(self, acc: cute.Tensor, mPart: cute.Tensor, m_tokens: Int32):
        """The accumulator's C fragments (rows g (+ 8), tokens 8 j + 2 c (+ 1)) to this split's partial."""
        tidx, _, _ = cute.arch.thread_idx()
        grp, split, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = grp * ROWS + (tidx // 32) * 16 + lane // 4
        for j in cutlass.range_constexpr(self.n_tiles):
            for v1 in cutlass.range_constexpr(2):
                for v0 in cutlass.range_constexpr(2):
                    if 8 * j + 2 * (lane % 4) + v0 < m_tokens:
                        mPart[split, 8 * j + 2 * (lane % 4) + v0, row + 8 * v1] = acc[(v0, v1), 0, j]

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, mBlob: cute.Tensor, mSf: cute.Tensor, mX: cute.Tensor,
               mPart: cute.Tensor, kt_per_split: Int32, m_tokens: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        thr = tiled_mma.get_slice(tidx % 32)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((16, 8 * self.n_tiles)), Float32)  # ((2,2),1,nt)
        acc.fill(0.0)
        self._mainloop(tiled_mma, mBlob, mSf, mX, kt_per_split, m_tokens, acc)
        self._store_partial(acc, mPart, m_tokens)

    @cute.kernel
    def kernel_fused(self, tiled_mma: cute.TiledMma, lr_mma: cute.TiledMma, mBlob: cute.Tensor, mSf: cute.Tensor,
                     mX: cute.Tensor, mPart: cute.Tensor, kt_per_split: Int32, m_tokens: Int32, mCnt: cute.Tensor,
                     mOut: cute.Tensor, mCs: cute.Tensor, mRs: cute.Tensor, mBias: cute.Tensor, mUp: cute.Tensor,
                     mLa: cute.Tensor, mSeg: cute.Tensor, w_lr: Int32):
        from quack.utils import elem_pointer

        nt = const_expr(self.n_tiles)
        tidx, _, _ = cute.arch.thread_idx()
        grp, split, _ = cute.arch.block_idx()
        lane = tidx % 32
        cq = lane % 4
        smem = cutlass.memory.SmemAllocator()
        s_flag = smem.allocate_tensor(Int32, cute.make_layout((1,)), byte_alignment=4)
        thr = tiled_mma.get_slice(lane)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((16, 8 * nt)), Float32)  # ((2,2),1,nt)
        acc.fill(0.0)
        row0 = grp * ROWS + (tidx // 32) * 16 + lane // 4
        if split == 0 and w_lr > 0:
            # the low-rank term, once (split 0): proj_up' rows as A (k = the window's columns), lora' as B;
            # the bf16 m16n8k16 accumulator fragment is laid out as the main MMA's
            thr_l = lr_mma.get_slice(lane)
            tA = thr_l.make_fragment_A(thr_l.partition_shape_A((16, 64)))
            fa = cute.recast_tensor(tA, Int32)  # ((1,2,2),1,4): [(0, row +8, k upper half), 0, k block]
            tB = thr_l.make_fragment_B(thr_l.partition_shape_B((8 * nt, 64)))
            fb = cute.recast_tensor(tB, Int32)  # ((1,2),nt,4): [(0, k upper half), token tile, k block]
            col0 = mSeg[grp] * (w_lr // 2)  # the window's first Int32 word in a lora' row
            for b in cutlass.range_constexpr(4):
                if 16 * b < w_lr:
                    for v1 in cutlass.range_constexpr(2):
                        for h in cutlass.range_constexpr(2):
                            fa[(0, v1, h), 0, b] = mUp[row0 + 8 * v1, 8 * b + cq + 4 * h]
                    for j in cutlass.range_constexpr(nt):
                        tok = cutlass.min(8 * j + lane // 4, m_tokens - 1)
                        for h in cutlass.range_constexpr(2):
                            fb[(0, h), j, b] = mLa[tok, col0 + 8 * b + cq + 4 * h]
                else:
                    for v1 in cutlass.range_constexpr(2):
                        for h in cutlass.range_constexpr(2):
                            fa[(0, v1, h), 0, b] = Int32(0)
                    for j in cutlass.range_constexpr(nt):
                        for h in cutlass.range_constexpr(2):
                            fb[(0, h), j, b] = Int32(0)
            cute.gemm(lr_mma, acc, tA, tB, acc)
        self._mainloop(tiled_mma, mBlob, mSf, mX, kt_per_split, m_tokens, acc)
        self._store_partial(acc, mPart, m_tokens)
        # the last CTA of this row group (every split's partial written and fenced) sums them in split order
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            s_flag[0] = cute.arch.atomic_add(elem_pointer(mCnt, (grp,)), Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.sync_threads()
        nsplit = mPart.shape[0]
        if s_flag[0] == nsplit - 1:
            cute.arch.fence_acq_rel_gpu()
            for e in cutlass.range(tidx, m_tokens * ROWS, 128):
                tok = e // ROWS
                r = grp * ROWS + e % ROWS
                y = Float32(0.0)
                for s in cutlass.range(nsplit):  # L2, not L1: other SMs wrote these
                    y = y + cute.arch.load(elem_pointer(mPart, (s, tok, r)), Float32, cop="cg")
                if const_expr(self.has_rs):
                    y = y * mRs[tok]
                mOut[tok, r] = (y * mCs[r] + mBias[r]).to(self.out_dtype)
            if tidx == 0:
                mCnt[grp] = Int32(0)  # ready for the next launch on this stream


# ---- host side ------------------------------------------------------------------------------------

CTAS_PER_SM = 4  # four warps a CTA: 16 warps an SM in flight
# k-tiles of weight bytes in flight a warp (SmallMMma's ring). The ring shifts by register moves in a loop
# that is not unrolled, so each load is waited on one iteration after it is issued whatever the depth:
# above 2 it should gain nothing until the loop is unrolled by the depth with fixed slots.
DEPTH = 2


def split_for(groups: int, k_tiles: int, sms: int = SM_COUNT, ctas_per_sm: int = CTAS_PER_SM) -> int:
    """K splits: a divisor of the k-tile count giving about ``ctas_per_sm`` CTAs an SM, at least two
    k-tiles a split (the prefetch needs a next tile to overlap)."""
    want = max(1, round(ctas_per_sm * sms / groups))
    best = 1
    for s in range(1, k_tiles // 2 + 1):
        if k_tiles % s == 0 and s <= want:
            best = s
    return best


_COMPILED: dict[tuple, object] = {}


def _compiled(n_tiles: int, mode: str, depth: int = DEPTH, unroll: bool = False, fused: str | None = None,
              has_rs: bool = False):
    """The kernel for up to ``8 * n_tiles`` tokens (``fused``, ``has_rs``: as ``compile_kernel``), compiled
    once per process (tvm-ffi: called with torch tensors on the current stream)."""
    key = (n_tiles, mode, depth, unroll, fused, has_rs)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = compile_kernel(*key)
    return fn


def compile_kernel(n_tiles: int, mode: str = "exact", depth: int = DEPTH, unroll: bool = False,
                   fused: str | None = None, has_rs: bool = False):
    """``fused``: None (partials only), or the output dtype of the fused kernel (``"bfloat16"`` /
    ``"float16"``); ``has_rs``: its epilogue multiplies by a per-token scale (the fast mode's ``sa``)."""
    from quack.compile_utils import make_fake_tensor

    out_dt = {"bfloat16": BFloat16, "float16": cutlass.Float16, None: None}[fused]
    kern = SmallMMma(n_tiles, mode, depth, unroll, fused is not None, out_dt, has_rs)
    g, kt, s, m, n, kh = (cute.sym_int() for _ in range(6))
    blob = make_fake_tensor(Int32, (g, kt, 128, kern.words), divisibility=4)
    sf = make_fake_tensor(Int32, (g, kt, 32 if mode == "exact" else 128, kern.sf_words), divisibility=kern.sf_words)
    x = make_fake_tensor(Int32, (m, kh), divisibility=4)
    part = make_fake_tensor(Float32, (s, m, n), divisibility=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if fused is None:
        return cute.compile(kern, blob, sf, x, part, Int32(1), Int32(1), stream, options="--enable-tvm-ffi")
    # every size its own variable where the host may pass a stand-in of another size (tvm-ffi binds each
    # variable once per call): the shared counter buffer, the segments, and the low-rank operands, which
    # are small dummies without a low-rank term
    nc, ns, ms, nu, wh, ml, lh = (cute.sym_int() for _ in range(7))
    cnt = make_fake_tensor(Int32, (nc,))
    out = make_fake_tensor(out_dt, (m, n), divisibility=4)
    cs, rs, bias = (make_fake_tensor(Float32, (d,)) for d in (n, ms, n))
    up = make_fake_tensor(Int32, (nu, wh))
    la = make_fake_tensor(Int32, (ml, lh))
    seg = make_fake_tensor(Int32, (ns,))
    return cute.compile(kern.call_fused, blob, sf, x, part, Int32(1), Int32(1), cnt, out, cs, rs, bias, up, la, seg,
                        Int32(0), stream, options="--enable-tvm-ffi")


def _run_fused(mode, a, blob_i32, sf_i32, colscale, rowscale, bias, up_w, la, seg, out_dtype, split=None):
    """The fused kernel: ``out = (sum_s part[s]) (* rowscale) * colscale + bias`` with the low-rank term
    (``up_w [N, W]`` bf16 = proj_up / the epilogue's column factor, ``la [M, LW]`` bf16 = lora_act / the
    token factor, ``seg [N / 64]`` int32 windows: ``plan_lowrank``'s accumulator form) in split 0's
    accumulator. One launch after the activation pass and ``lora_act``."""
    import torch

    from .small_m import _counters

    m = a.shape[0]
    groups, k_tiles = blob_i32.shape[:2]
    n = colscale.numel()
    if bias is None or bias.dtype != torch.float32 or bias.numel() != n:
        raise ValueError("the fused kernel takes the prepared fp32 bias (zeros without a bias)")
    w = 0 if up_w is None else up_w.shape[1]
    if w:
        if up_w.dtype != torch.bfloat16 or la.dtype != torch.bfloat16 or seg is None:
            raise ValueError("the fused kernel's low-rank operands are bf16 proj_up' and lora' with int32 segments")
        if w % 16 or w > 64 or la.shape[0] != m or la.shape[1] % w or seg.numel() != groups:
            raise ValueError(f"low-rank windows of 16-64 columns, [M, S * W] lora' and one segment a row group; got "
                             f"W={w}, lora' {tuple(la.shape)}, {seg.numel()} segments for {groups} groups")
    split = split or split_for(groups, k_tiles, sm_count(a.device))
    if k_tiles % split:
        raise ValueError(f"split {split} does not divide the {k_tiles} k-tiles")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the fused kernel writes bf16 or fp16, got {out_dtype}")
    fn = _compiled(-(-m // 8), mode, DEPTH, False, str(out_dtype).removeprefix("torch."), rowscale is not None)
    part = torch.empty(split, m, n, device=a.device, dtype=torch.float32)
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    cnt = _counters(a.device, groups)
    dummy_i = cnt  # any Int32 tensor where the low-rank operands are absent (w = 0: never read)
    fn(blob_i32, sf_i32, a.view(torch.int32), part, k_tiles // split, m, cnt, out, colscale.reshape(-1),
       (rowscale if rowscale is not None else colscale).reshape(-1), bias.reshape(-1),
       up_w.view(torch.int32) if w else dummy_i.view(1, -1), la.view(torch.int32) if w else dummy_i.view(1, -1),
       seg if w else dummy_i, w)
    return out


def _run(mode, a, blob_i32, sf_i32, colscale, rowscale, bias, proj_up, lora_act, out_dtype, split,
         depth=None, ctas_per_sm=None, unroll=False):
    """Launch the kernel on the tokens, then the ordered sum and the epilogue (``depth`` / ``ctas_per_sm``
    override ``DEPTH`` / ``CTAS_PER_SM``, ``unroll`` takes the loop unrolled by the depth: for
    measurement)."""
    import torch

    from .kernels import splitk_epilogue

    m = a.shape[0]
    groups, k_tiles = blob_i32.shape[:2]
    n = colscale.numel()
    split = split or split_for(groups, k_tiles, sm_count(a.device), ctas_per_sm or CTAS_PER_SM)
    if k_tiles % split:
        raise ValueError(f"split {split} does not divide the {k_tiles} k-tiles")
    depth = depth or DEPTH
    if unroll and (k_tiles // split) % depth:
        raise ValueError(f"the unrolled loop takes a multiple of depth {depth} k-tiles a split, got {k_tiles // split}")
    part = torch.empty(split, m, n, device=a.device, dtype=torch.float32)
    _compiled(-(-m // 8), mode, depth, unroll)(blob_i32, sf_i32, a.view(torch.int32), part, k_tiles // split, m)
    r = 0 if proj_up is None else proj_up.shape[1]
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    return splitk_epilogue(part, out, colscale, bias, proj_up if r else None, lora_act if r else None, rowscale)


def _check_call(m: int, k: int, n: int, k_tiles: int, groups: int, mode: str) -> None:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the mma small-M kernel takes 1 to {MAX_M} tokens, got {m}")
    if k != K_TILE[mode] * k_tiles or n != ROWS * groups:
        raise ValueError(f"x [{m}, {k}] does not match the blob of a {ROWS * groups} x {K_TILE[mode] * k_tiles} weight")


def linear(xq, blob, sf, wcscale, bias=None, proj_up=None, lora_act=None, out_dtype=None, split: int | None = None,
           **tune):
    """``out [M, N] = (xq @ W^T) * wcscale + lora_act @ proj_up^T + bias`` for M <= 64 on the quack blob
    (``quack_gemm.repack_weight`` / ``repack_scales``) and bf16 ``xq`` (the exact mode's activations, or
    x itself for W4A16)."""
    import torch

    if xq.dtype != torch.bfloat16:
        raise ValueError(f"the mma small-M kernel takes bf16 activations, got {xq.dtype}")
    groups, k_tiles = blob.shape[:2]
    _check_call(xq.shape[0], xq.shape[1], wcscale.numel(), k_tiles, groups, "exact")
    return _run("exact", xq.contiguous(), blob.view(torch.int32), sf.reshape(groups, k_tiles, 32, 8).view(torch.int32),
                wcscale, None, bias, proj_up, lora_act, out_dtype or xq.dtype, split, **tune)


def linear_fast(a8, sa, fw, bias=None, proj_up=None, lora_act=None, out_dtype=None, split: int | None = None,
                **tune):
    """The fast mode: ``out [M, N] = (a8 @ w8^T) * sa * cs + lora_act @ proj_up^T + bias`` for M <= 64,
    ``a8`` the E4M3 tokens in the fast GEMM's k order (``quantize_act_fp8(gemm_order=True)``), ``sa`` their
    scales, ``fw`` the ``quack_fast.FastWeight`` (its blob, strip and ``cs = 2**e * wcscale``)."""
    import torch

    if a8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the fast mma small-M kernel takes float8_e4m3fn activations, got {a8.dtype}")
    groups, k_tiles = fw.blob.shape[:2]
    _check_call(a8.shape[0], a8.shape[1], fw.cs.numel(), k_tiles, groups, "fast")
    return _run("fast", a8.contiguous().view(torch.uint8), fw.blob.view(torch.int32),
                fw.strip.view(torch.int32).reshape(groups, k_tiles, 128, 1), fw.cs.reshape(-1), sa.float(), bias,
                proj_up, lora_act, out_dtype or torch.bfloat16, split, **tune)


def linear_fused(xq, blob, sf, wc, bias, up_w=None, la=None, seg=None, out_dtype=None, split: int | None = None):
    """The exact mode in one launch after the activation pass and ``lora_act``: ``out [M, N] = (xq @ W^T +
    la @ up_w^T) * wc + bias`` on quack's blob, with the accumulator path's prepared operands
    (``QuackWeight.wc`` / ``.bias`` fp32, ``up_w = proj_up / wcscale`` per window, ``la = lora_act``
    bf16 over the windows, ``seg``: ``plan_lowrank``)."""
    import torch

    if xq.dtype != torch.bfloat16:
        raise ValueError(f"the mma small-M kernel takes bf16 activations, got {xq.dtype}")
    groups, k_tiles = blob.shape[:2]
    _check_call(xq.shape[0], xq.shape[1], wc.numel(), k_tiles, groups, "exact")
    return _run_fused("exact", xq.contiguous(), blob.view(torch.int32),
                      sf.reshape(groups, k_tiles, 32, 8).view(torch.int32), wc.reshape(-1), None, bias, up_w, la, seg,
                      out_dtype or xq.dtype, split)


def linear_fast_fused(a8, sa, fw, up_w=None, la=None, seg=None, out_dtype=None, split: int | None = None):
    """The fast mode in one launch after its activation pass and ``lora_act``: ``out [M, N] = (a8 @ w8^T +
    la @ up_w^T) * sa * cs + bias`` (``la = lora_act / sa`` as ``quantize_act_fp8`` writes it, ``up_w =
    proj_up / cs`` per window: the accumulator path's operands)."""
    import torch

    if a8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"the fast mma small-M kernel takes float8_e4m3fn activations, got {a8.dtype}")
    groups, k_tiles = fw.blob.shape[:2]
    _check_call(a8.shape[0], a8.shape[1], fw.cs.numel(), k_tiles, groups, "fast")
    return _run_fused("fast", a8.contiguous().view(torch.uint8), fw.blob.view(torch.int32),
                      fw.strip.view(torch.int32).reshape(groups, k_tiles, 128, 1), fw.cs.reshape(-1), sa.float(),
                      fw.bias, up_w, la, seg, out_dtype or torch.bfloat16, split)


def main(argv=None) -> int:
    """Compile for sm_90a with no GPU and write the cubin:
    ``CUTE_DSL_ARCH=sm_90a CUTE_DSL_KEEP=cubin python -m svdq_linear.backends.sm90.small_m_mma --n-tiles 1 --out F``."""
    import argparse
    from pathlib import Path

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--n-tiles", type=int, default=1)
    p.add_argument("--mode", choices=sorted(K_TILE), default="exact")
    p.add_argument("--depth", type=int, default=DEPTH, help="k-tiles of weight bytes in flight")
    p.add_argument("--unroll", action="store_true", help="the k-loop unrolled by the depth (fixed ring slots)")
    p.add_argument("--fused", action="store_true",
                   help="the fused kernel (low-rank MMA, split-K sum and epilogue in the kernel; bf16 out)")
    p.add_argument("--out", required=True, help="where to write the cubin")
    args = p.parse_args(argv)
    kern = (compile_kernel(args.n_tiles, args.mode, args.depth, args.unroll, "bfloat16", args.mode == "fast")
            if args.fused else compile_kernel(args.n_tiles, args.mode, args.depth, args.unroll))
    cubin = getattr(kern, "__cubin__", None)
    if not cubin:
        raise SystemExit("no cubin kept: set CUTE_DSL_KEEP=cubin")
    if isinstance(cubin, str):  # a path to the dumped file
        cubin = Path(cubin).read_bytes()
    Path(args.out).write_bytes(cubin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
