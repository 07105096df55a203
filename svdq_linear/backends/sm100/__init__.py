"""sm100 backend: datacenter Blackwell (B200 sm_100a, B300 sm_103a), compute capability 10.x.

``make_backend()`` returns the backend object the seam in ``svdq_linear.backends`` registers (lazily:
importing ``svdq_linear`` imports nothing from here). The kernel modules (cutlass, triton) are
imported on first use. See ``design.md`` beside this file.

Per call: ``quantize_act`` (Triton) turns ``x`` into E2M1 codes + E4M3 scales in the tcgen05
scale-factor atom layout; ``lora_act = x.bf16 @ (proj_down / smooth)`` (one bf16 GEMM, the prepared
``proj_down_smoothed``); then one persistent kernel computes
``y = (A4 (*) W4 + lora_act @ (proj_up / wcscale)^T) * wcscale + bias``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import nvfp4
from .. import Backend
from . import host

_MODULE_TENSORS = ("qweight", "wscales", "smooth", "proj_down", "proj_up", "wcscale", "bias")


@dataclass
class Sm100Prepared:
    """What ``prepare`` builds once per layer and device (kept on the module by the seam).

    - ``wsf``: weight scales in the scale-factor atom layout, flat uint8 (``host.to_sf_atom_layout``);
    - ``smooth_recip [K] f32``: ``1 / smooth`` (IEEE division, the contract's rule);
    - ``proj_up_folded [N_pad, R] bf16``: ``proj_up / wcscale`` rows, zero rows past N; bf16 even for
      fp16 output, because ``proj_up / wcscale`` routinely exceeds fp16's range;
    - ``wcscale_pad``, ``bias_pad [N_pad] f32``: zero past N (bias zeros when the layer has none);
    - ``proj_down_smoothed [K, R] bf16``: ``proj_down / smooth``, so ``lora_act = x.bf16 @ it`` is one bf16
      tensor-core GEMM reading x (the contract's bf16 operands of the low-rank product, as sm90's).
    """

    wsf: torch.Tensor
    smooth_recip: torch.Tensor
    proj_up_folded: torch.Tensor
    wcscale_pad: torch.Tensor
    bias_pad: torch.Tensor
    proj_down_smoothed: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.wsf, self.smooth_recip, self.proj_up_folded, self.wcscale_pad, self.bias_pad,
                self.proj_down_smoothed]

    @classmethod
    def from_tensors(cls, extra: list[torch.Tensor]) -> "Sm100Prepared":
        return cls(*extra)


def arch_of(device: torch.device) -> str | None:
    """``sm_100a`` / ``sm_103a`` for a CUDA device of capability 10.x, None otherwise."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major != 10:
        return None
    return "sm_103a" if minor == 3 else "sm_100a"


class Sm100Backend(Backend):
    name = "sm100"
    kinds = frozenset({"w4a4"})

    def __init__(self):
        self._compiled: dict[tuple, object] = {}

    # ---- choice --------------------------------------------------------------------------------

    def supports(self, device: torch.device, kind: str) -> bool:
        return kind == "w4a4" and arch_of(device) is not None

    def declines(self, module, device: torch.device | None = None) -> str | None:
        """Why this layer cannot run here (alignment, rank, scales), None if it can."""
        if getattr(module, "kind", None) != "w4a4":
            return "the sm100 kernel runs W4A4 layers only"
        n, k, r = module.out_features, module.in_features, module.rank
        reason = host.layer_alignment_error(n, k, r)
        if reason:
            return reason
        wc = module.wcscale.float()
        if not torch.isfinite(wc).all() or bool((wc == 0).any()):
            return "wcscale holds zeros or non-finite values: proj_up / wcscale cannot be folded"
        folded = module.proj_up.float() / wc[:, None]
        if not torch.isfinite(folded).all() or float(folded.abs().max()) > torch.finfo(torch.bfloat16).max:
            return "proj_up / wcscale overflows bfloat16"
        return None

    def declines_call(self, module, x: torch.Tensor) -> str | None:
        if x.dtype not in (torch.bfloat16, torch.float16):
            return f"the sm100 kernel takes bfloat16/float16 inputs, got {x.dtype}"
        if arch_of(x.device) is None:
            return f"input on {x.device}, not a compute capability 10.x GPU"
        if x.dim() != 2 or x.stride(-1) != 1:
            return "expected a 2-D input with unit stride along in_features"
        return None

    # ---- preparation ---------------------------------------------------------------------------

    def prepare(self, module, device: torch.device | None = None) -> Sm100Prepared:
        n, r = module.out_features, module.rank
        n_pad = -(-n // 256) * 256  # covers both tile_n choices
        dev = module.qweight.device if device is None else torch.device(device)
        wc = module.wcscale.to(dev, torch.float32)
        folded = torch.zeros(n_pad, r, dtype=torch.bfloat16, device=dev)
        folded[:n] = (module.proj_up.to(dev, torch.float32) / wc[:, None]).to(torch.bfloat16)
        wcs = torch.zeros(n_pad, dtype=torch.float32, device=dev)
        wcs[:n] = wc
        bias = torch.zeros(n_pad, dtype=torch.float32, device=dev)
        if module.bias is not None:
            bias[:n] = module.bias.to(dev, torch.float32)
        return Sm100Prepared(
            wsf=host.to_sf_atom_layout(module.wscales.to(dev)).view(torch.uint8),
            smooth_recip=1.0 / module.smooth.to(dev, torch.float32),
            proj_up_folded=folded,
            wcscale_pad=wcs,
            bias_pad=bias,
            proj_down_smoothed=nvfp4.proj_down_smoothed(module.proj_down.to(dev), module.smooth.to(dev)),
        )

    def extra_tensors(self, prepared: Sm100Prepared) -> list[torch.Tensor]:
        return prepared.tensors()

    # ---- run -----------------------------------------------------------------------------------

    def run_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra) -> torch.Tensor:
        from .quantize import quantize_act

        p = Sm100Prepared.from_tensors(extra)
        m, k = x.shape
        n, r = qweight.shape[0], proj_down.shape[1]
        if m == 0:  # no tile: the persistent grid would have 0 clusters, and CUDA refuses a launch of 0 blocks
            return torch.empty(0, n, dtype=x.dtype, device=x.device)
        codes, asf, _ = quantize_act(x, p.smooth_recip)
        lora_act = self.lora_act(x, p)
        out_dtype = "bfloat16" if x.dtype == torch.bfloat16 else "float16"
        cfg = host.choose_config(m, n, r, out_dtype)
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        self._launch(cfg, arch_of(x.device), codes, qweight, asf, p.wsf, lora_act, p.proj_up_folded, y,
                     p.wcscale_pad, p.bias_pad, m, n, k)
        return y

    @staticmethod
    def lora_act(x: torch.Tensor, p: Sm100Prepared) -> torch.Tensor:
        """``lora_act [M, R] bf16 = x.bf16 @ (proj_down / smooth)``: one bf16 GEMM (fp32 accumulation, one
        rounding), as sm90's exact mode computes it. It had been ``(x / smooth) @ proj_down`` in float32 from a
        written float32 copy of ``xs``: [M, K] fp32 written and read again (67 MB at 4352 x 3840) and an fp32
        GEMM, together several times the NVFP4 GEMM's own time on a B200."""
        return x.to(torch.bfloat16) @ p.proj_down_smoothed

    def _launch(self, cfg, arch, a, b, sfa, sfb, a2, b2, c, wcs, bias, m, n, k):
        import cuda.bindings.driver as cuda
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        from . import layouts
        from .kernel import compile_kernel

        sm_count = resident_ctas(c.device, cfg.cluster_shape_mn[0] * cfg.cluster_shape_mn[1])
        key = (cfg, arch, sm_count)
        if key not in self._compiled:
            self._compiled[key] = compile_kernel(cfg, arch, sm_count)
        gmem = cute.AddressSpace.gmem
        ptr = lambda dt, t, align: make_ptr(dt, t.data_ptr(), gmem, assumed_align=align)  # noqa: E731
        args = [
            ptr(layouts.AB_DTYPE, a, 32), ptr(layouts.AB_DTYPE, b, 32),
            ptr(layouts.SF_DTYPE, sfa, 32), ptr(layouts.SF_DTYPE, sfb, 32),
            ptr(layouts.LOWRANK_DTYPE, a2, 16), ptr(layouts.LOWRANK_DTYPE, b2, 16),
            ptr(layouts.out_dtype_of(cfg), c, 16), ptr(cutlass.Float32, wcs, 16), ptr(cutlass.Float32, bias, 16),
        ]
        stream = cuda.CUstream(torch.cuda.current_stream(c.device).cuda_stream)
        self._compiled[key](*args, cutlass.Int32(m), cutlass.Int32(n), cutlass.Int32(k), stream)


_RESIDENT: dict = {}


def resident_ctas(device: torch.device, cluster_size: int) -> int:
    """CTAs the persistent grid can keep resident at once on ``device``: the driver's count of active clusters of
    ``cluster_size`` at the kernel's shared memory (``HardwareInfo.get_max_active_clusters``, as CUTLASS's
    persistent examples size their grids), times the cluster size. Fewer than ``SMs / cluster_size`` where a GPC
    cannot hold whole clusters, or under MPS limits; a grid sized by the SM count would then run its last clusters
    as a second wave. The SM count where the driver cannot say. Cached per device and cluster size."""
    key = (device, cluster_size)
    if key not in _RESIDENT:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        try:
            import cutlass.utils

            with torch.cuda.device(device):  # the driver query runs in the current context: make it this device's
                clusters = cutlass.utils.HardwareInfo(device.index or 0).get_max_active_clusters(cluster_size)
            _RESIDENT[key] = min(sms, clusters * cluster_size) if clusters > 0 else sms
        except Exception:  # an older driver, or the query unavailable: the SM count, as before
            _RESIDENT[key] = sms
    return _RESIDENT[key]


def make_backend() -> Sm100Backend:
    return Sm100Backend()
