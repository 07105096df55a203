"""LoRA adapters on a quantized transformer, without dequantizing it.

diffusers' ``pipe.load_lora_weights`` goes through peft, which wraps ``nn.Linear`` layers and fails on the 4-bit
ones (Flux's loader first looks for a ``.weight`` they do not have). ``fuse_lora`` applies a LoRA instead:

- ``SVDQW4A4Linear``: the adapter joins the low-rank branch. The branch reads ``x / smooth``, so its down factor
  becomes ``smooth ⊙ A^T`` (per input channel) and its up factor ``B``: ``(x / smooth) @ (smooth ⊙ A^T) @ B^T =
  x @ A^T @ B^T``. The rank grows by the adapter's rank; the kernels run the longer branch in the same
  accumulator (``proj_down`` / ``proj_up`` are the contract's own tensors, so every backend follows).
- ``NVFP4W4A16Linear`` (the adaLN modulation linears): a side branch ``(x @ A^T) @ B^T`` added to the output
  (``lora_branch``, its tensors left out of ``state_dict``).
- ``nn.Linear`` kept in 16 bits (embedders, the final projection): ``B @ A`` added to the weight, the original
  weight kept to undo it exactly.

``unfuse_lora`` undoes every adapter bit for bit. A checkpoint cannot hold adapters (the side branches are not in
``state_dict``, and the longer W4A4 branches do not match the rank its config records): ``save_pretrained`` of a
model with adapters is refused, unfuse first. Fused q/k/v layers (``fuse_qkv_projections``) are refused: apply
adapters first, then fuse (the stacked layer carries the longer branches).

The LoRA is diffusers' format: ``<prefix>.<module>.lora_A.weight [r, K]``, ``lora_B.weight [N, r]``, an optional
``<module>.alpha``. Each adapter is scaled as diffusers and peft scale it: ``alpha / r`` with the module's own alpha,
else the most common alpha of the file, else 1; a file that diffusers saved with its adapter config in the header
(``lora_alpha``, ``alpha_pattern``, ``use_rslora``) follows that config. Given a pipeline, a file or folder is read
(safetensors only) and converted by the pipeline's own ``lora_state_dict`` (kohya, xlabs and other Flux formats).

The added columns of a W4A4 layer are padded with zeros to a multiple of 16 (exact: zero columns add zero), the
alignment the Blackwell kernel takes; it takes ranks up to 128 and sm90's up to 256, and ``fuse_lora`` warns when a
layer grows past those (the layer then runs on another backend there). Layers whose weights an offloader moves
(accelerate's sequential offload) are refused: remove the hooks, apply, offload again."""

from __future__ import annotations

import collections
import functools
import inspect
import math
import os
import re
import warnings

import torch
from torch import nn

from . import backends
from .backends.sm100.host import LOWRANK_ATOM_K
from .fuse import _FUSED_NAMES
from .linear import NVFP4W4A16Linear, SVDQW4A4Linear

_SUFFIX_A, _SUFFIX_B = ".lora_A.weight", ".lora_B.weight"


class LoraBranch(nn.Module):
    """The side branch of an ``NVFP4W4A16Linear``: ``y += (x @ down) @ up^T`` (``down [K, r]`` already scaled,
    ``up [N, r]``), in the layer's output dtype. Its tensors are buffers left out of ``state_dict``: the checkpoint
    stays the base model's."""

    def __init__(self, down: torch.Tensor, up: torch.Tensor):
        super().__init__()
        self.register_buffer("down", down, persistent=False)
        self.register_buffer("up", up, persistent=False)

    def forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (x.to(dtype) @ self.down.to(dtype)) @ self.up.to(dtype).T


