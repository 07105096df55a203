"""diffusers integration: the ``svdq_w4a4`` quantization config and quantizer.

``import svdq_linear`` registers them in ``diffusers.quantizers.auto`` (diffusers has no public
registry), so stock ``DiffusionPipeline.from_pretrained(folder)`` and
``FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer")`` build the quantized
modules of a folder written by ``svdq-convert``; ``load_svdq_pipeline`` goes through the same
quantizer. Without the import, such a folder fails loudly: diffusers' error ("Unknown quantization
type, got ...") shows the ``quant_method`` string, and the one written to ``config.json``
(``QUANT_METHOD_ON_DISK``) says to ``import svdq_linear``. A folder *without*
``quantization_config`` would load as plain ``nn.Linear``s with random/meta weights: the converter
always writes it, and loading here checks the checkpoint's keys against the config both ways, every
quantized tensor's shape, dtype and values (``SVDQW4A4Linear.checked_tensor``), the 16-bit tensors
against the recorded ``dtype``, and that nothing is left on ``meta``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
from typing import Any

import torch
from torch import nn

from . import files
from .linear import FIXED_DTYPES, W4A4, W4A16, NVFP4W4A16Linear, SVDQW4A4Linear, _is_int, _PackedNVFP4Linear

QUANT_METHOD = "svdq_w4a4"
QUANT_METHOD_ON_DISK = "svdq_w4a4 (run `import svdq_linear` before from_pretrained; pip install svdq-linear)"
"""What ``config.json`` records. diffusers looks the raw string up in its table and, when nothing
registered it, raises ``Unknown quantization type, got <this string>``: the only text of the folder
that its error shows. Both strings are registered; folders written before carry ``svdq_w4a4``."""
QUANT_METHOD_KEYS = (QUANT_METHOD, QUANT_METHOD_ON_DISK)
FORMAT_VERSION = 1
DTYPES = ("bfloat16", "float16", "float32")

MODULE_CLASSES = {W4A4: SVDQW4A4Linear, W4A16: NVFP4W4A16Linear}


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
    SVDQuant options used (alpha, svd, refine_iters, ...). dtype: the dtype of the quantized
    modules' 16-bit tensors (``proj_down``, ``proj_up``, ``bias``) in the checkpoint (``"bfloat16"``,
    ``"float16"``, ``"float32"``; default ``conversion["dtype"]``, None: not recorded, not checked).
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
        dtype: str | None = None,
        **kwargs,  # from_dict passes quant_method back in
    ):
        qm = kwargs.pop("quant_method", QUANT_METHOD)
        if str(qm) not in QUANT_METHOD_KEYS:
            raise ValueError(f"expected quant_method {QUANT_METHOD!r}, got {qm!r}")
        if kwargs:
            raise ValueError(f"unknown {QUANT_METHOD} quantization_config keys: {sorted(kwargs)}")
        if not _is_int(format_version) or format_version < 1:
            raise ValueError(f"{QUANT_METHOD} quantization_config format_version: expected an integer >= 1, got "
                             f"{format_version!r}")
        if format_version > FORMAT_VERSION:
            raise ValueError(
                f"{QUANT_METHOD} format_version {format_version!r} is not supported by this svdq-linear "
                f"(it reads version {FORMAT_VERSION}); upgrade svdq-linear"
            )
        if not _is_int(rank) or rank < 0:
            raise ValueError(f"{QUANT_METHOD} quantization_config rank: expected an integer >= 0, got {rank!r}")
        for key, names in (("w4a4_modules", w4a4_modules), ("w4a16_modules", w4a16_modules)):
            listed = isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)
            if names is not None and not listed:
                raise ValueError(f"{QUANT_METHOD} quantization_config {key}: expected a list of module names, got "
                                 f"{type(names).__name__} {str(names)[:80]!r}")
        for key, value in (("smooth_groups", smooth_groups), ("calibration", calibration), ("conversion", conversion)):
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{QUANT_METHOD} quantization_config {key}: expected a mapping, got "
                                 f"{type(value).__name__} {str(value)[:80]!r}")
        self.quant_method = SVDQQuantMethod.SVDQ_W4A4
        self.format_version = format_version
        self.rank = rank
        self.w4a4_modules = list(w4a4_modules or [])
        self.w4a16_modules = list(w4a16_modules or [])
        self.smooth_groups = dict(smooth_groups or {})
        self.calibration = dict(calibration or {})
        self.conversion = dict(conversion or {})
        self.dtype = dtype if dtype is not None else self.conversion.get("dtype")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"{QUANT_METHOD} quantization_config dtype: expected one of {DTYPES}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The recorded dtype of the 16-bit tensors, or None when the config does not record one."""
        return None if self.dtype is None else getattr(torch, self.dtype)

    def targets(self) -> dict[str, str]:
        """Module name -> ``W4A4`` / ``W4A16``."""
        return {**{n: W4A4 for n in self.w4a4_modules}, **{n: W4A16 for n in self.w4a16_modules}}

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["quant_method"] = QUANT_METHOD_ON_DISK
        return d

    def to_diff_dict(self) -> dict[str, Any]:  # the mixin's __repr__ needs it
        return self.to_dict()


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def mark_quantized(model: nn.Module) -> None:
    """Let diffusers' ``fuse_qkv_projections`` fuse quantized q/k/v exactly (``svdq_linear.fuse``), its
    pipelines' ``load_lora_weights`` point to ``svdq_linear.fuse_lora`` (``lora.guard_pipeline_loaders``), and its
    ControlNets' ``from_transformer`` refuse a quantized transformer (``guard_controlnet_builders``)."""
    from .fuse import fuse_attention_projections
    from .lora import guard_pipeline_loaders

    fuse_attention_projections(model)
    guard_pipeline_loaders()
    guard_controlnet_builders()
    guard_savers()


