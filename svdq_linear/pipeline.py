"""Quantizing modules in place and loading converted pipelines.

- ``quantize_state_dict``: the tensor-level step shared by ``svdq-convert`` (one block at a time)
  and in-place quantization: float linears in, the tensors of the 4-bit modules out.
- ``quantize_linears``: swap named ``nn.Linear``s of any module for quantized ones.
- ``load_svdq_pipeline``: a ready diffusers pipeline from an ``svdq-convert`` folder or hub id,
  through the ``svdq_w4a4`` diffusers quantizer. File and hub I/O is in ``svdq_linear.files``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from . import diffusers_quantizer as dq
from . import files, nvfp4
from .linear import MODES, W4A4, W4A16, _check_plain_linear, _is_16_or_32_bit_float, name_layers, set_mode
from .svdquant import SVDQuantConfig, check_act_max, group_smoothing_factor, svdquant, weight_only


@dataclass
class LayerStats:
    name: str
    kind: str
    bytes_before: int  # as 16-bit weights + bias
    bytes_after: int
    rel_error: float  # W4A4: weight-side output error (SVDQuantWeights.rel_error); W4A16: ||W - Qw|| / ||W||


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@contextlib.contextmanager
def _named(name: str):
    """A layer's refusal (rank, shape, NaN weights) names the layer: in a model of hundreds it is otherwise lost."""
    try:
        yield
    except (ValueError, TypeError) as e:
        if str(e).startswith(f"{name}: "):
            raise
        try:
            named = type(e)(f"{name}: {e}")
        except Exception:  # an exception class whose constructor takes other arguments
            named = (TypeError if isinstance(e, TypeError) else ValueError)(f"{name}: {e}")
        raise named from e