def _read(target, lora, prefix: str, reader: dict) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The LoRA as a diffusers-format state dict (``prefix`` included) and the adapter config diffusers saved
    with it (``lora_alpha``, ...; None if none). ``reader``: more arguments of the pipeline's ``lora_state_dict``."""
    pipeline = hasattr(type(target), "lora_state_dict")
    if reader and not pipeline:
        raise TypeError(f"fuse_lora got {sorted(reader)}, which only a pipeline's lora_state_dict takes: pass the "
                        f"pipeline, or the LoRA as a file or a state dict")
    if isinstance(lora, dict):
        if pipeline:
            return _convert(type(target), dict(lora), prefix, **reader)
        return dict(lora), None
    if not isinstance(lora, (str, os.PathLike)):
        raise TypeError(f"expected a LoRA state dict or a path, got {type(lora).__name__}")
    if pipeline:
        return _convert(type(target), os.fspath(lora), prefix, **reader)
    if not os.path.isfile(lora):
        raise FileNotFoundError(f"no LoRA file at {lora} (a folder needs the pipeline, not its transformer)")
    from safetensors.torch import load_file

    return load_file(os.fspath(lora)), None


def _convert(pipeline_cls, lora, prefix: str, **reader) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The pipeline class's own reader and format conversion, safetensors only (it would fall back to a pickle),
    with the alphas it returns apart (Flux) folded back in as ``.alpha`` keys and the saved adapter config.
    ``reader``: more arguments of ``lora_state_dict`` (``weight_name``, ``subfolder``, ...)."""
    name = reader.get("weight_name")
    if name is not None and not os.fspath(name).endswith(".safetensors"):  # diffusers would unpickle it
        raise ValueError(f"weight_name {name!r} is not a .safetensors file: svdq-linear reads LoRAs as safetensors "
                         f"only (loading a pickle can run code)")
    kwargs = {**reader, "use_safetensors": True, "return_lora_metadata": True}
    if "return_alphas" in inspect.signature(pipeline_cls.lora_state_dict).parameters:
        kwargs["return_alphas"] = True
    out = pipeline_cls.lora_state_dict(lora, **kwargs)
    out = out if isinstance(out, tuple) else (out,)
    state = dict(out[0])
    alphas = out[1] if kwargs.get("return_alphas") and len(out) > 2 else None
    metadata = out[-1] if len(out) > 1 else None
    for key, alpha in (alphas or {}).items():  # "<prefix>.<module>.alpha"
        state.setdefault(key, torch.as_tensor(alpha))
    head = prefix + "." if prefix else ""
    config = {k[len(head):]: v for k, v in (metadata or {}).items() if k.startswith(head)}
    return state, config or None


def _scales(adapters: dict[str, tuple], config: dict | None) -> dict[str, float]:
    """Each adapter's factor before the user's ``scale``, as peft scales a diffusers-loaded LoRA: ``alpha / r``
    (``/ sqrt(r)`` with rsLoRA). Without a saved config, a module without its own alpha takes the most common
    alpha of the LoRA, and a LoRA without alphas is taken at 1 (alpha = r)."""
    if config is not None:
        for key in ("use_dora", "lora_bias"):
            if config.get(key):
                raise ValueError(f"the LoRA's saved config sets {key}: DoRA and adapter biases are not supported")
        default, patterns = config.get("lora_alpha"), dict(config.get("alpha_pattern") or {})
        root = bool(config.get("use_rslora"))
    else:
        given = [alpha for _, _, alpha in adapters.values() if alpha is not None]
        default = collections.Counter(given).most_common(1)[0][0] if given else None
        patterns, root = {}, False
    out = {}
    for name, (a, _, alpha) in adapters.items():
        if config is not None:
            alpha = next((v for k, v in patterns.items() if re.fullmatch(rf"(.*\.)?({k})", name)), default)
        elif alpha is None:
            alpha = default
        r = a.shape[0]
        if alpha is None:
            out[name] = 1.0
        elif not math.isfinite(float(alpha)):
            raise ValueError(f"LoRA for {name!r}: alpha {alpha} is not finite")
        else:
            out[name] = float(alpha) / (math.sqrt(r) if root else r)
    return out


def _adapters(state: dict[str, torch.Tensor], prefix: str) -> dict[str, tuple]:
    """``module name -> (A [r, K], B [N, r], alpha or None)`` for the keys under ``prefix``; anything else in the
    LoRA (other components, DoRA magnitudes, adapter biases, half pairs) is refused by name."""
    head = prefix + "." if prefix else ""
    other = sorted(k for k in state if not k.startswith(head))
    if other:
        raise ValueError(f"the LoRA holds {len(other)} tensors outside {prefix!r} (e.g. {other[0]!r}); fuse_lora "
                         f"applies the transformer's only: pass the text encoder's keys to pipe.load_lora_weights "
                         f"(a dict, or a file without the transformer's keys)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        key = key[len(head):]
        for suffix, part in ((_SUFFIX_A, "A"), (_SUFFIX_B, "B"), (".alpha", "alpha")):
            if key.endswith(suffix):
                pairs.setdefault(key[: -len(suffix)], {})[part] = t
                break
        else:
            raise ValueError(f"unsupported LoRA tensor {head + key!r}: expected lora_A / lora_B weights and alphas "
                             f"(DoRA magnitudes and adapter biases are not supported)")
    out = {}
    for name, p in sorted(pairs.items()):
        if "A" not in p or "B" not in p:
            raise ValueError(f"LoRA for {name!r} lacks its {'lora_A' if 'A' not in p else 'lora_B'} weight")
        a, b = p["A"], p["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA for {name!r}: expected lora_A [r, K] and lora_B [N, r], got {tuple(a.shape)} "
                             f"and {tuple(b.shape)}")
        alpha = p.get("alpha")
        out[name] = (a, b, None if alpha is None else float(alpha))
    return out


def _balanced(down: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``down * 2^e``, ``up * 2^-e`` (same product, fp32) with the two maxima within a factor 4 of each other, so
    neither falls out of fp16's range when stored: ``smooth`` can be far from 1 (its activation factor is a power of
    two chosen from the calibrated inputs)."""
    md, mu = float(down.abs().max()), float(up.abs().max())
    if md == 0 or mu == 0:
        return down, up
    e = math.floor(math.log2(mu / md) / 2)
    return down * 2.0**e, up * 2.0**-e


