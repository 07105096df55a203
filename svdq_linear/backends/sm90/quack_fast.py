"""The fast mode's GEMM on quack-kernels' SM90 operand-transform mainloop: 4-bit weights decoded to
E4M3 in registers, E4M3 activations, FP8 wgmma.

quack runs layout-owning A transforms (its W4A16 / W4A8 formats) as the register-sourced A operand of
wgmma inside an interleaved mainloop (the decode of k-block b + 1 overlaps the wgmma of block b). This
module adds a decode of its own on that interface: ``_Nvfp4E4m3`` turns our NVFP4 codes and the
UE5M3 block factors of ``fast_layout`` into ``e4m3(code * g)`` (bit for bit ``nvfp4.fast_weight``)
by table lookup. In the GEMM's k order (``fast_layout``) a thread's values of a row in a k-tile are
two whole NVFP4 blocks, so per k-tile it builds four tables (rows r and r + 8, two blocks; each four
``HMUL2`` and four ``cvt.rn.satfinite.e4m3x2.f16x2`` from one strip byte) and then decodes eight codes
with two ``prmt`` lookups and two sign merges (seven instructions). The activations come in the same
k order (``kernels.quantize_act_fp8(gemm_order=True)``).

quack's W4 transform loads at most 8 scale bytes per thread and k-tile from a strip of ``128 *
sf_words`` bytes, one TMA box (a box may not exceed 256 along a mode). Our strip is 512 bytes per
m64 block and k-tile (one 4-byte word per thread): ``_FastTransform`` loads the thread's word and
``_SplitStrip`` moves the strip as a (256, 2) box.

The epilogue (quack's ``@gemm_epilogue``) applies ``acc * sa[token] * (2**e * wcscale)[n] + bias``.
The low-rank term joins the accumulator before it (``quack_lowrank``): ``R / 16`` bf16 wgmmas of
``lora_act / sa`` and ``proj_up / (2**e * wcscale)``. The earlier form, ``+ lowrank`` with the [M, N]
tile of one cuBLAS GEMM, stays for ranks whose operands do not fit the shared memory
(``quack_lowrank.fits``). Imported only on a GPU with quack-kernels installed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, const_expr
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.ops import ColVecLoad, RowVecLoad, TileLoad
from quack.gemm_runtime.identity import TORCH_OP_TRANSFORM_MODS
from quack.operand_transform.formats import DecodeFormat
from quack.operand_transform.frontend import PackedFormatMod
from quack.operand_transform.transform import AuxOperandA, TransformAW4

from . import fast_layout, quack_launch, quack_lowrank, tuning
from .fast_layout import STRIP_BYTES, TILE_K

@dsl_user_op
def _table(word: Int32, i: cutlass.Constexpr[int], *, loc=None, ip=None):
    """Byte ``i`` of a strip word (a block factor ``g``, UE5M3) -> the block's two table registers:
    bytes ``e4m3(m * g)`` for m = 0, 0.5, 1, 1.5 and for m = 2, 3, 4, 6 (``fast_layout._tables``)."""
    asm = fast_layout.table_asm(i)
    struct_ty = ir.Type.parse("!llvm.struct<(i32, i32)>")
    res = llvm.inline_asm(struct_ty, [Int32(word).ir_value(loc=loc, ip=ip)], asm, "=r,=r,r",
                          has_side_effects=False, loc=loc, ip=ip)
    return (Int32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)),
            Int32(llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)))


@dsl_user_op
def _decode_word(x: Int32, ta: Int32, tb: Int32, ta8: Int32, tb8: Int32, *, loc=None, ip=None):
    """One code word (``fast_layout``: eight codes, rows r and r + 8) and the two rows' tables -> two
    registers of four E4M3 bytes each: two ``prmt`` lookups, two sign merges."""
    asm = fast_layout.DECODE_ASM
    struct_ty = ir.Type.parse("!llvm.struct<(i32, i32)>")
    res = llvm.inline_asm(
        struct_ty,
        [Int32(v).ir_value(loc=loc, ip=ip) for v in (x, ta, tb, ta8, tb8)],
        asm, "=r,=r,r,r,r,r,r", has_side_effects=False, loc=loc, ip=ip)
    return (Int32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)),
            Int32(llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip)))


class _Nvfp4E4m3(DecodeFormat):
    """Our NVFP4 codes x UE5M3 block factors -> E4M3 fragments (``fast_layout``'s layout).

    ``b`` indexes k32 blocks (0..3); ``ts`` holds the thread's eight table registers of the k-tile:
    ``ts[2 i]``, ``ts[2 i + 1]`` for strip byte ``i = 2 B + p`` (block ``2 c + B``, row ``r + 8 p``)."""

    name = "svdq_nvfp4_e4m3"
    tile_k = TILE_K
    sf_words = STRIP_BYTES // 128
    mma_dtype = cutlass.Float8E4M3FN
    roundtrip = False  # the per-row 2**e lives in the epilogue

    def make_consts(self):
        return None

    @cute.jit
    def decode_k16(self, xw, ts, b, consts):
        t0 = 4 * (b // 2)  # k32 blocks 0, 1 read NVFP4 block 2 c, blocks 2, 3 block 2 c + 1
        r0, r1 = _decode_word(xw[2 * b], ts[t0], ts[t0 + 1], ts[t0 + 2], ts[t0 + 3])
        r2, r3 = _decode_word(xw[2 * b + 1], ts[t0], ts[t0 + 1], ts[t0 + 2], ts[t0 + 3])
        return r0, r1, r2, r3

    def prepare(self, q, sf):
        return fast_layout.repack_fast_weight(q), fast_layout.fast_scales(q, sf)[0]


class _SplitStrip(AuxOperandA):
    """The 512-byte scale strip of an m64 block and k-tile, moved as a (256, 2) TMA box."""

    dtype = cutlass.Uint8
    multicast = False

    def __init__(self, gemm):
        self.gemm = gemm

    def _tm64(self):
        return self.gemm.cta_tile_shape_mnk[0] // 64

    def bytes_per_stage(self):
        return STRIP_BYTES * self._tm64()

    def make_smem_layout_staged(self, ab_stage):
        return cute.make_ordered_layout((256, 2, self._tm64(), ab_stage), order=(0, 1, 2, 3))

    def make_tma(self, mAux):
        # quack's view is (512, tm64, Gt, Kt, L) bytes; split the contiguous 512 into (256, 2)
        split = cute.make_tensor(
            mAux.iterator,
            cute.make_layout((256, 2, *mAux.shape[1:]), stride=(1, 256, *mAux.layout.stride[1:])))
        box = (256, 2, self._tm64())
        return self.gemm._make_tma_atoms_and_tensors(
            split, cute.make_ordered_layout(box, order=(0, 1, 2)), box, self.gemm.cluster_shape_mnk[1])

    def gmem_slice(self, mAux, tile_coord_mnkl, batch_idx):
        return mAux[None, None, None, tile_coord_mnkl[0], None, batch_idx]


class _FastTransform(quack_lowrank.LowRankTransformHook, TransformAW4):
    """quack's W4 transform reading one strip word per thread and building the decode's tables from it."""

    def __init__(self, gemm, fmt):
        super().__init__(gemm, fmt)
        self.aux = _SplitStrip(gemm)

    @cute.jit
    def make_copy_block(self, tiled_mma, sA, tCrA, tidx, warp_group_idx, sAux=None, mAux=None):
        gemm = self.gemm
        tm64 = gemm.cta_tile_shape_mnk[0] // 64
        nw = self._nw
        codes = cute.make_tensor(
            cute.recast_ptr(sA.iterator, dtype=Int32),
            cute.make_ordered_layout((nw, 128, tm64, gemm.ab_stage), order=(0, 1, 2, 3)))
        strip = cute.make_tensor(
            cute.recast_ptr(sAux.iterator, dtype=Int32),
            cute.make_ordered_layout((128, tm64, gemm.ab_stage), order=(0, 1, 2)))
        t128 = tidx % 128  # also this thread's strip word
        frag_i32 = cute.recast_tensor(tCrA, Int32)
        mma_m = const_expr(cute.size(tCrA.shape[1]))
        atom_m = gemm.atom_layout_mnk[0]
        xw = cute.make_rmem_tensor((nw, mma_m), Int32)
        sw = cute.make_rmem_tensor((1, mma_m), Int32)
        ts = cute.make_rmem_tensor((8, mma_m), Int32)

        def copy_block(stage_idx, b, k_tile=None):
            if const_expr(b == 0):
                # the tile's words stay in registers for its four blocks; the next tile's block-0 load
                # comes after this tile's last decode
                for m in cutlass.range_constexpr(mma_m):
                    m64 = m * atom_m + warp_group_idx
                    cute.autovec_copy(codes[None, t128, m64, stage_idx], xw[None, m])
                    sw[0, m] = strip[t128, m64, stage_idx]
            if const_expr(b % 2 == 0):
                # the tables of NVFP4 block 2 c + b // 2 (rows r, r + 8), built before its first k32 block
                for m in cutlass.range_constexpr(mma_m):
                    for i in cutlass.range_constexpr(b, b + 2):
                        ta, tb = _table(sw[0, m], i)
                        ts[2 * i, m] = ta
                        ts[2 * i + 1, m] = tb
            self._decode_block(xw, ts, frag_i32, b, mma_m, None)

        return copy_block


def _source_digest() -> str:
    """Fail-closed identity of the decode for quack's caches: the source of this module and of the
    layout it reads (quack's own keyer cannot walk the DSL's inline-asm helpers)."""
    h = hashlib.sha256(b"svdq_w4a8")
    for path in (Path(__file__), Path(fast_layout.__file__), Path(quack_lowrank.__file__)):
        h.update(path.read_bytes())
    return h.hexdigest()


class _FastMod(PackedFormatMod):
    """The ``transform_a=`` handle: quack's packed-format mod, building ``_FastTransform``."""

    def __init__(self):  # not PackedFormatMod.__init__: it fingerprints decode_k16 with quack's keyer
        self.fmt = self.packed = _Nvfp4E4m3()
        self._registry_name = None
        self.name = "svdq_w4a8"
        self.semantic_digest = _source_digest()
        TORCH_OP_TRANSFORM_MODS[self.semantic_digest] = self

    def __call__(self, gemm):
        return _FastTransform(gemm, self.fmt)


FAST_MOD = _FastMod()


@gemm_epilogue(ops={"sa": ColVecLoad("sa"), "cs": RowVecLoad("cs"), "bias": RowVecLoad("bias"),
                    "lr": TileLoad("lr")})
def _epi_fast_lowrank(acc, lr, sa, cs, bias):
    return {"D": acc * sa * cs + bias + lr}


@quack_lowrank.lowrank_epilogue(ops={"sa": ColVecLoad("sa"), "cs": RowVecLoad("cs"), "bias": RowVecLoad("bias")})
def _epi_fast(acc, sa, cs, bias):
    return {"D": acc * sa * cs + bias}


@dataclass
class FastWeight:
    """The weight as the fast kernel reads it, prepared once per device."""

    blob: torch.Tensor  # [N/64, K/128, 128, 32] uint8
    strip: torch.Tensor  # [N/64, K/128, 512] uint8
    cs: torch.Tensor  # [1, N] fp32: 2**e * wcscale
    bias: torch.Tensor  # [1, N] fp32 (zeros without a bias)
    # [N] fp32 2**e (prepare's; not a kernel operand, so not in tensors()): with the strip it gives the
    # canonical scales back (fast_layout.rebuild_scales)
    nw: torch.Tensor | None = None
    warm: dict = field(default_factory=dict, repr=False, compare=False)  # quack_launch's plans and views

    def tensors(self) -> list[torch.Tensor]:  # the order FastWeight(*tensors) takes back
        return [self.blob, self.strip, self.cs, self.bias]


def weight(tensors: list[torch.Tensor]) -> FastWeight:
    """The prepared ``FastWeight`` these ``tensors()`` came from (its launch cache with it), or a new one."""
    return quack_launch.weight(FastWeight, tensors)


def prepare(qweight, wscales, wcscale, bias) -> FastWeight:
    blob = fast_layout.repack_fast_weight(qweight)
    strip, nw = fast_layout.fast_scales(qweight, wscales)
    n = qweight.shape[0]
    b = torch.zeros(n, device=qweight.device) if bias is None else bias.float()
    return quack_launch.register(FastWeight(blob, strip, (nw * wcscale.float()).reshape(1, n).contiguous(),
                                            b.reshape(1, n).contiguous(), nw))


def tiles(m: int, n: int, sms: int = tuning.SM_COUNT) -> tuple[int, int]:
    """(tile over weight rows, tile over tokens); above 1024 tokens ``tuning.prefill_tiles``."""
    if m > 1024:
        return tuning.prefill_tiles(m, n, sms)
    if m > 128:
        return 64, 256 if m > 256 else 128
    return 64, max(16, 1 << (max(m, 1) - 1).bit_length())


def gemm(a8: torch.Tensor, sa: torch.Tensor, w: FastWeight, lowrank: torch.Tensor | None = None,
         tile: tuple[int, int] | None = None, launch: bool = True,
         out_dtype: torch.dtype = torch.bfloat16, lr_acc: tuple[torch.Tensor, ...] | None = None
         ) -> torch.Tensor:
    """``out [M, N] = (a8 @ w8^T) * sa * cs + bias (+ lowrank)`` in ``out_dtype`` (bf16 or fp16, rounded
    once); ``a8`` E4M3 contiguous, its columns in the GEMM's k order (``fast_layout``; as
    ``kernels.quantize_act_fp8(gemm_order=True)`` writes them). The low-rank term comes either as the [M, N] tile ``lowrank`` or,
    into the accumulator, as ``lr_acc = (proj_up / cs [N, W], lora_act / sa [M, S * W][, segments
    [N / 64] int32])`` (bf16, ``quack_lowrank``). ``launch=False`` compiles (into quack's caches) without launching."""
    m = a8.shape[0]
    n = w.cs.shape[1]
    out = torch.empty(m, n, device=a8.device, dtype=out_dtype)
    if m == 0:
        return out
    tm, tn = tile or tiles(m, n, tuning.sm_count(a8.device))
    if n % tm:
        tm = 64  # n % 64 == 0 always (fast_layout.check_shape)
    args = {"sa": sa.reshape(1, m), "cs": w.cs, "bias": w.bias}
    mod = _epi_fast.chosen()
    if lowrank is not None:
        args["lr"], mod = lowrank, _epi_fast_lowrank
    elif lr_acc is not None:
        args.update(quack_lowrank.lowrank_args(lr_acc))
    quack_launch.launch(mod, w, w.strip, a8, out, args, FAST_MOD, tile_m=tm, tile_n=tn, tile_k=TILE_K, launch=launch)
    return out