def quantize_state_dict(
    tensors: dict[str, torch.Tensor],
    kinds: dict[str, str],
    groups: dict[str, str] | None = None,
    act_max: dict[str, torch.Tensor] | None = None,
    config: SVDQuantConfig | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[dict[str, torch.Tensor], list[LayerStats]]:
    """Quantize the linears ``kinds`` names (``"w4a4"`` or ``"w4a16"``) found in ``tensors``.

    ``tensors`` maps state_dict keys to tensors (``name.weight``/``name.bias`` for each linear; other
    keys pass through, floats cast to ``dtype``). W4A4 layers of one ``groups`` value share one
    smoothing factor; ``act_max`` maps a W4A4 name to its per-input-channel max |x|. Returns the new
    tensors (the buffers of the 4-bit modules under ``name.qweight`` etc.) and per-layer stats.
    """
    config = config or SVDQuantConfig()
    groups = groups or {}
    act_max = act_max or {}
    present = [n for n in kinds if f"{n}.weight" in tensors]
    out: dict[str, torch.Tensor] = {}
    stats: list[LayerStats] = []
    consumed: set[str] = set()

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.dtype.is_floating_point else t

    members: dict[str, list[str]] = {}
    for name in present:
        if kinds[name] == W4A4:
            members.setdefault(groups.get(name, name), []).append(name)
    for names in members.values():
        ks = {n: tensors[f"{n}.weight"].shape[-1] for n in names}
        if len(set(ks.values())) > 1:
            raise ValueError(f"smoothing group {groups.get(names[0], names[0])!r} joins layers of different "
                             f"in_features ({', '.join(f'{n}: {k}' for n, k in ks.items())}): one smoothing factor "
                             f"needs one input width")
        for n in names:  # before the group's maxima are stacked, each named
            if n in act_max:
                with _named(n):
                    check_act_max(act_max[n], ks[n])
        stats_in = [act_max[n] for n in names if n in act_max]
        group_act = torch.stack(stats_in).amax(0) if stats_in else None
        lam = group_smoothing_factor([tensors[f"{n}.weight"] for n in names], group_act, config.alpha, config.smooth)
        for name in names:
            w, b = tensors[f"{name}.weight"], tensors.get(f"{name}.bias")
            with _named(name):
                res = svdquant(w, b, act_max=group_act, config=config, dtype=dtype or w.dtype, smooth=lam,
                               seed=zlib.crc32(name.encode()))
            new = {f"{name}.{k}": v for k, v in res.tensors().items() if v is not None}
            out.update(new)
            stats.append(LayerStats(name, W4A4, _nbytes([w, b]) * 2 // w.element_size(), _nbytes(new.values()),
                                    res.rel_error))
            consumed.update({f"{name}.weight", f"{name}.bias"})
    for name in present:
        if kinds[name] != W4A16:
            continue
        w, b = tensors[f"{name}.weight"], tensors.get(f"{name}.bias")
        with _named(name):
            q = weight_only(w, b, dtype or w.dtype)
        deq = nvfp4.dequantize_weight(q["qweight"], q["wscales"], q["wcscale"])
        err = float((deq - w.float()).norm() / w.float().norm().clamp(min=torch.finfo(torch.float32).tiny))
        new = {f"{name}.{k}": v for k, v in q.items()}
        out.update(new)
        stats.append(LayerStats(name, W4A16, _nbytes([w, b]) * 2 // w.element_size(), _nbytes(new.values()), err))
        consumed.update({f"{name}.weight", f"{name}.bias"})
    for key, t in tensors.items():
        if key not in consumed:
            out[key] = cast(t)
    return out, stats


def quantize_linears(
    model: nn.Module,
    w4a4: list[str],
    w4a16: list[str] = (),
    rank: int | None = None,
    act_max: dict[str, torch.Tensor] | None = None,
    smooth_groups: dict[str, str] | None = None,
    config: SVDQuantConfig | None = None,
    **config_kwargs,
) -> list[LayerStats]:
    """Swap the named ``nn.Linear``s of ``model`` for ``SVDQW4A4Linear`` / ``NVFP4W4A16Linear``, in place.

    The new modules keep each linear's dtype and device. ``rank`` is 32 unless given; ``config_kwargs`` are
    ``SVDQuantConfig`` fields, or pass a whole ``config`` (as ``SVDQW4A4Linear.from_linear``). Everything is checked
    before a layer changes, and a failure puts back the layers swapped. Returns per-layer stats.
    """
    config = SVDQuantConfig.given(rank, config, config_kwargs)
    for key, names in (("w4a4", w4a4), ("w4a16", w4a16)):
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"{key}: expected a list of module names, got {names!r}")
    both = sorted(set(w4a4) & set(w4a16))
    if both:
        raise ValueError(f"{both[:4]} named in both w4a4 and w4a16: pick one kind for each layer")
    qcfg = dq.SVDQuantizationConfig(rank=config.rank, w4a4_modules=list(dict.fromkeys(w4a4)),
                                    w4a16_modules=list(dict.fromkeys(w4a16)))
    kinds = qcfg.targets()
    # a key that names no linear of the model (a prefix typo: "transformer.x" for "x") would leave its layer without
    # its statistics; keys of other layers are fine (a dict calibrated once, quantized block by block)
    linears = {n for n, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    stray = sorted(set(act_max or {}) - linears - set(w4a4))
    if stray:
        raise ValueError(f"act_max names {len(stray)} modules the model has no linear under (e.g. {stray[:3]}): its "
                         f"keys must be module names as model.get_submodule takes them")
    tensors, before = {}, {}
    for name in kinds:
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{name} is a {type(lin).__name__}, not an nn.Linear")
        if isinstance(lin, nn.modules.linear.NonDynamicallyQuantizableLinear):
            raise TypeError(f"{name} is nn.MultiheadAttention's out_proj, whose weight the attention reads directly: "
                            f"it cannot be swapped")
        _check_plain_linear(lin, name)
        if not _is_16_or_32_bit_float(lin.weight.dtype):
            raise TypeError(f"{name}: expected a float16/bfloat16/float32 linear, got {lin.weight.dtype}")
        if lin.weight.device.type == "meta":
            raise ValueError(f"{name}: the weight is on the meta device (no values to quantize): load the model's "
                             f"weights first")
        before[name] = lin
        tensors[f"{name}.weight"] = lin.weight.detach()
        if lin.bias is not None:
            tensors[f"{name}.bias"] = lin.bias.detach()
    with torch.no_grad():
        new, stats = quantize_state_dict(tensors, kinds, smooth_groups, act_max, config)
    try:
        # built on meta in a dtype they take (the default may be float64); the load then assigns each layer its
        # tensors, with their device and (the linear's) dtype
        dq.swap_in_quantized_modules(model, qcfg, torch.float32)
        for name in kinds:
            prefix = f"{name}."
            own = {k[len(prefix):]: v for k, v in new.items() if k.startswith(prefix)}
            model.get_submodule(name).load_state_dict(own, strict=True, assign=True)
    except BaseException:
        for name, lin in before.items():
            dq._set_submodule(model, name, lin)
        raise
    return stats


# ---- loading ----------------------------------------------------------------------------------------


def load_svdq_pipeline(
    path_or_id: str | os.PathLike, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
    mode: str | None = None, pipeline_cls: type | None = None, **kwargs
):
    """A ready diffusers pipeline from an ``svdq-convert`` folder (or hub id) in ``dtype`` (bf16 unless given; also
    taken as ``torch_dtype``, diffusers' older name) on ``device``.

    The pipeline class comes from ``model_index.json``; diffusers' ``from_pretrained`` loads it, its
    transformer through the ``svdq_w4a4`` quantizer (``svdq_linear.diffusers_quantizer``: targets
    swapped before the weights load, every tensor checked, keys matched both ways), even where
    registering it with diffusers failed at import. Only safetensors are read. ``mode``: ``"exact"``,
    ``"fast"`` or ``"auto"`` for every ``SVDQW4A4Linear`` (None: each module's default, ``"auto"`` unless
    ``$SVDQ_LINEAR_MODE`` says otherwise). ``kwargs`` go to the pipeline's ``from_pretrained``. ``pipeline_cls``:
    another pipeline class of the same components (``FluxControlNetPipeline`` with ``controlnet=...``,
    ``FluxImg2ImgPipeline``, ...) instead of the folder's; a component the class does not take is refused (diffusers
    would warn and drop it).
    """
    import diffusers

    root = files.resolve_model_path(path_or_id)
    index = files.read_json(root / "model_index.json", "not a diffusers pipeline folder")
    cls = getattr(diffusers, index.get("_class_name", ""), None) if pipeline_cls is None else pipeline_cls
    if cls is None:
        raise ValueError(f"{root}/model_index.json: unknown pipeline class {index.get('_class_name')!r}")
    if not (isinstance(cls, type) and issubclass(cls, diffusers.DiffusionPipeline)):
        raise TypeError(f"expected pipeline_cls to be a diffusers pipeline class, got {cls!r}")
    takes = set(inspect.signature(cls.__init__).parameters)
    extra = [k for k, v in kwargs.items() if isinstance(v, torch.nn.Module) and k not in takes]
    if extra:
        raise ValueError(f"{cls.__name__} takes no component {extra[0]!r} (diffusers would drop it with a warning): "
                         f"pass pipeline_cls, the pipeline that takes it (e.g. pipeline_cls=FluxControlNetPipeline "
                         f"with controlnet=...)")
    config = files.read_json(root / "transformer" / "config.json", "the pipeline has no transformer/")
    qdict = config.get("quantization_config")
    if not isinstance(qdict, dict):
        raise ValueError(f"{root}/transformer/config.json has no quantization_config: not an svdq-convert output")
    if not dq.is_svdq_config(qdict):
        raise ValueError(f"{root}/transformer: quant_method is {qdict.get('quant_method')!r}, "
                         f"expected {dq.QUANT_METHOD!r}")
    if "torch_dtype" in kwargs:
        if dtype is not None:
            raise ValueError("pass dtype or torch_dtype (the same setting), not both")
        dtype = kwargs.pop("torch_dtype")
    dtype = torch.bfloat16 if dtype is None else dtype
    kwargs.setdefault("use_safetensors", True)  # never unpickle a folder's other components
    if mode is not None and mode not in MODES:
        raise ValueError(f"expected a mode in {MODES}, got {mode!r}")
    with dq.registered():
        pipe = cls.from_pretrained(root, dtype=dtype, **kwargs)
    name_layers(pipe.transformer)  # range-check warnings name the layer
    if mode is not None:
        set_mode(pipe.transformer, mode)
    return pipe.to(device) if device is not None else pipe
