"""Backend seam: which kernel runs a 4-bit linear, chosen per call for the device of the call.

A backend subclasses ``Backend``. It says which devices and entry points (``kind``: ``"w4a4"`` for
``SVDQW4A4Linear``, ``"w4a4_fast"`` for one in the fast mode, ``"w4a16"`` for ``NVFP4W4A16Linear``) it covers (``supports``), may decline a
layer (``declines``: alignment, rank, dtype; the answer is cached per layer and device) or a single
call (``declines_call``: an fp32 input, say), prepares once per device what its kernel reads
(``prepare`` returns an object of its own type, cached on the module until a buffer changes) and runs
the layer (``linear``). Every backend computes through the two custom ops defined here,
``svdq_linear::w4a4_linear``, ``svdq_linear::w4a4_fast_linear`` and ``svdq_linear::w4a16_linear``: one schema
and one fake each, so
``torch.compile(fullgraph=True)`` and offload hooks see ordinary ops whatever runs underneath. The op
carries the backend's name and the prepared tensors (``extra``); its implementation calls the named
backend's ``run_w4a4`` / ``run_w4a16``.

Backends register lazily (``register_lazy``): ``import svdq_linear`` imports neither Triton nor
cutlass; a backend module is imported the first time a device it may cover asks for it.

Choice for a call: the candidates for (device, kind) in priority order, the preferred backend first
(``module.set_backend(name)`` or ``$SVDQ_LINEAR_BACKEND``); the first that neither declines the layer
nor the call serves it. A preference that cannot serve warns once and falls back; the ``reference``
backend serves everything, so a call always runs.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from .. import nvfp4
from .._env import getenv

ENV_BACKEND = "SVDQ_LINEAR_BACKEND"


class Backend:
    """Base class of a backend; subclasses set ``name`` and override what they need."""

    name: str = ""
    kinds: frozenset[str] = frozenset({"w4a4", "w4a16"})

    def supports(self, device: torch.device, kind: str) -> bool:
        return kind in self.kinds

    def declines(self, module, device: torch.device) -> str | None:
        """Why this backend cannot run ``module`` on ``device`` (None: it can). Cached per layer."""
        return None

    def declines_call(self, module, x: torch.Tensor) -> str | None:
        """Why this backend cannot run this call (None: it can). Must be cheap."""
        return None

    def prepare(self, module, device: torch.device) -> object | None:
        """Repack the module's canonical tensors for this backend's kernels (cached until they change)."""
        return None

    def extra_tensors(self, prepared) -> list[torch.Tensor]:
        """Prepared tensors handed to the custom op (so compile and offload see them as inputs)."""
        return []

    def replaced(self, prepared) -> dict[str, Callable[[], torch.Tensor]]:
        """Canonical tensors that ``prepared`` holds in its own layout and that this backend's ops do not
        read, each with a function that rebuilds it bit for bit: the module frees them while the state
        is cached (``_PackedNVFP4Linear._stand_in``), so the weight is not on the device twice."""
        return {}

    def run_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra) -> torch.Tensor:
        raise NotImplementedError(f"backend {self.name!r} has no W4A4 kernel")

    def run_w4a4_fast(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra) -> torch.Tensor:
        raise NotImplementedError(f"backend {self.name!r} has no fast-mode kernel")

    def run_w4a16(self, x, qweight, wscales, wcscale, bias, extra) -> torch.Tensor:
        raise NotImplementedError(f"backend {self.name!r} has no W4A16 kernel")

    def run_w4a4_cat_gelu(self, xa, xb, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias,
                          extra) -> torch.Tensor:
        """The exact mode on the input ``nvfp4.cat_gelu(xa, xb)``: by default that input written out."""
        return self.run_w4a4(nvfp4.cat_gelu(xa, xb), qweight, wscales, smooth, proj_down, proj_up, wcscale, bias,
                             extra)

    def run_w4a4_fast_cat_gelu(self, xa, xb, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias,
                               extra) -> torch.Tensor:
        """The fast mode on the input ``nvfp4.cat_gelu(xa, xb)``: by default that input written out."""
        return self.run_w4a4_fast(nvfp4.cat_gelu(xa, xb), qweight, wscales, smooth, proj_down, proj_up, wcscale,
                                  bias, extra)

    def run_w4a4_ada_norm(self, x, shift, scale, eps, tokens, qweight, wscales, smooth, proj_down, proj_up, wcscale,
                          bias, extra, fast) -> torch.Tensor:
        """The layer (``fast``: its fast mode) on the input ``nvfp4.ada_norm`` of ``x [M, K]`` (``tokens`` rows a
        batch element), ``shift`` / ``scale [M / tokens, K]``: by default that input written out."""
        inp = _ada_input(x, shift, scale, eps, tokens)
        run = self.run_w4a4_fast if fast else self.run_w4a4
        return run(inp, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra)

    def run_fast_gemm(self, a8, sa, la, extra, out_dtype) -> torch.Tensor:
        raise NotImplementedError(f"backend {self.name!r} has no fast-mode GEMM entry point")

    def linear(self, module, x: torch.Tensor, prepared, kind: str | None = None) -> torch.Tensor:
        """``y [M, N]`` for ``x [M, K]`` through the shared custom op (``kind``: ``module.kind``, when the
        caller has read it already)."""
        extra = self.extra_tensors(prepared)
        t = module._parameters  # not the attributes: reading a stood-in tensor would rebuild it
        kind = kind or module.kind
        if kind == "w4a16":
            args = (x, t["qweight"], t["wscales"], t["wcscale"], t["bias"], extra)
            return self.run_w4a16(*args) if plain_eager_call(x) else w4a16_linear(*args, self.name)
        args = (x, t["qweight"], t["wscales"], t["smooth"], t["proj_down"], t["proj_up"], t["wcscale"], t["bias"], extra)
        if plain_eager_call(x):
            return self.run_w4a4_fast(*args) if kind == "w4a4_fast" else self.run_w4a4(*args)
        return (w4a4_fast_linear if kind == "w4a4_fast" else w4a4_linear)(*args, self.name)


    def linear_cat_gelu(self, module, xa: torch.Tensor | None, xb: torch.Tensor, prepared,
                        kind: str | None = None) -> torch.Tensor:
        """``y [M, N]`` for the input ``nvfp4.cat_gelu(xa, xb)`` (``xa [M, KA]`` or None, ``xb [M, KB]``):
        by default that input written out and passed to ``linear``; a backend that reads the two tensors
        itself overrides this."""
        return self.linear(module, nvfp4.cat_gelu(xa, xb), prepared, kind)


    def linear_ada_norm(self, module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                        tokens: int, prepared, kind: str | None = None) -> torch.Tensor:
        """``y [M, N]`` for the input ``nvfp4.ada_norm`` of ``x [M, K]`` (``tokens`` rows a batch element) and
        ``shift`` / ``scale [M / tokens, K]``: by default that input written out and passed to ``linear``; a
        backend that normalizes as it loads overrides this."""
        return self.linear(module, _ada_input(x, shift, scale, eps, tokens), prepared, kind)


def _ada_input(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, tokens: int) -> torch.Tensor:
    """``nvfp4.ada_norm`` written out for ``x [M, K]`` of ``tokens`` rows a batch element: ``[M, K]``."""
    return nvfp4.ada_norm(x.reshape(-1, tokens, x.shape[1]), shift, scale, eps).reshape(x.shape)


def device_guard(x: torch.Tensor):
    """A context making ``x``'s CUDA device the current one for a call. Triton and CuTe DSL kernels launch on the
    current device, not on their tensors' one, so a layer on ``cuda:1`` called while ``cuda:0`` is current
    (``pipe.to("cuda:1")``, a pipeline spread over GPUs by ``device_map``) would launch them on the wrong GPU.
    A null context where that device is current already, off CUDA, and while torch.compile traces (the code
    it generates guards the device itself)."""
    if x.device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    index = x.device.index
    if index is None or index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def plain_eager_call(x: torch.Tensor) -> bool:
    """Whether a call may run the backend's function directly instead of through its custom op (whose
    dispatch costs 10-100 us of host time a call, docs/perf.md): not traced by torch.compile, no
    gradient recorded (the ops define none), a plain tensor on a real device, and no dispatch mode
    or torch-function mode or functorch transform that expects to see the op, no autocast (which the
    op's dispatch passes before the backend's own torch ops run), no ``torch.jit.trace``. The op stays
    for everything else: compile, fake and meta tensors, modes (FakeTensorMode, FlopCounterMode, a
    ``with torch.device(...)`` block, ...), vmap, autograd, autocast, jit tracing."""
    return (not torch.compiler.is_compiling() and not torch.is_grad_enabled() and type(x) is torch.Tensor
            and x.device.type != "meta" and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled()
            and torch._C._functorch.peek_interpreter_stack() is None and not torch._C._is_any_autocast_enabled()
            and torch._C._get_tracing_state() is None)


# ---- the registry --------------------------------------------------------------------------------


@dataclass
class _Entry:
    name: str
    priority: int
    loader: Callable[[], Backend] | None  # imports the backend module on first use
    may_cover: Callable[[torch.device], bool]  # cheap filter that needs no import
    backend: Backend | None = None
    failed: str | None = None


_ENTRIES: dict[str, _Entry] = {}
_GENERATION = 0  # bumped by each registration: a traced call reads it, so a compiled graph recompiles
_LOADS = 0  # bumped when an entry loads or fails: with _GENERATION and the entry count, the registry's state
_LOCK = threading.Lock()
_WARNED: set[tuple] = set()


def register_backend(backend: Backend, priority: int) -> None:
    """Add (or replace) a ready backend; a higher priority wins where several serve a call."""
    global _GENERATION
    _ENTRIES[backend.name] = _Entry(backend.name, priority, None, lambda d: True, backend)
    _GENERATION += 1


def register_lazy(name: str, priority: int, module: str, may_cover: Callable[[torch.device], bool]) -> None:
    """Register ``module.make_backend()`` to be imported the first time ``may_cover(device)`` holds."""

    def load():
        return importlib.import_module(module).make_backend()

    global _GENERATION
    _ENTRIES[name] = _Entry(name, priority, load, may_cover)
    _GENERATION += 1


def _load(entry: _Entry) -> Backend | None:
    if entry.backend is None and entry.failed is None:
        with _LOCK:
            if entry.backend is None and entry.failed is None:
                global _LOADS
                try:
                    entry.backend = entry.loader()
                except Exception as e:  # a missing optional dependency: this backend is unavailable
                    entry.failed = f"{type(e).__name__}: {e}"
                    warnings.warn(f"svdq-linear: backend {entry.name!r} is unavailable ({entry.failed})", stacklevel=3)
                finally:
                    _LOADS += 1
    return entry.backend


def available_backends() -> list[str]:
    return [e.name for e in sorted(_ENTRIES.values(), key=lambda e: -e.priority)]


def get_backend(name: str) -> Backend:
    entry = _ENTRIES.get(name)
    if entry is None:
        raise ValueError(f"unknown backend {name!r}; registered: {available_backends()}")
    backend = _load(entry)
    if backend is None:
        raise RuntimeError(f"backend {name!r} could not be loaded: {entry.failed}")
    return backend


def rank_limits() -> dict[str, int]:
    """The largest low-rank branch each GPU kernel takes (its backend declines a layer beyond it and another
    serves): ``{"sm100": 128, "sm90": 256}``, read from the backends' own constants (no Triton or cutlass import)."""
    from .sm100.host import MAX_RANK as sm100_max
    from .sm90 import MAX_RANK as sm90_max

    return {"sm100": sm100_max, "sm90": sm90_max}


