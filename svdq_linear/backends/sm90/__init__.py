"""The sm90 backend (H100/H200): exact W4A4 and W4A16 on 16-bit wgmma through Triton.

E2M1 codes times E4M3 scales are exact in bf16 and fp16, so the contract's block-scaled product is
computed exactly on Hopper's 16-bit tensor cores: ``quantize_act`` writes the exact dequantized
activations (and ``lora_act``) in one pass, and the W4 GEMM decodes the canonical packed weight in
registers, scales the accumulator by ``wcscale``, adds the low-rank product into the same
accumulator and writes the output once (``kernels.py``). The kernels read the canonical layouts, so
``prepare`` keeps no copy of the weight. Deviations from the reference stay inside the contract's
tensor-core tolerance (``svdq_linear.nvfp4``): FP32 summation order and tf32 operands of the
low-rank products.

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (slowly): the CPU test suite checks
them that way.
"""

from __future__ import annotations

import os

import torch

from .. import Backend, device_capability

MAX_RANK = 256


class Sm90Backend(Backend):
    name = "sm90"

    def __init__(self):
        from . import kernels, tuning  # imports Triton

        self.kernels, self.tuning = kernels, tuning
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"

    def _device_ok(self, device: torch.device) -> bool:
        if self.interpret:
            return device.type == "cpu"
        cap = device_capability(device)
        return cap is not None and cap[0] == 9

    def supports(self, device, kind):
        return kind in self.kinds and self._device_ok(device)

    def declines(self, module, device):
        if not (module.qweight.is_contiguous() and module.wscales.is_contiguous()):
            return "the packed weight is not contiguous"
        if module.kind == "w4a4":
            if module.rank > MAX_RANK:
                return f"rank {module.rank} > {MAX_RANK}"
            if not module.proj_up.is_contiguous():
                return "proj_up is not contiguous"
        return None

    def declines_call(self, module, x):
        if not self._device_ok(x.device):
            return f"input on {x.device}"
        if module.kind == "w4a16" and x.dtype not in (torch.bfloat16, torch.float16):
            return f"{x.dtype} input (the weight-only product runs on 16-bit operands)"
        return None

    def run_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        m, k = x.shape
        r = proj_down.shape[1]
        xq, _, _, lora = self.kernels.quantize_act(x, smooth, proj_down if r else None)
        cfg = self.tuning.pick(m, qweight.shape[0], k)
        return self.kernels.w4_gemm(xq, qweight, wscales, wcscale, bias, proj_up if r else None, lora, x.dtype, cfg)

    def run_w4a16(self, x, qweight, wscales, wcscale, bias, extra):
        if x.stride(1) != 1:
            x = x.contiguous()
        cfg = self.tuning.pick(x.shape[0], qweight.shape[0], x.shape[1])
        return self.kernels.w4_gemm(x, qweight, wscales, wcscale, bias, None, None, x.dtype, cfg)


def make_backend() -> Sm90Backend:
    return Sm90Backend()
