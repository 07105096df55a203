"""Tensor-parallel sharding of ``SVDQW4A4Linear`` (torch.distributed; any backend: NCCL, gloo).

Column sharding splits N: each rank keeps its rows of ``qweight``, ``wscales``, ``proj_up``,
``wcscale`` and ``bias``; ``smooth`` and ``proj_down`` are replicated; rank r computes ``y[:, N_r]``
exactly as the unsharded layer does.

Row sharding splits K on 16-aligned boundaries, so no activation block straddles two ranks and the
activation codes are those of the unsharded layer: each rank keeps its columns of ``qweight``,
``wscales``, ``smooth`` and ``proj_down`` (``proj_up`` and ``wcscale`` are replicated) and computes
``(Q(xs_r) (*) Qw_r) * wcscale + (xs_r @ proj_down_r) @ proj_up^T``, plus ``bias`` on rank 0 only; the
sum over ranks is the unsharded ``y`` up to FP32 summation order. ``RowParallelW4A4`` all-reduces it.

``load_shard`` reads only a rank's slice of each tensor from a safetensors file (``get_slice``), so
no rank materialises the whole layer. diffusers' own tensor-parallel plans refuse quantized models
(0.42); wiring these rules into them, and context parallelism, need a machine of several GPUs.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import nvfp4
from .linear import SVDQW4A4Linear

COLUMN, ROW = "column", "row"


def shard_bounds(size: int, rank: int, world: int, align: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank's share of ``size`` in multiples of ``align`` (the last ranks get less)."""
    if size % align:
        raise ValueError(f"expected a size divisible by {align} to shard, got {size}")
    units = size // align
    if units < world:
        raise ValueError(f"cannot shard {size} ({units} units of {align}) over {world} ranks")
    per, extra = divmod(units, world)
    lo = rank * per + min(rank, extra)
    return lo * align, (lo + per + (rank < extra)) * align


def _slices(kind: str, n: int, k: int, rank: int, world: int) -> dict[str, tuple[slice, ...] | None]:
    """Per tensor name, the index of this rank's part (None: replicated; "drop": not on this rank)."""
    if kind == COLUMN:
        lo, hi = shard_bounds(n, rank, world, 1)
        rows = (slice(lo, hi),)
        return {"qweight": rows, "wscales": rows, "proj_up": rows, "wcscale": rows, "bias": rows,
                "smooth": None, "proj_down": None}
    if kind == ROW:
        lo, hi = shard_bounds(k, rank, world, nvfp4.BLOCK_SIZE)
        return {"qweight": (slice(None), slice(lo // 2, hi // 2)),
                "wscales": (slice(None), slice(lo // 16, hi // 16)),
                "smooth": (slice(lo, hi),), "proj_down": (slice(lo, hi),),
                "proj_up": None, "wcscale": None, "bias": None if rank == 0 else "drop"}
    raise ValueError(f"expected kind {COLUMN!r} or {ROW!r}, got {kind!r}")


def _build(tensors: dict[str, torch.Tensor], rank_dim: int, dtype) -> SVDQW4A4Linear:
    n, k = tensors["qweight"].shape[0], tensors["qweight"].shape[1] * 2
    m = SVDQW4A4Linear(k, n, rank=rank_dim, bias="bias" in tensors, device="meta", dtype=dtype)
    m.load_state_dict(tensors, strict=True, assign=True)
    return m


def shard(module: SVDQW4A4Linear, kind: str, rank: int, world: int) -> SVDQW4A4Linear:
    """This rank's part of ``module`` (copies of the slices; the original is untouched)."""
    parts = _slices(kind, module.out_features, module.in_features, rank, world)
    tensors = {}
    for name, index in parts.items():
        t = getattr(module, name)
        if t is None or index == "drop":
            continue
        tensors[name] = (t if index is None else t[index]).detach().clone()
    return _build(tensors, module.rank, module.proj_up.dtype)


def load_shard(path: str | Path, prefix: str, kind: str, rank: int, world: int,
               device: torch.device | str = "cpu") -> SVDQW4A4Linear:
    """This rank's part of the layer ``prefix`` in a safetensors file, reading only its slices."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device=str(device)) as f:
        keys = set(f.keys())
        missing = [f"{prefix}.{n}" for n in ("qweight", "wscales", "smooth", "proj_down", "proj_up", "wcscale")
                   if f"{prefix}.{n}" not in keys]
        if missing:
            raise KeyError(f"{path}: missing tensors {missing}")
        n_out, half_k = f.get_slice(f"{prefix}.qweight").get_shape()
        r = f.get_slice(f"{prefix}.proj_down").get_shape()[1]
        dtype = f.get_slice(f"{prefix}.proj_up").get_dtype()
        tensors = {}
        for name, index in _slices(kind, n_out, 2 * half_k, rank, world).items():
            key = f"{prefix}.{name}"
            if key not in keys or index == "drop":
                continue
            sl = f.get_slice(key)
            tensors[name] = sl[:] if index is None else sl[index]
    torch_dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype]
    return _build(tensors, r, torch_dtype)


class RowParallelW4A4(nn.Module):
    """A row-sharded layer: takes this rank's input columns, returns the full output (all-reduced)."""

    def __init__(self, local: SVDQW4A4Linear, group=None):
        super().__init__()
        self.local, self.group = local, group

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        y = self.local(x_local)
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y


class ColumnParallelW4A4(nn.Module):
    """A column-sharded layer: full input, this rank's output columns (``gather=True``: all of them)."""

    def __init__(self, local: SVDQW4A4Linear, gather: bool = False, group=None):
        super().__init__()
        self.local, self.gather, self.group = local, gather, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if not self.gather:
            return y
        sizes = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(sizes, y.shape[-1], group=self.group)
        parts = [y.new_empty(*y.shape[:-1], s) for s in sizes]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