def _check_fits(name: str, layer, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
        raise ValueError(f"LoRA for {name!r}: expected lora_A [r, {layer.in_features}] and lora_B "
                         f"[{layer.out_features}, r] for this layer, got {tuple(a.shape)} and {tuple(b.shape)}")


def fuse_lora(target, lora, scale: float = 1.0, prefix: str = "transformer", **reader) -> int:
    """Apply a LoRA to ``target`` (a pipeline: its ``transformer``; or the transformer itself) with weight ``scale``
    (times ``alpha / r`` where the LoRA gives an alpha); returns how many layers it changed. ``lora``: a
    diffusers-format state dict, a safetensors file, or (given a pipeline) what ``pipe.lora_state_dict`` reads,
    with ``reader`` passed on to it (``weight_name=`` for a folder of several files, ``subfolder=``, ...).
    Several adapters stack; ``unfuse_lora`` removes them all. Nothing changes if the LoRA is refused."""
    if not math.isfinite(scale):
        raise ValueError(f"expected a finite scale, got {scale}")
    model = getattr(target, "transformer", target)
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a pipeline with a transformer or an nn.Module, got {type(target).__name__}")
    state, config = _read(target, lora, prefix, reader)
    adapters = _adapters(state, prefix)
    factors = _scales(adapters, config)
    modules = dict(model.named_modules())
    stacked = _stacked(model)
    plan = []
    for name, (a, b, alpha) in adapters.items():  # every check before the first change
        layer = modules.get(name)
        if layer is None:
            fused = next((n for n in _FUSED_NAMES if name.rsplit(".", 1)[0] + "." + n in modules), None)
            hint = (f"; the model's q/k/v are fused ({fused}): unfuse_qkv_projections, fuse_lora, then fuse again"
                    if fused else "")
            raise ValueError(f"the LoRA targets {name!r}, which the model does not have{hint}")
        if not isinstance(layer, (SVDQW4A4Linear, NVFP4W4A16Linear, nn.Linear)):
            raise TypeError(f"the LoRA targets {name!r}, a {type(layer).__name__}: only linears take adapters")
        if id(layer) in stacked:
            raise ValueError(f"{name!r} is part of fused q/k/v layers: unfuse_qkv_projections, fuse_lora, then fuse "
                             f"again")
        _check_fits(name, layer, a, b)
        _check_in_place(name, layer)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"LoRA for {name!r} holds NaN or Inf values")
        plan.append((name, layer, a, b, scale * factors[name]))
    undo = []
    try:
        with torch.no_grad():
            for _, layer, a, b, factor in plan:
                undo.append(_apply(layer, a, b, factor))
    except BaseException:
        with torch.no_grad():  # a failure part way (memory): the layers already changed go back
            for restore in reversed(undo):
                restore()
        raise
    limits = backends.rank_limits()
    large = [f"{name} ({layer.rank})" for name, layer, *_ in plan if isinstance(layer, SVDQW4A4Linear)
             and layer.rank > limits["sm100"]]
    if large:
        warnings.warn(f"svdq-linear: {len(large)} layers have a low-rank branch above "
                      f"{limits['sm100']} columns with the LoRA (e.g. {large[0]}): the Blackwell kernel takes up "
                      f"to {limits['sm100']}, sm90's up to {limits['sm90']}; beyond, such a layer runs on "
                      f"another backend", RuntimeWarning, stacklevel=2)
    return len(plan)


