"""The reference backend: the contract of ``svdq_linear.nvfp4`` in PyTorch, on any device.

FP32 accumulation; slow (it dequantizes the weight on every call) and exact to the contract. It is
the oracle of every test and the fallback where no kernel supports the device.
"""

from __future__ import annotations

import torch

from ... import nvfp4
from .. import register_backend


@torch.library.custom_op("svdq_linear::w4a4_linear_ref", mutates_args=())
def w4a4_linear_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    wscales: torch.Tensor,
    smooth: torch.Tensor,
    proj_down: torch.Tensor,
    proj_up: torch.Tensor,
    wcscale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``y [M, N]`` (x's dtype) of the contract for ``x [M, K]``."""
    y = nvfp4.w4a4_linear(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias)
    return y.to(x.dtype)


@w4a4_linear_ref.register_fake
def _(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias):
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.custom_op("svdq_linear::quantize_nvfp4_ref", mutates_args=())
def quantize_nvfp4_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-level NVFP4 of ``x [M, K]``: ``(packed [M, K/2] uint8, scales [M, K/16] e4m3)``."""
    return nvfp4.quantize_nvfp4(x)


@quantize_nvfp4_ref.register_fake
def _(x):
    m, k = x.shape
    return (
        x.new_empty(m, k // 2, dtype=torch.uint8),
        x.new_empty(m, k // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn),
    )


@torch.library.custom_op("svdq_linear::w4a16_linear_ref", mutates_args=())
def w4a16_linear_ref(
    x: torch.Tensor, qweight: torch.Tensor, wscales: torch.Tensor, wcscale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Weight-only ``y [M, N]`` (x's dtype) for ``x [M, K]``."""
    return nvfp4.w4a16_linear(x, qweight, wscales, wcscale, bias).to(x.dtype)


@w4a16_linear_ref.register_fake
def _(x, qweight, wscales, wcscale, bias):
    return x.new_empty(x.shape[0], qweight.shape[0])


class ReferenceBackend:
    name = "reference"

    def supports(self, device: torch.device, kind: str) -> bool:
        return kind in ("w4a4", "w4a16")

    def prepare(self, module) -> dict[str, torch.Tensor]:
        return {}

    def linear(self, module, x: torch.Tensor, prepared: dict[str, torch.Tensor]) -> torch.Tensor:
        if module.kind == "w4a16":
            return w4a16_linear_ref(x, module.qweight, module.wscales, module.wcscale, module.bias)
        return w4a4_linear_ref(
            x,
            module.qweight,
            module.wscales,
            module.smooth,
            module.proj_down,
            module.proj_up,
            module.wcscale,
            module.bias,
        )


register_backend(ReferenceBackend(), priority=0)
