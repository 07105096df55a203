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

The segment table's window is a global load at every work tile's start, and the ``la`` copies' addresses
wait on it. Where a table has at most ``MAX_RUNS`` runs (every table the Flux and SD3.5 layers get: one run
for a dense branch, three or four for fused q/k/v and a single block's fused input), the prepared
table is registered with its runs packed into two 32-bit words (``register_runs``), which the launch passes
as kernel parameters (``lb``, ``lw``): the window is then a few integer compares, no load. Other tables
(and tensors the registry does not know, e.g. a graph capture's copies) keep the load.

``prefetch_vecs`` epilogues also move the per-row vectors (``wcscale``, ``bias``; the fast mode's ``sa``
and ``cs``) from the epilogue's start, where quack's ``VecLoad`` issues their ``cp.async`` copies and waits
for them at once, to the work tile's start beside the low-rank copies: their latency then falls under the
K-loop too. The epilogue builds the same shared-memory views without the copies and waits for them only
where the low-rank MMA has not already waited.
"""

from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
import torch
from cutlass import BFloat16, Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.experimental import primitives as prims
from cutlass.utils import LayoutEnum
from quack import copy_utils
from quack import sm90_utils as quack_sm90_utils
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.epilogue.frontend import EpiMod
from quack.epilogue.ops import ColVecLoad, EpiContext, EpiOp, EpiSmemBytes, RowVecLoad, Scalar
from quack.gemm_runtime.identity import TORCH_OP_EPI_MODS

from ..._env import switch

_SMEM_ALIGN = 1024  # a 128-byte swizzle atom repeats every 1024 bytes
MAX_RUNS = 4  # runs of one window a packed segment table holds (q, k, v and a single block's mlp)
_BOUND_BITS, _WINDOW_BITS = 10, 4  # a run's first 64-row group (< 1023), its window (< 16)
_NO_BOUND = (1 << _BOUND_BITS) - 1  # an unused run starts past every group


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


def pack_runs(segments) -> tuple[int, int] | None:
    """A segment table (``[N / 64]`` windows, a sequence of ints) as two words ``(lb, lw)``: the first 64-row
    group of runs 1..3 in ``lb``'s 10-bit fields (``_NO_BOUND`` where there is no such run) and the windows of
    runs 0..3 in ``lw``'s 4-bit fields; ``run_window`` reads a group's window back. None where the table has
    more than ``MAX_RUNS`` runs, 1023 groups or more, or a window outside 0..15 (the table is used then)."""
    segments = [int(v) for v in segments]
    if not segments or len(segments) >= _NO_BOUND:
        return None
    starts, windows = [], []
    for g, v in enumerate(segments):
        if not windows or v != windows[-1]:
            starts.append(g)
            windows.append(v)
    if len(windows) > MAX_RUNS or not all(0 <= v < 1 << _WINDOW_BITS for v in windows):
        return None
    bounds = starts[1:] + [_NO_BOUND] * (MAX_RUNS - len(starts))
    windows += [0] * (MAX_RUNS - len(windows))
    lb = sum(b << (_BOUND_BITS * i) for i, b in enumerate(bounds))
    lw = sum(v << (_WINDOW_BITS * i) for i, v in enumerate(windows))
    return lb, lw


def run_window(lb: int, lw: int, g: int) -> int:
    """The window of 64-row group ``g`` under ``pack_runs``' words: what the kernel computes."""
    mask = (1 << _BOUND_BITS) - 1
    run = sum(g >= (lb >> (_BOUND_BITS * i)) & mask for i in range(MAX_RUNS - 1))
    return (lw >> (_WINDOW_BITS * run)) & ((1 << _WINDOW_BITS) - 1)


_RUNS: dict[int, tuple] = {}  # id(segment table) -> (weakref to it, (lb, lw))


def register_runs(segments: torch.Tensor) -> tuple[int, int] | None:
    """Pack a prepared segment table (``pack_runs``; reads it to the host once) and remember the words for
    ``runs_for``. Call where the table is made, not inside a graph capture."""
    packed = pack_runs(segments.tolist())
    if packed is not None:
        key = id(segments)
        _RUNS[key] = (weakref.ref(segments, lambda _r, key=key: _RUNS.pop(key, None)), packed)
    return packed


def runs_for(segments: torch.Tensor | None) -> tuple[int, int] | None:
    """The packed words ``register_runs`` made for this very tensor, or None."""
    entry = None if segments is None else _RUNS.get(id(segments))
    return entry[1] if entry is not None and entry[0]() is segments else None


class LowRankRunWord(Scalar):
    """``lb`` / ``lw``: a packed segment table's words (``pack_runs``), kernel parameters the low-rank
    prefetch reads; the fn frontend never sees them."""

    fn_port = None

    def __init__(self, name: str):
        super().__init__(name, Int32)


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
    _pf = None
    _prefetch_vecs = False  # set on the classes a ``prefetch_vecs`` epilogue mints

    def epi_get_smem_tensors(self, params, storage):
        tensors = super().epi_get_smem_tensors(params, storage)
        # trace time: the kernel's prologue runs this for every warp, so the values dominate the
        # work-tile loop where lowrank_prefetch and epi_visit_acc read them
        self._lr = (params, tensors) if tensors.get("lu") is not None and tensors.get("la") is not None else None
        # quack's own row / column vector loads only (a subclass may load otherwise), dense (no varlen)
        vecs = tuple(op for op in self._epi_ops if type(op) in (RowVecLoad, ColVecLoad)) if self._prefetch_vecs else ()
        if vecs:
            # the epilogue will read what the work tile's start copied: the seam that copies must be there
            assert self.mma_is_rs and isinstance(self.transform_a, LowRankTransformHook), \
                "prefetched epilogue vectors need the LowRankTransformHook operand transform"
            assert not getattr(self, "varlen_m", False), "prefetched epilogue vectors are dense vectors"
        self._pf = (params, tensors, vecs) if vecs else None
        return tensors

    @cute.jit
    def _prefetch_vec(self, op, param, smem, tile_coord_mnkl, tidx, nthreads):
        """``op``'s slice for this work tile into its shared memory: the copies ``VecLoad.begin`` issues (a
        dense vector, no varlen), each math thread its share."""
        dtype = param.element_type
        thr_copy = copy_utils.tiled_copy_1d(dtype, nthreads, max(32, dtype.width) // dtype.width,
                                            is_async=True).get_slice(tidx)
        vec = param
        if const_expr(cute.rank(param) == 2):
            vec = param[tile_coord_mnkl[3], None]
        tile_dim = self.cta_tile_shape_mnk[op.dim]
        coord = tile_coord_mnkl[op.dim]
        tVgV = thr_copy.partition_S(cute.local_tile(vec, (tile_dim,), (coord,)))
        tVsV = thr_copy.partition_D(smem)
        tVcV = thr_copy.partition_S(cute.make_identity_tensor(tile_dim))
        limit = min(cute.size(vec, mode=[0]) - coord * tile_dim, tile_dim)
        for m in cutlass.range(cute.size(tVsV.shape[1]), unroll_full=True):
            if tVcV[0, m] < tile_dim:
                pred = cute.make_rmem_tensor(1, Boolean)
                pred[0] = tVcV[0, m] < limit
                cute.copy(thr_copy, tVgV[None, m], tVsV[None, m], pred=pred)

    def epi_begin(self, params, epi_smem_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl,
                  varlen_manager, epilogue_barrier, tidx, tRS_rD_layout=None):
        """quack's ``epi_begin``, except for the prefetched vectors: their views without the copies, and one
        wait for them where the low-rank MMA did not wait already (``epi_visit_acc``)."""
        if const_expr(self._pf is None):
            return super().epi_begin(params, epi_smem_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
                                     tile_coord_mnkl, varlen_manager, epilogue_barrier, tidx, tRS_rD_layout)
        ctx = EpiContext(self, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl, varlen_manager,
                         epilogue_barrier, tidx, tRS_rD_layout)
        names = {op.name for op in self._pf[2]}
        results = {op.name: (_vec_views(op, self, epi_smem_tensors.get(op.name), ctx) if op.name in names
                             else op.begin(self, getattr(params, op.name), epi_smem_tensors.get(op.name), ctx))
                   for op in self._epi_ops}
        others = any(op.needs_async_fence() for op in self._epi_ops if op.name not in names)
        if const_expr(others):
            cute.arch.cp_async_commit_group()
        if const_expr(others or self._lr is None):
            cute.arch.cp_async_wait_group(0)
            epilogue_barrier.arrive_and_wait()
        return results

    @cute.jit
    def _window(self, params, tile_coord_mnkl):
        """The ``la`` window of this work tile's weight rows: from the packed words (no load), the table, or 0."""
        window = Int32(0)
        g = tile_coord_mnkl[0] * (self.cta_tile_shape_mnk[0] // 64)
        if const_expr(params.lb is not None):
            lb, lw = Int32(params.lb), Int32(params.lw)
            mask = (1 << _BOUND_BITS) - 1
            window = lw & ((1 << _WINDOW_BITS) - 1)
            for i in cutlass.range_constexpr(MAX_RUNS - 1):  # the bounds increase: the last run passed wins
                if g >= (lb >> (_BOUND_BITS * i)) & mask:
                    window = (lw >> (_WINDOW_BITS * (i + 1))) & ((1 << _WINDOW_BITS) - 1)
        elif const_expr(params.ls is not None):  # the weight tile's segment (tiles never straddle two)
            window = params.ls[g]
        return window

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
        """Math warps, at a work tile's start: cp.async the tile's prefetched vectors and its ``lu`` and
        ``la`` rows (rows past the tensor are left as they are: they only feed outputs that are never
        stored), in one group."""
        if const_expr(self._lr is not None or self._pf is not None):
            if const_expr(self.use_pdl):
                # la (and the fast mode's sa) is the grid before's output (the activation pass, which may let
                # this grid start before it ends: kernels.quantize_act_after_lora). Quack's producer waits for
                # that grid before its first load; these copies run before the K-loop, so they wait too (at
                # once after the first tile).
                prims.griddepcontrol(prims.GridDepAction.WAIT)
            tidx, _, _ = cute.arch.thread_idx()
            nthreads = self.mma_warp_groups * self.num_threads_per_warp_group
            if const_expr(self._pf is not None):
                # the vectors' copies split over the epilogue's threads
                assert nthreads == self.num_epi_warps * cute.arch.WARP_SIZE
                pf_params, pf_tensors, vecs = self._pf
                for op in vecs:
                    self._prefetch_vec(op, getattr(pf_params, op.name), pf_tensors[op.name], tile_coord_mnkl, tidx,
                                       nthreads)
            if const_expr(self._lr is not None):
                params, tensors = self._lr
                w = cute.size(params.lu, mode=[1])
                window = self._window(params, tile_coord_mnkl)
                for name, dim in (("lu", 0), ("la", 1)):
                    mX = getattr(params, name)
                    sX = tensors[name]
                    rows = self.cta_tile_shape_mnk[dim]
                    per_row, rows_per_pass = copy_split(rows, w, nthreads)
                    nthr = rows_per_pass * per_row
                    thr_copy = copy_utils.tiled_copy_2d(BFloat16, per_row, nthr, _VEC,
                                                        is_async=True).get_slice(tidx % nthr)
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


def _vec_views(op, gemm, smem, ctx):
    """What ``VecLoad.begin`` returns for ``op`` (its shared-memory slice seen by the epilogue, and the
    register fragment ``begin_loop`` fills), without its copies: they were issued at the work tile's start."""
    tDsV = ctx.partition_for_epilogue_fn(
        cute.make_tensor(smem.iterator, cute.make_layout((ctx.tile_M, ctx.tile_N), stride=op._broadcast_stride())))
    if const_expr(ctx.tiled_copy_t2r is not None):
        tDsV = ctx.tiled_copy_r2s.retile(tDsV)
    tDsV_sub = cute.group_modes(tDsV, 3, cute.rank(tDsV))[None, None, None, 0]
    return [tDsV, cute.make_rmem_tensor(tDsV_sub.layout, gemm.acc_dtype)]


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

    def __init__(self, fn, prefetch_vecs: bool = True, **kwargs):
        # the same epilogue with the vectors loaded at its start, as quack does (``ENV_PREFETCH`` = "0": measuring)
        self.at_epilogue = LowRankEpiMod(fn, prefetch_vecs=False, **kwargs) if prefetch_vecs else self
        extra = tuple(kwargs.pop("extra_ops", ())) + (LowRankOperand("lu", 0), LowRankOperand("la", 1),
                                                      LowRankSegments("ls"), LowRankRunWord("lb"),
                                                      LowRankRunWord("lw"))
        super().__init__(fn, extra_ops=extra, **kwargs)
        self.prefetch_vecs = prefetch_vecs
        TORCH_OP_EPI_MODS.pop(self.semantic_digest, None)
        # the mixin's code, and whether it prefetches the vectors, are part of what the compiled kernels mean
        self.semantic_digest = hashlib.sha256(
            (self.semantic_digest + source_digest() + f"prefetch_vecs={prefetch_vecs}").encode()).hexdigest()
        self._ident = f"{fn.__name__}_{self.semantic_digest[:16]}"
        TORCH_OP_EPI_MODS[self.semantic_digest] = self
        self._lr_minted = {}

    def chosen(self) -> "LowRankEpiMod":
        """This mod, or its ``at_epilogue`` form where ``ENV_PREFETCH`` is off (read per call)."""
        return self.at_epilogue if switch(ENV_PREFETCH) is False else self

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
                       {"EpilogueParams": base.EpilogueParams, "__module__": __name__, "__qualname__": name,
                        "_prefetch_vecs": self.prefetch_vecs})
            self._lr_minted[key] = cls
        return cls


def lowrank_epilogue(**kwargs):
    """``quack.epilogue.frontend.gemm_epilogue`` with the low-rank MMA in the accumulator (and, unless
    ``prefetch_vecs=False``, the per-row vectors prefetched at the work tile's start)."""

    def wrap(fn):
        return LowRankEpiMod(fn, **kwargs)

    return wrap


def lowrank_args(lr_acc) -> dict:
    """The epilogue arguments of ``lr_acc = (lu, la[, segments])``: the segment table as its registered
    words (``register_runs``) where it has them and ``ENV_RUNS`` is not off, else the table itself."""
    args = dict(zip(("lu", "la", "ls"), lr_acc))
    words = runs_for(args.get("ls")) if switch(ENV_RUNS) is not False else None
    if words is not None:
        del args["ls"]
        args["lb"], args["lw"] = words
    return args


ENV_RUNS = "SVDQ_SM90_LR_RUNS"  # off ("0"): the segment table's load at every tile (for measuring the words)
ENV_PREFETCH = "SVDQ_SM90_EPI_PREFETCH"  # off ("0"): the per-row vectors loaded at the epilogue's start (measuring)