def guard_pipeline_loaders() -> None:
    """Make diffusers' pipelines' ``load_lora_weights`` refuse, by name, a transformer that holds svdq-linear layers
    (called when a transformer is quantized or loaded). It goes through peft, which does not wrap them: Flux's loader
    failed with ``KeyError: '...to_k.weight'``, SD3's with peft's "Target module ... is not supported". The error
    points to ``fuse_lora``. Pipelines without such layers, and a LoRA without transformer keys (a text encoder's,
    as a dict or a safetensors file; read and converted by the pipeline's ``lora_state_dict`` to tell), load as
    before."""
    try:
        from diffusers.loaders import lora_pipeline
    except ImportError:  # pragma: no cover - diffusers without its LoRA loaders
        return
    from .diffusers_quantizer import wrap_once

    for cls in list(vars(lora_pipeline).values()):
        if isinstance(cls, type):
            wrap_once(cls, "load_lora_weights", _refusing_quantized)


def _refusing_quantized(fn):
    @functools.wraps(fn)
    def load_lora_weights(self, *args, **kwargs):
        lora = args[0] if args else kwargs.get("pretrained_model_name_or_path_or_dict")
        model = getattr(self, "transformer", None)
        if (isinstance(model, nn.Module) and any(isinstance(m, (SVDQW4A4Linear, NVFP4W4A16Linear))
                                                 for m in model.modules())):
            _refuse_transformer_keys(self, lora, kwargs)
        return fn(self, *args, **kwargs)

    return load_lora_weights


# load_lora_weights' own arguments; the rest of its kwargs go to lora_state_dict (weight_name, subfolder, ...)
_LOADER_ONLY = ("pretrained_model_name_or_path_or_dict", "adapter_name", "hotswap", "low_cpu_mem_usage")


def _refuse_transformer_keys(pipe, lora, kwargs: dict) -> None:
    """Raise unless the LoRA, as the pipeline's own ``lora_state_dict`` reads and converts it (kohya and other
    formats name the transformer's modules their own way; a file is read as safetensors only), holds no key for the
    transformer."""
    head = getattr(pipe, "transformer_name", "transformer") + "."
    reader = {k: v for k, v in kwargs.items() if k not in _LOADER_ONLY}
    try:
        state, _ = _read(pipe, lora, head[:-1], reader)
        reason = None if not any(str(k).startswith(head) for k in state) else "holds keys for the 4-bit transformer"
    except Exception as exc:  # unreadable as safetensors, or a format diffusers does not know: peft would get it
        reason, cause = f"could not be read as a safetensors LoRA ({type(exc).__name__}: {exc})", exc
    else:
        cause = None
    if reason is not None:
        raise ValueError(f"{type(pipe).__name__}.load_lora_weights goes through peft, which cannot wrap svdq-linear's "
                         f"4-bit layers, and this LoRA {reason}: apply it with svdq_linear.fuse_lora(pipe, lora, "
                         f"scale=1.0) instead (merged into the quantized layers; svdq_linear.unfuse_lora(pipe) "
                         f"removes it)") from cause


