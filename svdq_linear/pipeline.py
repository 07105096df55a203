"""Quantizing modules in place and loading converted pipelines.

- ``quantize_state_dict``: the tensor-level step shared by ``svdq-convert`` (one block at a time)
  and in-place quantization: float linears in, the buffers of the 4-bit modules out.
- ``quantize_linears``: swap named ``nn.Linear``s of any module for quantized ones.
- ``load_svdq_pipeline``: a ready diffusers pipeline from an ``svdq-convert`` folder or hub id.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from . import diffusers_quantizer as dq
from . import nvfp4
from .svdquant import SVDQuantConfig, group_smoothing_factor, svdquant, weight_only

W4A4, W4A16 = "w4a4", "w4a16"


@dataclass
class LayerStats:
    name: str
    kind: str
    bytes_before: int  # as 16-bit weights + bias
    bytes_after: int
    rel_error: float  # W4A4: weight-side output error (SVDQuantWeights.rel_error); W4A16: ||W - Qw|| / ||W||


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


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
        stats_in = [act_max[n] for n in names if n in act_max]
        group_act = torch.stack(stats_in).amax(0) if stats_in else None
        lam = group_smoothing_factor([tensors[f"{n}.weight"] for n in names], group_act, config.alpha, config.smooth)
        for name in names:
            w, b = tensors[f"{name}.weight"], tensors.get(f"{name}.bias")
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
    rank: int = 32,
    act_max: dict[str, torch.Tensor] | None = None,
    smooth_groups: dict[str, str] | None = None,
    config: SVDQuantConfig | None = None,
    **config_kwargs,
) -> list[LayerStats]:
    """Swap the named ``nn.Linear``s of ``model`` for ``SVDQW4A4Linear`` / ``NVFP4W4A16Linear``, in place.

    The new modules keep each linear's dtype and device. ``config_kwargs`` are ``SVDQuantConfig``
    fields. Returns per-layer stats.
    """
    config = config or SVDQuantConfig.from_kwargs(rank=rank, **config_kwargs)
    kinds = {**{n: W4A4 for n in w4a4}, **{n: W4A16 for n in w4a16}}
    tensors = {}
    for name in kinds:
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{name} is a {type(lin).__name__}, not an nn.Linear")
        tensors[f"{name}.weight"] = lin.weight.detach()
        if lin.bias is not None:
            tensors[f"{name}.bias"] = lin.bias.detach()
    with torch.no_grad():
        new, stats = quantize_state_dict(tensors, kinds, smooth_groups, act_max, config)
    qcfg = dq.SVDQuantizationConfig(rank=config.rank, w4a4_modules=list(w4a4), w4a16_modules=list(w4a16))
    dq.swap_in_quantized_modules(model, qcfg, torch.get_default_dtype())
    for name in kinds:  # meta modules + assign: each takes the tensors' device and (the linear's) dtype
        prefix = f"{name}."
        own = {k[len(prefix):]: v for k, v in new.items() if k.startswith(prefix)}
        model.get_submodule(name).load_state_dict(own, strict=True, assign=True)
    return stats


# ---- loading ----------------------------------------------------------------------------------------


def pipeline_components(model_index: dict) -> list[str]:
    """The component folders a ``model_index.json`` names (``"vae": ["diffusers", "AutoencoderKL"]``...)."""
    return [k for k, v in model_index.items()
            if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0] is not None]


def resolve_model_path(path_or_id: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id through ``huggingface_hub``.

    From the hub, only ``model_index.json`` and the component folders it names are fetched, and no
    pickled weights (a FLUX.1 repo also holds a 23 GB single-file checkpoint at its root).
    """
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path} is a file; expected a diffusers pipeline folder")
        return path
    from huggingface_hub import hf_hub_download, snapshot_download

    repo = str(path_or_id)
    try:
        index = json.loads(Path(hf_hub_download(repo, "model_index.json")).read_text())
        allow = ["model_index.json"] + [f"{c}/*" for c in pipeline_components(index)]
        return Path(snapshot_download(repo, allow_patterns=allow, ignore_patterns=["*.bin", "*.pt", "*.pth", "*.ckpt"]))
    except Exception as e:  # offline, unknown repo, no access: say which and what to do
        raise FileNotFoundError(
            f"{repo!r} is not a local folder and could not be fetched from the Hugging Face Hub "
            f"({type(e).__name__}: {e}); pass a local diffusers folder"
        ) from e


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {what}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a diffusers model folder (sharded through its index, or single)."""
    index = model_dir / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "the shard index")["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} named by {index.name} is missing")
        return files
    single = model_dir / "diffusion_pytorch_model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors checkpoint in {model_dir} (pickled .bin files are not loaded)")


def load_safetensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path} is corrupted or truncated ({type(e).__name__}: {e})") from e


def load_svdq_transformer(model_dir: Path, dtype: torch.dtype = torch.bfloat16, device=None) -> nn.Module:
    """The quantized transformer of an ``svdq-convert`` folder's ``transformer/``, strictly loaded."""
    import diffusers
    from accelerate import init_empty_weights

    config = read_json(model_dir / "config.json", "not a diffusers model folder")
    if "quantization_config" not in config:
        raise ValueError(f"{model_dir}/config.json has no quantization_config: not an svdq-convert output")
    qdict = dict(config.pop("quantization_config"))
    if qdict.get("quant_method") != dq.QUANT_METHOD:
        raise ValueError(f"{model_dir}: quant_method is {qdict.get('quant_method')!r}, expected {dq.QUANT_METHOD!r}")
    qcfg = dq.SVDQuantizationConfig(**qdict)
    cls_name = config.get("_class_name")
    cls = getattr(diffusers, cls_name or "", None)
    if cls is None:
        raise ValueError(f"{model_dir}/config.json: unknown model class {cls_name!r}")
    with init_empty_weights():
        model = cls.from_config(config)
    dq.swap_in_quantized_modules(model, qcfg, dtype)
    state = {}
    for f in checkpoint_files(model_dir):
        state.update(load_safetensors(f))
    dq.check_keys(model, state, str(model_dir))
    state = {k: v.to(dtype) if v.dtype in (torch.float16, torch.bfloat16, torch.float32)
             and not k.endswith((".smooth", ".wcscale")) else v for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    dq.check_no_meta(model, str(model_dir))
    model.register_to_config(quantization_config=qcfg)
    model.hf_quantizer = dq.SVDQuantizer(qcfg)
    model.is_quantized = True
    model.eval()
    return model.to(device) if device is not None else model


def load_svdq_pipeline(
    path_or_id: str | os.PathLike, device: str | torch.device | None = None, dtype: torch.dtype = torch.bfloat16, **kwargs
):
    """A ready diffusers pipeline from an ``svdq-convert`` folder (or hub id) in ``dtype`` on ``device``.

    The pipeline class comes from ``model_index.json``; the transformer is built on ``meta``, its
    targets swapped for the quantized modules and the checkpoint loaded strictly. ``kwargs`` go to
    the pipeline's ``from_pretrained``.
    """
    import diffusers

    root = resolve_model_path(path_or_id)
    index = read_json(root / "model_index.json", "not a diffusers pipeline folder")
    cls = getattr(diffusers, index.get("_class_name", ""), None)
    if cls is None:
        raise ValueError(f"{root}/model_index.json: unknown pipeline class {index.get('_class_name')!r}")
    transformer = load_svdq_transformer(root / "transformer", dtype)
    kwargs.setdefault("use_safetensors", True)  # never unpickle a folder's other components
    pipe = cls.from_pretrained(root, transformer=transformer, dtype=dtype, **kwargs)
    return pipe.to(device) if device is not None else pipe