def rank_note(rank: int) -> str | None:
    """Why layers of this rank would leave a GPU kernel (``svdq-convert`` and ``quantize_pipeline`` say so before the
    work), or None when every kernel takes it. The Blackwell kernel takes positive multiples of 16 up to 128 (one low-rank
    MMA consumes 16 of R; ``sm100.host.layer_alignment_error``); sm90 takes up to 256. A declined layer runs on the
    next backend: on a Blackwell GPU that is the PyTorch reference, 16-100x slower than bf16."""
    from .sm100.host import LOWRANK_ATOM_K

    limits = rank_limits()
    slow = "the PyTorch reference, 16-100x slower than bf16"
    if rank > limits["sm90"]:
        return (f"rank {rank} is above what either GPU kernel takes (sm90 (H100/H200) up to {limits['sm90']}, "
                f"Blackwell up to {limits['sm100']}): the layers will run on {slow}")
    if rank > limits["sm100"]:
        return (f"rank {rank} is above the Blackwell kernel's {limits['sm100']}: on a B200/B300 the layers will run "
                f"on {slow} (sm90 takes up to {limits['sm90']})")
    if rank <= 0 or rank % LOWRANK_ATOM_K:
        return (f"rank {rank} is not a positive multiple of {LOWRANK_ATOM_K}, which the Blackwell kernel needs: on a "
                f"B200/B300 the layers will run on {slow} (sm90 takes it)")
    return None


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _where(device: torch.device) -> str:
    cap = device_capability(device)
    return f"{device}" + (f" (sm_{cap[0]}{cap[1]})" if cap else "")


