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

``unfuse_lora`` undoes every adapter bit for bit. A model with adapters saves a larger rank than its checkpoint
records: unfuse before ``save_pretrained`` or ``svdq-convert``. Fused q/k/v layers (``fuse_qkv_projections``) are
refused: apply adapters first, then fuse (the stacked layer carries the longer branches).

The LoRA is diffusers' format: ``<prefix>.<module>.lora_A.weight [r, K]``, ``lora_B.weight [N, r]``, an optional
``<module>.alpha`` (scale ``alpha / r``). Given a pipeline, a file or folder is read (safetensors only) and
converted by the pipeline's own ``lora_state_dict`` (kohya, xlabs and other Flux formats)."""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from . import backends
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


def _read(target, lora, prefix: str) -> dict[str, torch.Tensor]:
    """The LoRA as a diffusers-format state dict (``prefix`` included)."""
    if isinstance(lora, dict):
        if hasattr(type(target), "lora_state_dict"):
            return _convert(type(target), dict(lora))
        return dict(lora)
    if not isinstance(lora, (str, os.PathLike)):
        raise TypeError(f"expected a LoRA state dict or a path, got {type(lora).__name__}")
    if hasattr(type(target), "lora_state_dict"):
        return _convert(type(target), os.fspath(lora))
    if not os.path.isfile(lora):
        raise FileNotFoundError(f"no LoRA file at {lora} (a folder needs the pipeline, not its transformer)")
    from safetensors.torch import load_file

    return load_file(os.fspath(lora))


def _convert(pipeline_cls, lora) -> dict[str, torch.Tensor]:
    """The pipeline class's own reader and format conversion, safetensors only (it would fall back to a pickle)."""
    import inspect

    kwargs = {"use_safetensors": True}
    if "return_alphas" in inspect.signature(pipeline_cls.lora_state_dict).parameters:
        kwargs["return_alphas"] = True
    out = pipeline_cls.lora_state_dict(lora, **kwargs)
    if isinstance(out, tuple):
        state, alphas = out[0], out[1]
        state = dict(state)
        for key, alpha in (alphas or {}).items():  # Flux returns them apart: "<prefix>.<module>.alpha"
            state.setdefault(key, torch.as_tensor(alpha))
        return state
    return dict(out)


