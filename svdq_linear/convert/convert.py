"""Block-by-block SVDQuant conversion of a Flux / SD3 diffusers pipeline folder, and in-place quantization.

``convert`` never holds more than one transformer block (plus calibration, if asked for): it reads a
block's tensors from the source safetensors, quantizes them, writes them as one shard and frees them.
Everything is written into ``<out_dir>.partial`` and renamed to ``out_dir`` only when complete;
``resume=True`` continues an interrupted run from its last finished block.

Every option is checked before the first expensive step (types, ranges, the device, the rank
against every target layer, the calibration size against the pipeline, calibration on a CPU only for
small models). Every file is written to ``<name>.tmp`` and renamed, so a full or read-only disk leaves
the last complete file (and ``progress.json`` says which blocks are done). ``progress.json`` also
records a run's failure; a ``.partial`` that holds no finished block, or whose run failed on its
settings, is restarted with other settings without asking.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from svdq_linear import diffusers_quantizer as dq
from svdq_linear.files import checkpoint_files, pipeline_components, read_json, resolve_model_path, safetensors_keys
from svdq_linear.linear import MODES, SVDQW4A4Linear, _PackedNVFP4Linear, name_layers, set_mode
from svdq_linear.pipeline import LayerStats, quantize_linears, quantize_state_dict
from svdq_linear.svdquant import (
    DEFAULT_ACT_HEADROOM,
    MAX_ACT_HEADROOM,
    SVD_METHODS,
    SVDQuantConfig,
    activation_headroom,
)

from . import calibrate, recipes

TINY_PREFIX = "tiny:"
FAIL_AFTER_ENV = "SVDQ_CONVERT_FAIL_AFTER_UNITS"  # fault injection for the resume tests
CPU_CALIB_MAX_PARAMS = 2_000_000_000
"""Calibrating a larger transformer on a CPU takes hours: refused, with advice."""
CALIB_FILE = "calibration.safetensors"  # in the .partial; renamed svdq_calibration.safetensors when done
LAYER_REPORT = "svdq_layers.json"  # per-layer error and activation headroom, in the finished folder


class ConvertError(ValueError):
    """A failure that the same command would hit again (an option that cannot work for this model or
    machine, a damaged ``.partial``): no ``--resume`` advice follows it."""


class ConvertWarning(UserWarning):
    """An option that works but costs the user later (``svdq-convert`` prints it on one line)."""


def _warn_rank(rank: int) -> None:
    """Say before the work when the rank leaves a GPU kernel (``backends.rank_note``): the layers would run on a slower
    backend there, which nothing at load time would make obvious."""
    from svdq_linear.backends import rank_note

    note = rank_note(rank)
    if note:
        warnings.warn(note, ConvertWarning, stacklevel=3)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _expect_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConvertError(f"expected {_flag(name)} to be an integer, got {value!r} ({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        want = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ConvertError(f"expected {_flag(name)} {want}, got {value}")


def check_device(device: str | None) -> torch.device:
    """The device calibration and SVD run on: ``device``, or the GPU when there is one, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConvertError(f"expected --device cpu, cuda or cuda:N, got {device!r} ({e})") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible")
            raise ConvertError(f"--device {device}: expected an available CUDA device, but {why} "
                               f"(torch {torch.__version__}); use --device cpu (with --no-calib for large "
                               f"models), or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConvertError(f"--device {device}: expected a CUDA index below {torch.cuda.device_count()}, "
                               f"got {dev.index}")
    elif dev.type == "meta":
        raise ConvertError("expected --device cpu, cuda or cuda:N, got 'meta' (a device that holds no data)")
    elif dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except Exception as e:
            raise ConvertError(f"--device {device} is not available here ({type(e).__name__}: {e})") from e
    return dev