# (device, kind) -> (registry snapshot, backends)
_CANDIDATES: dict[tuple, tuple[tuple, list[Backend]]] = {}


def _registry_snapshot() -> tuple:
    """Changes when an entry is registered, removed, loaded or failed (three integers: this runs on
    every call)."""
    return _GENERATION, _LOADS, len(_ENTRIES)


def candidates(device: torch.device | str, kind: str) -> list[Backend]:
    """The loaded backends that support ``kind`` on ``device``, highest priority first (cached per
    device and kind until the registry changes: an entry added, removed, loaded or failed)."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if tracing():  # loading imports and takes a lock: done outside the trace
        names = _candidate_names(device.type, device.index, kind, _GENERATION)
        return [_ENTRIES[name].backend for name in names]
    return _candidates_eager(device, kind)


def _candidates_eager(device: torch.device, kind: str) -> list[Backend]:
    key = (device, kind)
    snap = _registry_snapshot()
    hit = _CANDIDATES.get(key)
    if hit is not None and hit[0] == snap:
        return list(hit[1])
    out = []
    for entry in sorted(_ENTRIES.values(), key=lambda e: -e.priority):
        if not entry.may_cover(device):
            continue
        backend = _load(entry)
        if backend is not None and backend.supports(device, kind):
            out.append(backend)
    _CANDIDATES[key] = (_registry_snapshot(), out)  # after the loads above
    return list(out)


@torch._dynamo.assume_constant_result
def _candidate_names(device_type: str, index: int | None, kind: str, generation: int) -> tuple[str, ...]:
    """``candidates`` by name, run eagerly when torch.compile traces a call (a first call may be a
    compiled one: the lazy backends load here, not inside the trace). ``generation``: the registry's,
    read by the traced code, so that a graph compiled before a registration is recompiled."""
    device = torch.device(device_type) if index is None else torch.device(device_type, index)
    return tuple(b.name for b in _candidates_eager(device, kind))


def preferred_name(module) -> str | None:
    return module._backend_pref or getenv(ENV_BACKEND) or None


def _warn_once(key: tuple, msg: str, category: type[Warning] = UserWarning) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, category, stacklevel=4)


def select_backend(device: torch.device | str, name: str | None = None, kind: str = "w4a4") -> Backend:
    """The backend a layer of ``kind`` would get on ``device`` (ignoring layer and call checks)."""
    device = torch.device(device)
    cands = candidates(device, kind)
    name = name or getenv(ENV_BACKEND) or None
    if name is not None:
        for b in cands:
            if b.name == name:
                return b
        get_backend(name)  # unknown names raise here
    if not cands:
        raise RuntimeError(f"no svdq-linear backend supports {kind} layers on {_where(device)}")
    return cands[0]


def _state_key(module, device: torch.device) -> tuple:
    # A buffer replaced (load, offload hook, .to) changes its data_ptr; an in-place edit bumps _version.
    # Tensors made under torch.inference_mode() (a model loaded or fused there) keep no version counter;
    # they can be edited in place only inside inference mode, which no caller does to packed weights.
    return (device,) + tuple((t.data_ptr(), -1 if t.is_inference() else t._version, t.dtype)
                             for t in module.packed_tensors())


_GROUP_OFFLOAD_HOOKS = ("group_offloading", "lazy_prefetch_group_offloading")  # diffusers' hook names


def weights_are_offloaded(module) -> bool:
    """True when something moves this module's tensors in for each call and out after it.

    A prepared state cached on the GPU would then stay there after the weights leave, so it is rebuilt
    per call instead and backends keep it small (no repacked weight copies). Seen three ways:
    accelerate's sequential CPU offload puts an ``AlignDevicesHook(offload=True)`` on the module;
    diffusers' leaf-level group offloading registers its hook on the module; and any other mover
    (diffusers' block-level groups, whose hook sits on an ancestor) shows as tensors that came back at
    new addresses on the same device between two calls (``resolve`` marks the module then).
    """
    # plain attributes (in __dict__): a missing one read through nn.Module.__getattr__ raises and costs
    # microseconds a call
    attrs = module.__dict__
    if attrs.get("_svdq_moved_each_call", False):
        return True
    hook = attrs.get("_hf_hook")
    hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
    if any(getattr(h, "offload", False) for h in hooks):
        return True
    registry = attrs.get("_diffusers_hook")
    get_hook = getattr(registry, "get_hook", None)
    return get_hook is not None and any(get_hook(name) is not None for name in _GROUP_OFFLOAD_HOOKS)


def _moved_since(old_key: tuple, new_key: tuple) -> bool:
    """Same device, but every tensor at a new address: replaced from outside between two calls."""
    pairs = [(a[0], b[0]) for a, b in zip(old_key[1:], new_key[1:]) if a[0] and b[0]]  # stand-ins are empty
    return old_key[0] == new_key[0] and len(old_key) == len(new_key) and bool(pairs) and all(a != b for a, b in pairs)


# (device type, index, preferred) -> (registry snapshot, answer)
_NATIVE_FAST: dict[tuple, tuple[tuple, bool]] = {}


def fast_mode_is_native(device: torch.device, preferred: str | None = None) -> bool:
    """Whether a GPU kernel (not the reference) would serve fast-mode layers on ``device``: what the
    ``"auto"`` mode resolves to fast on. With a preferred backend, only that backend counts. Cached until
    the registry changes (a backend registered later is seen, as by ``candidates``)."""
    if device.type == "meta":
        return False
    if tracing():
        # no cache in a trace: its snapshot would be guarded on (a load for another device would retrace the graph
        # twice); candidates' traced path guards on the registry generation only
        return _native_fast(device, preferred)
    key = (device.type, device.index, preferred)
    snap = _registry_snapshot()  # before the loads below: a registration racing them is seen at the next call
    hit = _NATIVE_FAST.get(key)
    if hit is None or hit[0] != snap:
        hit = (snap, _native_fast(device, preferred))
        _NATIVE_FAST[key] = hit
    return hit[1]


def _native_fast(device: torch.device, preferred: str | None) -> bool:
    native = [b.name for b in candidates(device, "w4a4_fast") if b.name != "reference"]
    return bool(native) and (preferred is None or preferred in native)


def choose(module, x: torch.Tensor, kind: str | None = None) -> Backend:
    """The backend that serves this call of ``module`` on ``x [M, K]`` (no preparation; ``kind``:
    ``module.kind``, when the caller has read it already: it reads the environment)."""
    device = x.device
    pref = preferred_name(module)
    kind = kind or module.kind
    cands = candidates(device, kind)
    if pref is not None:
        if pref not in _ENTRIES:
            raise ValueError(f"unknown backend {pref!r} ({ENV_BACKEND} or set_backend); registered: {available_backends()}")
        first = [b for b in cands if b.name == pref]
        if not first:
            _warn_once((pref, device.type, kind),
                       f"svdq-linear: backend {pref!r} does not cover {kind} layers on {_where(device)}; "
                       f"falling back to the next backend")
        cands = first + [b for b in cands if b.name != pref]
    for backend in cands:
        slot = (backend.name, device, kind)  # a mode switch changes what a backend checks
        declined = module._declined.get(slot, False)
        if declined is False:
            declined = backend.declines(module, device)
            if not tracing():  # a trace that wrote it would fail the guard its own read installed
                module._declined[slot] = declined
        if declined is None:
            declined = backend.declines_call(module, x)
        if declined is None:
            return backend
        if backend.name == pref:
            _warn_once((pref, device.type, kind, declined),
                       f"svdq-linear: backend {pref!r} declines {module._describe()} on {_where(device)}: "
                       f"{declined}; falling back to the next backend")
    raise RuntimeError(f"no svdq-linear backend can run {module._describe()} on {_where(device)}")


class PreparedEntry:
    """A module's cached prepared state: ``key`` (its tensors' devices, addresses and versions when it
    was made), ``state`` (the backend's object) and ``dtype`` (the input dtype it was made for, to make
    it again after a move). An object, not a tuple: a traced call reads only ``state``, and dynamo
    would guard a tuple of constants (a ``None`` state) by value, addresses included, and recompile
    for every layer."""

    __slots__ = ("key", "state", "dtype")

    def __init__(self, key: tuple, state, dtype: torch.dtype):
        self.key, self.state, self.dtype = key, state, dtype


def resolve(module, x: torch.Tensor, kind: str | None = None) -> tuple[Backend, object]:
    """The backend and its prepared state for this call of ``module`` on ``x [M, K]`` (``kind`` as in
    ``choose``)."""
    kind = kind or module.kind
    backend = choose(module, x, kind)
    device = x.device
    cache = module._dispatch_cache
    slot = (backend.name, kind)  # a mode switch changes the kind and what is prepared
    entry = cache.get(slot)
    if tracing():
        if entry is not None:
            return backend, entry.state  # prepared before tracing (an eager call, or prepare_before_trace)
        # Not prepared before tracing (an offloader moves the weights, or this call takes another
        # backend than the one prepared at trace time): the preparation is traced into the graph (it
        # holds no data-dependent choices then, see sm90.plan_lowrank) and runs on every call. It reads
        # the canonical tensors, which the trace cannot bring back if another backend's state stands in.
        stood = module.__dict__.get("_stood_in")
        if stood:
            owner = next(iter(cache), ("?",))[0]
            raise RuntimeError(
                f"svdq-linear: {module._describe()} holds backend {owner!r}'s prepared weights in place of "
                f"{sorted(stood)}, but this traced call ({x.dtype}, {tuple(x.shape)}) takes backend "
                f"{backend.name!r}; call the model once eagerly with such inputs before compiling it")
        return backend, backend.prepare(module, device)
    if weights_are_offloaded(module):
        module._restore()
        cache.clear()
        return backend, backend.prepare(module, device)
    key = _state_key(module, device)
    if entry is not None and entry.key != key and _moved_since(entry.key, key):
        module._svdq_moved_each_call = True  # an offloader we do not know moves the weights per call
        module._restore()
        cache.clear()
        return backend, backend.prepare(module, device)
    if entry is None or entry.key != key:
        module._check_devices(device)
        module._restore()  # prepare reads the canonical tensors; the old state's stand-ins come back first
        cache.clear()  # one prepared state a module: another backend's or mode's would hold a second copy
        prepared = backend.prepare(module, device)
        rebuild = backend.replaced(prepared)
        if rebuild:
            module._stand_in(rebuild)
        entry = PreparedEntry(_state_key(module, device), prepared, x.dtype)
        cache[slot] = entry
    return backend, entry.state


# ---- a first call that torch.compile traces ------------------------------------------------------

# Every packed layer (svdq_linear.linear adds itself when built, copied or unpickled).
LIVE_LAYERS: weakref.WeakSet = weakref.WeakSet()
_EAGER_IN_TRACE = False  # a plain global: dynamo reads it as a constant (compiles are serialized)


def tracing() -> bool:
    """Whether torch.compile is tracing this code (False in ``prepare_before_trace``'s eager work,
    which runs while dynamo traces)."""
    return torch.compiler.is_compiling() and not _EAGER_IN_TRACE


def prepare_layer(m, dtype: torch.dtype) -> None:
    """Prepare ``m`` now, eagerly, for inputs of ``dtype`` on its device, as its first call would;
    nothing for a layer on the meta device or with offloaded weights. A failure warns (naming the
    layer) and leaves the layer to prepare at its own call, which raises it again or traces it."""
    global _EAGER_IN_TRACE
    device = m._device()
    if device.type == "meta" or weights_are_offloaded(m) or is_fake(m._parameters["wcscale"]):
        return  # fake: torch.export traces the layer with fake parameters, and the preparation goes into its program
    outer, _EAGER_IN_TRACE = _EAGER_IN_TRACE, True
    try:
        resolve(m, torch.zeros(1, m.in_features, dtype=dtype, device=device))
    except Exception as e:  # noqa: BLE001
        m._restore()
        m._dispatch_cache.clear()
        _warn_once(("prepare", id(m), type(e)), f"svdq-linear: preparing {m._describe()} ahead of its call "
                   f"failed ({type(e).__name__}: {e}); it prepares at its own call instead")
    finally:
        _EAGER_IN_TRACE = outer


@torch._dynamo.assume_constant_result
def prepare_before_trace(device_type: str, index: int | None, dtype: str) -> bool:
    """Prepare, eagerly, every live layer on this device that has no prepared state yet, for inputs of
    ``dtype`` (``str(torch.dtype)``), as its first eager call would (repacked weights cached,
    canonical tensors stood in for). A layer's forward calls this first thing when torch.compile
    traces it (dynamo runs it once, at trace time, and keeps the constant result), before the trace
    reads any of the layer's tensors. Without it a model compiled before any eager call would trace
    the preparation into its graph and repack the weights on every call. All layers on the device,
    not only the traced one: repeated blocks compiled once (``compile_repeated_blocks``) then find
    every block's state in the same form and do not recompile per block. Left alone: layers whose
    rows a fused layer serves (``svdq_linear.fuse``), offloaded ones, other devices. A trace that reads
    a layer's packed tensors before any layer's forward (model code reading ``qweight``) would see
    them change under it: call such a model once eagerly before compiling it."""
    device = torch.device(device_type) if index is None else torch.device(device_type, index)
    dt = getattr(torch, dtype.removeprefix("torch."))
    layers = list(LIVE_LAYERS)
    parts = {id(ref()) for m in layers for ref, *_ in m.__dict__.get("_view_parts", ())}
    for m in layers:
        if id(m) not in parts and not m._dispatch_cache and m._device() == device:
            prepare_layer(m, dt)
    return True


# ---- the shared custom ops -----------------------------------------------------------------------


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype of the autocast region that is on for ``device_type``; None outside one, or for a device type
    autocast does not cover (meta)."""
    if not torch._C._is_any_autocast_enabled():
        return None
    try:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except RuntimeError:
        return None


