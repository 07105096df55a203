"""Calibration: per-input-channel max |x| of every W4A4 target while the original pipeline runs."""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm


def read_prompts(path: str | Path | None = None, limit: int | None = None) -> list[str]:
    """Prompts from ``path`` (one a line, blank lines and ``#`` comments skipped), or the shipped set."""
    if path is None:
        text = resources.files(__package__).joinpath("prompts.txt").read_text()
    else:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"calibration prompt file {p} not found")
        text = p.read_text()
    if limit is not None and limit < 1:
        raise ValueError(f"expected a prompt limit of at least 1, got {limit}")
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"no prompts in {path or 'the default prompt set'}")
    return prompts if limit is None else prompts[:limit]


DEFAULT_MAX_RESOLUTION = 512
"""Calibration image size cap: activation ranges settle at this size and larger costs time."""
FLUX_DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline.default_sample_size (latent pixels; a constant of the pipeline)


@dataclass(frozen=True)
class Resolution:
    """Image sizes a pipeline can calibrate at: ``default`` (what calibration uses unless told),
    ``maximum`` (None: no limit from the positional embedding) and ``multiple`` (sizes must divide by it)."""

    default: int
    maximum: int | None
    multiple: int


def resolution_limits(transformer_class: str, transformer_config: dict, vae_config: dict | None,
                      cap: int = DEFAULT_MAX_RESOLUTION) -> Resolution:
    """The calibration image sizes of a Flux / SD3 pipeline, from its transformer's and VAE's configs.

    The default is the pipeline's own default size (the transformer's ``sample_size`` latents, or
    Flux's 128, times the VAE's scale factor) capped at ``cap`` and at what SD3's positional
    embedding covers (``pos_embed_max_size`` patches), rounded down to a multiple of the latent patch.
    """
    blocks = (vae_config or {}).get("block_out_channels")
    vae_scale = 2 ** (len(blocks) - 1) if isinstance(blocks, (list, tuple)) and blocks else 8
    patch = transformer_config.get("patch_size") or 1
    if transformer_class == "FluxTransformer2DModel":
        multiple = vae_scale * 2  # Flux packs 2x2 latent patches into one token
        native, maximum = FLUX_DEFAULT_SAMPLE_SIZE * vae_scale, None
    else:
        multiple = vae_scale * patch
        native = (transformer_config.get("sample_size") or 128) * vae_scale
        pos = transformer_config.get("pos_embed_max_size")
        maximum = pos * patch * vae_scale if pos else None
    default = min(cap, native, maximum or cap)
    return Resolution(max(multiple, default - default % multiple), maximum, multiple)


# Messages the pipelines and tokenizers log once per prompt that is longer than a text encoder reads;
# the pipeline truncates such prompts, as it does at inference. Counted and reported once.
_TRUNCATION_MESSAGES = (
    "The following part of your input was truncated",
    "Token indices sequence length is longer than the specified maximum",
)


class _TruncationFilter(logging.Filter):
    def __init__(self):
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(_TRUNCATION_MESSAGES):
            self.count += 1
            return False
        return True


@contextlib.contextmanager
def _truncation_counted(pipe):
    """Drop the per-prompt truncation warnings of ``pipe`` and its tokenizers; yields the counter."""
    names = {cls.__module__ for cls in type(pipe).__mro__ if cls.__module__.startswith("diffusers.")}
    names.add("transformers.tokenization_utils_base")
    loggers = [logging.getLogger(n) for n in sorted(names)]
    counter = _TruncationFilter()
    for lg in loggers:
        lg.addFilter(counter)
    try:
        yield counter
    finally:
        for lg in loggers:
            lg.removeFilter(counter)


# the image inputs a pipeline's call may need besides the prompt (img2img, inpainting, fill, control, ControlNet
# inpainting); every one but ``image`` (optional in Kontext) is needed wherever a pipeline takes it
IMAGE_INPUTS = ("image", "mask_image", "control_image", "control_mask")
NEEDED_IMAGE_INPUTS = IMAGE_INPUTS[1:]