def wrap_once(cls: type, attr: str, wrap) -> None:
    """Replace ``cls.<attr>``, a function or classmethod that ``cls`` itself defines, with ``wrap(fn)`` (a guard
    around diffusers' method), once: the guard is marked, and a marked one is left as it is."""
    raw = cls.__dict__.get(attr)
    fn = raw.__func__ if isinstance(raw, classmethod) else raw
    if not inspect.isfunction(fn) or getattr(fn, "_svdq_guard", False):
        return
    guarded = wrap(fn)
    guarded._svdq_guard = True
    setattr(cls, attr, classmethod(guarded) if isinstance(raw, classmethod) else guarded)


def guard_savers() -> None:
    """Make diffusers' ``ModelMixin.save_pretrained`` and ``DiffusionPipeline.save_pretrained`` check a model that
    holds svdq-linear layers before anything is written (``check_saveable``). Without it,
    ``safe_serialization=False`` wrote a pickle that the loader refuses, and a model cast past diffusers' guard
    (``model.type(torch.float16)``, a cast of some blocks) wrote 16-bit tensors under a stale ``dtype`` record, a
    folder that did not load."""
    from diffusers import DiffusionPipeline, ModelMixin

    for cls in (ModelMixin, DiffusionPipeline):
        wrap_once(cls, "save_pretrained", _checking_save)


