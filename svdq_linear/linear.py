"""The 4-bit linear modules: ``SVDQW4A4Linear`` (W4A4 + low-rank) and ``NVFP4W4A16Linear`` (weight-only).

Both hold the weight as packed NVFP4 (``qweight``/``wscales``) with a float32 per-output-channel
``wcscale``; neither subclasses ``nn.Linear`` (diffusers' layer-wise casting hooks would touch it).
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Callable, ClassVar

import torch
from torch import nn

from . import backends, nvfp4
from ._env import getenv, switch
from .svdquant import SVDQuantConfig, SVDQuantWeights, svdquant, weight_only


ENV_MODE = "SVDQ_LINEAR_MODE"
MODES = ("exact", "fast", "auto")

W4A4, W4A16 = "w4a4", "w4a16"
"""What a target linear becomes: ``SVDQW4A4Linear`` or ``NVFP4W4A16Linear`` (recipes, configs, stats)."""

FIXED_DTYPES: dict[str, torch.dtype] = {
    "qweight": torch.uint8,  # E2M1 codes, two per byte
    "wscales": torch.float8_e4m3fn,  # block scales
    "wcscale": torch.float32,  # ~1e-5 for typical weights: subnormal in fp16
    "smooth": torch.float32,
}
"""Tensors kept in one dtype whatever ``.to(dtype)`` or a loader's ``dtype`` asks, and stored so in
checkpoints; the others (``proj_down``, ``proj_up``, ``bias``) follow the module's float dtype."""

ENV_CHECK_RANGE = "SVDQ_LINEAR_CHECK_RANGE"
# Read once, at import: off, the check is a constant False that torch.compile folds away.


def _flag(name: str) -> bool:
    """An on/off environment variable (``_env.switch``: 1/true/yes/on or 0/false/no/off, any case; unset, empty or
    "auto": off)."""
    return switch(name) is True


_CHECK_RANGE = _flag(ENV_CHECK_RANGE)


def set_mode(model: nn.Module, mode: str | None) -> int:
    """Set the numerics mode of every ``SVDQW4A4Linear`` in ``model``; returns how many there are."""
    if mode is not None and mode not in MODES:  # also where the model has none
        raise ValueError(f"expected a mode in {MODES}, got {mode!r}")
    layers = [m for m in model.modules() if isinstance(m, SVDQW4A4Linear)]
    for m in layers:
        m.set_mode(mode)
    return len(layers)