@dataclass
class ConvertOptions:
    rank: int = 32
    alpha: float = 0.5
    svd: str = "auto"
    refine_iters: int = 0
    act_headroom: int = DEFAULT_ACT_HEADROOM  # powers of two between the calibrated max and saturation
    calib: bool = True
    calib_prompts: str | None = None  # file; None: the shipped prompt set
    calib_num: int | None = None  # use the first N prompts
    calib_steps: int = 4
    calib_resolution: int | None = None  # None: the pipeline's own size, at most 512 (calibrate.resolution_limits)
    calib_offload: bool = False  # enable_model_cpu_offload during calibration (GPUs smaller than the model)
    # images the calibration call passes besides the prompt: call argument -> file (image, mask_image, control_image)
    calib_inputs: dict[str, str] | None = None
    device: str | None = None  # calibration and SVD; default: the GPU when there is one
    dtype: str = "bfloat16"  # 16-bit branch, biases and kept tensors
    resume: bool = False
    overwrite: bool = False  # start over: discard <out_dir>.partial; replace an earlier output once the new one is complete
    progress: bool = True

    def validate(self) -> list[str]:
        """Check every option that needs no model (types, ranges, device, prompts); returns the prompts
        calibration will use (empty without calibration). Raises ConvertError."""
        _expect_int("rank", self.rank, 0)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0:
            raise ConvertError(f"expected --alpha to be a number in [0, 1], got {self.alpha!r}")
        if self.svd not in SVD_METHODS:
            raise ConvertError(f"expected --svd in {SVD_METHODS}, got {self.svd!r}")
        _expect_int("refine_iters", self.refine_iters, 0)
        _expect_int("act_headroom", self.act_headroom, 0, MAX_ACT_HEADROOM)
        if self.calib_num is not None:
            _expect_int("calib_num", self.calib_num, 1)
        _expect_int("calib_steps", self.calib_steps, 1)
        if self.calib_resolution is not None:
            _expect_int("calib_resolution", self.calib_resolution, 16)
        self.torch_dtype()
        check_device(self.device)
        if not self.calib:
            given = [flag for flag, v in (("--calib-prompts", self.calib_prompts), ("--calib-num", self.calib_num),
                                          ("--calib-resolution", self.calib_resolution),
                                          ("--calib-input", self.calib_inputs or None)) if v is not None]
            given += ["--calib-offload"] if self.calib_offload else []
            if given:
                raise ConvertError(f"{', '.join(given)} set{'s' if len(given) == 1 else ''} up the calibration runs, "
                                   "which --no-calib skips: pass one or the other")
        for name, path in (self.calib_inputs or {}).items():
            _check_calib_image(name, path)
        if not self.calib:
            return []
        try:
            return calibrate.read_prompts(self.calib_prompts, self.calib_num)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ConvertError(f"--calib-prompts: {e}") from e

    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None) if isinstance(self.dtype, str) else None
        if dt not in (torch.bfloat16, torch.float16, torch.float32):
            raise ConvertError(f"expected --dtype bfloat16, float16 or float32, got {self.dtype!r}")
        return dt

    def svdquant_config(self) -> SVDQuantConfig:
        return SVDQuantConfig(rank=self.rank, alpha=self.alpha, svd=self.svd, refine_iters=self.refine_iters,
                              act_headroom=self.act_headroom, device=self.device)

    def settings(self, model_id: str) -> dict:
        """What must match for ``--resume`` to continue a partial run."""
        keep = ("rank", "alpha", "svd", "refine_iters", "act_headroom", "calib", "calib_prompts", "calib_num",
                "calib_steps", "calib_resolution", "dtype")
        out = {"model_id": _local_or_id(str(model_id)), **{k: getattr(self, k) for k in keep}}
        if self.calib_prompts:  # one file, however the path was typed
            out["calib_prompts"] = str(Path(self.calib_prompts).expanduser().resolve())
        if self.calib_inputs:  # only when given: partial runs recorded before the option resume as they were
            out["calib_inputs"] = {k: str(Path(v).expanduser().resolve()) for k, v in sorted(self.calib_inputs.items())}
        return out


def _local_or_id(model_id: str) -> str:
    """A local folder as its resolved path (``src/flux``, ``./src/flux/`` and the absolute path are one source);
    a hub id or ``tiny:`` name as given."""
    path = Path(model_id).expanduser()
    return str(path.resolve()) if not model_id.startswith(TINY_PREFIX) and path.is_dir() else model_id


