"""Time and error of the SVDQuant decomposition per Flux layer shape, on each available device.

    python benchmarks/svdquant_bench.py [--out results.md]

Random weights with a decaying spectrum plus outlier input channels (act_max from a random
calibration set). Reports seconds per layer and the weight-side relative error for the full SVD and
the randomized low-rank SVD the converter uses for large layers.
"""

import argparse
import time

import torch
from _table import emit

from svdq_linear import SVDQuantConfig, svdquant

SHAPES = [(3072, 3072), (12288, 3072), (3072, 12288), (3072, 15360)]  # (N, K)


def layer(n: int, k: int):
    g = torch.Generator().manual_seed(0)
    u = torch.randn(n, 64, generator=g) * torch.logspace(0, -2, 64)
    w = u @ torch.randn(64, k, generator=g) / 8 + torch.randn(n, k, generator=g) * 0.05
    act_max = torch.exp(torch.randn(k, generator=g)).abs()
    act_max[torch.randperm(k, generator=g)[:16]] *= 50
    return w, act_max


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    args = p.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = [f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
            + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""), "",
            "| N x K | device | svd | seconds | rel. error |", "|---|---|---|---|---|"]
    for n, k in SHAPES:
        w, act_max = layer(n, k)
        for dev in devices:
            for method in ("full", "lowrank"):
                if dev == "cpu" and method == "full" and n * k > 3072 * 3072:
                    continue  # tens of seconds per layer on a small CPU: the reason for lowrank
                cfg = SVDQuantConfig(rank=32, svd=method, device=dev)
                svdquant(w, act_max=act_max, config=cfg)  # warm-up (cuSOLVER handles, kernels)
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = svdquant(w, act_max=act_max, config=cfg)
                if dev == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                rows.append(f"| {n} x {k} | {dev} | {method} | {dt:.3f} | {res.rel_error:.4f} |")
                print(rows[-1], flush=True)
    emit(rows, args.out)


if __name__ == "__main__":
    main()