def _checking_save(fn):
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def save_pretrained(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        safe = bound.arguments.get("safe_serialization", True)
        if isinstance(self, nn.Module):
            models = [self]
        else:  # a pipeline's components as its save_pretrained finds them: the attributes its config names
            parts = (getattr(self, k, None) for k in dict(getattr(self, "config", {})) if not k.startswith("_"))
            models = [m for m in parts if isinstance(m, nn.Module)]
        for model in models:
            check_saveable(model, safe)
        return fn(self, *args, **kwargs)

    return save_pretrained


def check_saveable(model: nn.Module, safe_serialization: bool = True) -> None:
    """Raise if ``model`` (quantized by this library) cannot be saved as a folder that loads again: a pickle
    (``safe_serialization=False``) or 4-bit layers whose 16-bit tensors (``proj_down``, ``proj_up``, ``bias``) hold
    more than one dtype. A single dtype other than the recorded one (a cast past diffusers' refusal) becomes the
    record, so the folder loads as saved."""
    config = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
    if not isinstance(config, SVDQuantizationConfig):
        return
    name = type(model).__name__
    if not safe_serialization:
        raise ValueError(f"{name} holds svdq-linear layers, which are saved as safetensors only: "
                         f"save_pretrained(safe_serialization=False) would write a pickle, which svdq-linear does not "
                         f"load")
    found: dict[torch.dtype, str] = {}  # dtype -> the first tensor that holds it
    for module_name, module in model.named_modules():
        if isinstance(module, _PackedNVFP4Linear):
            for t in module._expected_shapes():
                p = module._parameters.get(t)
                if t not in FIXED_DTYPES and p is not None:
                    found.setdefault(p.dtype, f"{module_name}.{t}")
    if len(found) > 1:
        held = ", ".join(f"{str(d).removeprefix('torch.')} ({k})" for d, k in found.items())
        raise ValueError(f"{name}: the 4-bit layers' 16-bit tensors hold {len(found)} dtypes, {held}; a checkpoint "
                         f"records one. Cast the whole model (torch.nn.Module.to(model, dtype)), or load it again with "
                         f"the torch_dtype wanted")
    if len(found) == 1 and config.dtype is not None:
        config.dtype = str(next(iter(found))).removeprefix("torch.")


def guard_controlnet_builders() -> None:
    """Make the Flux and SD3 ControlNets' ``from_transformer`` refuse a transformer holding svdq-linear layers. It
    copies the transformer's blocks with ``load_state_dict(strict=False)`` into 16-bit linears, which find no
    ``weight`` in a 4-bit layer's state and keep their random initialization, silently; and it copies the config,
    ``quantization_config`` included, so the saved ControlNet would not load."""
    import diffusers

    for name in ("FluxControlNetModel", "SD3ControlNetModel"):
        cls = getattr(diffusers, name, None)
        if isinstance(cls, type):
            wrap_once(cls, "from_transformer", _refusing_quantized_source)


def _refusing_quantized_source(fn):
    @functools.wraps(fn)
    def from_transformer(cls, transformer, *args, **kwargs):
        if isinstance(transformer, nn.Module) and any(isinstance(m, _PackedNVFP4Linear) for m in transformer.modules()):
            raise ValueError(f"{cls.__name__}.from_transformer cannot copy svdq-linear's 4-bit layers: diffusers "
                             f"loads the blocks with strict=False, so the ControlNet's linears would keep random "
                             f"weights, and it would carry the transformer's quantization_config. Build the "
                             f"ControlNet from the unquantized transformer (before quantize_pipeline, or loaded from "
                             f"the original checkpoint)")
        return fn(cls, transformer, *args, **kwargs)

    return from_transformer


def swap_in_quantized_modules(model: nn.Module, config: SVDQuantizationConfig, dtype: torch.dtype) -> None:
    """Replace the config's targets with empty (``meta``) quantized modules of the same shape."""
    for name, kind in config.targets().items():
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            raise ValueError(
                f"quantization_config names module {name!r}, which {type(model).__name__} does not have"
            ) from None
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"quantization_config names {name!r}, a {type(lin).__name__}, not an nn.Linear")
        extra = {"rank": config.rank} if kind == W4A4 else {}
        module = MODULE_CLASSES[kind](lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta",
                                      dtype=dtype, **extra)
        _set_submodule(model, name, module)
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
        held: dict[str, str] = {}  # tensor name -> the file that holds it
        for f in checkpoint_files or ():
            for key in files.safetensors_keys(f):  # safetensors only, and whole: a clear error naming the file
                if key in held:  # a later shard's copy would silently replace the one the index names
                    raise ValueError(f"{key} is in two checkpoint files: {held[key]} and {f}")
                held[key] = str(f)
        if len(checkpoint_files or ()) > 1:  # sharded: the index's keys are what diffusers loads, so hold the
            # shards to them (a tensor the index does not list would load unchecked)
            listed = set(loaded_keys)
            extra, absent = sorted(set(held) - listed), sorted(listed - set(held))
            if extra:
                raise ValueError(f"{len(extra)} tensors in the checkpoint's shards are not in its index (e.g. "
                                 f"{extra[:4]}, in {held[extra[0]]})")
            if absent:
                raise ValueError(f"the checkpoint's index lists {len(absent)} tensors that no shard holds (e.g. "
                                 f"{absent[:4]})")
        self.loaded_keys = set(loaded_keys)
        return loaded_keys

    def validate_environment(self, *args, device_map=None, **kwargs):
        # diffusers calls this with the device_map it resolved ("auto" and max_memory included)
        on_disk = sorted(n for n, d in device_map.items() if d == "disk") if isinstance(device_map, dict) else []
        if on_disk:  # the quantized tensors load through create_quantized_param, which has no disk path
            raise ValueError(f"svdq_w4a4 checkpoints do not load with disk offload (the device_map puts "
                             f"{len(on_disk)} modules on disk, e.g. {on_disk[:3]}): allow more max_memory, or load "
                             "to the CPU and offload with enable_model_cpu_offload")

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
        raw = state_dict[param_name]  # param_value may already be cast to torch_dtype
        recorded = self.quantization_config.torch_dtype
        if name not in FIXED_DTYPES and recorded is not None and raw.dtype != recorded:
            raise ValueError(f"{param_name}: expected {recorded}, the checkpoint's recorded dtype "
                             f"(quantization_config.dtype), got {raw.dtype}")
        t = module.checked_tensor(name, raw, param_name)
        if name not in FIXED_DTYPES:
            t = t.to(module._parameters[name].dtype)  # the 16-bit branch follows torch_dtype
        module._set(name, t.to(target_device))

    def _process_model_after_weight_loading(self, model, **kwargs):
        check_no_meta(model, type(model).__name__)
        for module in model.modules():
            if isinstance(module, _PackedNVFP4Linear):
                module._reset_dispatch()
        # The 16-bit tensors now hold the load's dtype: what save_pretrained will write.
        self.quantization_config.dtype = str(self.compute_dtype).removeprefix("torch.")
        return model

    @property
    def is_serializable(self) -> bool:
        return True

    def get_state_dict_and_metadata(self, state_dict, safe_serialization: bool = False):
        """What ``save_pretrained`` writes: the state_dict as it is, unless layers carry LoRA adapters (refused)."""
        from .lora import refuse_adapters_in

        refuse_adapters_in(state_dict)
        return super().get_state_dict_and_metadata(state_dict, safe_serialization=safe_serialization)

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _tables():
    from diffusers.quantizers import auto

    return ((auto.AUTO_QUANTIZER_MAPPING, SVDQuantizer), (auto.AUTO_QUANTIZATION_CONFIG_MAPPING, SVDQuantizationConfig))