_RANK_ALIGN = LOWRANK_ATOM_K  # the Blackwell kernel's rank step (backends.rank_note)


def _check_in_place(name: str, layer: nn.Module) -> None:
    """Refuse a layer whose weights an offloader holds elsewhere (accelerate's hook keeps its own copy and puts it
    back every call; the parameters here are placeholders on ``meta``)."""
    if "_hf_hook" in layer.__dict__ or any(t.device.type == "meta" for t in layer.parameters()):
        raise ValueError(f"{name!r} has its weights offloaded (accelerate's sequential offload or a meta device): "
                         f"remove the hooks (pipe.remove_all_hooks()), apply or remove the LoRA, then offload again")


def _guard(layer: nn.Module) -> None:
    """Hooks on a layer that takes an adapter (once per layer; each checks at its call whether one is still there):
    a load into it is refused, and a ``state_dict`` taken from it is marked, so that saving it is refused."""
    if not layer.__dict__.get("_lora_guard"):
        layer._register_load_state_dict_pre_hook(_refuse_load, with_module=True)
        layer.register_state_dict_post_hook(_mark_state_dict)
        layer.__dict__["_lora_guard"] = True


_MARK = "svdq_lora"  # in a state_dict's per-module metadata: taken from a layer that carries an adapter


def _mark_state_dict(module, state_dict, prefix, local_metadata) -> None:
    if _has_adapter(module):
        local_metadata[_MARK] = True


def refuse_adapters_in(state_dict) -> None:
    """Raise if ``state_dict`` was taken from a model whose layers carry adapters (``fuse_lora``): a 4-bit checkpoint
    cannot hold them. The adaLN layers' adapters are side branches outside ``state_dict``, and the W4A4 layers'
    branches are longer than the rank the checkpoint's config records, so such a file would load the LoRA in part,
    or not at all. The save path (the ``svdq_w4a4`` quantizer's ``get_state_dict_and_metadata``) calls this."""
    meta = getattr(state_dict, "_metadata", None) or {}
    names = [name for name, local in meta.items() if isinstance(local, dict) and local.get(_MARK)]
    if names:
        raise ValueError(f"{len(names)} layers carry a LoRA from svdq_linear.fuse_lora (e.g. {names[0]!r}), which a "
                         f"4-bit checkpoint cannot hold: svdq_linear.unfuse_lora(pipe) before saving, and apply the "
                         f"LoRA file again after loading")


def _has_adapter(layer: nn.Module) -> bool:
    return ("_lora_base_rank" in layer.__dict__ or "_lora_base_weight" in layer.__dict__
            or "lora_branch" in layer._modules)


def _refuse_load(module, state_dict, prefix, *args) -> None:
    if _has_adapter(module):
        raise RuntimeError(f"{prefix.rstrip('.') or type(module).__name__} carries a LoRA (svdq_linear.fuse_lora): "
                           f"unfuse_lora before loading weights into it (the adapter would stay on top of them)")


