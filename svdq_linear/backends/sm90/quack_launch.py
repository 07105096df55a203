"""Warm launches of our quack GEMMs with the host work of a call done once per layer.

quack's epilogue frontend (``EpiMod.gemm``) spends ~55 us of host time a call before its launch (the
CI CPU; docs/perf.md, sixth session): the weight operand's views (``resolve_operands``), a plan key
over every tensor's shape, strides and dtype, its checks, then a plan-cache lookup. For a layer's
prepared weight all of that is the same on every call with the same token count. ``launch`` runs
the frontend once per (weight, token count, tile, output dtype, epilogue, per-call operand widths),
keeps the plan it returns and the weight's operand views, and afterwards calls
``run_gemm_epi_plan`` with them: what the frontend's own warm path calls, minus the key and views.

A prepared weight (``QuackWeight``, ``FastWeight``) is found again from the tensors a custom op
hands the backend (``weight``): the op passes the prepared tensors themselves, so the object that
holds them comes back by identity. Its operand views (one set per tile over its rows) live on it and
go when the layer's prepared state goes; plans hold no tensors and are kept per shape for all
layers (as quack's own plan cache does). A tensor list that is not a registered weight's gets a
fresh object and the frontend's path.
"""

from __future__ import annotations

import weakref

import torch
from quack.gemm_runtime.host import run_gemm_epi_plan
from quack.operand_transform.host import as_transform_mod

from ..._env import switch

_WEIGHTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(blob) -> prepared weight
# off ("0"): every call through the frontend (for measuring the difference; read per call)
ENV_WARM = "SVDQ_SM90_QUACK_WARM"


_PLANS: dict[tuple, object] = {}  # shape key -> quack's plan (no tensors: shared by every layer of a shape)


def register(w):
    """Make ``w`` (a prepared weight with ``tensors()``, ``blob`` and a ``warm`` dict) findable by
    ``weight``; returns it. Not while torch.compile traces (a preparation traced into a graph: its
    weight is a new object on every call, and dynamo cannot trace the weak registry)."""
    if not torch.compiler.is_compiling():
        _WEIGHTS[id(w.blob)] = w
    return w


def weight(cls, tensors):
    """The registered weight whose ``tensors()`` are exactly these objects, or a ``cls(*tensors)`` that
    caches nothing (``warm = None``: other tensors each call, e.g. copies a graph capture made)."""
    w = _WEIGHTS.get(id(tensors[0]))
    if w is not None and all(a is b for a, b in zip(w.tensors(), tensors)):
        return w
    w = cls(*tensors)
    w.warm = None
    return w


def launch(mod, w, sf, a, out, epi_args: dict, transform, *, tile_m: int, tile_n: int, tile_k: int,
           max_swizzle_size: int = 8, launch: bool = True) -> None:
    """``mod.gemm(a, w.blob, out, ...)`` (cluster 1 x 1, no split-K) with the host work cached: the plan
    per shape (``_PLANS``), the weight's operand views per tile on ``w.warm``. Calls whose per-call
    tensors (``a``, ``out`` and the epilogue operands that are not the weight's) are not contiguous,
    unregistered weights and compile-only calls take the frontend's path."""
    key = None
    if launch and w.warm is not None and switch(ENV_WARM) is not False:
        own = {id(t) for t in w.tensors()}
        per_call = [(name, t) for name, t in epi_args.items() if id(t) not in own]
        tensors = [t for _, t in per_call if isinstance(t, torch.Tensor)]
        if a.is_contiguous() and out.is_contiguous() and all(t.is_contiguous() for t in tensors):
            # an int (a scalar the kernel takes as an immediate parameter) keys by its type: the plan passes
            # the value at each call
            key = (id(mod), tuple(w.blob.shape), tuple(a.shape), a.dtype, out.dtype, tile_m, tile_n, a.device,
                   tuple((name, tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else (name, type(t))
                         for name, t in per_call))
            plan, views = _PLANS.get(key), w.warm.get(tile_m)
            if plan is not None and views is not None:
                run_gemm_epi_plan(plan, views, a, out, None, epi_args)
                return
    plan = mod.gemm(a, w.blob, out, epi_args=epi_args, transform_a=transform, transform_sf=sf, tile_M=tile_m,
                    tile_N=tile_n, tile_K=tile_k, cluster_M=1, cluster_N=1, max_swizzle_size=max_swizzle_size,
                    split_k=1, _launch=launch)
    if key is not None:
        _PLANS[key] = plan
        if tile_m not in w.warm:
            w.warm[tile_m] = as_transform_mod(transform).resolve_operands(a, w.blob, sf, tile_m, tile_k).a_slot
