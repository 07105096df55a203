"""Accuracy of the fast mode (FP8 weights and per-token FP8 activations) against the exact W4A4 mode.

    python benchmarks/fast_mode_accuracy.py [--out FILE]

Runs on the CPU through the reference backend (both modes are formulas of ``svdq_linear.nvfp4``):
1. synthetic Flux-sized layers with outlier input channels: output error against the fp32 layer;
2. the tiny offline Flux / SD3 pipelines, quantized with calibration: PSNR of the image against the
   fp32 pipeline's, exact and fast.
"""

import argparse
import time

import numpy as np
import torch
from _table import emit

import svdq_linear
from svdq_linear.convert.tiny import TINY_CALL_KWARGS, build_tiny_pipeline
from svdq_linear import SVDQW4A4Linear


def _image(pipe, kind):
    pipe.set_progress_bar_config(disable=True)
    return pipe("a photo of a cat", generator=torch.Generator().manual_seed(0), output_type="np",
                **TINY_CALL_KWARGS[kind]).images[0]


def _psnr(a, b):
    return 10 * np.log10(1.0 / max(float(np.mean((a - b) ** 2)), 1e-12))


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    args = p.parse_args()
    rows = [f"CPU, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", "",
            "| layer (K x N, rank 32, 256 tokens, 16 outlier channels x gain) | exact W4A4 rel. error | fast rel. error |",
            "|---|---|---|"]
    for k, n, gain in [(3072, 3072, 20.0), (3072, 3072, 100.0), (12288, 3072, 20.0)]:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n)
        x = torch.randn(256, k)
        x[:, torch.randperm(k)[:16]] *= gain
        ref = lin(x).double()
        m = SVDQW4A4Linear.from_linear(lin, rank=32, act_max=x.abs().amax(0))
        err = {mode: ((m.set_mode(mode)(x).double() - ref).norm() / ref.norm()).item() for mode in ("exact", "fast")}
        rows.append(f"| {k} x {n}, gain {gain:g} | {err['exact']:.4f} | {err['fast']:.4f} |")
    rows += ["", "| tiny pipeline (random weights, calibrated, rank 8) | exact PSNR dB vs fp32 | fast PSNR dB vs fp32 |",
             "|---|---|---|"]
    for kind in ("flux", "sd3"):
        ref = _image(build_tiny_pipeline(kind), kind)
        pipe = build_tiny_pipeline(kind)
        call = {key: v for key, v in TINY_CALL_KWARGS[kind].items() if key != "num_inference_steps"}
        svdq_linear.quantize_pipeline(pipe, rank=8, calib_prompts=["a cat", "a dog"], calib_steps=2,
                                      call_kwargs=call, progress=False)
        psnr = {}
        for mode in ("exact", "fast"):
            svdq_linear.set_mode(pipe.transformer, mode)
            psnr[mode] = _psnr(_image(pipe, kind), ref)
        rows.append(f"| {kind} | {psnr['exact']:.1f} | {psnr['fast']:.1f} |")
    emit(rows, args.out)


if __name__ == "__main__":
    main()
