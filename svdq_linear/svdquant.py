"""SVDQuant: smoothing, a rank-R SVD branch and an NVFP4 residual, from a float weight.

For ``W [N, K]`` (and optional per-input-channel activation maxima ``act_max [K]``)::

    lambda_j = act_max_j^alpha / max|W[:, j]|^(1 - alpha)       (smoothing; 1 without statistics)
    Ws       = W diag(lambda)                                    (x W^T = (x / lambda) Ws^T)
    L        = U_R S_R V_R^T = top-R SVD of Ws                   (the low-rank branch, fp32/fp64)
    Qres     = NVFP4(Ws - L) with a float32 scale per row        (folded into wcscale)

Optional refinement repeats ``L <- SVD_R(Ws - Q(Ws - L))`` and keeps the iterate with the smallest
output error. With statistics, a power-of-two factor ``c`` is folded into ``smooth`` (and back into
``wcscale`` and ``proj_down``) so that the calibrated activation maximum sits ``act_headroom`` powers
of two below NVFP4's saturation point ``6 * 448`` (within one more power of two): single-level NVFP4
represents block maxima from about ``6 * 2**-9`` (subnormal scales) to ``6 * 448``, a span of
``2**17.8``, and the headroom trades precision of small blocks (nearer the subnormal scales) for
inputs hotter than the calibration set (which would saturate). A power of two keeps every fold exact.
``docs/perf.md`` ("activation headroom") has the measurement behind ``DEFAULT_ACT_HEADROOM``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass, field, fields

import torch

from . import nvfp4

SMOOTH_RULES = ("auto", "none", "weight", "activation")
DEFAULT_ACT_HEADROOM = 2
"""Powers of two between the calibrated activation maximum and saturation (see docs/perf.md)."""
MAX_ACT_HEADROOM = 12  # 2688 / 2**12 = 0.66: a calibrated maximum there is barely above the subnormal scales
SVD_METHODS = ("auto", "full", "lowrank")


@dataclass(frozen=True)
class SVDQuantConfig:
    """How to decompose one weight.

    rank: R of the low-rank branch (0 disables it).
    alpha: migration strength of the smoothing rule.
    smooth: ``"activation"`` (needs ``act_max``), ``"weight"`` (``lambda_j = max|W_j|^-(1-alpha)``,
        normalized to geometric mean 1), ``"none"`` (lambda = 1) or ``"auto"`` (activation when
        ``act_max`` is given, else none).
    svd: ``"full"`` (``torch.linalg.svd``), ``"lowrank"`` (randomized ``torch.svd_lowrank``) or
        ``"auto"`` (low-rank once ``min(N, K) >= lowrank_threshold``).
    svd_dtype: float32 or float64.
    refine_iters: extra ``L <- SVD_R(Ws - Q(Ws - L))`` iterations; the best iterate is kept.
    act_headroom: with ``act_max``, the calibrated maximum of ``x / smooth`` sits ``act_headroom`` to
        ``act_headroom + 1`` powers of two below ``6 * 448`` (an integer in 0..12).
    device: where the SVD runs; default the GPU when there is one, else the weight's device.
    """

    rank: int = 32
    alpha: float = 0.5
    smooth: str = "auto"
    svd: str = "auto"
    svd_dtype: torch.dtype = torch.float32
    refine_iters: int = 0
    act_headroom: int = DEFAULT_ACT_HEADROOM
    lowrank_threshold: int = 1024
    lowrank_oversample: int = 8
    lowrank_niter: int = 2
    device: str | None = None

    def __post_init__(self):
        for name in ("rank", "refine_iters", "act_headroom", "lowrank_threshold", "lowrank_oversample",
                     "lowrank_niter"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise TypeError(f"expected an integer {name}, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, int(value))  # frozen; a numpy integer would not serialize
            if name.startswith("lowrank_") and value < 0:
                raise ValueError(f"expected {name} >= 0, got {value}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real):  # numpy scalars included
            raise TypeError(f"expected a float alpha, got {self.alpha!r} ({type(self.alpha).__name__})")
        object.__setattr__(self, "alpha", float(self.alpha))
        if self.device is not None:
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"expected device to be a torch device name, got {self.device!r}") from e
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r}: no CUDA device is available to this torch")
        if self.rank < 0:
            raise ValueError(f"expected rank >= 0, got {self.rank}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"expected 0 <= alpha <= 1, got {self.alpha}")
        if self.smooth not in SMOOTH_RULES:
            raise ValueError(f"expected smooth in {SMOOTH_RULES}, got {self.smooth!r}")
        if self.svd not in SVD_METHODS:
            raise ValueError(f"expected svd in {SVD_METHODS}, got {self.svd!r}")
        if self.svd_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"expected svd_dtype float32 or float64, got {self.svd_dtype}")
        if self.refine_iters < 0:
            raise ValueError(f"expected refine_iters >= 0, got {self.refine_iters}")
        if not 0 <= self.act_headroom <= MAX_ACT_HEADROOM:
            raise ValueError(f"expected 0 <= act_headroom <= {MAX_ACT_HEADROOM}, got {self.act_headroom}")

    @classmethod
    def given(cls, rank: int | None, config: "SVDQuantConfig | None", kwargs: dict) -> "SVDQuantConfig":
        """``config``, or one of ``rank`` (32 unless given) and the keyword options ``kwargs``: both at once are
        refused, and so is a ``rank`` beside a ``config`` of another rank."""
        if config is None:
            return cls.from_kwargs(rank=32 if rank is None else rank, **kwargs)
        if kwargs:
            raise TypeError("pass either config or SVDQuant keyword options, not both")
        if rank is not None and rank != config.rank:
            raise TypeError(f"rank={rank} disagrees with config.rank={config.rank}: pass the rank once")
        return config

    @classmethod
    def from_kwargs(cls, **kwargs) -> "SVDQuantConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown SVDQuant option(s) {unknown}; expected some of {sorted(names)}")
        return cls(**kwargs)


@dataclass
class SVDQuantWeights:
    """The tensors of one ``SVDQW4A4Linear`` (shapes in its docstring) and the decomposition's error.

    ``rel_error`` is ``||(Ws - L - Qres) diag(xs_max)||_F / ||Ws diag(xs_max)||_F``, the output error
    of the weight side for inputs whose channel ranges are ``xs_max`` (all ones without statistics).
    """

    qweight: torch.Tensor
    wscales: torch.Tensor
    smooth: torch.Tensor
    proj_down: torch.Tensor
    proj_up: torch.Tensor
    wcscale: torch.Tensor
    bias: torch.Tensor | None
    rel_error: float = field(default=float("nan"))

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {
            "qweight": self.qweight,
            "wscales": self.wscales,
            "smooth": self.smooth,
            "proj_down": self.proj_down,
            "proj_up": self.proj_up,
            "wcscale": self.wcscale,
            "bias": self.bias,
        }


def _default_device(weight: torch.Tensor, device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if weight.device.type == "cpu" and torch.cuda.is_available():
        return torch.device("cuda")
    return weight.device if weight.device.type != "meta" else torch.device("cpu")


def _rel_clamp(v: torch.Tensor, rel: float = 1e-5) -> torch.Tensor:
    top = v.max()
    floor = top * rel if top > 0 else torch.ones_like(top)
    return v.clamp(min=floor)


def smoothing_factor(
    weight: torch.Tensor, act_max: torch.Tensor | None, alpha: float, rule: str = "auto"
) -> torch.Tensor:
    """``lambda [K]`` float32 for ``weight [N, K]`` under ``rule`` (see ``SVDQuantConfig.smooth``)."""
    weight = weight.detach()
    k = weight.shape[1]
    if rule == "auto":
        rule = "activation" if act_max is not None else "none"
    if rule == "none":
        return torch.ones(k, dtype=torch.float32, device=weight.device)
    w_max = _rel_clamp(weight.float().abs().amax(dim=0))
    if rule == "weight":
        lam = w_max.pow(-(1.0 - alpha))
        return lam / lam.log().mean().exp()
    if act_max is None:
        raise ValueError("smooth='activation' needs act_max (per-input-channel activation maxima)")
    a = _rel_clamp(act_max.float().to(weight.device).abs())
    return a.pow(alpha) / w_max.pow(1.0 - alpha)


def group_smoothing_factor(
    weights: list[torch.Tensor], act_max: torch.Tensor | None, alpha: float, rule: str = "auto"
) -> torch.Tensor:
    """One ``lambda [K]`` for linears that read the same input (q/k/v...): the rule applied to the
    weights stacked along N, so every member sees the column maxima of the whole group."""
    return smoothing_factor(torch.cat([w.detach() for w in weights], dim=0), act_max, alpha, rule)


def check_act_max(act_max, k: int) -> None:
    """``act_max`` must be a real tensor ``[K]`` of finite per-input-channel maxima (the calibration's)."""
    if (not isinstance(act_max, torch.Tensor) or tuple(act_max.shape) != (k,) or act_max.dtype == torch.bool
            or act_max.is_complex()):
        got = f"{act_max.dtype} {list(act_max.shape)}" if isinstance(act_max, torch.Tensor) else type(act_max).__name__
        raise ValueError(f"expected act_max as a real tensor [{k}] (per-input-channel maxima), got {got}")
    if not torch.isfinite(act_max).all():
        raise ValueError(f"act_max holds {int((~torch.isfinite(act_max)).sum())} NaN or Inf values (calibration "
                         "maxima must be finite)")


def _check_finite_bias(bias: torch.Tensor | None) -> None:
    """A bias of NaN or Inf is a damaged checkpoint, refused as NaN or Inf weights are (loading refuses it too)."""
    if bias is not None and not torch.isfinite(bias.detach()).all():
        raise ValueError(f"bias holds {int((~torch.isfinite(bias.detach())).sum())} NaN or Inf values; cannot "
                         f"quantize the layer")


def weight_only(weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None):
    """The tensors of an ``NVFP4W4A16Linear`` for ``weight [N, K]``: qweight, wscales, wcscale, bias."""
    _check_finite_bias(bias)
    qweight, wscales, row_scale = nvfp4.quantize_weight(weight.detach())
    tensors = {"qweight": qweight, "wscales": wscales, "wcscale": row_scale}
    if bias is not None:
        tensors["bias"] = bias.detach().to(dtype or weight.dtype)
    return tensors


def low_rank(
    a: torch.Tensor, rank: int, config: SVDQuantConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``rank`` factors of ``a [N, K]``: ``(up [N, R], down [K, R])`` with ``a ~= up @ down.T``.

    The singular values are split evenly (``sqrt(S)`` on each side) to keep both factors in range
    for bf16/fp16.
    """
    n, k = a.shape
    if rank == 0:
        return a.new_zeros(n, 0), a.new_zeros(k, 0)
    a = a.to(config.svd_dtype)
    method = config.svd
    if method == "auto":
        method = "lowrank" if min(n, k) >= config.lowrank_threshold else "full"
    if method == "full":
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        v = vh.T
    else:
        q = min(rank + config.lowrank_oversample, n, k)
        u, s, v = torch.svd_lowrank(a, q=q, niter=config.lowrank_niter)
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).float().contiguous(), (v[:, :rank] * root).float().contiguous()


def _quantize_residual(ws: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    residual = ws - up @ down.T
    qweight, wscales, row_scale = nvfp4.quantize_weight(residual)
    deq = nvfp4.dequantize_weight(qweight, wscales, row_scale)
    return qweight, wscales, row_scale, deq


def activation_factor(xs_max: torch.Tensor | None, headroom: int = 0) -> float:
    """Power of two ``c`` so that ``max(xs_max) / c`` lies in ``(6*448 / 2**(headroom+1), 6*448 / 2**headroom]``."""
    if xs_max is None:
        return 1.0
    top = float(xs_max.max())
    if not math.isfinite(top) or top <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(top / nvfp4.NVFP4_MAX) + headroom)


def activation_headroom(act_max: torch.Tensor, smooth: torch.Tensor) -> float:
    """How many powers of two the calibrated block maximum of ``x / smooth`` sits below saturation.

    ``log2(6*448 / max(act_max / smooth))`` for a layer's calibration maxima ``act_max [K]`` and its
    ``smooth [K]`` (which holds the activation factor): negative when calibrated inputs saturate,
    ``inf`` for an all-zero ``act_max``.
    """
    top = float((act_max.float().abs() / smooth.float().to(act_max.device)).max())
    return math.log2(nvfp4.NVFP4_MAX / top) if top > 0 else math.inf


@contextlib.contextmanager
def _autocast_off():
    """Every autocast region that is on, off: the decomposition's fp32 matmuls must not run in 16 bits, or the
    packed weights would depend on whether the caller had autocast on."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def svdquant(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_max: torch.Tensor | None = None,
    config: SVDQuantConfig | None = None,
    dtype: torch.dtype | None = None,
    smooth: torch.Tensor | None = None,
    seed: int = 0,
) -> SVDQuantWeights:
    """Decompose ``weight [N, K]`` (+ ``bias [N]``) into the tensors of an ``SVDQW4A4Linear``.

    ``act_max [K]`` holds per-input-channel max |x| from calibration. ``dtype`` is that of
    ``proj_down``/``proj_up``/``bias`` (default: the weight's). ``smooth`` overrides the smoothing
    factor lambda (linears that read one input share one: see ``group_smoothing_factor``). ``seed``
    seeds the randomized SVD, so a conversion is reproducible. Results are on the weight's device, and the same
    with autocast on or off.
    """
    with _autocast_off():
        return _svdquant(weight, bias, act_max, config, dtype, smooth, seed)


def _svdquant(weight, bias, act_max, config, dtype, smooth, seed) -> SVDQuantWeights:
    config = config or SVDQuantConfig()
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % nvfp4.BLOCK_SIZE:
        raise ValueError(f"expected in_features % {nvfp4.BLOCK_SIZE} == 0, got {k}")
    if config.rank > min(n, k):
        raise ValueError(f"rank {config.rank} exceeds min(out_features, in_features) = {min(n, k)}")
    if act_max is not None:
        check_act_max(act_max, k)
    if smooth is not None and not (torch.isfinite(smooth) & (smooth > 0)).all():
        raise ValueError("smooth must be finite and positive (it divides the input)")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"expected bias of shape ({n},), got {tuple(bias.shape)}")
    _check_finite_bias(bias)
    out_device = weight.device
    dtype = dtype or weight.dtype
    dev = _default_device(weight, config.device)
    w = weight.detach().to(dev, torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("weight holds NaN or Inf values; cannot quantize it")

    lam = smoothing_factor(w, act_max, config.alpha, config.smooth) if smooth is None else smooth.to(dev, torch.float32)
    if tuple(lam.shape) != (k,):
        raise ValueError(f"expected a smoothing factor of shape ({k},), got {tuple(lam.shape)}")
    ws = w * lam
    xs_max = None if act_max is None else act_max.detach().to(dev, torch.float32).abs() / lam
    col_weight = xs_max if xs_max is not None else torch.ones_like(lam)
    ref_norm = (ws * col_weight).norm().clamp(min=torch.finfo(torch.float32).tiny)

    # The activation factor c (a power of two) folds into smooth, wcscale and the low-rank branch. In fp16 (five
    # exponent bits) a small c would push proj_down * c into subnormals or zero, so there it splits between the two
    # factors (c_down * c_up = c, both powers of two); bf16 and fp32 keep it whole on proj_down.
    c = activation_factor(xs_max, config.act_headroom)
    c_down = 2.0 ** math.floor(math.log2(c) / 2) if dtype == torch.float16 else c
    c_up = c / c_down
    best = None
    target = ws
    for _ in range(config.refine_iters + 1):
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            up, down = low_rank(target, config.rank, config)
        # The module stores the folded factors in ``dtype``: quantize the residual against what it will hold.
        up_s, down_s = (up * c_up).to(dtype), (down * c_down).to(dtype)
        up, down = up_s.float() / c_up, down_s.float() / c_down
        qweight, wscales, row_scale, deq = _quantize_residual(ws, up, down)
        err = float(((ws - up @ down.T - deq) * col_weight).norm() / ref_norm)
        if best is None or err < best[0]:
            best = (err, up_s, down_s, qweight, wscales, row_scale)
        target = ws - deq

    err, up_s, down_s, qweight, wscales, row_scale = best
    return SVDQuantWeights(
        qweight=qweight.to(out_device),
        wscales=wscales.to(out_device),
        smooth=(lam * c).to(out_device),
        proj_down=down_s.to(out_device),
        proj_up=up_s.to(out_device),
        wcscale=(row_scale * c).to(out_device),
        bias=None if bias is None else bias.detach().to(out_device, dtype),
        rel_error=err,
    )
