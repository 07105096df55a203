"""The Triton W4 GEMM (the exact mode above 64 tokens without quack-kernels) at the pipeline depth
``tuning.pick`` caps it to against the depth its table holds: kernel alone, CUDA-graph replays.

    python benchmarks/bench_fallback.py [--out FILE]

Triton 3.6 on sm_90 compiled the 3-stage loop of the 128x256x64 tile into a kernel that wrote garbage
at 1000 tokens (docs/perf.md, 2026-12-04 ninth session), so every tile above 64 tokens runs at
``tuning.MAX_STAGES_ABOVE_64`` stages. Here each shape runs at the capped config and at the table's own
depth; the bf16 output that is timed is compared five times with the float64 product of the same
operands (the capped config must match every time, or the script exits 1; the uncapped one is
reported, not trusted), beside cuBLAS bf16 in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_small_m import graph_time  # noqa: E402

from svdq_linear import nvfp4  # noqa: E402
from svdq_linear.backends.sm90 import kernels, tuning  # noqa: E402

SHAPES = [(128, 3072, 3072), (512, 3072, 3072), (1000, 3072, 3072), (1000, 3072, 12288), (4096, 3072, 3072),
          (4096, 3072, 12288), (4608, 15360, 3072)]


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    args = p.parse_args()
    rows = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; "
            "us, kernel alone (CUDA-graph replays); err = the worst of five bf16 outputs against float64, as a "
            "fraction of the bound (bf16 rounding plus 1e-3 of the largest output): above 1 is wrong", "",
            "| M | K | N | cuBLAS bf16 | table config | stages: capped (default) | err | table's own | err | capped / own |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    gen = torch.Generator().manual_seed(0)
    failed: list[str] = []
    for m, k, n in SHAPES:
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen).cuda()
        ws = (torch.rand(n, k // 16, generator=gen) * 0.5 + 0.01).to(torch.float8_e4m3fn).cuda()
        wc = torch.ones(n, device="cuda")
        a = torch.randn(m, k, generator=gen).bfloat16().cuda()
        ref = a.double() @ nvfp4.dequantize_nvfp4(q, ws, torch.float64).T
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        t_ref = graph_time(lambda: F.linear(a, wb))
        capped = tuning.pick(m, n, k)
        own = tuning._table().get(tuning.m_bucket(m)) or tuning._default(m)
        own = replace(capped, num_stages=own.num_stages)
        cells = []
        times = []
        for cfg in (capped, own):
            # the kernel that is timed (bf16 output), checked five times: the race it guards against is
            # intermittent; bf16 rounding is 2**-8 of each output at most
            err = max(((kernels.w4_gemm(a, q, ws, wc, None, None, None, torch.bfloat16, cfg).double() - ref).abs()
                       / (ref.abs() * 2.0**-8 + 1e-3 * ref.abs().max())).max().item() for _ in range(5))
            if cfg is capped and not err <= 1.0:
                failed.append(f"{m}x{k}x{n} at {cfg.num_stages} stages: {err:.2f} of the bound")
            t = graph_time(lambda cfg=cfg: kernels.w4_gemm(a, q, ws, wc, None, None, None, torch.bfloat16, cfg))
            times.append(t)
            cells += [f"{cfg.num_stages}: {t * 1e3:.1f}", f"{err:.2f}"]
        rows.append(f"| {m} | {k} | {n} | {t_ref * 1e3:.1f} | {capped.block_n}x{capped.block_m}x{capped.block_k} s{capped.split_k} "
                    f"w{capped.num_warps} | " + " | ".join(cells) + f" | {times[0] / times[1]:.2f} |")
        print(rows[-1], flush=True)
    if failed:
        rows += ["", "WRONG (the default config): " + "; ".join(failed)]
        print(rows[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(rows) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
