"""Activation headroom: precision of small blocks against room for inputs hotter than calibration.

    python benchmarks/act_headroom.py [--out FILE] [--quick]

The converter folds a power-of-two factor into ``smooth`` so that the calibrated maximum of
``x / smooth`` sits ``H`` (to ``H + 1``) powers of two below NVFP4's saturation point 6 * 448
(``SVDQuantConfig.act_headroom``). Larger ``H`` leaves room for inputs hotter than the calibration
set; it moves every block ``H`` powers of two nearer the subnormal E4M3 scales (and, below
6 * 2**-10, zero). CPU, reference formulas (``svdq_linear.nvfp4``); two measurements:

1. synthetic layers with realistic activations (per-token magnitudes log-normal, 8 input
   channels 50-100x larger; either i.i.d. weights, so the outlier channels dominate the output and
   the low-rank branch absorbs them, or "balanced" weights whose outlier columns are 50-100x
   smaller, so smoothing evens the channels and the loudest tokens set the range), calibrated on one set of tokens and evaluated on fresh tokens scaled
   by a gain: relative output error against the fp32 layer, per token, averaged over tokens (so quiet
   tokens count as much as loud ones; no bias, so the error is the product's);
2. the tiny offline Flux / SD3 / SD3.5 pipelines, calibrated (2 prompts x 2 steps) and quantized at
   each headroom, run on a prompt outside the calibration set (as at inference): the transformer's
   output against the fp32 transformer's on the same inputs, the share of activation blocks that
   saturate / underflow, and the image's PSNR against the fp32 pipeline's;
3. for reference, a module made without ``act_max`` (activation factor 1) over input scales.
"""

import argparse
import math
import time

import numpy as np
import torch
from _table import emit

import svdq_linear
from svdq_linear import SVDQuantConfig, SVDQW4A4Linear, nvfp4, svdquant
from svdq_linear.convert.tiny import TINY_CALL_KWARGS, build_tiny_pipeline
from svdq_linear.svdquant import activation_headroom

HEADROOMS = (0, 1, 2, 3, 4, 6, 8, 12)
GAINS = (1e-3, 1e-2, 1e-1, 1.0, 2.0, 4.0, 16.0, 64.0)


def activations(m: int, k: int, outliers: torch.Tensor, outlier_gain: torch.Tensor, gen: torch.Generator,
                nonneg: bool) -> torch.Tensor:
    """``[m, k]``: per-token scale exp(N(0, 0.75)), channels ``outliers`` x ``outlier_gain`` (50-100)."""
    x = torch.randn(m, k, generator=gen)
    if nonneg:  # after a GELU (the feed-forward's down projection): skewed, mostly small
        x = torch.nn.functional.gelu(x * 1.5)
    x = x * torch.exp(0.75 * torch.randn(m, 1, generator=gen))
    x[:, outliers] *= outlier_gain
    return x


def block_stats(xs: torch.Tensor) -> tuple[float, float]:
    """Fractions of nonzero blocks of ``xs`` that saturate / get a subnormal or zero scale."""
    amax = xs.reshape(*xs.shape[:-1], -1, nvfp4.BLOCK_SIZE).abs().amax(-1)
    scales = nvfp4.block_scales(xs).float()
    nonzero = amax > 0
    sat = (amax > nvfp4.NVFP4_MAX).sum() / nonzero.sum()
    under = (nonzero & (scales < 2.0**-6)).sum() / nonzero.sum()
    return float(sat), float(under)


@torch.no_grad()
def synthetic(rows: list[str], quick: bool) -> None:
    # (name, K, N, GELU-shaped inputs, outlier weight columns scaled by 1 / outlier gain)
    layers = [("i.i.d. weights", 3072, 3072, False, False),
              ("balanced outliers", 3072, 3072, False, True),
              ("ff down, GELU inputs", 12288, 3072, True, False)]
    if quick:
        layers = [("i.i.d. weights", 1024, 1024, False, False), ("balanced outliers", 1024, 1024, False, True)]
    rows += ["| layer (K -> N, rank 32) | H | calibrated headroom | "
             + " | ".join(f"x{g:g}" for g in GAINS) + " |",
             "|---|---|---|" + "---|" * len(GAINS)]
    for name, k, n, nonneg, balanced in layers:
        gen = torch.Generator().manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False)
        torch.nn.init.normal_(lin.weight, std=k**-0.5, generator=gen)
        outliers = torch.randperm(k, generator=gen)[:8]
        outlier_gain = 50.0 + 50.0 * torch.rand(8, generator=gen)
        if balanced:  # the outlier channels' products x_j w_j no larger than the others'
            lin.weight[:, outliers] /= outlier_gain
        calib = activations(1024, k, outliers, outlier_gain, gen, nonneg)
        test = activations(256, k, outliers, outlier_gain, gen, nonneg)
        act_max = calib.abs().amax(0)
        ref = test.double() @ lin.weight.double().T
        for h in HEADROOMS:
            res = svdquant(lin.weight, None, act_max, SVDQuantConfig(rank=32, svd="lowrank", act_headroom=h))
            m = SVDQW4A4Linear.from_weights(res)
            errs = []
            for g in GAINS:
                y = m(test * g).double()
                per_token = (y - ref * g).norm(dim=1) / (ref * g).norm(dim=1)
                errs.append(per_token.mean().item())
            head = activation_headroom(act_max, res.smooth)
            rows.append(f"| {name}, {k} -> {n} | {h} | {head:.2f} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")
        # where the blocks sit at H = 0 and at the largest H, for the table's reader
        for h in (0, HEADROOMS[-1]):
            res = svdquant(lin.weight, None, act_max, SVDQuantConfig(rank=32, svd="lowrank", act_headroom=h))
            stats = [block_stats(nvfp4.smooth_input(test * g, res.smooth)) for g in GAINS]
            rows.append(f"| {name}: blocks saturated / subnormal-or-zero, H = {h} | | | "
                        + " | ".join(f"{s:.1%} / {u:.1%}" for s, u in stats) + " |")


