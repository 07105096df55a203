"""diffusers integration: the ``svdq_w4a4`` quantization config and quantizer.

``import svdq_linear`` registers them in ``diffusers.quantizers.auto`` (diffusers has no public
registry), so stock ``DiffusionPipeline.from_pretrained(folder)`` and
``FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer")`` build the quantized
modules of a folder written by ``svdq-convert``. Without this, such a folder fails loudly
("Unknown quantization type"), and a folder *without* ``quantization_config`` would load as plain
``nn.Linear``s with random/meta weights: the converter always writes it, and loading here checks
the checkpoint's keys against the config both ways and that nothing is left on ``meta``.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

from .linear import NVFP4W4A16Linear, SVDQW4A4Linear, _PackedNVFP4Linear

QUANT_METHOD = "svdq_w4a4"
FORMAT_VERSION = 1


class SVDQQuantMethod(str, enum.Enum):
    """diffusers reads ``quant_method.value``: a str-Enum of our own (its enum is closed)."""

    SVDQ_W4A4 = QUANT_METHOD

    def __str__(self) -> str:
        return self.value


def _config_mixin():
    from diffusers.quantizers.quantization_config import QuantizationConfigMixin

    return QuantizationConfigMixin


class SVDQuantizationConfig(_config_mixin()):
    """What ``transformer/config.json``'s ``quantization_config`` records.

    rank: R of every W4A4 layer. w4a4_modules / w4a16_modules: the module names swapped for
    ``SVDQW4A4Linear`` / ``NVFP4W4A16Linear``. smooth_groups: W4A4 name -> the group whose smoothing
    factor it shares. calibration: how activation statistics were gathered. conversion: the
    SVDQuant options used (alpha, svd, refine_iters, ...).
    """

    def __init__(
        self,
        rank: int = 32,
        w4a4_modules: list[str] | None = None,
        w4a16_modules: list[str] | None = None,
        smooth_groups: dict[str, str] | None = None,
        calibration: dict[str, Any] | None = None,
        conversion: dict[str, Any] | None = None,
        format_version: int = FORMAT_VERSION,
        **kwargs,  # from_dict passes quant_method back in
    ):
        qm = kwargs.pop("quant_method", QUANT_METHOD)
        if str(qm) != QUANT_METHOD:
            raise ValueError(f"expected quant_method {QUANT_METHOD!r}, got {qm!r}")
        if kwargs:
            raise ValueError(f"unknown {QUANT_METHOD} quantization_config keys: {sorted(kwargs)}")
        if not isinstance(format_version, int) or format_version > FORMAT_VERSION or format_version < 1:
            raise ValueError(
                f"{QUANT_METHOD} format_version {format_version!r} is not supported by this svdq-linear "
                f"(it reads version {FORMAT_VERSION}); upgrade svdq-linear"
            )
        self.quant_method = SVDQQuantMethod.SVDQ_W4A4
        self.format_version = format_version
        self.rank = int(rank)
        self.w4a4_modules = list(w4a4_modules or [])
        self.w4a16_modules = list(w4a16_modules or [])
        self.smooth_groups = dict(smooth_groups or {})
        self.calibration = dict(calibration or {})
        self.conversion = dict(conversion or {})

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["quant_method"] = self.quant_method.value
        return d

    def to_diff_dict(self) -> dict[str, Any]:  # the mixin's __repr__ needs it
        return self.to_dict()


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def mark_quantized(model: nn.Module) -> None:
    """Let diffusers' ``fuse_qkv_projections`` fuse quantized q/k/v exactly (``svdq_linear.fuse``)."""
    from .fuse import fuse_attention_projections

    fuse_attention_projections(model)