def _source_fingerprint(src: Path, model_index: dict) -> str:
    """What identifies the source's files without reading them whole: each component's file names and sizes, and
    the first and last MiB of each (all of a file under 2 MiB; another model of the same shapes differs there), with
    ``model_index.json``.
    A ``--resume`` holds the source to it: a folder replaced by another model under the same path would otherwise
    finish the output with the other model's blocks."""
    digest = hashlib.sha256((src / "model_index.json").read_bytes())
    for component in sorted(pipeline_components(model_index)):
        folder = src / component
        files = sorted(f for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else []
        for f in files:
            size = f.stat().st_size
            digest.update(f"{f.relative_to(src).as_posix()}:{size}".encode())
            with open(f, "rb") as fh:
                digest.update(fh.read(1 << 20))
                if size > 1 << 20:  # the last MiB, or the rest of a file under 2 MiB (it had gone unread)
                    fh.seek(max(1 << 20, size - (1 << 20)))
                    digest.update(fh.read())
    return digest.hexdigest()


def _check_components(src: Path, model_index: dict) -> type:
    """The pipeline class ``model_index.json`` names, after checking that diffusers has it and that every component
    folder it lists is there and not empty (a source without its VAE converted, and gave an output that did not
    load)."""
    import diffusers

    cls = model_index.get("_class_name")
    if not isinstance(cls, str) or not hasattr(diffusers, cls):
        raise ConvertError(f"{src}/model_index.json names the pipeline class {cls!r}, which diffusers "
                           f"{diffusers.__version__} does not have")
    missing = [c for c in pipeline_components(model_index) if not (src / c).is_dir() or not any((src / c).iterdir())]
    if missing:
        raise ConvertError(f"{src} lacks the component folders {missing} that its model_index.json lists: the output "
                           f"would not load (download or copy the whole pipeline)")
    return getattr(diffusers, cls)


def _check_calib_image(name, path) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ConvertError(f"--calib-input: expected NAME=FILE with NAME a call argument such as "
                           f"{', '.join(calibrate.IMAGE_INPUTS)}, got {name!r}")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(Path(path).expanduser()) as img:
            img.verify()
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise ConvertError(f"--calib-input {name}={path}: not a readable image ({type(e).__name__}: {e})") from e


def _load_calib_images(inputs: dict[str, str] | None) -> dict:
    from PIL import Image

    out = {}
    for name, path in (inputs or {}).items():
        with Image.open(Path(path).expanduser()) as img:
            out[name] = img.convert("RGB")
    return out


def _check_pipeline_inputs(cls: type, opts: ConvertOptions) -> None:
    """Before any weight is read: the calibration inputs against the call of pipeline class ``cls``. A pipeline
    that takes a mask or a control image cannot run on a prompt alone (its plain ``image``, optional in some, is
    checked by the first calibration call: ``calibrate.collect_act_max``)."""
    import inspect

    params = inspect.signature(cls.__call__).parameters
    given = opts.calib_inputs or {}
    for name in given:
        if name not in params:
            takes = [n for n in calibrate.IMAGE_INPUTS if n in params]
            raise ConvertError(f"--calib-input {name}: {cls.__name__} takes no argument {name!r} (its image inputs: "
                               f"{', '.join(takes) or 'none'})")
    missing = [n for n in calibrate.NEEDED_IMAGE_INPUTS if n in params and n not in given]
    if missing:
        also = " and image" if "image" in params and "image" not in given else ""
        raise ConvertError(f"{cls.__name__} needs {', '.join(missing)}{also} besides the prompt to run: calibrate with "
                           f"--calib-input NAME=FILE for each (e.g. --calib-input {missing[0]}=FILE), or pass "
                           f"--no-calib")


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
    layers: list[dict] = field(default_factory=list)  # LayerStats fields + act_headroom (None without calibration)

    def text(self) -> str:
        lines = [
            f"svdq-convert: wrote {self.out_dir}",
            f"  layers: {self.layers_w4a4} W4A4 (SVDQW4A4Linear), {self.layers_w4a16} W4A16 (NVFP4W4A16Linear)",
            f"  transformer: {_fmt_bytes(self.bytes_before)} -> {_fmt_bytes(self.bytes_after)} "
            f"({self.bytes_before / max(self.bytes_after, 1):.2f}x smaller)",
            f"  time: {self.seconds:.1f} s ({self.converted_units} blocks converted, {self.resumed_units} resumed)",
            f"  W4A4 relative weight error: median {self.rel_error_median:.4f}, "
            f"worst {self.rel_error_worst:.4f} ({self.worst_layer})",
            f"  W4A16 relative weight error: median {self.w4a16_error_median:.4f}",
        ]
        heads = sorted((layer["act_headroom"], layer["name"]) for layer in self.layers
                       if layer.get("act_headroom") is not None)
        if heads:
            tight = ", ".join(f"{name} {h:.2f}" for h, name in heads[:3])
            lines.append(
                f"  W4A4 activation headroom (powers of two between the calibrated block max and saturation): "
                f"median {statistics.median(h for h, _ in heads):.2f}, lowest {tight} (every layer: {LAYER_REPORT})")
        elif self.layers_w4a4:
            lines.append("  W4A4 activation headroom: not calibrated (activation factor 1; "
                         "SVDQ_LINEAR_CHECK_RANGE=1 warns at run time when blocks saturate or underflow)")
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _note(msg: str) -> None:
    print(f"svdq-convert: {msg}", file=sys.stderr)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through ``path.tmp`` + rename: a failed write (full or read-only disk)
    leaves the previous file or none, never a truncated one, and no ``.tmp`` behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # a model folder is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _atomic_write_json(path: Path, data) -> None:
    _write_atomic(path, json.dumps(data, indent=2, sort_keys=True).encode())


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    _write_atomic(path, save({k: v.contiguous() for k, v in tensors.items()}))


def _copy_tree(src: Path, dst: Path) -> None:
    """Copy a component folder. Files are copied, never hard-linked: a hub snapshot's files are links
    into the shared cache, and a later in-place write to the output must not reach the source."""
    shutil.copytree(src, dst, dirs_exist_ok=True)  # copy2 follows the snapshot's symlinks


# ---- the source ----------------------------------------------------------------------------------


def _source_folder(model_id: str, partial: Path) -> Path:
    if model_id.startswith(TINY_PREFIX):
        from .tiny import KINDS, save_tiny_pipeline

        kind = model_id[len(TINY_PREFIX):]
        if kind not in KINDS:
            raise ConvertError(f"unknown built-in demo {model_id!r}; expected one of {[TINY_PREFIX + k for k in KINDS]}")
        src = partial / "_tiny_source"
        if not (src / "model_index.json").is_file():
            save_tiny_pipeline(kind, src)
        return src
    return resolve_model_path(model_id)


def _source_keys(model_dir: Path) -> dict[str, Path]:
    return {k: f for f in checkpoint_files(model_dir) for k in safetensors_keys(f)}


def _read_block(files: list[Path], keys: list[str], key_files: dict[str, Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    tensors = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as fh:
                tensors.update({k: fh.get_tensor(k) for k in keys if key_files[k] == f})
        except SafetensorError as e:
            raise ValueError(f"{f} is corrupted or truncated ({e})") from e
    return tensors


def _meta_model(cls_name: str, config: dict, where: Path):
    """The transformer on ``meta`` from its config (no weights): a config value of the wrong type or
    range is a one-line error naming the file."""
    import diffusers
    from accelerate import init_empty_weights

    try:
        with init_empty_weights():
            return getattr(diffusers, cls_name).from_config(config)
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError, RuntimeError) as e:
        raise ConvertError(f"{where}: cannot build {cls_name} from this config "
                           f"({type(e).__name__}: {' '.join(str(e).split())})") from e


def _check_rank(model, recipe: recipes.Recipe, rank: int, what: str = "--rank") -> None:
    """Rank against every W4A4 target: ``rank <= min(in_features, out_features)`` (``what``: the option's name)."""
    smallest = min(recipe.w4a4, key=lambda n: min(model.get_submodule(n).weight.shape))
    n, k = model.get_submodule(smallest).weight.shape
    if rank > min(n, k):
        raise ConvertError(f"expected {what} <= min(in_features, out_features) of every W4A4 layer, got {rank} "
                           f"> {min(n, k)} for {smallest} ({k} -> {n})")


def _read_config_file(path: Path) -> dict | None:
    if not path.is_file():
        return None
    data = read_json(path, "")
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _calibration_kwargs(model_id: str, src: Path, config: dict, opts: ConvertOptions) -> dict:
    """The calibration call's size (and, for the demos, their fast settings), checked against the
    pipeline before anything runs."""
    try:
        limits = calibrate.resolution_limits(config["_class_name"], config, _read_config_file(src / "vae" / "config.json"))
    except (TypeError, ValueError) as e:  # a size in a config that is not a number
        raise ConvertError(f"{src}: cannot derive the calibration size from transformer/config.json and "
                           f"vae/config.json ({type(e).__name__}: {e})") from e
    if model_id.startswith(TINY_PREFIX):  # the demo's own fast settings (64x64, short prompts)
        from .tiny import TINY_CALL_KWARGS

        kwargs = dict(TINY_CALL_KWARGS[model_id[len(TINY_PREFIX):]])
        kwargs.pop("num_inference_steps")
    else:
        kwargs = {"height": limits.default, "width": limits.default}
    size = opts.calib_resolution
    if size is not None:
        if limits.maximum is not None and size > limits.maximum:
            raise ConvertError(f"expected --calib-resolution <= {limits.maximum} for this pipeline (its positional "
                               f"embedding covers {limits.maximum} pixels), got {size}")
        if size % limits.multiple:
            raise ConvertError(f"expected --calib-resolution to be a multiple of {limits.multiple} for this "
                               f"pipeline (VAE scale x patch), got {size}")
        kwargs.update(height=size, width=size)
    return kwargs


def _load_calibration(path: Path, recipe: recipes.Recipe, in_features: dict[str, int]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    fix = "delete it to calibrate again (then --resume), or pass --overwrite to start over"
    try:
        act_max = load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ConvertError(f"{path} is corrupted or truncated ({' '.join(str(e).split())}): {fix}") from e
    for name in recipe.w4a4:
        t = act_max.get(name)
        if t is None or tuple(t.shape) != (in_features[name],) or t.dtype != torch.float32:
            got = "nothing" if t is None else f"{t.dtype} {list(t.shape)}"
            raise ConvertError(f"{path}: expected {name} as float32 [{in_features[name]}], got {got}: {fix}")
        if not torch.isfinite(t).all():
            raise ConvertError(f"{path}: {name} holds {int((~torch.isfinite(t)).sum())} NaN or Inf maxima: {fix}")
    return act_max


def _calibrate(src: Path, recipe: recipes.Recipe, opts: ConvertOptions, prompts: list[str], call_kwargs: dict,
               out_file: Path) -> dict[str, torch.Tensor]:
    from diffusers import DiffusionPipeline

    device = check_device(opts.device)
    pipe = DiffusionPipeline.from_pretrained(src, dtype=opts.torch_dtype(), use_safetensors=True)
    if opts.calib_offload and device.type != "cpu":
        pipe.enable_model_cpu_offload(device=device)
    else:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    call_kwargs = {**call_kwargs, **_load_calib_images(opts.calib_inputs)}
    act_max = calibrate.collect_act_max(pipe, recipe.w4a4, prompts, opts.calib_steps, call_kwargs,
                                        progress=opts.progress)
    del pipe
    _save_tensors(out_file, act_max)
    return act_max


# ---- the partial folder --------------------------------------------------------------------------


def _check_our_partial(partial: Path) -> None:
    """``--overwrite`` removes only an unfinished svdq-convert run: a folder with its ``progress.json``, or one that
    a run left before writing it (nothing but an empty ``transformer/``)."""
    if (partial / "progress.json").is_file():
        return
    names = [p.name for p in partial.iterdir()] if partial.is_dir() else None
    sub = partial / "transformer"
    if names == [] or (names == ["transformer"] and sub.is_dir() and not any(sub.iterdir())):
        return
    raise ConvertError(f"{partial} exists but has no progress.json (not an unfinished svdq-convert run): "
                       "remove it or pick another output folder (--overwrite removes only svdq-convert's own)")


def _read_progress(partial: Path) -> dict:
    path = partial / "progress.json"
    fix = "pass --overwrite to start over"
    _check_our_partial(partial)
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path} is malformed ({e}): {fix}") from e
    entry_ok = lambda v: (isinstance(v, dict) and isinstance(v.get("keys"), list) and isinstance(v.get("layers"), list)
                          and isinstance(v.get("bytes_before"), int) and isinstance(v.get("bytes_after"), int))
    if not (isinstance(state, dict) and isinstance(state.get("settings"), dict) and isinstance(state.get("done"), dict)
            and all(entry_ok(v) for v in state["done"].values())
            and isinstance(state.get("failed") or {}, dict)):
        raise ConvertError(f"{path} is malformed (expected {{\"settings\": {{...}}, \"done\": {{block: {{\"keys\", "
                           f"\"layers\", \"bytes_before\", \"bytes_after\"}}}}}}): {fix}")
    return state


def _describe_diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in keys)


def _open_partial(partial: Path, settings: dict, opts: ConvertOptions) -> dict:
    """The progress state to continue from: a resumable ``partial``, or a fresh one.

    A ``partial`` with no finished block, or whose run failed on its settings, gives way to other
    settings; one with finished blocks needs ``--resume`` (same settings) or ``--overwrite``.
    """
    if partial.exists() and opts.overwrite:
        _check_our_partial(partial)
        _note(f"--overwrite: removing {partial}")
        shutil.rmtree(partial)
    if partial.exists():
        state = _read_progress(partial)
        done, failed = len(state["done"]), state.get("failed") or {}
        calibrated = (partial / CALIB_FILE).is_file()
        diff = _describe_diff(state["settings"], settings)
        last = f"; its last run failed: {failed['error']}" if failed.get("error") else ""
        if diff and (done == 0 or failed.get("resumable") is False):
            _note(f"starting {partial} over: it holds {done} finished blocks, made with other settings ({diff}){last}")
            shutil.rmtree(partial)
        elif diff:
            raise ConvertError(f"{partial} holds {done} finished blocks of a conversion with other settings ({diff}): "
                               f"rerun with those settings and --resume to continue it, or pass --overwrite to start over")
        elif done == 0 and not calibrated:
            shutil.rmtree(partial)  # nothing worth keeping
        elif not opts.resume:
            have = f"{done} finished blocks" + (" and its calibration" if calibrated else "")
            raise FileExistsError(f"{partial} holds an unfinished conversion with these settings ({have}{last}): "
                                  f"pass --resume to continue it, or --overwrite to start over")
        else:
            state.pop("failed", None)
            _atomic_write_json(partial / "progress.json", state)
            return state
    (partial / "transformer").mkdir(parents=True)
    state = {"settings": settings, "done": {}}
    _atomic_write_json(partial / "progress.json", state)
    return state


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None and e.strerror:
        import errno as errno_names

        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror} ({errno_names.errorcode.get(e.errno, e.errno)})"
    return " ".join(str(e).split()) or type(e).__name__