@torch.no_grad()
def uncalibrated(rows: list[str], quick: bool) -> None:
    """A module made without ``act_max`` (factor 1): where unit-scale inputs sit, and what the range
    check ($SVDQ_LINEAR_CHECK_RANGE) would report."""
    k = n = 1024 if quick else 3072
    gains = (1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3, 1e4)
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False)
    torch.nn.init.normal_(lin.weight, std=k**-0.5, generator=gen)
    x = torch.randn(256, k, generator=gen) * torch.exp(0.75 * torch.randn(256, 1, generator=gen))
    m = SVDQW4A4Linear.from_linear(lin, rank=32, svd="lowrank")
    ref = x.double() @ lin.weight.double().T
    errs, stats = [], []
    for g in gains:
        y = m(x * g).double()
        errs.append(((y - ref * g).norm(dim=1) / (ref * g).norm(dim=1)).mean().item())
        stats.append(block_stats(nvfp4.smooth_input(x * g, m.smooth)))
    rows += ["", f"| module without act_max ({k} -> {n}, rank 32, unit-scale Gaussian inputs x gain) | "
             + " | ".join(f"x{g:g}" for g in gains) + " |", "|---|" + "---|" * len(gains),
             "| mean per-token rel. error | " + " | ".join(f"{e:.4f}" for e in errs) + " |",
             "| blocks saturated / subnormal-or-zero | " + " | ".join(f"{a:.1%} / {b:.1%}" for a, b in stats) + " |"]


def _image(pipe, kind):
    pipe.set_progress_bar_config(disable=True)
    return pipe("a photo of a cat wearing a hat", generator=torch.Generator().manual_seed(0), output_type="np",
                **TINY_CALL_KWARGS[kind]).images[0]


def _psnr(a, b):
    return 10 * np.log10(1.0 / max(float(np.mean((a - b) ** 2)), 1e-12))


def _capture_transformer_calls(pipe) -> list[dict]:
    """Run the test prompt through ``pipe`` and return the transformer's keyword inputs at each step."""
    calls = []

    def hook(module, args, kwargs):
        calls.append({k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        image = _image(pipe, pipe._svdq_kind)
    finally:
        handle.remove()
    return calls, image


@torch.no_grad()
def pipelines(rows: list[str], quick: bool) -> None:
    kinds = ("flux",) if quick else ("flux", "sd3", "sd35")
    rows += ["", "| tiny pipeline (random weights, rank 8, calibrated on 2 prompts x 2 steps; test prompt "
             "outside the calibration set) | " + " | ".join(f"H = {h}" for h in HEADROOMS) + " |",
             "|---|" + "---|" * len(HEADROOMS)]
    for kind in kinds:
        ref_pipe = build_tiny_pipeline(kind)
        ref_pipe._svdq_kind = kind
        calls, ref_image = _capture_transformer_calls(ref_pipe)
        ref_out = [ref_pipe.transformer(**c)[0].double() for c in calls]
        call = {key: v for key, v in TINY_CALL_KWARGS[kind].items() if key != "num_inference_steps"}
        psnr, errs, blocks = [], [], []
        for h in HEADROOMS:
            pipe = build_tiny_pipeline(kind)
            svdq_linear.quantize_pipeline(pipe, rank=8, calib_prompts=["a dog", "a photo of the city at night"],
                                          calib_steps=2, call_kwargs=call, progress=False, act_headroom=h)
            counts = torch.zeros(3)

            def count(module, args):
                xs = nvfp4.smooth_input(args[0].reshape(-1, module.in_features), module.smooth)
                sat, under = nvfp4.range_violations(xs)
                counts.add_(torch.tensor([sat.sum(), under.sum(), sat.numel()], dtype=torch.float32))

            handles = [m.register_forward_pre_hook(count) for m in pipe.transformer.modules()
                       if isinstance(m, SVDQW4A4Linear)]
            outs = [pipe.transformer(**c)[0].double() for c in calls]
            for handle in handles:
                handle.remove()
            errs.append(sum(((o - r).norm() / r.norm()).item() for o, r in zip(outs, ref_out)) / len(outs))
            blocks.append(((counts[0] / counts[2]).item(), (counts[1] / counts[2]).item()))
            psnr.append(_psnr(_image(pipe, kind), ref_image))
        rows.append(f"| {kind}: transformer output rel. error (mean over steps) | "
                    + " | ".join(f"{e:.4f}" for e in errs) + " |")
        rows.append(f"| {kind}: blocks saturated / subnormal-or-zero | "
                    + " | ".join(f"{a:.2%} / {b:.2%}" for a, b in blocks) + " |")
        rows.append(f"| {kind}: image PSNR dB vs fp32 | " + " | ".join(f"{p:.1f}" for p in psnr) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="one small layer and one pipeline (a smoke run)")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.perf_counter()
    rows = [f"CPU, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; mean per-token relative output error "
            f"of the W4A4 layer against fp32 for test inputs x gain (calibrated at gain 1); H = act_headroom", ""]
    synthetic(rows, args.quick)
    uncalibrated(rows, args.quick)
    pipelines(rows, args.quick)
    rows += ["", f"({time.perf_counter() - t0:.0f} s)"]
    emit(rows, args.out)


if __name__ == "__main__":
    main()
