"""The reference backend: the contract of ``svdq_linear.nvfp4`` in PyTorch, on any device.

FP32 accumulation; slow (it dequantizes the weight on every call) and exact to the contract. It is
the oracle of every test and the fallback that serves every layer and call no kernel takes.
"""

from __future__ import annotations

from ... import nvfp4
from .. import Backend, register_backend


class ReferenceBackend(Backend):
    name = "reference"
    kinds = frozenset({"w4a4", "w4a4_fast", "w4a16"})

    def run_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        return nvfp4.w4a4_linear(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias).to(x.dtype)

    def run_w4a4_fast(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        return nvfp4.w4a8_fast_linear(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias).to(x.dtype)

    def run_w4a16(self, x, qweight, wscales, wcscale, bias, extra):
        return nvfp4.w4a16_linear(x, qweight, wscales, wcscale, bias).to(x.dtype)


register_backend(ReferenceBackend(), priority=0)
