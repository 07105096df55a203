"""GPU time of the sm90 path at a few tokens, without host overhead: CUDA-graph replays.

    python benchmarks/bench_small_m.py [--out FILE]

At M <= 64 one call is microseconds of GPU work behind ~0.2 ms of Python and launch overhead, so
``do_bench`` on the eager call measures the host. Here each variant is captured once in a CUDA graph
holding 20 calls and the replays are timed with events: cuBLAS bf16 ``F.linear``, the module's whole
forward (activation pass, lora, W4 GEMM), and the Triton W4 GEMM alone; weight GB/s counts the 4-bit
weight and its scales once.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _table import emit  # noqa: E402
from test_conformance import random_w4a4  # noqa: E402

from svdq_linear import NVFP4W4A16Linear  # noqa: E402
from svdq_linear.backends.sm90 import kernels, tuning  # noqa: E402

CALLS = 20


def graph_time(fn) -> float:
    """Median ms of one call, from replays of a graph of CALLS calls."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(30):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / CALLS)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    args = p.parse_args()
    rows = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"CUDA-graph replays of {CALLS} calls", "",
            "| layer | M | K | N | cuBLAS bf16 us | svdq linear us | vs bf16 | W4 GEMM alone us | weight GB/s |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, m, k, n, w4a16 in [("attn", 1, 3072, 3072, False), ("attn", 7, 3072, 3072, False),
                                  ("attn", 64, 3072, 3072, False), ("ff up", 7, 3072, 12288, False),
                                  ("adaLN W4A16", 1, 3072, 18432, True), ("adaLN W4A16", 4, 3072, 9216, True)]:
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q = NVFP4W4A16Linear.from_linear(lin) if w4a16 else random_w4a4(k, n, 32, torch.bfloat16, "cuda")
        t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
        t_q = graph_time(lambda: q(x))
        cfg = tuning.pick(m, n, k)
        if w4a16:
            t_g = graph_time(lambda: kernels.w4_gemm(x, q.qweight, q.wscales, q.wcscale, q.bias, None, None,
                                                     torch.bfloat16, cfg))
        else:
            lora = torch.randn(m, 32, device="cuda", dtype=torch.bfloat16)
            t_g = graph_time(lambda: kernels.w4_gemm(x, q.qweight, q.wscales, q.wcscale, q.bias, q.proj_up, lora,
                                                     torch.bfloat16, cfg))
        gbs = (n * k // 2 + n * k // 16) / (t_g * 1e-3) / 1e9
        rows.append(f"| {label} | {m} | {k} | {n} | {t_ref * 1e3:.1f} | {t_q * 1e3:.1f} | {t_ref / t_q:.2f}x | "
                    f"{t_g * 1e3:.1f} | {gbs:.0f} |")
    emit(rows, args.out)


if __name__ == "__main__":
    main()