def _apply(layer, a: torch.Tensor, b: torch.Tensor, factor: float):
    """Add one adapter to ``layer``; returns a function that puts the layer back as it was before."""
    a = a.detach().float().to(_device(layer))
    b = b.detach().float().to(_device(layer))
    _guard(layer)
    if isinstance(layer, SVDQW4A4Linear):
        down, up = _balanced(a.T * factor, b)
        first = "_lora_base_rank" not in layer.__dict__
        before = layer.rank
        pad = -(before + down.shape[1]) % _RANK_ALIGN if before % _RANK_ALIGN == 0 else 0

        def grow(layer):
            down_s = layer.smooth.float()[:, None] * down
            dtype = layer.proj_down.dtype
            zeros_d, zeros_u = down_s.new_zeros(down_s.shape[0], pad), up.new_zeros(up.shape[0], pad)
            layer._set("proj_down", torch.cat([layer.proj_down, down_s.to(dtype), zeros_d.to(dtype)], 1).contiguous())
            layer._set("proj_up", torch.cat([layer.proj_up, up.to(dtype), zeros_u.to(dtype)], 1).contiguous())

        layer.__dict__.setdefault("_lora_base_rank", before)
        _edit_branch(layer, grow)

        def restore():
            _edit_branch(layer, lambda m: _truncate(m, before))
            if first:
                del layer.__dict__["_lora_base_rank"]

        return restore
    if isinstance(layer, NVFP4W4A16Linear):
        down, up = _balanced(a.T * factor, b)
        old = layer._modules.get("lora_branch")
        if old is not None:
            down, up = torch.cat([old.down.float(), down], 1), torch.cat([old.up.float(), up], 1)
        layer.lora_branch = LoraBranch(down.contiguous(), up.contiguous())  # fp32 until the model's .to(dtype)

        def restore():
            if old is None:
                del layer.lora_branch
            else:
                layer.lora_branch = old

        return restore
    w = layer.weight
    first = "_lora_base_weight" not in layer.__dict__
    prev = w.detach().clone()
    layer.__dict__.setdefault("_lora_base_weight", prev)
    w.copy_((w.float() + factor * (b @ a)).to(w.dtype))

    def restore():
        w.copy_(prev)
        if first:
            del layer.__dict__["_lora_base_weight"]

    return restore


def _truncate(layer: SVDQW4A4Linear, r: int) -> None:
    layer._set("proj_down", layer.proj_down[:, :r].contiguous())
    layer._set("proj_up", layer.proj_up[:, :r].contiguous())


def _edit_branch(layer: SVDQW4A4Linear, edit) -> None:
    """``edit(layer)`` replaces the low-rank branch: the canonical tensors come back from a prepared state first,
    and a layer that had one is prepared again now, so a graph compiled before the edit retraces onto the new
    state instead of reading the old one (``reset_prepared``)."""
    had = next(iter(layer.__dict__.get("_dispatch_cache", {}).values()), None)
    layer._reset_dispatch()  # also forgets which backends declined the old rank
    edit(layer)
    layer.rank = layer.proj_down.shape[1]
    if had is not None:
        backends.prepare_layer(layer, had.dtype)


def _stacked(model: nn.Module) -> set[int]:
    """``id`` of every layer that fused q/k/v layers (``svdq_linear.fuse``) were stacked from, and of those."""
    out = set()
    for m in model.modules():
        parts = m.__dict__.get("_view_parts", ())
        if parts:
            out.add(id(m))
            out.update(id(ref()) for ref, *_ in parts)
    return out


def _device(layer) -> torch.device:
    t = next((p for p in layer.parameters() if p.numel()), None)
    return t.device if t is not None else torch.device("cpu")


def unfuse_lora(target) -> int:
    """Remove every adapter ``fuse_lora`` applied to ``target`` (a pipeline or its transformer), bit for bit;
    returns how many layers it restored."""
    model = getattr(target, "transformer", target)
    stacked = _stacked(model)
    if any(id(m) in stacked and "_lora_base_rank" in m.__dict__ for m in model.modules()):
        raise ValueError("the model's q/k/v are fused over layers with adapters: unfuse_qkv_projections first")
    for name, layer in model.named_modules():  # every check before the first change
        if _has_adapter(layer):
            _check_in_place(name, layer)
    count = 0
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, SVDQW4A4Linear) and "_lora_base_rank" in layer.__dict__:
                r = layer.__dict__.pop("_lora_base_rank")
                _edit_branch(layer, lambda m, r=r: _truncate(m, r))
            elif isinstance(layer, NVFP4W4A16Linear) and "lora_branch" in layer._modules:
                del layer.lora_branch
            elif isinstance(layer, nn.Linear) and "_lora_base_weight" in layer.__dict__:
                layer.weight.copy_(layer.__dict__.pop("_lora_base_weight").to(layer.weight.device))
            else:
                continue
            count += 1
    return count


__all__ = ["LoraBranch", "fuse_lora", "unfuse_lora"]
