"""Linears on a GELU'd input: read from its parts against written out first (H100/H200).

    python benchmarks/bench_gelu_in.py [--out FILE]

The inputs of a Flux single block's ``proj_out`` (``cat([attn, gelu_tanh(mlp)])``, 3072 + 12288 columns,
4608 tokens) and of a feed-forward's down projection (``gelu_tanh(h)``, 12288 columns, 4096 image and
512 text tokens), rank 32, bf16. Per shape, same run:

- *written*: the input written by inductor's ``cat + gelu`` kernel (``torch.compile`` of
  ``nvfp4.cat_gelu``, what the compiled model runs today), then the fast mode's activation work on it
  (``lora_act`` on the backend's plan, the one-pass FP8 pass in the GEMM's k order);
- *two-source*: ``lora_act(xa, xb=, gelu_b=True)`` and ``quantize_act_fp8_cat`` on the parts;
- the whole layer both ways, exact and (with quack-kernels) fast mode: ``forward(cat_gelu(...))`` with
  the input written by the same compiled kernel, and ``forward_cat_gelu``.

Before timing, the two-source bytes are compared with the written path's: the count of differing
``a8`` bytes is reported (only ambiguous GELU roundings may differ; the CPU and GPU tests bound them)
and the whole layers' relative difference. Also the copy of the written input's bytes (read + write)
for scale. CUDA-graph replays, ``do_bench`` medians, us.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _cuda import graphed  # noqa: E402
from _table import emit  # noqa: E402

from svdq_linear import nvfp4  # noqa: E402
from svdq_linear.backends.sm90 import Sm90Backend, kernels, tuning  # noqa: E402

SHAPES = [("single proj_out", 4608, 3072, 12288), ("ff down (image)", 4096, 0, 12288),
          ("ff down (text)", 512, 0, 12288)]


def bench(fn) -> float:
    return do_bench(graphed(fn), warmup=10, rep=100, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    be = Sm90Backend()
    write = torch.compile(nvfp4.cat_gelu)
    lines = [f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", "",
             "| layer | M | KA + KB | copy of x | written: cat+gelu | + lora + pass | two-source: lora | + pass "
             "| activation work written / two-source | a8 bytes differing |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    whole = ["", "| layer | mode | M | K x N | forward(cat_gelu) | forward_cat_gelu | ratio | rel. difference |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m, ka, kb in SHAPES:
        k = ka + kb
        xa = torch.randn(m, ka, device="cuda", dtype=torch.bfloat16) if ka else None
        xb = torch.randn(m, kb, device="cuda", dtype=torch.bfloat16) * 2
        inv = 1.0 / (torch.rand(k, device="cuda") + 0.5)
        pds = (torch.randn(k, 32, device="cuda") / k**0.5).bfloat16()
        nbytes = m * k * 2 * 2
        src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8)
        dst = torch.empty_like(src)
        t_copy = bench(lambda: dst.copy_(src))
        x = write(xa, xb)

        def written(x=x):
            kernels.quantize_act_fp8(x, inv, lora=be._lora_act(x, pds), inv_smooth=inv, gemm_order=True)

        def two_source(xa=xa, xb=xb):
            kernels.quantize_act_fp8_cat(xa, xb, inv, lora=be._lora_act_cat(xa, xb, pds), gemm_order=True)

        a8w, saw, law = kernels.quantize_act_fp8(x, inv, lora=be._lora_act(x, pds), inv_smooth=inv, gemm_order=True)
        a8t, sat, lat = kernels.quantize_act_fp8_cat(xa, xb, inv, lora=be._lora_act_cat(xa, xb, pds), gemm_order=True)
        ndiff = (a8w.view(torch.uint8) != a8t.view(torch.uint8)).sum().item()
        t_write = bench(lambda: write(xa, xb))
        t_w = bench(written)
        t_lora = bench(lambda: be._lora_act_cat(xa, xb, pds))
        t_t = bench(two_source)
        lines.append(f"| {name} | {m} | {ka} + {kb} | {t_copy:.1f} | {t_write:.1f} | {t_write + t_w:.1f} | {t_lora:.1f} "
                     f"| {t_t:.1f} | {(t_write + t_w) / t_t:.2f}x | {ndiff} of {a8w.numel()} |")
        print(lines[-1], flush=True)
        from test_conformance import random_w4a4

        for mode in ("exact", "fast"):
            if mode == "fast" and not be.supports(xb.device, "w4a4_fast"):
                continue
            mod = random_w4a4(k, 3072, 32, torch.bfloat16, "cuda").set_mode(mode)
            y_w = mod(write(xa, xb))
            y_t = mod.forward_cat_gelu(xa, xb)
            rel = ((y_t.float() - y_w.float()).norm() / y_w.float().norm()).item()
            tw = bench(lambda: mod(write(xa, xb)))
            tt = bench(lambda: mod.forward_cat_gelu(xa, xb))
            whole.append(f"| {name} | {mode} | {m} | {k} x 3072 | {tw:.1f} | {tt:.1f} | {tw / tt:.2f}x | {rel:.2e} |")
            print(whole[-1], flush=True)
            del mod
    plan = tuning.lora_act_plan(4608, 15360, 32, os.environ.get(tuning.ENV_LORA_ACT))
    emit(lines + (whole if len(whole) > 3 else []) + ["", f"lora_act plan at 4608 x 15360: {plan}"], args.out)


if __name__ == "__main__":
    main()
