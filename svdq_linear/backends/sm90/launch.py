"""A Triton launch that skips the JIT's per-call work once a kernel is compiled.

``kernel[grid](...)`` costs 16-29 us of host time a launch on the H200's host, against 9-14 us for the
compiled kernel launched directly (docs/perf.md, 2026-12-04 eighth session): Triton binds every
argument, computes its specialization key and looks the kernel up on each call. A small-M linear or
a fast-mode call makes two or three such launches, so the host, not the GPU, sets the pace of an
eager forward (the FLUX.1-dev-size forward: 162 ms eager against 144 ms for the same work captured in
a CUDA graph).

``FastLaunch(kernel)`` is called like ``kernel[grid]``: positional arguments in signature order, the
constexprs and launch options (``num_warps``, ``num_stages``, ``maxnreg``) by keyword. It keeps the
compiled kernels it has seen under a key of its own, built from exactly what Triton specializes a
kernel on: each tensor's dtype and whether its address is a multiple of 16, each integer's equality
to 1, divisibility by 16 and 32-bit range, the type of any other scalar, every constexpr value and
the launch options, and the device. Two calls with the same key would be given the same compiled
kernel by Triton (``tests/test_gpu.py`` checks this against Triton's own cache on the GPU), so a hit
launches that kernel straight through its launcher, with the tensors' addresses passed as integers.
A miss, the interpreter, and any launch or pre-run hook (a profiler's) go through Triton's JIT as
before.
"""

from __future__ import annotations

import inspect
import os

import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_OPTIONS = ("num_warps", "num_stages", "maxnreg")
_I32 = (-(1 << 31), 1 << 31)


def spec_of(value) -> object:
    """The part of the specialization key a runtime argument contributes (what Triton specializes on)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):  # before int: a bool is an int
        return "i1"
    if isinstance(value, int):
        return "int", value == 1, value % 16 == 0, _I32[0] <= value < _I32[1]
    if value is None:
        return None
    return type(value).__name__


class FastLaunch:
    """``FastLaunch(jit_kernel)(grid, *args, **constexprs_and_options)``: see the module docstring."""

    def __init__(self, kernel):
        self.kernel = kernel
        fn = getattr(kernel, "fn", None)
        params = inspect.signature(fn).parameters if fn is not None else {}
        self.names = tuple(params) or tuple(getattr(kernel, "arg_names", ()))
        self.defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        # indices of the constexpr parameters (Triton's own list; the annotations under the interpreter)
        cx = getattr(kernel, "constexprs", None)
        if cx is None:
            cx = [i for i, p in enumerate(params.values()) if "constexpr" in str(p.annotation)]
        self.constexpr = frozenset(cx)
        self.cache: dict[tuple, tuple] = {}

    def _slow(self, grid, args, kwargs):
        return self.kernel[grid](*args, **kwargs)

    def key(self, args: tuple, kwargs: dict, device: int | None = None) -> tuple[tuple, list]:
        """``(key, arguments)`` of a launch: the cache key (device, debug flag, launch options, each
        argument's specialization) and every argument in signature order, tensors as their addresses.
        ``device``: the CUDA device index (default: the current one, where Triton launches)."""
        names, cx = self.names, self.constexpr
        full, spec = [], []
        for i, name in enumerate(names):
            if i < len(args):
                v = args[i]
            elif name in kwargs:
                v = kwargs[name]
            elif name in self.defaults:
                v = self.defaults[name]
            else:
                raise TypeError(f"argument {name!r} missing in the launch of {self.kernel.__name__}")
            if i in cx:
                spec.append(v)
                full.append(v)
            elif isinstance(v, torch.Tensor):
                p = v.data_ptr()
                spec.append((v.dtype, p % 16 == 0))
                full.append(p)
            else:
                spec.append(spec_of(v))
                full.append(v)
        dev = torch.cuda.current_device() if device is None else device
        return (dev, _runtime().debug, tuple(kwargs.get(o) for o in _OPTIONS), tuple(spec)), full

    def __call__(self, grid, *args, **kwargs):
        if _INTERPRET or not isinstance(self.kernel, _jit_type()):
            return self._slow(grid, args, kwargs)
        rt = _runtime()
        if rt.launch_enter_hook is not None or rt.launch_exit_hook is not None or self.kernel.pre_run_hooks:
            return self._slow(grid, args, kwargs)
        key, full = self.key(args, kwargs)
        hit = self.cache.get(key)
        if hit is None:
            ck = self._slow(grid, args, kwargs)
            self.cache[key] = (ck.run, ck.function, ck.packed_metadata)
            return ck
        run, function, packed = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, torch._C._cuda_getCurrentRawStream(key[0]), function, packed, None, None, None, *full)
        return None


_JIT = None
_RUNTIME = None


def _runtime():
    """``triton.knobs.runtime`` (imported once: an import statement a call costs a microsecond)."""
    global _RUNTIME
    if _RUNTIME is None:
        from triton import knobs

        _RUNTIME = knobs.runtime
    return _RUNTIME


def _jit_type():
    global _JIT
    if _JIT is None:
        from triton.runtime.jit import JITFunction

        _JIT = JITFunction
    return _JIT