def call_is_wrapped(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs more than its ``forward``: forward (pre-)hooks, global ones, or a ``forward``
    replaced on the instance (accelerate's and diffusers' hooks: offload, attention caches, layer skip)."""
    return bool("forward" in module.__dict__ or module._forward_hooks or module._forward_pre_hooks
                or nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def reset_prepared(model: nn.Module, reprepare: bool = True) -> int:
    """Drop the prepared state (a backend's repacked weights) of every 4-bit layer of ``model`` that has one, and
    bring back the canonical tensors it stood in for; returns how many layers had one.

    Prepared states follow ``.to()`` and ``load_state_dict`` by themselves, and an eager call sees an in-place edit
    of a layer's tensors. Call this after edits they cannot see: through ``.data`` (which PyTorch does not count as
    an edit), or while a compiled model holds the old state (a compiled graph reads the prepared state without
    checking it). With ``reprepare`` (the default) a layer gets a new state now, for the input dtype of its last
    one, and a compiled graph retraces once onto it. ``reprepare=False`` leaves the canonical tensors in place until
    the next call: for a tool that reads ``parameters()`` directly after a first call."""
    count = 0
    for m in model.modules():
        if isinstance(m, _PackedNVFP4Linear) and m.__dict__.get("_dispatch_cache"):
            m._reset_dispatch(reprepare=reprepare)
            count += 1
    return count


def name_layers(model: nn.Module) -> int:
    """Record each 4-bit layer's qualified name in ``layer_name`` (warnings name it); returns the count."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, _PackedNVFP4Linear):
            module.layer_name = name
            count += 1
    return count


def _autocast_inputs(*ts: torch.Tensor | None) -> tuple:
    """The layer's inputs as autocast hands them to ``nn.Linear``: inside an autocast region for their device, a
    16- or 32-bit float input is cast to the region's dtype (the result comes back in it too). Outside one, or on
    a device autocast does not know, the inputs as given. The layer's steps after the cast run with autocast off
    (``backends._no_autocast``): the written adaLN norm and GELU concatenation are computed outside the ops, where
    CUDA autocast would run the norm in fp32 and hand the kernels an fp32 input."""
    if not torch._C._is_any_autocast_enabled():
        return ts
    dtype = backends.autocast_dtype(next(t for t in ts if t is not None).device.type)
    if dtype is None:
        return ts
    return tuple(t.to(dtype) if t is not None and t.dtype in (torch.float32, torch.float16, torch.bfloat16) else t
                 for t in ts)


def _check_plain_linear(linear, name: str | None = None) -> None:
    """An ``nn.Linear`` whose product is ``F.linear``: a subclass with its own ``forward`` (a LoRA wrapper, another
    quantizer's layer) would lose that behaviour silently when its weight is quantized."""
    where = f"{name}: " if name else ""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{where}expected an nn.Linear, got {type(linear).__name__}")
    if type(linear).forward is not nn.Linear.forward:
        raise TypeError(f"{where}{type(linear).__name__} subclasses nn.Linear with its own forward, which the "
                        f"quantized layer would drop: quantize a plain nn.Linear (merge or remove the wrapper first)")


def _is_int(value) -> bool:
    """An integer that is not a bool (``True`` is an ``int`` in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_16_or_32_bit_float(dtype: torch.dtype) -> bool:
    return dtype in nvfp4.SUPPORTED_ACT_DTYPES


def _check_values(name: str, t: torch.Tensor, key: str) -> None:
    """Values a loader must refuse: they would turn every output they touch into NaN or Inf."""
    # smooth: the input is divided by it. wcscale: each output row's scale, positive by construction (a row's
    # maximum / 2688, times a power of two); a 0 or a negative one from an edited checkpoint gives finite, wrong
    # outputs, and the Blackwell kernel, which folds proj_up / wcscale, declines a layer with a 0.
    what = {"smooth": "smoothing factors", "wcscale": "per-row weight scales"}.get(name)
    if what is not None:
        bad = ~(torch.isfinite(t) & (t > 0))
        if bad.any():
            counts = {"zero": int((t == 0).sum()), "negative": int((t < 0).sum()),
                      "NaN": int(torch.isnan(t).sum()), "Inf": int(torch.isinf(t).sum())}
            first = int(bad.nonzero()[0, 0])
            got = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
            raise ValueError(f"{key}: expected finite positive {what}, got {got} "
                             f"(first at index {first}: {t[first].item()})")
    elif name in ("bias", "proj_down", "proj_up") and t.is_floating_point() and not torch.isfinite(t).all():
        bad = ~torch.isfinite(t)
        raise ValueError(f"{key}: expected finite values, got {int(bad.sum())} NaN or Inf (first at index "
                         f"{bad.nonzero()[0].tolist()}): every output it touches would be NaN or Inf")
    elif name == "wscales":  # E4M3 has one NaN, S.1111.111
        nan = (t.view(torch.uint8) & 0x7F) == nvfp4.E4M3_NAN_BYTE
        if nan.any():
            first = nan.nonzero()[0].tolist()
            raise ValueError(f"{key}: expected finite E4M3 block scales, got {int(nan.sum())} NaN scale bytes "
                             f"(0x7F/0xFF; first at [row, block] = {first})")


class _PackedNVFP4Linear(nn.Module):
    """Shared by the 4-bit modules: packed buffers, dtype rules, state_dict checks, backend choice.

    Subclasses declare ``kind`` (the backend entry point) and extend ``_expected_shapes`` (tensor
    name -> shape); the tensors named in ``FIXED_DTYPES`` keep that dtype, the others the module's.
    """

    kind: ClassVar[str]

    @property
    def _fixed_dtypes(self) -> dict[str, torch.dtype]:
        return {name: FIXED_DTYPES[name] for name in self._expected_shapes() if name in FIXED_DTYPES}

    def __init__(self, in_features: int, out_features: int, bias: bool, device, dtype):
        super().__init__()
        if in_features <= 0 or in_features % nvfp4.BLOCK_SIZE:
            raise ValueError(
                f"expected in_features to be a positive multiple of {nvfp4.BLOCK_SIZE}, got {in_features}"
            )
        if out_features <= 0:
            raise ValueError(f"expected out_features > 0, got {out_features}")
        dtype = dtype or torch.get_default_dtype()
        if not _is_16_or_32_bit_float(dtype):
            raise TypeError(f"expected a float16/bfloat16/float32 module dtype, got {dtype}")
        self.in_features, self.out_features = in_features, out_features
        n, k = out_features, in_features
        self._set("qweight", torch.zeros(n, k // 2, dtype=FIXED_DTYPES["qweight"], device=device))
        self._set("wscales", torch.zeros(n, k // nvfp4.BLOCK_SIZE, dtype=FIXED_DTYPES["wscales"], device=device))
        self._set("wcscale", torch.ones(n, dtype=FIXED_DTYPES["wcscale"], device=device))
        self._set("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)
        self._backend_pref: str | None = None
        self._reset_dispatch()
        backends.LIVE_LAYERS.add(self)
        # the class function with the module passed in: a bound method would make a reference cycle, and a
        # dropped layer would stay alive (and in backends.LIVE_LAYERS) until the garbage collector ran
        self._register_load_state_dict_pre_hook(type(self)._check_state_dict, with_module=True)
        self.register_load_state_dict_post_hook(type(self)._after_load)

    def _set(self, name: str, t: torch.Tensor | None) -> None:
        """Store ``t`` as a frozen parameter: offload hooks move parameters (not always buffers)."""
        self._parameters[name] = None if t is None else nn.Parameter(t, requires_grad=False)

    def packed_tensors(self) -> list[torch.Tensor]:
        """The module's tensors in a fixed order (the dispatch cache keys on them)."""
        return [t for t in self._parameters.values() if t is not None]

    # ---- stand-ins: canonical tensors that a cached prepared state holds in its own layout ---------

    def _stand_in(self, rebuild: dict[str, Callable[[], torch.Tensor]]) -> None:
        """Free the canonical tensors that the prepared state just cached also holds in its kernel's
        layout, so the weight is not on the device twice. ``rebuild[name]()`` gives a tensor back bit for
        bit; ``_restore`` runs it before anything reads the tensor or the state goes (an attribute read,
        ``state_dict``, ``.to()``, a load, a copy or pickle, another backend or mode)."""
        freed = {}
        for name, fn in rebuild.items():
            p = self._parameters[name]
            self._stood_in[name] = (p, fn)
            freed[name] = p.data.untyped_storage().data_ptr()
            p.data = p.data.new_empty((0,) * p.dim())
        # a fused module (svdq_linear.fuse): the layers it was built from hold row views of these tensors,
        # which would keep the freed storage alive; they stand in too, rebuilt from this module's rows
        for ref, row, n in self.__dict__.get("_view_parts", ()):
            part = ref()
            if part is not None:
                part._drop_views_of(self, row, n, freed)

    def _drop_views_of(self, owner: _PackedNVFP4Linear, row: int, n: int, freed: dict[str, int]) -> None:
        """``owner`` (the fused module this layer's packed rows are views of) freed its canonical tensors
        (``freed``: name -> storage address): free this layer's views of them too, rebuilt on demand from
        rows ``row`` to ``row + n`` of the owner (a view of its canonical tensor, or a copy of the rows when
        that is stood in too). A tensor of the layer's own (loaded or moved since) stays."""
        ours = self.__dict__.setdefault("_owner_rows", {})  # name -> storage of the rows rows() last gave

        def shared(name: str, ptr: int) -> bool:
            p = self._parameters.get(name)
            return (name in ("qweight", "wscales") and p is not None and p.numel() > 0  # what fuse shares
                    and p.data.untyped_storage().data_ptr() in (ptr, ours.get(name)))

        names = [name for name, ptr in freed.items() if shared(name, ptr)]
        if not names:
            return

        def rows(name: str) -> torch.Tensor:
            stood = owner.__dict__.get("_stood_in") or {}
            p = owner._parameters[name]
            if name in stood and stood[name][0] is p and p.numel() == 0:
                t = stood[name][1]()[row:row + n].clone()  # just these rows, not the whole rebuilt weight
            else:
                t = p[row:row + n]
            ours[name] = t.untyped_storage().data_ptr()
            return t

        self._stand_in({name: (lambda name=name: rows(name)) for name in names})

    def _restore(self) -> None:
        stood, self._stood_in = self.__dict__.get("_stood_in") or {}, {}
        for name, (p, fn) in stood.items():
            if self._parameters.get(name) is p and p.numel() == 0:  # not replaced by the user meanwhile
                p.data = fn()

    def __getattr__(self, name: str):
        stood = self.__dict__.get("_stood_in")
        if stood and name in stood:
            self._restore()
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, (p, fn) in (self.__dict__.get("_stood_in") or {}).items():
            if self._parameters.get(name) is p:
                destination[prefix + name] = fn()  # the canonical layout, without keeping it on the device

    def _device(self) -> torch.device:
        return self._parameters["wcscale"].device

    def _check_devices(self, device: torch.device) -> None:
        """Raise unless every tensor is on ``device`` (checked when a state is prepared, not every call). A tensor
        left on ``meta`` (a ``load_state_dict(strict=False, assign=True)`` that missed it) would otherwise give
        garbage: torch multiplies a CPU tensor by a meta one without complaint."""
        off = [f"{name} on {t.device}" for name, t in self._parameters.items() if t is not None and t.device != device]
        if off:
            hint = " (never loaded: a load_state_dict that missed it)" if any("meta" in o for o in off) else ""
            raise RuntimeError(f"{self._describe()}: the input is on {device}, but {', '.join(off)}{hint}")

    def _reset_dispatch(self, reprepare: bool = False) -> None:
        """Drop the prepared state (the tensors changed). With ``reprepare``, a layer that had one gets a
        new one now, for the input dtype it was prepared for: a graph compiled after its first call
        reads the prepared state, and would otherwise recompile after every ``.to()`` or load (each
        trace prepares again, at trace time, with new objects)."""
        # one entry at most (resolve keeps one prepared state a module)
        had = next(iter((self.__dict__.get("_dispatch_cache") or {}).values()), None) if reprepare else None
        self._restore()
        self._dispatch_cache: dict[tuple, backends.PreparedEntry] = {}  # (backend, kind) -> its prepared state
        self._declined: dict[tuple, str | None] = {}  # (backend name, device, kind) -> reason or None
        self._svdq_moved_each_call = False  # set by backends.resolve when an unknown offloader moves the weights
        if had is not None:
            backends.prepare_layer(self, had.dtype)

    def _after_load(self, incompatible_keys) -> None:
        self._reset_dispatch(reprepare=True)

    def _link_parts(self, parts) -> None:
        """``parts``: ``(layer, row, n)``, the layers this fused module was built from (``svdq_linear.fuse``). Point
        each one's packed weight at rows ``row`` to ``row + n`` of this module's (views: the weight is held once),
        and keep weak references to them, so that they free those views when this module stands in."""
        for layer, row, n in parts:
            for name in ("qweight", "wscales"):
                layer._set(name, self._parameters[name][row:row + n])
            layer._reset_dispatch()
        self.__dict__["_view_parts"] = [(weakref.ref(layer), row, n) for layer, row, n in parts]

    def _shares_rows_of(self, owner: _PackedNVFP4Linear, row: int, n: int) -> bool:
        """Whether this layer's packed weight is rows ``row`` to ``row + n`` of ``owner``'s: views of them, or
        the copy of them that ``_drop_views_of`` rebuilt while ``owner`` stood in (checked against the rows)."""
        ours = self.__dict__.get("_owner_rows") or {}
        for name in ("qweight", "wscales"):
            a, b = self._parameters.get(name), owner._parameters.get(name)
            if a is None or b is None or a.device != b.device or a.numel() == 0 or b.dim() != 2:
                return False
            rows = b[row:row + n]
            if a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr():
                if a.stride() != rows.stride() or a.shape != rows.shape or a.storage_offset() != rows.storage_offset():
                    return False
            elif (ours.get(name) != a.untyped_storage().data_ptr() or a.device.type == "meta"
                  or not torch.equal(a, rows)):
                return False
        return True

    def __getstate__(self):
        # Prepared states are derived data: deepcopy and pickle rebuild them on the next call.
        self._restore()
        state = self.__dict__.copy()
        state["_dispatch_cache"], state["_declined"] = {}, {}
        state.pop("_owner_rows", None)
        # a fused module (svdq_linear.fuse): its parts' packed weights are views of its rows; a copy keeps that
        # (deepcopy would clone each view, and the copy would hold q/k/v twice). The weak references go into
        # the state as strong ones (the copy's parts, the same objects its model holds through the memo), those
        # parts still sharing the rows only; they are weak again in the copy.
        parts = []
        for ref, row, n in state.pop("_view_parts", ()):
            part = ref()
            if part is not None:
                part._restore()
                if part._shares_rows_of(self, row, n):
                    parts.append((part, row, n))
        if parts:
            state["_view_parts_state"] = parts
        return state

    def __setstate__(self, state):
        parts = state.pop("_view_parts_state", None)
        super().__setstate__(state)
        if parts:
            self._link_parts(parts)
        backends.LIVE_LAYERS.add(self)  # a copy or an unpickled layer

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        n, k = self.out_features, self.in_features
        return {"qweight": (n, k // 2), "wscales": (n, k // nvfp4.BLOCK_SIZE), "wcscale": (n,), "bias": (n,)}

    def _describe(self) -> str:
        return f"{type(self).__name__}(in_features={self.in_features}, out_features={self.out_features})"

    # ---- dtype/device handling ------------------------------------------------------------------

    def _apply(self, fn, recurse=True):
        self._restore()  # the canonical tensors move, not the stand-ins
        kept = {name: p.data for name, p in self._parameters.items() if p is not None}
        before = {name: kept[name] for name in self._fixed_dtypes}
        super()._apply(fn, recurse)
        cast = {name: p.dtype for name, p in self._parameters.items() if p is not None and name not in before}
        if any(not _is_16_or_32_bit_float(d) for d in cast.values()):  # .double(), .to(torch.float64)
            for name, t in kept.items():
                self._set(name, t)
            got = sorted({str(d) for d in cast.values()})
            raise TypeError(f"{self._describe()} takes float16/bfloat16/float32, not {got}: its 16-bit tensors "
                            f"would not load again")
        device = self.qweight.device
        for name, dtype in self._fixed_dtypes.items():
            if self._parameters[name].dtype != dtype:
                self._set(name, before[name].to(device))
        self._reset_dispatch(reprepare=True)
        return self

    def checked_tensor(self, name: str, t: torch.Tensor, key: str | None = None) -> torch.Tensor:
        """``t`` for tensor ``name`` after the shape, dtype and value checks, in the dtype it is kept in.

        Raises ValueError naming ``key`` (default ``name``) with what was expected and what came. The
        tensors of ``FIXED_DTYPES`` must come in exactly that dtype; ``smooth`` and ``wcscale`` must be finite and
        positive, ``bias``, ``proj_down`` and ``proj_up`` finite, and ``wscales`` must hold no NaN scale (bytes
        0x7F/0xFF). The 16-bit branch tensors
        take the module's dtype, or keep their own when the module is still on ``meta``
        (``load_state_dict(assign=True)``).
        """
        key = key or name
        shapes = self._expected_shapes()
        if name not in shapes:
            raise ValueError(f"{key}: {self._describe()} has no tensor {name!r}")
        if name == "bias" and self.bias is None:
            raise ValueError(f"{key}: {self._describe()} was built with bias=False, but the state_dict has a bias")
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{key}: expected shape {list(shapes[name])} for {self._describe()}, got {list(t.shape)}")
        fixed = self._fixed_dtypes.get(name)
        if fixed is not None and t.dtype != fixed:
            raise ValueError(f"{key}: expected dtype {fixed}, got {t.dtype}")
        if fixed is None and not _is_16_or_32_bit_float(t.dtype):
            raise ValueError(f"{key}: expected a float16/bfloat16/float32 tensor, got {t.dtype}")
        if not t.is_meta:
            _check_values(name, t, key)
        if fixed is not None or self._parameters[name].device.type == "meta":
            return t
        return t.to(self._parameters[name].dtype)

    def _check_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        self._restore()  # the load copies into the canonical tensors
        for name in self._expected_shapes():
            if prefix + name in state_dict:
                state_dict[prefix + name] = self.checked_tensor(name, state_dict[prefix + name], prefix + name)

    # ---- backends -------------------------------------------------------------------------------

    def set_backend(self, name: str | None):
        """Prefer backend ``name`` for this layer (None: the per-device default, or $SVDQ_LINEAR_BACKEND).

        A preference that cannot serve a call (another device, a declined layer or input) warns once
        and falls back to the next backend.
        """
        if name is not None:
            backends.get_backend(name)  # unknown names raise now
        self._backend_pref = name
        return self

    def backend_for(self, x: torch.Tensor) -> str:
        """The name of the backend that would run ``forward(x)``."""
        return backends.choose(self, x.reshape(-1, self.in_features)).name

    @property
    def backend(self) -> str:
        """The backend a call with this layer's dtype on its own device would use."""
        dev = self._device()
        dtype = self.bias.dtype if self.bias is not None else torch.bfloat16
        if dev.type == "meta":
            return backends.select_backend(dev, backends.preferred_name(self), self.kind).name
        return self.backend_for(torch.empty(1, self.in_features, device=dev, dtype=dtype))

    # ---- forward --------------------------------------------------------------------------------

    def _enter_call(self, x: torch.Tensor) -> None:
        """What every call checks and does first (``x``: the input, or its last part for ``forward_cat_gelu``)."""
        if backends.tracing() and x.device.type != "meta":
            # before the trace reads this layer's tensors: the preparation (and its stand-ins) runs eagerly
            backends.prepare_before_trace(x.device.type, x.device.index, str(x.dtype))
        nvfp4.check_act_dtype(x)
        if x.device != self._device():
            raise RuntimeError(f"input is on {x.device} but the {type(self).__name__} is on {self._device()}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"expected input with last dimension {self.in_features}, got shape {tuple(x.shape)}")
        x, = _autocast_inputs(x)
        self._enter_call(x)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        kind = self.kind  # read once a call: it consults the environment
        with backends.device_guard(x2d), backends._no_autocast(x2d):
            backend, prepared = backends.resolve(self, x2d, kind)
            y = backend.linear(self, x2d, prepared, kind)
        return y.reshape(*lead, self.out_features)

    def _repr_backend(self) -> str:
        try:
            return self.backend
        except (ValueError, RuntimeError) as e:  # a bad $SVDQ_LINEAR_BACKEND / $SVDQ_LINEAR_MODE: print the model
            return f"? ({type(e).__name__}: {str(e)[:60]})"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, backend={self._repr_backend()}"
        )


class SVDQW4A4Linear(_PackedNVFP4Linear):
    """``y = x W^T + b`` with W in SVDQuant W4A4 form (NVFP4 residual + rank-R low-rank branch).

    Buffers (N = out_features, K = in_features, R = rank):

    - ``qweight [N, K/2] uint8``: E2M1 codes of the residual, element 2i in the low nibble;
    - ``wscales [N, K/16] float8_e4m3fn``: one scale per 16 consecutive k, row-major;
    - ``smooth [K] float32``: the smoothing factor (input is divided by it);
    - ``proj_down [K, R]``, ``proj_up [N, R]``: the low-rank branch, in the module's float dtype;
    - ``wcscale [N] float32``: per-output-channel scale of the FP4 product;
    - ``bias [N]`` or None, in the module's float dtype.

    ``forward`` accepts any leading dimensions and bf16/fp16/fp32 inputs and returns the input's
    dtype (inside an autocast region, as ``nn.Linear``: the input cast to the region's dtype, the result
    in it). ``.to(dtype)`` casts only ``proj_down``, ``proj_up`` and ``bias``. The kernel is chosen per
    device by ``svdq_linear.backends.select_backend`` (``set_backend`` overrides it); the numerics are
    those of ``svdq_linear.nvfp4.w4a4_linear`` on every backend.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int = 32,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        if not _is_int(rank) or rank < 0:
            raise ValueError(f"expected an integer rank >= 0, got {rank!r}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.rank = rank
        n, k, r, dtype = out_features, in_features, rank, dtype or torch.get_default_dtype()
        self._set("smooth", torch.ones(k, dtype=FIXED_DTYPES["smooth"], device=device))
        self._set("proj_down", torch.zeros(k, r, dtype=dtype, device=device))
        self._set("proj_up", torch.zeros(n, r, dtype=dtype, device=device))

    # ---- numerics mode ---------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"exact"`` (the W4A4 contract), ``"fast"`` (``nvfp4.w4a8_fast_linear``: FP8 tensor cores on
        Hopper) or ``"auto"`` (the default: fast where a GPU kernel serves the fast mode, i.e. sm90 with
        quack-kernels; exact elsewhere, Blackwell and the CPU included).

        Set per module (``set_mode``), per model (``svdq_linear.set_mode``) or by ``$SVDQ_LINEAR_MODE``;
        a module's own setting wins over the variable.
        """
        # a plain attribute when set: read from __dict__ (a missing one through nn.Module.__getattr__ raises,
        # ~4 us a call); while dynamo traces, getattr, which it guards even while unset (set_mode recompiles)
        own = getattr(self, "_mode", None) if torch.compiler.is_compiling() else self.__dict__.get("_mode")
        mode = own or getenv(ENV_MODE) or "auto"
        if mode not in MODES:
            raise ValueError(f"expected a mode in {MODES} (module or ${ENV_MODE}), got {mode!r}")
        return mode

    def set_mode(self, mode: str | None):
        if mode is not None and mode not in MODES:
            raise ValueError(f"expected a mode in {MODES}, got {mode!r}")
        self._mode = mode
        return self

    @property
    def kind(self) -> str:
        mode = self.mode
        if mode == "auto":
            device = self._device()
            mode = "fast" if backends.fast_mode_is_native(device, backends.preferred_name(self)) else "exact"
        return "w4a4_fast" if mode == "fast" else "w4a4"

    # ---- opt-in range check ($SVDQ_LINEAR_CHECK_RANGE=1) ----------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if _CHECK_RANGE and not torch.compiler.is_compiling() and self.kind == "w4a4":
            self._check_range(x)
        return y

    def forward_cat_gelu(self, x_a: torch.Tensor | None, x_b: torch.Tensor) -> torch.Tensor:
        """``self(nvfp4.cat_gelu(x_a, x_b))``: the layer on ``cat([x_a, gelu_tanh(x_b)], -1)`` (``x_a`` None:
        on ``gelu_tanh(x_b)``), the input of a Flux single block's ``proj_out`` (attention output, MLP
        before its GELU) or of a feed-forward's down projection (``svdq_linear.fuse.fuse_gelu_inputs``
        routes those blocks here). Where the backend reads the two tensors itself (sm90, both modes,
        above the small-M kernels' tokens) the concatenated input is never written; elsewhere, and
        whenever the module's call is wrapped (hooks, an offloader's forward), it is written and the
        layer is called on it.
        The contract: ``svdq_linear.nvfp4``, "Inputs built from two tensors"."""
        x_a, x_b = _autocast_inputs(x_a, x_b)
        ka = 0 if x_a is None else x_a.shape[-1]
        if x_a is not None and (x_a.shape[:-1] != x_b.shape[:-1] or x_a.dtype != x_b.dtype
                                or x_a.device != x_b.device):
            raise ValueError(f"x_a and x_b must share leading dimensions, dtype and device, got {tuple(x_a.shape)} "
                             f"{x_a.dtype} {x_a.device} and {tuple(x_b.shape)} {x_b.dtype} {x_b.device}")
        if ka + x_b.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs whose last dimensions add up to {self.in_features}, got {ka} + "
                             f"{x_b.shape[-1]}")
        kind = self.kind
        if (_CHECK_RANGE and not torch.compiler.is_compiling() and kind == "w4a4") or self._call_is_wrapped():
            # the range check reads the written input; hooks and wrapped forwards (offloading moves the
            # weights in one) expect the layer's own call
            with backends._no_autocast(x_b):
                written = nvfp4.cat_gelu(x_a, x_b)
            return self(written)
        self._enter_call(x_b)
        lead = x_b.shape[:-1]
        xb2d = x_b.reshape(-1, x_b.shape[-1])
        xa2d = None if x_a is None else x_a.reshape(-1, ka)
        with backends.device_guard(xb2d), backends._no_autocast(xb2d):
            backend, prepared = backends.resolve(self, xb2d, kind)
            y = backend.linear_cat_gelu(self, xa2d, xb2d, prepared, kind)
        return y.reshape(*lead, self.out_features)

    def forward_ada_norm(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        """``self(nvfp4.ada_norm(x, shift, scale, eps))``: the layer on ``layer_norm(x) * (1 + scale) + shift`` (``x
        [B, S, K]``, ``shift`` / ``scale [B, K]``, no affine weight in the norm), the input that diffusers'
        ``AdaLayerNormZero`` / ``AdaLayerNormZeroSingle`` hand a block's q/k/v (a Flux single block's fused
        ``to_qkv_mlp`` calls this). Where the backend normalizes as it loads (sm90, both modes, from
        ``tuning.ADA_NORM_MIN_M`` tokens, unless ``SVDQ_SM90_ADA_NORM=0``) that input is never written; elsewhere,
        and whenever the module's call is wrapped (hooks, an offloader's forward), it is written and the layer is
        called on it.
        The contract: ``svdq_linear.nvfp4``, "Inputs made by an adaLN norm"."""
        if x.dim() != 3 or x.shape[-1] != self.in_features:
            raise ValueError(f"expected x [B, S, {self.in_features}], got {tuple(x.shape)}")
        x, shift, scale = _autocast_inputs(x, shift, scale)
        want = (x.shape[0], self.in_features)
        for name, t in (("shift", shift), ("scale", scale)):
            if tuple(t.shape) != want or t.dtype != x.dtype or t.device != x.device:
                raise ValueError(f"{name} must be [{want[0]}, {want[1]}] {x.dtype} on {x.device} like x, got "
                                 f"{tuple(t.shape)} {t.dtype} {t.device}")
        kind = self.kind
        if (_CHECK_RANGE and not torch.compiler.is_compiling() and kind == "w4a4") or self._call_is_wrapped():
            with backends._no_autocast(x):
                written = nvfp4.ada_norm(x, shift, scale, eps)
            return self(written)
        self._enter_call(x)
        b, s_, k = x.shape
        x2d = x.reshape(b * s_, k)
        with backends.device_guard(x2d), backends._no_autocast(x2d):
            backend, prepared = backends.resolve(self, x2d, kind)
            y = backend.linear_ada_norm(self, x2d, shift, scale, float(eps), s_, prepared, kind)
        return y.reshape(b, s_, self.out_features)

    def _call_is_wrapped(self) -> bool:
        return call_is_wrapped(self)

    @torch.no_grad()
    def _check_range(self, x: torch.Tensor) -> None:
        """Warn once per layer and problem when activation blocks saturate or underflow (eager only)."""
        warned = self.__dict__.setdefault("_range_warned", set())
        if len(warned) == 2:
            return
        xs = nvfp4.smooth_input(x.reshape(-1, self.in_features), self.smooth)
        amax = nvfp4.block_amax(xs)
        saturated, underflow = nvfp4.range_violations(xs)
        name = getattr(self, "layer_name", None) or self._describe()
        total = amax.numel()
        if "saturate" not in warned and bool(saturated.any()):
            warned.add("saturate")
            top = float(amax[saturated].max())
            warnings.warn(
                f"svdq-linear: {name}: {int(saturated.sum())} of {total} activation blocks saturate "
                f"(block max {top:.4g} after smoothing, 2^{math.log2(top / nvfp4.NVFP4_MAX):.1f} above the "
                f"largest NVFP4 value {nvfp4.NVFP4_MAX:g}): convert with a larger --act-headroom or calibrate on "
                f"inputs like these", RuntimeWarning, stacklevel=3)
        if "underflow" not in warned and bool(underflow.any()):
            warned.add("underflow")
            low = float(amax[underflow].min())
            warnings.warn(
                f"svdq-linear: {name}: {int(underflow.sum())} of {total} nonzero activation blocks underflow "
                f"(block max down to {low:.3g} after smoothing; below {nvfp4.E2M1_MAX * nvfp4.E4M3_MIN_NORMAL:g} "
                f"the E4M3 scale is subnormal or zero): convert with a smaller --act-headroom or calibrate on "
                f"inputs like these", RuntimeWarning, stacklevel=3)

    def _expected_shapes(self):
        n, k, r = self.out_features, self.in_features, self.rank
        return {**super()._expected_shapes(), "smooth": (k,), "proj_down": (k, r), "proj_up": (n, r)}

    def _describe(self) -> str:
        return f"SVDQW4A4Linear(in_features={self.in_features}, out_features={self.out_features}, rank={self.rank})"

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        rank: int | None = None,
        act_max: torch.Tensor | None = None,
        config: SVDQuantConfig | None = None,
        **config_kwargs,
    ) -> "SVDQW4A4Linear":
        """SVDQuant ``linear`` (see ``svdq_linear.svdquant``) at ``rank`` (32 unless given); ``act_max [K]`` from
        calibration.

        Without ``act_max`` the activation scales are placed for inputs of about unit size: a block of 16 smoothed
        inputs whose largest magnitude is below ~0.01 gets a block scale of 0 or of a few bits (E4M3's smallest is
        2^-9; the block then reads as zeros and the output keeps little more than the low-rank branch), and blocks
        above 2688 (6 x 448) saturate. Pass ``act_max``
        (the per-channel max |x| of a few real batches) for inputs of other sizes; ``SVDQ_LINEAR_CHECK_RANGE=1``
        warns at run time where blocks saturate or underflow.

        Extra keyword arguments are ``SVDQuantConfig`` fields (``alpha``, ``smooth``, ``svd``, ...); or pass a whole
        ``config`` (its rank then, a different ``rank`` beside it is refused).
        The module keeps the linear's dtype and device.
        """
        _check_plain_linear(linear)
        if linear.weight.is_meta:
            raise ValueError("the nn.Linear's weight is on meta (never loaded): load its weights, then quantize it")
        config = SVDQuantConfig.given(rank, config, config_kwargs)
        weights = svdquant(linear.weight, linear.bias, act_max=act_max, config=config)
        return cls.from_weights(weights)

    @classmethod
    def from_weights(cls, weights: SVDQuantWeights) -> "SVDQW4A4Linear":
        """A module holding the tensors of a decomposition (checked like a state_dict)."""
        n, k = weights.qweight.shape[0], weights.qweight.shape[1] * 2
        module = cls(
            k, n, rank=weights.proj_down.shape[1], bias=weights.bias is not None, device="meta",
            dtype=weights.proj_down.dtype,
        )
        tensors = {name: t for name, t in weights.tensors().items() if t is not None}
        module.load_state_dict(tensors, strict=True, assign=True)
        return module

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"bias={self.bias is not None}, backend={self._repr_backend()}"
        )


class NVFP4W4A16Linear(_PackedNVFP4Linear):
    """Weight-only 4-bit linear: NVFP4 weights, 16-bit activations (``y = x (Qw * wcscale)^T + b``).

    For the adaLN modulation linears of DiTs (GEMVs at M = batch, a quarter of Flux's parameters),
    where quantizing the activation buys nothing. Buffers as in ``SVDQW4A4Linear`` without
    ``smooth``/``proj_*``; numerics of ``svdq_linear.nvfp4.w4a16_linear``.
    """

    kind = "w4a16"

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        branch = self._modules.get("lora_branch")  # a LoRA's side branch (svdq_linear.lora.fuse_lora)
        return y if branch is None else y + branch(x, y.dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "NVFP4W4A16Linear":
        """Quantize ``linear`` (per-row scale folded into ``wcscale``); keeps its dtype and device."""
        _check_plain_linear(linear)
        if linear.weight.is_meta:
            raise ValueError("the nn.Linear's weight is on meta (never loaded): load its weights, then quantize it")
        tensors = weight_only(linear.weight, linear.bias)
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                     dtype=linear.weight.dtype)
        module.load_state_dict(tensors, strict=True, assign=True)
        return module