def _after_failure(partial: Path, state: dict, error: BaseException) -> Path | None:
    """Keep ``partial`` when it holds finished work (recording the failure) and return it when a
    ``--resume`` with the same settings can continue; remove it otherwise."""
    if not partial.exists():
        return None
    if not state["done"] and not (partial / CALIB_FILE).is_file():
        shutil.rmtree(partial, ignore_errors=True)  # nothing worth resuming: leave no trace
        return None
    resumable = not isinstance(error, ConvertError)
    state["failed"] = {"error": _one_line(error), "resumable": resumable}
    try:
        _atomic_write_json(partial / "progress.json", state)
    except OSError:
        pass  # a full disk: the previous progress.json still says what is done
    return partial if resumable else None


def resume_hint(error: BaseException) -> Path | None:
    """The ``.partial`` folder that ``--resume`` can continue after ``error`` escaped ``convert`` (or None)."""
    return getattr(error, "svdq_resumable_partial", None)


# ---- the conversion ------------------------------------------------------------------------------


def _is_replaceable(out: Path) -> bool:
    try:
        _check_replaceable(out)
    except FileExistsError:
        return False
    return True


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

    Options are checked first (``ConvertError``). A run that fails before finishing any work removes
    ``<out_dir>.partial``; a later failure keeps it, records the failure in its ``progress.json``, and
    ``resume_hint(error)`` names it when ``resume=True`` with the same options can continue.
    """
    opts = opts or ConvertOptions()
    prompts = opts.validate()  # before touching the disk
    t0 = time.perf_counter()
    out = Path(out_dir).expanduser().resolve()
    if not out.name:
        raise ConvertError(f"the output folder {str(out_dir)!r} is a filesystem root: name a folder to create")
    partial = out.with_name(out.name + ".partial")
    if out.exists():
        if not opts.overwrite:
            raise FileExistsError(f"{out} already exists; pass --overwrite to replace it, or pick another output folder")
        _check_replaceable(out)
        replaced = out.with_name(out.name + ".replaced")
        if replaced.exists():  # the swap's stand-by name: an earlier swap's leftover may go, nothing else
            _check_replaceable(replaced)
    with _exclusive(out):
        state = _open_partial(partial, opts.settings(model_id), opts)
        try:
            return _convert(str(model_id), out, partial, state, opts, prompts, t0)
        except BaseException as e:
            keep = _after_failure(partial, state, e)
            try:
                e.svdq_resumable_partial = keep
            except AttributeError:
                pass
            raise


@contextlib.contextmanager
def _exclusive(out: Path):
    """One svdq-convert at a time into ``out``: a second run deleted the first one's partial folder and failed on
    a missing temporary file, naming neither run. The lock is ``<out>.lock`` (POSIX ``flock``), removed at the end."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    lock = out.with_name(out.name + ".lock")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConvertError(f"another svdq-convert is writing {out} (it holds {lock}): wait for it to end, or "
                               f"pick another output folder") from None
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)


