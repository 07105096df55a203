"""``SVDQW4A4Linear``: the drop-in 4-bit replacement of ``nn.Linear``."""

from __future__ import annotations

import torch
from torch import nn

from . import backends, nvfp4
from .svdquant import SVDQuantConfig, SVDQuantWeights, svdquant

# Buffers kept in a fixed dtype whatever ``.to(dtype)`` asks: packed codes, E4M3 block scales, and
# the float32 per-channel factors (wcscale is ~1e-5 for typical weights: subnormal in fp16).
_FIXED_DTYPES = {
    "qweight": torch.uint8,
    "wscales": torch.float8_e4m3fn,
    "smooth": torch.float32,
    "wcscale": torch.float32,
}


class SVDQW4A4Linear(nn.Module):
    """``y = x W^T + b`` with W in SVDQuant W4A4 form (NVFP4 residual + rank-R low-rank branch).

    Buffers (N = out_features, K = in_features, R = rank):

    - ``qweight [N, K/2] uint8``: E2M1 codes of the residual, element 2i in the low nibble;
    - ``wscales [N, K/16] float8_e4m3fn``: one scale per 16 consecutive k, row-major;
    - ``smooth [K] float32``: the smoothing factor (input is divided by it);
    - ``proj_down [K, R]``, ``proj_up [N, R]``: the low-rank branch, in the module's float dtype;
    - ``wcscale [N] float32``: per-output-channel scale of the FP4 product;
    - ``bias [N]`` or None, in the module's float dtype.

    ``forward`` accepts any leading dimensions and bf16/fp16/fp32 inputs and returns the input's
    dtype. ``.to(dtype)`` casts only ``proj_down``, ``proj_up`` and ``bias``. The kernel is chosen per
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
        super().__init__()
        if in_features <= 0 or in_features % nvfp4.BLOCK_SIZE:
            raise ValueError(
                f"expected in_features to be a positive multiple of {nvfp4.BLOCK_SIZE}, got {in_features}"
            )
        if out_features <= 0:
            raise ValueError(f"expected out_features > 0, got {out_features}")
        if rank < 0:
            raise ValueError(f"expected rank >= 0, got {rank}")
        dtype = dtype or torch.get_default_dtype()
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise TypeError(f"expected a float16/bfloat16/float32 module dtype, got {dtype}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        n, k, r = out_features, in_features, rank
        self.register_buffer("qweight", torch.zeros(n, k // 2, dtype=torch.uint8, device=device))
        self.register_buffer("wscales", torch.zeros(n, k // nvfp4.BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("smooth", torch.ones(k, dtype=torch.float32, device=device))
        self.register_buffer("proj_down", torch.zeros(k, r, dtype=dtype, device=device))
        self.register_buffer("proj_up", torch.zeros(n, r, dtype=dtype, device=device))
        self.register_buffer("wcscale", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)
        self._backend_name: str | None = None
        self._backend = None
        self._prepared: dict[str, torch.Tensor] = {}
        self._register_load_state_dict_pre_hook(self._check_state_dict)
        self.register_load_state_dict_post_hook(lambda module, _: module._refresh())
        self._refresh()

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        rank: int = 32,
        act_max: torch.Tensor | None = None,
        config: SVDQuantConfig | None = None,
        **config_kwargs,
    ) -> "SVDQW4A4Linear":
        """SVDQuant ``linear`` (see ``svdq_linear.svdquant``); ``act_max [K]`` from calibration.

        Extra keyword arguments are ``SVDQuantConfig`` fields (``alpha``, ``smooth``, ``svd``, ...).
        The module keeps the linear's dtype and device.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
        if config is None:
            config = SVDQuantConfig.from_kwargs(rank=rank, **config_kwargs)
        elif config_kwargs:
            raise TypeError("pass either config or SVDQuant keyword options, not both")
        weights = svdquant(linear.weight, linear.bias, act_max=act_max, config=config)
        return cls.from_weights(weights)

    @classmethod
    def from_weights(cls, weights: SVDQuantWeights) -> "SVDQW4A4Linear":
        """A module holding the tensors of a decomposition (checked like a state_dict)."""
        n, k = weights.qweight.shape[0], weights.qweight.shape[1] * 2
        module = cls(
            k,
            n,
            rank=weights.proj_down.shape[1],
            bias=weights.bias is not None,
            device="meta",
            dtype=weights.proj_down.dtype,
        )
        tensors = {name: t for name, t in weights.tensors().items() if t is not None}
        module.load_state_dict(tensors, strict=True, assign=True)
        return module

    # ---- dtype/device handling ------------------------------------------------------------------

    def _apply(self, fn, recurse=True):
        fixed = {name: getattr(self, name) for name in _FIXED_DTYPES}
        super()._apply(fn, recurse)
        device = self.proj_down.device
        for name, before in fixed.items():
            after = self._buffers[name]
            if after.dtype != _FIXED_DTYPES[name]:
                self._buffers[name] = before.to(device)
        self._refresh()
        return self

    def _check_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        """Shape/dtype check of every incoming buffer, naming the offending tensor."""
        n, k, r = self.out_features, self.in_features, self.rank
        expected = {
            "qweight": ((n, k // 2), torch.uint8),
            "wscales": ((n, k // nvfp4.BLOCK_SIZE), torch.float8_e4m3fn),
            "smooth": ((k,), None),
            "proj_down": ((k, r), None),
            "proj_up": ((n, r), None),
            "wcscale": ((n,), None),
            "bias": ((n,), None),
        }
        for name, (shape, dtype) in expected.items():
            key = prefix + name
            if key not in state_dict:
                continue
            t = state_dict[key]
            if name == "bias" and self.bias is None:
                raise ValueError(f"{key}: this SVDQW4A4Linear was built with bias=False, but the state_dict has a bias")
            if tuple(t.shape) != shape:
                raise ValueError(
                    f"{key}: expected shape {list(shape)} for SVDQW4A4Linear(in_features={k}, "
                    f"out_features={n}, rank={r}), got {list(t.shape)}"
                )
            if dtype is not None and t.dtype != dtype:
                raise ValueError(f"{key}: expected dtype {dtype}, got {t.dtype}")
            if dtype is None and not (t.dtype.is_floating_point and t.dtype.itemsize >= 2):
                raise ValueError(f"{key}: expected a float16/bfloat16/float32 tensor, got {t.dtype}")
            if name in _FIXED_DTYPES and t.dtype != _FIXED_DTYPES[name]:
                state_dict[key] = t.to(_FIXED_DTYPES[name])
            elif dtype is None and self._buffers[name].device.type == "meta":
                pass  # assign=True: the module takes the file's float dtype
            elif dtype is None:
                state_dict[key] = t.to(self._buffers[name].dtype)

    # ---- backends -------------------------------------------------------------------------------

    def set_backend(self, name: str | None) -> "SVDQW4A4Linear":
        """Pin a backend by name (None: choose per device again)."""
        self._backend_name = name
        self._refresh()
        return self

    @property
    def backend(self) -> str:
        return self._backend.name

    def _refresh(self) -> None:
        """Pick the backend for the buffers' device and let it repack (once per move or load)."""
        device = self.qweight.device
        self._backend = backends.select_backend(device, self._backend_name)
        self._prepared = {} if device.type == "meta" else self._backend.prepare(self)

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input with last dimension {self.in_features}, got shape {tuple(x.shape)}")
        nvfp4.check_act_dtype(x)
        if x.device != self.qweight.device:
            raise RuntimeError(f"input is on {x.device} but the SVDQW4A4Linear is on {self.qweight.device}")
        lead = x.shape[:-1]
        y = self._backend.linear(self, x.reshape(-1, self.in_features), self._prepared)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"bias={self.bias is not None}, backend={self.backend}"
        )