def swap_in_quantized_modules(model: nn.Module, config: SVDQuantizationConfig, dtype: torch.dtype) -> None:
    """Replace the config's targets with empty (``meta``) quantized modules of the same shape."""
    for names, build in (
        (config.w4a4_modules, lambda lin: SVDQW4A4Linear(
            lin.in_features, lin.out_features, rank=config.rank, bias=lin.bias is not None,
            device="meta", dtype=dtype)),
        (config.w4a16_modules, lambda lin: NVFP4W4A16Linear(
            lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta", dtype=dtype)),
    ):
        for name in names:
            try:
                lin = model.get_submodule(name)
            except AttributeError:
                raise ValueError(
                    f"quantization_config names module {name!r}, which {type(model).__name__} does not have"
                ) from None
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"quantization_config names {name!r}, a {type(lin).__name__}, not an nn.Linear")
            _set_submodule(model, name, build(lin))
    mark_quantized(model)


def check_keys(model: nn.Module, checkpoint_keys, where: str) -> None:
    """Both ways: every model tensor is in the checkpoint and every checkpoint tensor in the model."""
    expected = set(model.state_dict())
    got = set(checkpoint_keys)
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {missing[:4]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {unexpected[:4]})")
        raise ValueError(f"{where}: the checkpoint does not match its quantization_config: " + "; ".join(parts))


def check_no_meta(model: nn.Module, where: str) -> None:
    left = [n for n, t in model.state_dict().items() if t.is_meta]
    if left:
        raise RuntimeError(f"{where}: {len(left)} tensors were never loaded (e.g. {left[:4]})")


def _quantizer_base():
    from diffusers.quantizers.base import DiffusersQuantizer

    return DiffusersQuantizer


class SVDQuantizer(_quantizer_base()):
    """Loads ``svdq_w4a4`` checkpoints: swaps the targets before weights load, claims their tensors."""

    requires_calibration = True  # pre-quantized checkpoints only; converting is svdq-convert's job
    supports_parallel_loading = False

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.loaded_keys: set[str] | None = None
        self.compute_dtype = torch.get_default_dtype()

    def update_torch_dtype(self, torch_dtype):
        if torch_dtype is not None:
            self.compute_dtype = torch_dtype
        return torch_dtype

    def maybe_update_loaded_keys(self, loaded_keys, checkpoint_files):
        self.loaded_keys = set(loaded_keys)
        return loaded_keys

    def _process_model_before_weight_loading(self, model, device_map=None, keep_in_fp32_modules=None, **kwargs):
        swap_in_quantized_modules(model, self.quantization_config, self.compute_dtype)
        if self.loaded_keys is not None:
            check_keys(model, self.loaded_keys, type(model).__name__)
        return model

    def check_if_quantized_param(self, model, param_value, param_name, state_dict, **kwargs) -> bool:
        module_name, _, _ = param_name.rpartition(".")
        try:
            return isinstance(model.get_submodule(module_name), _PackedNVFP4Linear)
        except AttributeError:
            return False

    def create_quantized_param(self, model, param_value, param_name, target_device, state_dict, *args, **kwargs):
        module_name, _, name = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        t = module.checked_tensor(name, state_dict[param_name], param_name)  # raw: param_value may be cast
        if name not in module._fixed_dtypes:
            t = t.to(module._parameters[name].dtype)  # the 16-bit branch follows torch_dtype
        module._set(name, t.to(target_device))

    def _process_model_after_weight_loading(self, model, **kwargs):
        check_no_meta(model, type(model).__name__)
        for module in model.modules():
            if isinstance(module, _PackedNVFP4Linear):
                module._reset_dispatch()
        return model

    @property
    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    """Insert ``svdq_w4a4`` into diffusers' quantizer tables (refusing to replace someone else's)."""
    from diffusers.quantizers import auto

    for table, value in (
        (auto.AUTO_QUANTIZER_MAPPING, SVDQuantizer),
        (auto.AUTO_QUANTIZATION_CONFIG_MAPPING, SVDQuantizationConfig),
    ):
        present = table.get(QUANT_METHOD)
        if present is not None and present.__module__ != value.__module__:
            raise RuntimeError(f"diffusers already has a {QUANT_METHOD!r} quantizer ({present!r}); not replacing it")
        table[QUANT_METHOD] = value