def _explain_missing_inputs(pipe, kwargs: dict, error: BaseException) -> None:
    """Raise a ValueError naming the image inputs the pipeline's call takes and the calibration did not pass (its
    first call failed before reaching the transformer: img2img, inpainting, fill and control pipelines fail deep in
    their image processors, "Input is in incorrect format")."""
    import inspect

    params = inspect.signature(type(pipe).__call__).parameters
    missing = [n for n in IMAGE_INPUTS if n in params and kwargs.get(n) is None]
    if missing:
        why = f"{type(error).__name__}: {' '.join(str(error).split())}"
        raise ValueError(f"calibration could not run {type(pipe).__name__} on a prompt alone ({why}); it takes "
                         f"{', '.join(missing)} besides the prompt: pass them in call_kwargs (svdq-convert: "
                         f"--calib-input NAME=FILE), or skip calibration (calib=False; svdq-convert --no-calib)"
                         ) from error


@torch.no_grad()
def collect_act_max(
    pipe,
    names: list[str],
    prompts: list[str],
    steps: int = 4,
    call_kwargs: dict | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Run ``pipe`` once per prompt for ``steps`` steps; return name -> max |x| ``[K]`` (float32, CPU).

    Hooks sit on the inputs of ``pipe.transformer``'s modules ``names``; the latents are not decoded.
    Prompts longer than a text encoder reads are truncated by the pipeline, as at inference; that is
    reported once (with ``progress``) instead of once per prompt.
    """
    transformer = pipe.transformer
    maxima: dict[str, torch.Tensor] = {}

    def hook_for(name: str):
        def hook(module: nn.Module, args):
            x = args[0].detach()
            amax = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            prev = maxima.get(name)
            maxima[name] = amax if prev is None else torch.maximum(prev, amax)

        return hook

    call_kwargs = dict(call_kwargs or {})
    if call_kwargs.get("num_inference_steps", steps) != steps:
        # the run would take call_kwargs' count, and the checkpoint would record steps
        raise ValueError(f"call_kwargs' num_inference_steps ({call_kwargs['num_inference_steps']}) differs from "
                         f"steps ({steps}): pass the step count once, as steps")
    handles = []
    try:  # a name that does not resolve leaves none of the hooks before it behind
        for n in names:
            handles.append(transformer.get_submodule(n).register_forward_pre_hook(hook_for(n)))
        kwargs = {"num_inference_steps": steps, "output_type": "latent", **call_kwargs}
        with _truncation_counted(pipe) as truncated:
            for i, prompt in enumerate(tqdm(prompts, desc="calibrating", disable=not progress)):
                generator = torch.Generator("cpu").manual_seed(seed + i)
                try:
                    pipe(prompt=prompt, generator=generator, **kwargs)
                except (ValueError, TypeError, AttributeError) as e:
                    if not maxima:
                        _explain_missing_inputs(pipe, kwargs, e)
                    raise
    finally:
        for h in handles:
            h.remove()
    if truncated.count and progress:
        print(f"calibration: prompts longer than a text encoder reads were truncated ({truncated.count} "
              f"truncation warnings silenced), as the pipeline does at inference", file=sys.stderr)
    missing = [n for n in names if n not in maxima]
    if missing:
        raise RuntimeError(f"calibration never reached {len(missing)} target layers (e.g. {missing[:3]})")
    bad = [n for n in names if not torch.isfinite(maxima[n]).all()]
    if bad:  # a maximum of NaN or Inf cannot place a scale; the layers after the first one only inherit it
        dtype = next((t.dtype for t in transformer.parameters() if t.is_floating_point()), None)
        raise ValueError(f"calibration saw NaN or Inf inputs at {len(bad)} target layers (first {bad[0]!r}): the "
                         f"pipeline overflows or diverges in {str(dtype).removeprefix('torch.')} on these prompts; "
                         f"calibrate in bfloat16 or float32, or with other prompts")
    return {n: v.cpu() for n, v in maxima.items()}