def _adapters(state: dict[str, torch.Tensor], prefix: str) -> dict[str, tuple]:
    """``module name -> (A [r, K], B [N, r], alpha or None)`` for the keys under ``prefix``; anything else in the
    LoRA (other components, DoRA magnitudes, adapter biases, half pairs) is refused by name."""
    head = prefix + "." if prefix else ""
    other = sorted(k for k in state if not k.startswith(head))
    if other:
        raise ValueError(f"the LoRA holds {len(other)} tensors outside {prefix!r} (e.g. {other[0]!r}); fuse_lora "
                         f"applies the transformer's only: load text-encoder adapters with diffusers")
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
    """``down * 2^e``, ``up * 2^-e`` (same product, fp32) with the two maxima within a factor 2 of each other, so
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


def fuse_lora(target, lora, scale: float = 1.0, prefix: str = "transformer") -> int:
    """Apply a LoRA to ``target`` (a pipeline: its ``transformer``; or the transformer itself) with weight ``scale``
    (times ``alpha / r`` where the LoRA gives an alpha); returns how many layers it changed. ``lora``: a
    diffusers-format state dict, a safetensors file, or (given a pipeline) what ``pipe.lora_state_dict`` reads.
    Several adapters stack; ``unfuse_lora`` removes them all. Nothing changes if the LoRA is refused."""
    if not math.isfinite(scale):
        raise ValueError(f"expected a finite scale, got {scale}")
    model = getattr(target, "transformer", target)
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a pipeline with a transformer or an nn.Module, got {type(target).__name__}")
    adapters = _adapters(_read(target, lora, prefix), prefix)
    modules = dict(model.named_modules())
    stacked = _stacked(model)
    plan = []
    for name, (a, b, alpha) in adapters.items():  # every check before the first change
        layer = modules.get(name)
        if layer is None:
            fused = next((n for n in ("to_qkv", "to_added_qkv", "to_qkv_mlp")
                          if name.rsplit(".", 1)[0] + "." + n in modules), None)
            hint = (f"; the model's q/k/v are fused ({fused}): unfuse_qkv_projections, fuse_lora, then fuse again"
                    if fused else "")
            raise ValueError(f"the LoRA targets {name!r}, which the model does not have{hint}")
        if not isinstance(layer, (SVDQW4A4Linear, NVFP4W4A16Linear, nn.Linear)):
            raise TypeError(f"the LoRA targets {name!r}, a {type(layer).__name__}: only linears take adapters")
        if id(layer) in stacked:
            raise ValueError(f"{name!r} is part of fused q/k/v layers: unfuse_qkv_projections, fuse_lora, then fuse "
                             f"again")
        _check_fits(name, layer, a, b)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"LoRA for {name!r} holds NaN or Inf values")
        plan.append((layer, a, b, scale * (alpha / a.shape[0] if alpha is not None else 1.0)))
    with torch.no_grad():
        for layer, a, b, factor in plan:
            _apply(layer, a, b, factor)
    return len(plan)


def _apply(layer, a: torch.Tensor, b: torch.Tensor, factor: float) -> None:
    a = a.detach().float().to(_device(layer))
    b = b.detach().float().to(_device(layer))
    if isinstance(layer, SVDQW4A4Linear):
        down, up = _balanced(a.T * factor, b)

        def grow(layer):
            down_s = layer.smooth.float()[:, None] * down
            dtype = layer.proj_down.dtype
            layer._set("proj_down", torch.cat([layer.proj_down, down_s.to(dtype)], 1).contiguous())
            layer._set("proj_up", torch.cat([layer.proj_up, up.to(dtype)], 1).contiguous())

        layer.__dict__.setdefault("_lora_base_rank", layer.rank)
        _edit_branch(layer, grow)
    elif isinstance(layer, NVFP4W4A16Linear):
        down, up = _balanced(a.T * factor, b)
        old = layer._modules.get("lora_branch")
        if old is not None:
            down, up = torch.cat([old.down.float(), down], 1), torch.cat([old.up.float(), up], 1)
        layer.lora_branch = LoraBranch(down.contiguous(), up.contiguous())  # fp32 until the model's .to(dtype)
    else:
        w = layer.weight
        layer.__dict__.setdefault("_lora_base_weight", w.detach().clone())
        w.copy_((w.float() + factor * (b @ a)).to(w.dtype))


def _edit_branch(layer: SVDQW4A4Linear, edit) -> None:
    """``edit(layer)`` replaces the low-rank branch: the canonical tensors come back from a prepared state first,
    and a layer that had one is prepared again now, so a graph compiled before the edit retraces onto the new
    state instead of reading the old one (``reset_prepared``)."""
    had = next(iter(layer.__dict__.get("_dispatch_cache", {}).values()), None)
    layer._reset_dispatch()
    edit(layer)
    layer.rank = layer.proj_down.shape[1]
    layer._reset_dispatch(reprepare=False)
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
    count = 0
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, SVDQW4A4Linear) and "_lora_base_rank" in layer.__dict__:
                r = layer.__dict__.pop("_lora_base_rank")

                def shrink(layer, r=r):
                    layer._set("proj_down", layer.proj_down[:, :r].contiguous())
                    layer._set("proj_up", layer.proj_up[:, :r].contiguous())

                _edit_branch(layer, shrink)
            elif isinstance(layer, NVFP4W4A16Linear) and "lora_branch" in layer._modules:
                del layer.lora_branch
            elif isinstance(layer, nn.Linear) and "_lora_base_weight" in layer.__dict__:
                layer.weight.copy_(layer.__dict__.pop("_lora_base_weight").to(layer.weight.device))
            else:
                continue
            count += 1
    return count


__all__ = ["LoraBranch", "fuse_lora", "unfuse_lora"]