def _convert(model_id: str, out: Path, partial: Path, state: dict, opts: ConvertOptions, prompts: list[str],
             t0: float) -> Summary:
    dtype = opts.torch_dtype()
    progress_file = partial / "progress.json"
    src = _source_folder(model_id, partial)
    model_index = read_json(src / "model_index.json", "not a diffusers pipeline folder")
    config = read_json(src / "transformer" / "config.json", "the pipeline has no transformer/ (Flux or SD3 expected)")
    if not isinstance(config, dict) or not isinstance(model_index, dict):
        raise ConvertError(f"{src}: expected JSON objects in model_index.json and transformer/config.json")
    pipeline_cls = _check_components(src, model_index)
    fingerprint = _source_fingerprint(src, model_index)
    if state.get("source", fingerprint) != fingerprint:
        raise ConvertError(f"{src} is not the source {partial}'s finished blocks were made from (its files differ): "
                           f"pass --overwrite to start over from it")
    if "source" not in state:
        state["source"] = fingerprint
        _atomic_write_json(progress_file, state)  # before the calibration and blocks it stands for
    cls_name = config.get("_class_name")
    recipes.check_supported(cls_name)
    if "quantization_config" in config:
        qc = config["quantization_config"]
        raise ValueError(f"{src} is already quantized ({qc.get('quant_method') if isinstance(qc, dict) else qc})")

    # Everything that can be known from the configs is checked before any weight is read.
    meta_model = _meta_model(cls_name, config, src / "transformer" / "config.json")
    recipe = recipes.recipe_for(meta_model)
    _check_rank(meta_model, recipe, opts.rank)
    params = sum(p.numel() for p in meta_model.parameters())
    if opts.calib and check_device(opts.device).type == "cpu" and params > CPU_CALIB_MAX_PARAMS:
        raise ConvertError(f"calibrating a {params / 1e9:.1f} B-parameter transformer on the CPU would take hours "
                           f"(the limit is {CPU_CALIB_MAX_PARAMS / 1e9:g} B): pass --no-calib (weight-only smoothing; "
                           f"the conversion itself runs on a CPU), or calibrate on a GPU (--device cuda)")
    if opts.calib:
        _check_pipeline_inputs(pipeline_cls, opts)
    call_kwargs = _calibration_kwargs(model_id, src, config, opts) if opts.calib else {}
    in_features = {n: meta_model.get_submodule(n).weight.shape[1] for n in recipe.w4a4}
    model_keys = set(meta_model.state_dict())
    del meta_model

    key_files = _source_keys(src / "transformer")
    foreign, absent = sorted(set(key_files) - model_keys), sorted(model_keys - set(key_files))
    if foreign or absent:
        raise ValueError(f"{src}/transformer: the checkpoint does not match {cls_name}: "
                         f"{len(foreign)} unknown tensors (e.g. {foreign[:3]}), {len(absent)} missing (e.g. {absent[:3]})")

    units: dict[str, list[str]] = {}
    for key in sorted(key_files, key=_natural):
        units.setdefault(recipes.unit_of(key), []).append(key)
    shard_names = {u: f"diffusion_pytorch_model-{i + 1:05d}-of-{len(units):05d}.safetensors"
                   for i, u in enumerate(units)}
    is_done = lambda u: u in state["done"] and (partial / "transformer" / shard_names[u]).is_file()

    _warn_rank(opts.rank)  # the checks passed: the work starts
    act_max: dict[str, torch.Tensor] = {}
    calib_file = partial / CALIB_FILE
    if opts.calib and not all(is_done(u) for u in units):  # calibrate only when a block still needs it
        if calib_file.is_file():
            act_max = _load_calibration(calib_file, recipe, in_features)
        else:
            act_max = _calibrate(src, recipe, opts, prompts, call_kwargs, calib_file)

    svdq_config = opts.svdquant_config()
    fail_after = int(os.environ.get(FAIL_AFTER_ENV, "0") or 0)
    converted = resumed = 0
    for unit, keys in tqdm(units.items(), desc="converting", unit="block", disable=not opts.progress):
        shard = partial / "transformer" / shard_names[unit]
        if is_done(unit):
            resumed += 1
            continue
        tensors = _read_block(sorted({key_files[k] for k in keys}), keys, key_files)
        with torch.no_grad():
            new, stats = quantize_state_dict(tensors, recipe.kinds, recipe.groups, act_max, svdq_config, dtype)
        before = sum(t.numel() * t.element_size() for t in tensors.values())
        _save_tensors(shard, new)
        layers = [asdict(s) for s in stats]
        for layer in layers:
            name = layer["name"]
            head = (activation_headroom(act_max[name], new[f"{name}.smooth"])
                    if layer["kind"] == recipes.W4A4 and name in act_max else None)
            layer["act_headroom"] = head if head is None or math.isfinite(head) else None  # all-zero inputs
        state["done"][unit] = {
            "keys": sorted(new),
            "bytes_before": before,
            "bytes_after": sum(t.numel() * t.element_size() for t in new.values()),
            "layers": layers,
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
                     "num_prompts": len(prompts), "steps": opts.calib_steps,
                     "resolution": call_kwargs.get("height") if opts.calib else None},
        conversion={"alpha": opts.alpha, "svd": opts.svd, "refine_iters": opts.refine_iters, "dtype": opts.dtype,
                    "act_headroom": opts.act_headroom, "source": model_id},
    )
    _atomic_write_json(partial / "transformer" / "config.json", {**config, "quantization_config": qcfg.to_dict()})
    shutil.copy2(src / "model_index.json", partial / "model_index.json")
    for component in pipeline_components(model_index):  # not stray root files (single-file checkpoints)
        if component != "transformer" and (src / component).is_dir():
            _copy_tree(src / component, partial / component)
    layers = [layer for info in state["done"].values() for layer in info["layers"]]
    _atomic_write_json(partial / LAYER_REPORT, layers)
    if (partial / "_tiny_source").exists():
        shutil.rmtree(partial / "_tiny_source")
    if calib_file.exists():
        os.replace(calib_file, partial / "svdq_calibration.safetensors")
    # The partial folder keeps its progress.json until it is out_dir: a run stopped anywhere here leaves either a
    # partial folder that --resume finishes, or out_dir complete (its stray progress.json removed by the next step).
    old = out.with_name(out.name + ".replaced")
    if out.exists():  # --overwrite: the earlier output goes only now that the new one is complete
        if old.exists():  # an earlier swap's leftover (convert() checked it is an svdq-convert output)
            shutil.rmtree(old)
        os.replace(out, old)
    os.replace(partial, out)  # the only step that makes out_dir exist
    (out / "progress.json").unlink(missing_ok=True)
    if old.exists() and _is_replaceable(old):  # this run's swap, or one a stopped run left (resumed now)
        shutil.rmtree(old)

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
    go to the calibration runs (height, width, ...; the size defaults to the pipeline's own, at most
    512, as in ``svdq-convert``; ``image``, ``mask_image``, ``control_image`` for the img2img, inpainting,
    fill and control pipelines, which do not run on a prompt alone). ``mode`` (``"exact"``, ``"fast"``, ``"auto"``) is set on every
    quantized layer (None: the default). ``config_kwargs`` are ``SVDQuantConfig`` fields
    (``act_headroom``...).
    Afterwards ``pipe.save_pretrained(folder)`` writes a folder that ``load_svdq_pipeline`` loads.
    """
    transformer = pipe.transformer
    if mode is not None and mode not in MODES:
        raise ValueError(f"expected a mode in {MODES}, got {mode!r}")
    held = [n for n, m in transformer.named_modules() if isinstance(m, _PackedNVFP4Linear)]
    if held:
        # the recipe would take the rest only, and the saved folder's quantization_config would miss these
        raise ValueError(f"the transformer already holds {len(held)} quantized layers (first: {held[0]!r}); "
                         "quantize_pipeline takes an unquantized pipeline: after an interrupted run, load it again")
    adapted = [n for n, m in transformer.named_modules() if isinstance(getattr(m, "base_layer", None), nn.Module)]
    if adapted:
        # peft's LoRA layers wrap the linears: the recipe would pass them over and leave them in 16 bits
        raise ValueError(f"the transformer holds {len(adapted)} LoRA adapter layers from pipe.load_lora_weights "
                         f"(first: {adapted[0]!r}), which quantize_pipeline would leave unquantized: merge them first "
                         "(pipe.fuse_lora(); pipe.unload_lora_weights()), or quantize without them and apply the LoRA "
                         "afterwards with svdq_linear.fuse_lora")
    config = SVDQuantConfig.from_kwargs(rank=rank, **config_kwargs)  # checked before the calibration runs
    recipe = recipes.recipe_for(transformer)
    _check_rank(transformer, recipe, config.rank, "rank")
    _warn_rank(config.rank)
    act_max = {}
    if calib:
        prompts = calib_prompts if isinstance(calib_prompts, list) else calibrate.read_prompts(calib_prompts)
        call_kwargs = dict(call_kwargs or {})
        if "height" not in call_kwargs and "width" not in call_kwargs:
            vae = getattr(pipe, "vae", None)
            size = calibrate.resolution_limits(type(transformer).__name__, dict(transformer.config),
                                               dict(vae.config) if vae is not None else None)
            call_kwargs.update(height=size.default, width=size.default)
        act_max = calibrate.collect_act_max(pipe, recipe.w4a4, prompts, calib_steps, call_kwargs, progress=progress)
    by_unit: dict[str, list[str]] = {}
    for name in recipe.kinds:
        by_unit.setdefault(recipes.unit_of(name), []).append(name)
    stats = []
    for names in tqdm(by_unit.values(), desc="quantizing", unit="block", disable=not progress):
        w4a4 = [n for n in names if recipe.kinds[n] == recipes.W4A4]
        stats += quantize_linears(
            transformer,
            w4a4=w4a4,
            w4a16=[n for n in names if recipe.kinds[n] == recipes.W4A16],
            act_max={n: act_max[n] for n in w4a4 if n in act_max},  # this block's
            smooth_groups=recipe.groups,
            config=config,
        )
    branch = next(m for m in transformer.modules() if isinstance(m, SVDQW4A4Linear)).proj_down.dtype
    qcfg = dq.SVDQuantizationConfig(rank=rank, w4a4_modules=recipe.w4a4, w4a16_modules=recipe.w4a16,
                                    smooth_groups=recipe.groups, dtype=str(branch).removeprefix("torch."),
                                    calibration={"enabled": calib, "steps": calib_steps},
                                    conversion={"alpha": config.alpha, "svd": config.svd,
                                                "refine_iters": config.refine_iters,
                                                "act_headroom": config.act_headroom, "source": "quantize_pipeline"})
    transformer.register_to_config(quantization_config=qcfg)
    transformer.hf_quantizer = dq.SVDQuantizer(qcfg)
    transformer.is_quantized = True
    dq.mark_quantized(transformer)
    name_layers(transformer)
    if mode is not None:
        set_mode(transformer, mode)
    return stats