def register() -> None:
    """Insert ``svdq_w4a4`` into diffusers' quantizer tables (refusing to replace someone else's)."""
    tables = _tables()
    for table, value in tables:
        for key in QUANT_METHOD_KEYS:
            present = table.get(key)
            if present is not None and present.__module__ != value.__module__:
                raise RuntimeError(f"diffusers already has a {key!r} quantizer ({present!r}); not replacing it")
    for table, value in tables:
        for key in QUANT_METHOD_KEYS:
            table[key] = value


@contextlib.contextmanager
def registered():
    """Our entries in diffusers' tables for the ``with`` block, whatever ``register`` managed at import.

    ``load_svdq_pipeline`` loads through this, so it works where ``register`` failed (a foreign entry
    under our name is put back afterwards).
    """
    saved = []
    for table, value in _tables():
        for key in QUANT_METHOD_KEYS:
            saved.append((table, key, table.get(key)))
            table[key] = value
    try:
        yield
    finally:
        for table, key, before in saved:
            if before is None:
                table.pop(key, None)
            else:
                table[key] = before


def is_svdq_config(quantization_config) -> bool:
    """Whether a ``config.json``'s ``quantization_config`` (dict or object) is ours."""
    qm = quantization_config.get("quant_method") if isinstance(quantization_config, dict) else getattr(
        quantization_config, "quant_method", None)
    return str(qm) in QUANT_METHOD_KEYS
