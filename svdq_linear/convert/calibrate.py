"""Calibration: per-input-channel max |x| of every W4A4 target while the original pipeline runs."""

from __future__ import annotations

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
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"no prompts in {path or 'the default prompt set'}")
    return prompts[:limit] if limit else prompts


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

    handles = [transformer.get_submodule(n).register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        kwargs = {"num_inference_steps": steps, "output_type": "latent", **(call_kwargs or {})}
        for i, prompt in enumerate(tqdm(prompts, desc="calibrating", disable=not progress)):
            generator = torch.Generator("cpu").manual_seed(seed + i)
            pipe(prompt=prompt, generator=generator, **kwargs)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in maxima]
    if missing:
        raise RuntimeError(f"calibration never reached {len(missing)} target layers (e.g. {missing[:3]})")
    return {n: v.cpu() for n, v in maxima.items()}