def _no_autocast(t: torch.Tensor):
    """Autocast off for an op's body: it passes the op's dispatch, and would then cast the backend's own torch ops
    (the reference's fp32 matmuls, a ``lora_act`` GEMM) to 16 bits, where the FP4 product overflows fp16 before
    its ``* wcscale``. The op returns its input's dtype, as it does without autocast. The layers also run their
    own steps outside the ops under it (``svdq_linear.linear``). A null context where autocast is off for ``t``'s
    device, or where autocast does not know the device (meta)."""
    if autocast_dtype(t.device.type) is not None:
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


@torch.library.custom_op("svdq_linear::w4a4_linear", mutates_args=())
def w4a4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    smooth: torch.Tensor,
    proj_down: torch.Tensor,
    proj_up: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None,
    extra: list[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    """``y [M, N]`` (x's dtype) of the contract for ``x [M, K]``, computed by ``backend``."""
    with _no_autocast(x):
        return get_backend(backend).run_w4a4(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra)


@w4a4_linear.register_fake
def _(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra, backend):
    return x.new_empty(x.shape[0], wcscale.shape[0])  # qweight may be a stood-in (empty)


@torch.library.custom_op("svdq_linear::w4a4_fast_linear", mutates_args=())
def w4a4_fast_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    smooth: torch.Tensor,
    proj_down: torch.Tensor,
    proj_up: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None,
    extra: list[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    """``y [M, N]`` (x's dtype) of the fast mode (``nvfp4.w4a8_fast_linear``), computed by ``backend``."""
    with _no_autocast(x):
        return get_backend(backend).run_w4a4_fast(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias,
                                                  extra)


@w4a4_fast_linear.register_fake
def _(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra, backend):
    return x.new_empty(x.shape[0], wcscale.shape[0])  # qweight may be a stood-in (empty)


@torch.library.custom_op("svdq_linear::w4a4_cat_gelu_linear", mutates_args=())
def w4a4_cat_gelu_linear(
    xa: torch.Tensor | None,
    xb: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    smooth: torch.Tensor,
    proj_down: torch.Tensor,
    proj_up: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None,
    extra: list[torch.Tensor],
    fast: bool,
    backend: str,
) -> torch.Tensor:
    """``y [M, N]`` (xb's dtype) of the contract (``fast``: of the fast mode) on the input
    ``nvfp4.cat_gelu(xa, xb)`` (``xa [M, KA]`` or None, ``xb [M, KB]``), computed by ``backend``."""
    b = get_backend(backend)
    run = b.run_w4a4_fast_cat_gelu if fast else b.run_w4a4_cat_gelu
    with _no_autocast(xb):
        return run(xa, xb, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra)


@w4a4_cat_gelu_linear.register_fake
def _(xa, xb, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra, fast, backend):
    return xb.new_empty(xb.shape[0], wcscale.shape[0])


@torch.library.custom_op("svdq_linear::w4a4_ada_norm_linear", mutates_args=())
def w4a4_ada_norm_linear(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    tokens: int,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    smooth: torch.Tensor,
    proj_down: torch.Tensor,
    proj_up: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None,
    extra: list[torch.Tensor],
    fast: bool,
    backend: str,
) -> torch.Tensor:
    """``y [M, N]`` (x's dtype) of the contract (``fast``: of the fast mode) on the input ``nvfp4.ada_norm`` of
    ``x [M, K]`` (``tokens`` rows a batch element) and ``shift`` / ``scale [M / tokens, K]``, computed by
    ``backend``."""
    with _no_autocast(x):
        return get_backend(backend).run_w4a4_ada_norm(x, shift, scale, eps, tokens, qweight, wscales, smooth,
                                                      proj_down, proj_up, wcscale, bias, extra, fast)


@w4a4_ada_norm_linear.register_fake
def _(x, shift, scale, eps, tokens, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra, fast, backend):
    return x.new_empty(x.shape[0], wcscale.shape[0])


@torch.library.custom_op("svdq_linear::w4a8_fast_gemm", mutates_args=())
def w4a8_fast_gemm(
    a8: torch.Tensor,
    sa: torch.Tensor,
    la: torch.Tensor | None,
    extra: list[torch.Tensor],
    out_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    """The fast mode's GEMM from activations quantized outside the op (a backend that lets the compiler
    fuse the activation pass into the ops producing x): ``y [M, N]`` in ``out_dtype`` from ``a8 [M, K]``
    E4M3 and ``sa [M]`` (``nvfp4.fast_act``, in the backend's k order), ``la [M, R']`` (the low-rank
    operand the backend defines, or None) and the backend's prepared tensors ``extra``, whose
    second-to-last is ``[1, N]``."""
    with _no_autocast(sa):
        return get_backend(backend).run_fast_gemm(a8, sa, la, extra, out_dtype)


@w4a8_fast_gemm.register_fake
def _(a8, sa, la, extra, out_dtype, backend):
    return a8.new_empty(a8.shape[0], extra[-2].shape[-1], dtype=out_dtype)


@torch.library.custom_op("svdq_linear::w4a16_linear", mutates_args=())
def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None,
    extra: list[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    """Weight-only ``y [M, N]`` (x's dtype) for ``x [M, K]``, computed by ``backend``."""
    with _no_autocast(x):
        return get_backend(backend).run_w4a16(x, qweight, wscales, wcscale, bias, extra)


@w4a16_linear.register_fake
def _(x, qweight, wscales, wcscale, bias, extra, backend):
    return x.new_empty(x.shape[0], wcscale.shape[0])


@torch.library.custom_op("svdq_linear::no_gradient", mutates_args=())
def no_gradient(grad: torch.Tensor, shape: list[int], dtype: torch.dtype, op: str) -> torch.Tensor:
    """The gradient of an op's input: it raises when it runs. A backward traced by torch.compile (a graph with
    something upstream that requires grad) holds this op, so the compiled forward runs as the eager one does, and
    only a backward that runs raises."""
    raise RuntimeError(f"svdq-linear's 4-bit layers are for inference: {op} has no gradient (the packed weights are "
                       f"fixed, and the activation quantizer's rounding has none). Run the model under "
                       f"torch.no_grad() or torch.inference_mode(); to train, use the 16-bit model")


@no_gradient.register_fake
def _(grad, shape, dtype, op):
    return grad.new_empty(shape, dtype=dtype)


def _shape_of(t):
    if isinstance(t, torch.Tensor):
        return list(t.shape), t.dtype
    if isinstance(t, (list, tuple)):
        return [_shape_of(u) for u in t]
    return None


def _input_shapes(ctx, inputs, output) -> None:
    ctx.inputs = [_shape_of(t) for t in inputs]


def _no_gradient(op_name: str):
    def refused(grad, shape, need: bool):
        if isinstance(shape, list):  # a list input takes a list, of its tensors' gradients or Nones
            return [refused(grad, s, need) for s in shape]
        return None if shape is None or not need else no_gradient(grad, *shape, op_name)

    def backward(ctx, *grads):
        # a gradient for each input that wants one, from the op that raises (None would be a silent zero)
        return tuple(refused(grads[0], shape, need) for shape, need in zip(ctx.inputs, ctx.needs_input_grad))

    return backward


for _name, _op in (("w4a4_linear", w4a4_linear), ("w4a4_fast_linear", w4a4_fast_linear),
                   ("w4a4_cat_gelu_linear", w4a4_cat_gelu_linear), ("w4a4_ada_norm_linear", w4a4_ada_norm_linear),
                   ("w4a8_fast_gemm", w4a8_fast_gemm), ("w4a16_linear", w4a16_linear)):
    # a backward that names the problem (without one, torch's "no autograd formula was registered")
    _op.register_autograd(_no_gradient(f"svdq_linear::{_name}"), setup_context=_input_shapes)


def _is_cuda_major(major: int) -> Callable[[torch.device], bool]:
    def check(device: torch.device) -> bool:
        cap = device_capability(device)
        return cap is not None and cap[0] == major

    return check


from . import reference  # noqa: E402  (registers itself)

register_lazy("sm90", 20, "svdq_linear.backends.sm90", _is_cuda_major(9))
register_lazy("sm100", 30, "svdq_linear.backends.sm100", _is_cuda_major(10))

__all__ = [
    "Backend",
    "available_backends",
    "candidates",
    "choose",
    "device_capability",
    "get_backend",
    "register_backend",
    "register_lazy",
    "resolve",
    "select_backend",
    "w4a4_cat_gelu_linear",
    "w4a4_fast_linear",
    "w4a4_linear",
    "w4a8_fast_gemm",
    "w4a16_linear",
]
