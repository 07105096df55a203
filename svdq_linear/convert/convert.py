"""Block-by-block SVDQuant conversion of a Flux / SD3 diffusers pipeline folder, and in-place quantization.

``convert`` never holds more than one transformer block (plus calibration, if asked for): it reads a
block's tensors from the source safetensors, quantizes them, writes them as one shard and frees them.
Everything is written into ``<out_dir>.partial`` and renamed to ``out_dir`` only when complete;
``resume=True`` continues an interrupted run from its last finished block.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from svdq_linear import diffusers_quantizer as dq
from svdq_linear.files import checkpoint_files, pipeline_components, read_json, resolve_model_path, safetensors_keys
from svdq_linear.linear import MODES, SVDQW4A4Linear, set_mode
from svdq_linear.pipeline import LayerStats, quantize_linears, quantize_state_dict
from svdq_linear.svdquant import SVDQuantConfig

from . import calibrate, recipes

TINY_PREFIX = "tiny:"
FAIL_AFTER_ENV = "SVDQ_CONVERT_FAIL_AFTER_UNITS"  # fault injection for the resume tests


@dataclass
class ConvertOptions:
    rank: int = 32
    alpha: float = 0.5
    svd: str = "auto"
    refine_iters: int = 0
    calib: bool = True
    calib_prompts: str | None = None  # file; None: the shipped prompt set
    calib_num: int | None = None  # use the first N prompts
    calib_steps: int = 4
    calib_resolution: int = 512
    calib_offload: bool = False  # enable_model_cpu_offload during calibration (GPUs smaller than the model)
    device: str | None = None  # calibration and SVD; default: the GPU when there is one
    dtype: str = "bfloat16"  # 16-bit branch, biases and kept tensors
    resume: bool = False
    overwrite: bool = False  # replace an earlier svdq-convert output in out_dir once the new one is complete
    progress: bool = True

    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if dt not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"expected --dtype bfloat16, float16 or float32, got {self.dtype!r}")
        return dt

    def svdquant_config(self) -> SVDQuantConfig:
        return SVDQuantConfig(rank=self.rank, alpha=self.alpha, svd=self.svd, refine_iters=self.refine_iters,
                              device=self.device)

    def settings(self, model_id: str) -> dict:
        """What must match for ``--resume`` to continue a partial run."""
        keep = ("rank", "alpha", "svd", "refine_iters", "calib", "calib_prompts", "calib_num", "calib_steps",
                "calib_resolution", "dtype")
        return {"model_id": str(model_id), **{k: getattr(self, k) for k in keep}}


@dataclass
class Summary:
    out_dir: str
    layers_w4a4: int
    layers_w4a16: int
    bytes_before: int
    bytes_after: int
    seconds: float
    rel_error_median: float
    rel_error_worst: float
    worst_layer: str
    w4a16_error_median: float
    resumed_units: int = 0
    converted_units: int = 0
    layers: list[dict] = field(default_factory=list)

    def text(self) -> str:
        return (
            f"svdq-convert: wrote {self.out_dir}\n"
            f"  layers: {self.layers_w4a4} W4A4 (SVDQW4A4Linear), {self.layers_w4a16} W4A16 (NVFP4W4A16Linear)\n"
            f"  transformer: {_fmt_bytes(self.bytes_before)} -> {_fmt_bytes(self.bytes_after)} "
            f"({self.bytes_before / max(self.bytes_after, 1):.2f}x smaller)\n"
            f"  time: {self.seconds:.1f} s ({self.converted_units} blocks converted, {self.resumed_units} resumed)\n"
            f"  W4A4 relative weight error: median {self.rel_error_median:.4f}, "
            f"worst {self.rel_error_worst:.4f} ({self.worst_layer})\n"
            f"  W4A16 relative weight error: median {self.w4a16_error_median:.4f}"
        )


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _atomic_write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def _link_or_copy_tree(src: Path, dst: Path) -> None:
    """Copy a folder, hard-linking files where the filesystem allows (weights can be gigabytes)."""

    def link_or_copy(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=link_or_copy, dirs_exist_ok=True)


def _source_folder(model_id: str, partial: Path) -> Path:
    if model_id.startswith(TINY_PREFIX):
        from .tiny import KINDS, save_tiny_pipeline

        kind = model_id[len(TINY_PREFIX):]
        if kind not in KINDS:
            raise ValueError(f"unknown built-in demo {model_id!r}; expected one of {[TINY_PREFIX + k for k in KINDS]}")
        src = partial / "_tiny_source"
        if not (src / "model_index.json").is_file():
            save_tiny_pipeline(kind, src)
        return src
    return resolve_model_path(model_id)


def _source_keys(model_dir: Path) -> dict[str, Path]:
    return {k: f for f in checkpoint_files(model_dir) for k in safetensors_keys(f)}


def _calibration_kwargs(model_id: str, opts: ConvertOptions) -> dict:
    if model_id.startswith(TINY_PREFIX):  # the demo's own fast settings (64x64, short prompts)
        from .tiny import TINY_CALL_KWARGS

        kwargs = dict(TINY_CALL_KWARGS[model_id[len(TINY_PREFIX):]])
        kwargs.pop("num_inference_steps")
        return kwargs
    return {"height": opts.calib_resolution, "width": opts.calib_resolution}


def _calibrate(
    model_id: str, src: Path, recipe: recipes.Recipe, opts: ConvertOptions, out_file: Path
) -> dict[str, torch.Tensor]:
    from diffusers import DiffusionPipeline
    from safetensors.torch import load_file, save_file

    if out_file.is_file():
        return load_file(out_file)
    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe = DiffusionPipeline.from_pretrained(src, dtype=opts.torch_dtype(), use_safetensors=True)
    if opts.calib_offload and device != "cpu":
        pipe.enable_model_cpu_offload(device=device)
    else:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    prompts = calibrate.read_prompts(opts.calib_prompts, opts.calib_num)
    act_max = calibrate.collect_act_max(pipe, recipe.w4a4, prompts, opts.calib_steps,
                                        _calibration_kwargs(model_id, opts), progress=opts.progress)
    del pipe
    save_file({k: v.contiguous() for k, v in act_max.items()}, out_file)
    os.chmod(out_file, 0o644)
    return act_max


def _check_replaceable(out: Path) -> None:
    """``--overwrite`` replaces only what svdq-convert wrote (not a home folder given by mistake)."""
    config = out / "transformer" / "config.json"
    try:
        ours = out.is_dir() and dq.is_svdq_config(read_json(config, "").get("quantization_config") or {})
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise FileExistsError(f"{out} exists and is not an svdq-convert output (no svdq quantization_config in "
                              f"{config}); --overwrite replaces only those: remove it or pick another output folder")


def convert(model_id: str, out_dir: str | os.PathLike, opts: ConvertOptions | None = None) -> Summary:
    """Convert ``model_id`` (a local diffusers folder, a hub id, or ``tiny:flux|sd3|sd35``) into ``out_dir``.

    A run that fails before its first block is written removes ``<out_dir>.partial``; a later failure
    keeps it for ``resume=True``.
    """
    opts = opts or ConvertOptions()
    opts.torch_dtype()  # validate before touching the disk
    t0 = time.perf_counter()
    out = Path(out_dir).expanduser().resolve()
    partial = out.with_name(out.name + ".partial")
    if out.exists():
        if not opts.overwrite:
            raise FileExistsError(f"{out} already exists; pass --overwrite to replace it, or pick another output folder")
        _check_replaceable(out)
    settings = opts.settings(model_id)
    progress_file = partial / "progress.json"
    if partial.exists():
        if not opts.resume:
            raise FileExistsError(f"{partial} holds an unfinished conversion: pass --resume to continue it, or delete it")
        state = read_json(progress_file, "the partial conversion's progress file")
        diff = sorted(k for k in settings.keys() | state["settings"].keys()
                      if settings.get(k) != state["settings"].get(k))
        if diff:
            raise ValueError(f"--resume: {partial} was started with other settings ({', '.join(diff)})")
    else:
        (partial / "transformer").mkdir(parents=True)
        state = {"settings": settings, "done": {}}
        _atomic_write_json(progress_file, state)
    try:
        return _convert(str(model_id), out, partial, state, opts, t0)
    except BaseException:
        if not state["done"]:  # nothing worth resuming: leave no trace
            shutil.rmtree(partial, ignore_errors=True)
        raise


def _convert(model_id: str, out: Path, partial: Path, state: dict, opts: ConvertOptions, t0: float) -> Summary:
    import diffusers
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from safetensors.torch import save_file

    dtype = opts.torch_dtype()
    progress_file = partial / "progress.json"
    src = _source_folder(model_id, partial)
    model_index = read_json(src / "model_index.json", "not a diffusers pipeline folder")
    config = read_json(src / "transformer" / "config.json", "the pipeline has no transformer/ (Flux or SD3 expected)")
    cls_name = config.get("_class_name")
    recipes.check_supported(cls_name)
    if "quantization_config" in config:
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    with init_empty_weights():
        meta_model = getattr(diffusers, cls_name).from_config(config)
    recipe = recipes.recipe_for(meta_model)
    model_keys = set(meta_model.state_dict())
    del meta_model

    key_files = _source_keys(src / "transformer")
    foreign, absent = sorted(set(key_files) - model_keys), sorted(model_keys - set(key_files))
    if foreign or absent:
        raise ValueError(f"{src}/transformer: the checkpoint does not match {cls_name}: "
                         f"{len(foreign)} unknown tensors (e.g. {foreign[:3]}), {len(absent)} missing (e.g. {absent[:3]})")

    act_max = _calibrate(model_id, src, recipe, opts, partial / "calibration.safetensors") if opts.calib else {}

    units: dict[str, list[str]] = {}
    for key in sorted(key_files, key=_natural):
        units.setdefault(recipes.unit_of(key), []).append(key)
    shard_names = {u: f"diffusion_pytorch_model-{i + 1:05d}-of-{len(units):05d}.safetensors"
                   for i, u in enumerate(units)}
    svdq_config = opts.svdquant_config()
    fail_after = int(os.environ.get(FAIL_AFTER_ENV, "0") or 0)
    converted = resumed = 0
    for unit, keys in tqdm(units.items(), desc="converting", unit="block", disable=not opts.progress):
        shard = partial / "transformer" / shard_names[unit]
        if unit in state["done"] and shard.is_file():
            resumed += 1
            continue
        tensors = {}
        for f in sorted({key_files[k] for k in keys}):
            with safe_open(f, framework="pt") as fh:
                tensors.update({k: fh.get_tensor(k) for k in keys if key_files[k] == f})
        with torch.no_grad():
            new, stats = quantize_state_dict(tensors, recipe.kinds, recipe.groups, act_max, svdq_config, dtype)
        before = sum(t.numel() * t.element_size() for t in tensors.values())
        tmp = shard.with_name(shard.name + ".tmp")
        save_file({k: v.contiguous() for k, v in new.items()}, tmp)
        os.chmod(tmp, 0o644)  # safetensors writes 0600; a model folder is meant to be shared
        os.replace(tmp, shard)
        state["done"][unit] = {
            "keys": sorted(new),
            "bytes_before": before,
            "bytes_after": sum(t.numel() * t.element_size() for t in new.values()),
            "layers": [asdict(s) for s in stats],
        }
        _atomic_write_json(progress_file, state)
        del tensors, new
        converted += 1
        if fail_after and converted >= fail_after:
            raise RuntimeError(f"{FAIL_AFTER_ENV}={fail_after}: simulated crash after {converted} blocks")

    weight_map = {k: shard_names[u] for u, info in state["done"].items() for k in info["keys"]}
    _atomic_write_json(partial / "transformer" / "diffusion_pytorch_model.safetensors.index.json",
                       {"metadata": {"total_size": sum(i["bytes_after"] for i in state["done"].values())},
                        "weight_map": weight_map})
    qcfg = dq.SVDQuantizationConfig(
        rank=opts.rank,
        w4a4_modules=recipe.w4a4,
        w4a16_modules=recipe.w4a16,
        smooth_groups=recipe.groups,
        calibration={"enabled": opts.calib, "prompts": opts.calib_prompts or "default",
                     "num_prompts": len(calibrate.read_prompts(opts.calib_prompts, opts.calib_num)) if opts.calib else 0,
                     "steps": opts.calib_steps, "resolution": opts.calib_resolution},
        conversion={"alpha": opts.alpha, "svd": opts.svd, "refine_iters": opts.refine_iters, "dtype": opts.dtype,
                    "source": model_id},
    )
    _atomic_write_json(partial / "transformer" / "config.json", {**config, "quantization_config": qcfg.to_dict()})
    shutil.copy2(src / "model_index.json", partial / "model_index.json")
    for component in pipeline_components(model_index):  # not stray root files (single-file checkpoints)
        if component != "transformer" and (src / component).is_dir():
            _link_or_copy_tree(src / component, partial / component)
    if (partial / "_tiny_source").exists():
        shutil.rmtree(partial / "_tiny_source")
    if (partial / "calibration.safetensors").exists():
        os.replace(partial / "calibration.safetensors", partial / "svdq_calibration.safetensors")
    layers = [layer for info in state["done"].values() for layer in info["layers"]]
    progress_file.unlink()
    if out.exists():  # --overwrite: the earlier output goes only now that the new one is complete
        old = out.with_name(out.name + ".replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old)
    else:
        os.replace(partial, out)  # the only step that makes out_dir exist

    errors = sorted((layer["rel_error"], layer["name"]) for layer in layers if layer["kind"] == "w4a4")
    w4a16_errors = [layer["rel_error"] for layer in layers if layer["kind"] == "w4a16"]
    return Summary(
        out_dir=str(out),
        layers_w4a4=sum(layer["kind"] == "w4a4" for layer in layers),
        layers_w4a16=sum(layer["kind"] == "w4a16" for layer in layers),
        bytes_before=sum(i["bytes_before"] for i in state["done"].values()),
        bytes_after=sum(i["bytes_after"] for i in state["done"].values()),
        seconds=time.perf_counter() - t0,
        rel_error_median=statistics.median(e for e, _ in errors) if errors else math.nan,
        rel_error_worst=errors[-1][0] if errors else math.nan,
        worst_layer=errors[-1][1] if errors else "",
        w4a16_error_median=statistics.median(w4a16_errors) if w4a16_errors else math.nan,
        resumed_units=resumed,
        converted_units=converted,
        layers=layers,
    )


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in key.split(".")]


def quantize_pipeline(
    pipe,
    rank: int = 32,
    calib_prompts: list[str] | str | None = None,
    calib_steps: int = 4,
    calib: bool = True,
    call_kwargs: dict | None = None,
    progress: bool = True,
    mode: str | None = None,
    **config_kwargs,
) -> list[LayerStats]:
    """Quantize an already-loaded Flux / SD3 pipeline's transformer in place, with the recipes of
    ``svdq-convert``. ``calib_prompts``: a list, a file, or None for the shipped set; ``call_kwargs``
    go to the calibration runs (height, width, ...). ``mode`` (``"exact"``, ``"fast"``, ``"auto"``)
    is set on every quantized layer (None: the default). ``config_kwargs`` are ``SVDQuantConfig`` fields.
    Afterwards ``pipe.save_pretrained(folder)`` writes a folder that ``load_svdq_pipeline`` loads.
    """
    transformer = pipe.transformer
    if mode is not None and mode not in MODES:
        raise ValueError(f"expected a mode in {MODES}, got {mode!r}")
    recipe = recipes.recipe_for(transformer)
    act_max = {}
    if calib:
        prompts = calib_prompts if isinstance(calib_prompts, list) else calibrate.read_prompts(calib_prompts)
        act_max = calibrate.collect_act_max(pipe, recipe.w4a4, prompts, calib_steps, call_kwargs, progress=progress)
    config = SVDQuantConfig.from_kwargs(rank=rank, **config_kwargs)
    by_unit: dict[str, list[str]] = {}
    for name in recipe.kinds:
        by_unit.setdefault(recipes.unit_of(name), []).append(name)
    stats = []
    for names in tqdm(by_unit.values(), desc="quantizing", unit="block", disable=not progress):
        stats += quantize_linears(
            transformer,
            w4a4=[n for n in names if recipe.kinds[n] == recipes.W4A4],
            w4a16=[n for n in names if recipe.kinds[n] == recipes.W4A16],
            act_max=act_max,
            smooth_groups=recipe.groups,
            config=config,
        )
    branch = next(m for m in transformer.modules() if isinstance(m, SVDQW4A4Linear)).proj_down.dtype
    qcfg = dq.SVDQuantizationConfig(rank=rank, w4a4_modules=recipe.w4a4, w4a16_modules=recipe.w4a16,
                                    smooth_groups=recipe.groups, dtype=str(branch).removeprefix("torch."),
                                    calibration={"enabled": calib, "steps": calib_steps},
                                    conversion={"alpha": config.alpha, "svd": config.svd,
                                                "refine_iters": config.refine_iters, "source": "quantize_pipeline"})
    transformer.register_to_config(quantization_config=qcfg)
    transformer.hf_quantizer = dq.SVDQuantizer(qcfg)
    transformer.is_quantized = True
    dq.mark_quantized(transformer)
    if mode is not None:
        set_mode(transformer, mode)
    return stats
