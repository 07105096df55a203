"""Time SVDQW4A4Linear / NVFP4W4A16Linear against bf16 nn.Linear (cuBLAS) at Flux shapes.

    python benchmarks/linear_bench.py [--out results.md] [--backend NAME]

Random bf16 inputs, CUDA events through triton.testing.do_bench (median); the baseline is timed in the
same run. Prints a markdown table and writes it to --out.
"""

import argparse
import time

import torch
from _table import emit

from svdq_linear import NVFP4W4A16Linear, SVDQW4A4Linear

# (M tokens, K, N): Flux at 1024x1024 has 4096 image + 512 text tokens; adaLN runs at M = batch.
SHAPES = [
    ("attn q/k/v/out", 4608, 3072, 3072),
    ("ff up", 4608, 3072, 12288),
    ("ff down", 4608, 12288, 3072),
    ("single proj_out", 4096 + 512, 15360, 3072),
    ("adaLN (W4A16)", 1, 3072, 18432),
]


def bench(fn) -> float:
    try:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, return_mode="median")
    except ImportError:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            fn()
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 50


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--backend", default=None)
    args = p.parse_args()
    dev = "cuda"
    rows = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}", "",
            "| layer | M | K | N | bf16 nn.Linear ms | svdq ms | svdq / bf16 | backend |",
            "|---|---|---|---|---|---|---|---|"]
    for name, m, k, n in SHAPES:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        q = NVFP4W4A16Linear.from_linear(lin) if "W4A16" in name else SVDQW4A4Linear.from_linear(lin, rank=32)
        q.set_backend(args.backend)
        t_ref = bench(lambda: lin(x))
        t_q = bench(lambda: q(x))
        rows.append(f"| {name} | {m} | {k} | {n} | {t_ref:.3f} | {t_q:.3f} | {t_q / t_ref:.2f}x | {q.backend} |")
    emit(rows, args.out)


if __name__ == "__main__":
    main()
