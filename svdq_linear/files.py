"""File and hub I/O for pipeline folders: resolve a path or hub id, read JSON, list and open checkpoints.

Nothing here quantizes or builds a model. Weights are read from safetensors only: a folder's pickled
files (``.bin``, ``.pt``, ``.ckpt``) are neither downloaded nor loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt"]
"""Hub files never fetched: loading them would run arbitrary code (unpickling)."""


def pipeline_components(model_index: dict) -> list[str]:
    """The component folders a ``model_index.json`` names (``"vae": ["diffusers", "AutoencoderKL"]``...)."""
    return [k for k, v in model_index.items()
            if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0] is not None]


def looks_local(model_id: str) -> bool:
    """True when ``model_id`` can only be a path: not a valid hub id (``./x``, ``/x``, ``~/x``, ``a/b/c``,
    a trailing separator), or ``dir/name`` whose ``dir`` is a local folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model_id.startswith((".", "~", "/")) or os.path.isabs(model_id) or model_id.endswith(("/", os.sep)):
        return True
    if os.sep != "/" and os.sep in model_id:
        return True
    try:
        validate_repo_id(model_id)
    except HFValidationError:
        return True
    return "/" in model_id and Path(model_id.split("/")[0]).is_dir()


def _hub_offline() -> bool:
    from huggingface_hub import constants

    check = getattr(constants, "is_offline_mode", None)
    return bool(check() if callable(check) else constants.HF_HUB_OFFLINE)


def resolve_model_path(path_or_id: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub id through ``huggingface_hub``.

    A path that does not exist (``looks_local``) is not looked up on the hub; with ``HF_HUB_OFFLINE``
    only the hub cache is asked. From the hub, only ``model_index.json`` and the component folders it
    names are fetched, and no pickled weights (a FLUX.1 repo also holds a 23 GB single-file checkpoint
    at its root).
    """
    path = Path(path_or_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path} is a file; expected a diffusers pipeline folder")
        return path
    if looks_local(str(path_or_id)):
        raise FileNotFoundError(f"{path_or_id} is not a local folder: {path.resolve()} does not exist (a path, "
                                f"so the Hugging Face Hub is not asked)")
    from huggingface_hub import hf_hub_download, snapshot_download

    repo = str(path_or_id)
    try:
        index = json.loads(Path(hf_hub_download(repo, "model_index.json")).read_text())
        allow = ["model_index.json"] + [f"{c}/*" for c in pipeline_components(index)]
        return Path(snapshot_download(repo, allow_patterns=allow, ignore_patterns=PICKLE_PATTERNS))
    except Exception as e:  # offline, unknown repo, no access: say which and what to do
        if _hub_offline():
            raise FileNotFoundError(
                f"{repo!r} is not a local folder, and HF_HUB_OFFLINE is set while the Hugging Face Hub cache "
                f"has no copy of it: unset HF_HUB_OFFLINE to download it, or pass a local diffusers folder") from e
        raise FileNotFoundError(
            f"{repo!r} is not a local folder and could not be fetched from the Hugging Face Hub "
            f"({type(e).__name__}: {e}); pass a local diffusers folder"
        ) from e


def read_json(path: Path, what: str) -> dict:
    """The JSON object in ``path``; ``what`` says what a missing file means (``"not a diffusers folder"``)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {what}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a diffusers model folder (sharded through its index, or single)."""
    index = model_dir / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: expected a 'weight_map' object naming the shards")
        files = sorted({model_dir / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"shard {f} named by {index.name} is missing")
        return files
    single = model_dir / "diffusion_pytorch_model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors checkpoint in {model_dir} (pickled .bin files are not loaded)")


def safetensors_keys(path: str | os.PathLike) -> list[str]:
    """The tensor names of a safetensors file, from its header (no tensor is read).

    Raises ValueError naming the file when it is not safetensors, or is corrupted or truncated
    (safetensors checks that the header's offsets cover the file exactly).
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: expected a .safetensors file (pickled checkpoints are not loaded)")
    try:
        with safe_open(path, framework="pt") as fh:
            return list(fh.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} is corrupted or truncated ({type(e).__name__}: {e})") from e
