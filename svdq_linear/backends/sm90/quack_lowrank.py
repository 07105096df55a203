"""The low-rank MMA in the main accumulator of quack's SM90 W4 GEMMs (both modes).

The contract's low-rank term ``lora_act @ proj_up^T`` is folded into the accumulator before the
epilogue scales it: with the epilogue ``out = acc * s[m] * c[n] + bias``, adding
``(lora_act[m] / s[m]) . (proj_up[n] / c[n])`` to ``acc`` gives the contract's sum, so after quack's
K-loop each math warpgroup issues ``W / 16`` more bf16 wgmmas (shared-memory operands, fp32 into the
same registers) and the output is written once. No [M, N] low-rank tile, no second GEMM.

Operands (kernel coordinates: the kernel computes ``D^T``, its M is the weight's rows, its N the
tokens): ``lu [N_w, W]`` = ``proj_up / c`` (prepared once per device), ``la [M_tok, S * W]`` =
``lora_act / s`` (per call), bf16, K-major, ``W % 16 == 0``; with the optional segment table ``ls``
(fused linears: a block-diagonal ``proj_up``) a weight tile reads the ``W``-wide window of ``la`` of
its segment, and ``lu`` holds each row's own window only.

Overlap: the math warps issue ``cp.async`` copies of the tile's ``lu`` and ``la`` rows into two
swizzled shared-memory buffers (``W`` wide) at the start of each work tile (quack's ``on_work_tile``
seam of the operand transform, which runs before the K-loop), so the loads fly under the main loop;
after it, ``epi_visit_acc`` waits for them, joins the math threads on the epilogue barrier and issues
the wgmmas. The buffers are unstaged epilogue shared memory, ``(tile_M + tile_N) * W * 2`` bytes that
quack counts before it picks the number of K-stages (one stage fewer at ``W = 32``: docs/perf.md).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
import torch
from cutlass import BFloat16, Float32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.experimental import primitives as prims
from cutlass.utils import LayoutEnum
from quack import copy_utils
from quack import sm90_utils as quack_sm90_utils
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.epilogue.frontend import EpiMod
from quack.epilogue.ops import EpiOp, EpiSmemBytes
from quack.gemm_runtime.identity import TORCH_OP_EPI_MODS

_SMEM_ALIGN = 1024  # a 128-byte swizzle atom repeats every 1024 bytes


def source_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _smem_layout(rows: int, r: int):
    """[rows, r] bf16 K-major, the wgmma swizzle for a K extent of ``r``."""
    atom = warpgroup.make_smem_layout_atom(hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, BFloat16, r), BFloat16)
    return cute.tile_to_shape(atom, (rows, r), order=(0, 1))


_VEC = 8  # bf16 elements a cp.async moves (16 bytes)


def copy_split(rows: int, r: int, nthreads: int) -> tuple[int, int]:
    """How ``nthreads`` math threads cp.async a ``[rows, r]`` bf16 tile: (threads a row, rows a pass).

    A row takes ``r / 8`` threads; the rows a pass are a power of two that divides the tile's rows (a
    192-row tile: at most 64), so the passes cover the tile exactly. R = 48 (three fused rank-16
    branches) gives 6 threads a row and 32 rows a pass: 192 of 256 threads copy, the rest wait at the
    barrier."""
    if r % 16 or rows % 8 or rows <= 0 or not 0 < r // _VEC <= nthreads:
        raise ValueError(f"cannot split a [{rows}, {r}] tile over {nthreads} threads")
    per_row = r // _VEC
    return per_row, min(rows & -rows, 1 << ((nthreads // per_row).bit_length() - 1))


class LowRankOperand(EpiOp):
    """One operand of the low-rank MMA, bf16, K-major: ``lu [N_w, W]`` (``dim`` 0, kernel M) or
    ``la [M_tok, S * W]`` (``dim`` 1, kernel N). A work tile reads ``W`` columns of each: all of ``lu``,
    and the window ``s`` of ``la`` that the segment table gives its weight rows (``s = 0`` without a
    table). The tile's rows of both sit whole in shared memory, ``W`` wide; ``lu`` declares the bytes
    of both buffers (``la``'s own width is ``S * W``). The fn frontend never sees them."""

    fn_port = None

    def __init__(self, name: str, dim: int):
        super().__init__(name)
        self.dim = dim

    def config_key(self):
        return (self.dim,)

    def host_arg_key(self, value):
        if value is None:
            return None
        if self.dim == 1:  # la's width (S * W) stays dynamic: one kernel for one window or several
            return (torch2cute_dtype_map[value.dtype],)
        return (torch2cute_dtype_map[value.dtype], int(value.shape[1]))

    def host_validate(self, value, **_):
        if value.dtype != torch.bfloat16 or value.dim() != 2 or value.stride(1) != 1 or value.shape[1] % 16:
            raise ValueError(f"low-rank operand {self.name!r}: needs a [rows, R] bf16 tensor, R contiguous and a "
                             f"multiple of 16; got {tuple(value.shape)} {value.dtype} strides {value.stride()}")
        if value.stride(0) % 8 or value.data_ptr() % 16:
            raise ValueError(f"low-rank operand {self.name!r}: rows must be 16-byte aligned")

    def host_fake_arg(self, key, fctx):
        if self.dim == 1:
            return make_fake_tensor(key[0], (fctx.n, cute.sym_int()), divisibility=8, leading_dim=1)
        return make_fake_tensor(key[0], (fctx.m, key[1]), divisibility=8, leading_dim=1)

    def param_fields(self):
        return [(self.name, object, None)]

    def to_params(self, gemm, args):
        t = getattr(args, self.name)  # host_validate: 16-byte rows and base
        stride = tuple(s if cute.is_static(s) else cute.assume(s, divby=8) for s in t.stride)
        ptr = cute.make_ptr(t.element_type, t.iterator.toint(), cute.AddressSpace.gmem, assumed_align=16)
        return {self.name: cute.make_tensor(ptr, cute.make_layout(t.shape, stride=stride))}

    def smem_bytes(self, arg_tensor, cta_tile_shape_mnk, epi_tile, warp_shape_mnk=None):
        if self.dim == 1:
            return EpiSmemBytes()  # counted by lu, whose width is the window's
        rows = cta_tile_shape_mnk[0] + cta_tile_shape_mnk[1]
        return EpiSmemBytes(unstaged=rows * cute.size(arg_tensor, mode=[1]) * 2 + 2 * _SMEM_ALIGN)

    def _layout(self, gemm, params):
        return _smem_layout(gemm.cta_tile_shape_mnk[self.dim], cute.size(params.lu, mode=[1]))

    def smem_struct_field(self, gemm, params):
        size = cute.cosize(self._layout(gemm, params))
        return (f"s_{self.name}", cute.struct.Align[cute.struct.MemRange[BFloat16, size], _SMEM_ALIGN])

    def get_smem_tensor(self, gemm, params, storage_epi):
        layout = self._layout(gemm, params)
        return getattr(storage_epi, f"s_{self.name}").get_tensor(layout.outer, swizzle=layout.inner)


class LowRankSegments(EpiOp):
    """``ls [N_w / 64] int32``: the window of ``la`` (and of the fused ``proj_up``) that each 64 weight
    rows use. Fused linears (q/k/v, the single blocks' inputs) concatenate their low-rank branches
    along R with a block-diagonal ``proj_up``: a weight tile inside one segment needs its own ``W``
    columns only, so the MMA and the buffers stay ``W`` wide instead of ``S * W``."""

    fn_port = None

    def host_arg_key(self, value):
        return None if value is None else (torch2cute_dtype_map[value.dtype],)

    def host_validate(self, value, **_):
        if value.dtype != torch.int32 or value.dim() != 1 or not value.is_contiguous():
            raise ValueError(f"low-rank segment table {self.name!r}: needs a contiguous [N / 64] int32 tensor, "
                             f"got {tuple(value.shape)} {value.dtype}")

    def host_fake_arg(self, key, fctx):
        return make_fake_tensor(key[0], (cute.sym_int(),), leading_dim=0)

    def param_fields(self):
        return [(self.name, object, None)]

    def to_params(self, gemm, args):
        return {self.name: getattr(args, self.name)}


class LowRankAccMixin:
    """Joins a minted quack GEMM class: the ``lu``/``la`` prefetch per work tile and the low-rank wgmmas
    into the accumulator after the K-loop."""

    _lr = None

    def epi_get_smem_tensors(self, params, storage):
        tensors = super().epi_get_smem_tensors(params, storage)
        # trace time: the kernel's prologue runs this for every warp, so the values dominate the
        # work-tile loop where lowrank_prefetch and epi_visit_acc read them
        self._lr = (params, tensors) if tensors.get("lu") is not None and tensors.get("la") is not None else None
        return tensors

    def _lr_tiled_mma(self):
        """bf16 SS wgmma with the main MMA's warpgroup layout and N permutation: the same accumulator."""
        atom = self.atom_layout_mnk
        tiled = hopper.make_trivial_tiled_mma(
            BFloat16, BFloat16, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32, atom,
            tiler_mn=(64, self.cta_tile_shape_mnk[1] // atom[1]))
        if const_expr(atom[1] > 1):
            perm_n = cute.make_ordered_layout((8, self.cta_tile_shape_mnk[1] // atom[1] // 8, atom[1]), order=(0, 2, 1))
            tiled = cute.make_tiled_mma(cute.make_mma_atom(tiled.op), atom, permutation_mnk=(None, perm_n, None))
        return tiled

    @cute.jit
    def lowrank_prefetch(self, tile_coord_mnkl):
        """Math warps, at a work tile's start: cp.async the tile's ``lu`` and ``la`` rows (rows past the
        tensor are left as they are: they only feed outputs that are never stored)."""
        if const_expr(self._lr is not None):
            params, tensors = self._lr
            if const_expr(self.use_pdl):
                # la is the grid before's output (the activation pass, which may let this grid start before it
                # ends: kernels.quantize_act_after_lora). Quack's producer waits for that grid before its first
                # load; these copies run before the K-loop, so they wait too (at once after the first tile).
                prims.griddepcontrol(prims.GridDepAction.WAIT)
            tidx, _, _ = cute.arch.thread_idx()
            nthreads = self.mma_warp_groups * self.num_threads_per_warp_group
            w = cute.size(params.lu, mode=[1])
            window = 0
            if const_expr(params.ls is not None):  # the weight tile's segment (tiles never straddle two)
                window = params.ls[tile_coord_mnkl[0] * (self.cta_tile_shape_mnk[0] // 64)]
            for name, dim in (("lu", 0), ("la", 1)):
                mX = getattr(params, name)
                sX = tensors[name]
                rows = self.cta_tile_shape_mnk[dim]
                per_row, rows_per_pass = copy_split(rows, w, nthreads)
                nthr = rows_per_pass * per_row
                thr_copy = copy_utils.tiled_copy_2d(BFloat16, per_row, nthr, _VEC, is_async=True).get_slice(tidx % nthr)
                col = 0 if dim == 0 else window
                gX = cute.local_tile(mX, (rows, w), (tile_coord_mnkl[dim], col))
                cX = cute.local_tile(cute.make_identity_tensor(mX.shape), (rows, w), (tile_coord_mnkl[dim], col))
                tXgX = thr_copy.partition_S(gX)
                tXsX = thr_copy.partition_D(sX)
                tXcX = thr_copy.partition_S(cX)
                limit = cute.size(mX, mode=[0])
                if tidx < nthr:
                    for i in cutlass.range_constexpr(cute.size(tXsX, mode=[1])):
                        if tXcX[0, i, 0][0] < limit:
                            cute.copy(thr_copy, tXgX[None, i, None], tXsX[None, i, None])
            cute.arch.cp_async_commit_group()

    @cute.jit
    def epi_visit_acc(self, params, acc, tiled_mma, tile_coord_mnkl, tidx):
        if const_expr(self._lr is not None):
            # quack calls this hook in every split of a split-K tile: the term would be added split_k times
            assert self.split_k == 1, "the low-rank MMA in the accumulator needs split_k == 1"
            _, tensors = self._lr
            cute.arch.cp_async_wait_group(0)
            # the cp.async writes are generic-proxy stores; wgmma reads through the async proxy
            cute.arch.fence_proxy("async.shared", space="cta")
            self.epilogue_barrier.arrive_and_wait()
            lr_mma = self._lr_tiled_mma()
            warp_group_idx = cute.arch.make_warp_uniform(tidx // self.num_threads_per_warp_group)
            thr = lr_mma.get_slice(warp_group_idx * self.num_threads_per_warp_group)
            tCrA = thr.make_fragment_A(thr.partition_A(tensors["lu"]))
            tCrB = thr.make_fragment_B(thr.partition_B(tensors["la"]))
            quack_sm90_utils.gemm(lr_mma, acc, tCrA, tCrB, zero_init=False, wg_wait=0)


class LowRankTransformHook:
    """Mixed into an operand transform: the mainloop's per-work-tile seam starts the low-rank prefetch."""

    uses_work_tile = True

    def on_work_tile(self, tile_coord_mnkl):
        hook = getattr(self.gemm, "lowrank_prefetch", None)
        if hook is not None:
            hook(tile_coord_mnkl)


class LowRankEpiMod(EpiMod):
    """quack's fn-frontend epilogue mod whose minted GEMM classes carry ``LowRankAccMixin`` (active when
    the call passes ``lu`` and ``la``)."""

    def __init__(self, fn, **kwargs):
        extra = tuple(kwargs.pop("extra_ops", ())) + (LowRankOperand("lu", 0), LowRankOperand("la", 1),
                                                      LowRankSegments("ls"))
        super().__init__(fn, extra_ops=extra, **kwargs)
        TORCH_OP_EPI_MODS.pop(self.semantic_digest, None)
        # the mixin's code is part of what the compiled kernels mean
        self.semantic_digest = hashlib.sha256((self.semantic_digest + source_digest()).encode()).hexdigest()
        self._ident = f"{fn.__name__}_{self.semantic_digest[:16]}"
        TORCH_OP_EPI_MODS[self.semantic_digest] = self
        self._lr_minted = {}

    def __getstate__(self):
        state = super().__getstate__()
        state["_lr_minted"] = {}
        return state

    def _mint(self, *key):
        cls = self._lr_minted.get(key)
        if cls is None:
            base = super()._mint(*key)
            name = base.__name__ + "_lracc"
            cls = type(name, (LowRankAccMixin, base),
                       {"EpilogueParams": base.EpilogueParams, "__module__": __name__, "__qualname__": name})
            self._lr_minted[key] = cls
        return cls


def lowrank_epilogue(**kwargs):
    """``quack.epilogue.frontend.gemm_epilogue`` with the low-rank MMA in the accumulator."""

    def wrap(fn):
        return LowRankEpiMod(fn, **kwargs)

    return wrap
