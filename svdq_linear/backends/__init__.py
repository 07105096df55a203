"""Backend registry: which kernel runs an ``SVDQW4A4Linear`` on a given device.

A backend is a small object with a ``name``, ``supports(device, kind) -> bool`` (``kind`` is the
module's entry point: ``"w4a4"`` for ``SVDQW4A4Linear``, ``"w4a16"`` for ``NVFP4W4A16Linear``),
``prepare(module)`` (repack the canonical buffers once, at load time, into what its kernel reads; the
result is cached on the module) and ``linear(module, x2d, prepared) -> y2d``. Backends register
with a priority; ``select_backend`` returns the highest-priority one that supports the device and
kind, so a backend with only a W4A4 kernel leaves weight-only layers to the next one. The ``reference``
backend supports every device and is the oracle of the tests. ``SVDQ_LINEAR_BACKEND=name`` forces
a backend (an error if it does not support the device).

Kernels are exposed as ``torch.library`` custom ops with fake implementations, so
``torch.compile(fullgraph=True)`` and offload hooks see ordinary ops.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

ENV_BACKEND = "SVDQ_LINEAR_BACKEND"


class Backend(Protocol):
    name: str

    def supports(self, device: torch.device, kind: str) -> bool: ...

    def prepare(self, module) -> dict[str, torch.Tensor]: ...

    def linear(self, module, x: torch.Tensor, prepared: dict[str, torch.Tensor]) -> torch.Tensor: ...


_BACKENDS: dict[str, tuple[int, Backend]] = {}


def register_backend(backend: Backend, priority: int) -> None:
    """Add (or replace) a backend; a higher priority wins where several support a device."""
    _BACKENDS[backend.name] = (priority, backend)


def available_backends() -> list[str]:
    return [name for name, _ in sorted(_BACKENDS.items(), key=lambda kv: -kv[1][0])]


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name][1]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; registered: {available_backends()}") from None


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """``(major, minor)`` of a CUDA device, None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def select_backend(device: torch.device | str, name: str | None = None, kind: str = "w4a4") -> Backend:
    """The backend for ``kind`` on ``device``: ``name`` (or ``$SVDQ_LINEAR_BACKEND``) if given, else
    the highest-priority one that supports both."""
    device = torch.device(device)
    name = name or os.environ.get(ENV_BACKEND) or None
    if name is not None:
        backend = get_backend(name)
        if not backend.supports(device, kind):
            cap = device_capability(device)
            where = f"{device}" + (f" (sm_{cap[0]}{cap[1]})" if cap else "")
            raise RuntimeError(f"backend {name!r} does not support {kind} layers on {where}")
        return backend
    for _, backend in sorted(_BACKENDS.values(), key=lambda pb: -pb[0]):
        if backend.supports(device, kind):
            return backend
    raise RuntimeError(f"no svdq-linear backend supports {kind} layers on device {device}")


from . import reference  # noqa: E402  (registers itself)

__all__ = [
    "Backend",
    "available_backends",
    "device_capability",
    "get_backend",
    "register_backend",
    "select_backend",
    "reference",
]
