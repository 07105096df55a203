"""Tensor-parallel sharding of ``SVDQW4A4Linear`` (torch.distributed; any backend: NCCL, gloo).

Column sharding splits N: each rank keeps its rows of ``qweight``, ``wscales``, ``proj_up``,
``wcscale`` and ``bias``; ``smooth`` and ``proj_down`` are replicated; rank r computes ``y[:, N_r]`` from the
same activation codes and weight rows as the unsharded layer, in either mode (the low-rank product's summation
order may differ: within the contract).

Row sharding splits K on 16-aligned boundaries, so no activation block straddles two ranks and the
activation codes are those of the unsharded layer: each rank keeps its columns of ``qweight``,
``wscales``, ``smooth`` and ``proj_down`` (``proj_up`` and ``wcscale`` are replicated) and computes
``(Q(xs_r) (*) Qw_r) * wcscale + (xs_r @ proj_down_r) @ proj_up^T``, plus ``bias`` on rank 0 only; the
sum over ranks is the unsharded ``y`` up to FP32 summation order. ``RowParallelW4A4`` all-reduces it, in fp32:
each rank's partial is rounded to a 16-bit input's dtype once (the layer's output), so in bf16 / fp16 the sum
carries one rounding per rank, which can exceed the contract's tolerance where the partials cancel; fp32 inputs
keep it. Row shards run the exact mode: the fast mode's per-token activation scale and per-row weight normalizer
are maxima over all of K, which a K-slice does not see (a layer set to "fast" is refused).

A shard keeps the layer's mode (row: exact), backend preference and name (``name_layers``, with its part). Its
``state_dict`` holds its slices under the local layer's keys, not the full checkpoint.

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


def _settings(part: SVDQW4A4Linear, kind: str, rank: int, world: int, src: SVDQW4A4Linear | None = None):
    """Carry ``src``'s own mode (a row shard: exact), backend preference and name to its shard ``part``."""
    mode = None if src is None else src.__dict__.get("_mode")
    if kind == ROW:
        mode = "exact"  # also over $SVDQ_LINEAR_MODE and "auto", which picks the fast mode on Hopper
    part.set_mode(mode)
    if src is not None:
        part._backend_pref = src._backend_pref
        name = getattr(src, "layer_name", None)
        if name:
            part.layer_name = f"{name}[{kind} {rank}/{world}]"
    return part


def shard(module: SVDQW4A4Linear, kind: str, rank: int, world: int) -> SVDQW4A4Linear:
    """This rank's part of ``module`` (copies of the slices; the original is untouched)."""
    parts = _slices(kind, module.out_features, module.in_features, rank, world)
    if kind == ROW and module.__dict__.get("_mode") == "fast":
        raise ValueError("a layer set to the fast mode does not row-shard: its per-token activation scale and "
                         "per-row weight normalizer are maxima over all of K; set_mode('exact') to row-shard it")
    tensors = {}
    for name, index in parts.items():
        t = getattr(module, name)
        if t is None or index == "drop":
            continue
        tensors[name] = (t if index is None else t[index]).detach().clone()
    return _settings(_build(tensors, module.rank, module.proj_up.dtype), kind, rank, world, module)


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
    return _settings(_build(tensors, r, torch_dtype), kind, rank, world)


class RowParallelW4A4(nn.Module):
    """A row-sharded layer: takes this rank's input columns, returns the full output (all-reduced)."""

    def __init__(self, local: SVDQW4A4Linear, group=None):
        super().__init__()
        self.local, self.group = local, group

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        y = self.local(x_local)
        acc = y.float()  # summed in fp32 and rounded once (no fp16 overflow of a partial sum); y itself when fp32
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=self.group)
        return acc.to(y.dtype)


class ColumnParallelW4A4(nn.Module):
    """A column-sharded layer: full input, this rank's output columns (``gather=True``: all of them)."""

    def __init__(self, local: SVDQW4A4Linear, gather: bool = False, group=None):
        super().__init__()
        self.local, self.gather, self.group = local, gather, group
        self._sizes: list[int] | None = None  # every rank's output columns, asked once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if not self.gather:
            return y
        if self._sizes is None:
            sizes = torch.zeros(dist.get_world_size(self.group), dtype=torch.int64, device=y.device)
            sizes[dist.get_rank(self.group)] = y.shape[-1]
            dist.all_reduce(sizes, group=self.group)
            self._sizes = sizes.tolist()
        width = max(self._sizes)
        # equal sizes for every rank (gloo's all_gather takes no other): uneven shares are padded, then cut
        y = y.contiguous() if y.shape[-1] == width else torch.nn.functional.pad(y, (0, width - y.shape[-1]))
        parts = [torch.empty_like(y) for _ in self._sizes]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat([p[..., :s] for p, s in zip(parts, self._sizes)], dim=-1)
