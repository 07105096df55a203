"""The norm pass alone (``sm90.norm_pass``: row statistics, then the split-K apply) at other tile shapes, beside
the written route's kernels (the compiled adaLN norm, then the library's pass and ``lora_act``), Triton only (no
quack): which apply tile would make the fused pass pay.

    python benchmarks/bench_norm_pass_cfg.py [--out FILE] [--configs 32x4x64,64x4x64,...] [--reps 20]

A config is ``block_m x num_warps x block_k``. Each row: a CUDA graph of ``--reps`` calls timed by CUDA events
(us a call; median of 5 replays); the ratio is the written route's time over the config's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cuda import graph_call_ms  # noqa: E402

from svdq_linear import nvfp4  # noqa: E402
from svdq_linear.backends.sm90 import kernels, norm_pass  # noqa: E402

# (name, M, K, R): bench_lowrank's Flux layers after an adaLN norm, R = 32 a fused part
SHAPES = [("fused_qkv", 4096, 3072, 96), ("ff_up", 4096, 3072, 32), ("single_fused_in", 4608, 3072, 128)]


def timed(fn, reps: int) -> float:
    return graph_call_ms(fn, reps, 5) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default="32x4x64,64x4x64,64x8x64,32x4x32,64x8x32,16x4x64")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    lines = [f"# norm pass alone by tile (block_m x warps x block_k) — {torch.cuda.get_device_name()}; us a call",
             "", "| layer | M x K, R | mode | written (norm + pass + lora_act) | "
             + " | ".join(f"{bm}x{w}x{bk}" for bm, w, bk in configs) + " |",
             "|---|---|---|---|" + "---|" * len(configs)]
    norm = torch.compile(nvfp4.ada_norm)
    for name, m, k, r in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(m + r)
        x = torch.randn(1, m, k, device="cuda", generator=g).bfloat16()
        shift = (torch.randn(1, k, device="cuda", generator=g) * 0.5).bfloat16()
        scale = (torch.randn(1, k, device="cuda", generator=g) * 0.5).bfloat16()
        smooth = torch.rand(k, device="cuda", generator=g) * 4 + 0.25
        inv = smooth.reciprocal()
        pds = (torch.randn(k, r, device="cuda", generator=g) / k ** 0.5).bfloat16()
        x2 = x.view(m, k)
        for mode in ("exact", "fast"):
            if mode == "exact":
                def written():
                    inp = norm(x, shift, scale, 1e-6).view(m, k)
                    return kernels.quantize_act(inp, smooth, inv_smooth=inv), kernels.lora_act(inp, pds)
            else:
                def written():
                    inp = norm(x, shift, scale, 1e-6).view(m, k)
                    return kernels.quantize_act_fp8(inp, smooth, lora=kernels.lora_act(inp, pds), inv_smooth=inv,
                                                    gemm_order=True)
            try:
                base = timed(written, args.reps)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{name} {mode} written: {type(e).__name__}: {e}", flush=True)
                base = float("nan")
            cells = []
            for bm, w, bk in configs:
                fn = norm_pass.ada_norm_exact if mode == "exact" else norm_pass.ada_norm_fast
                try:
                    t = timed(lambda: fn(x2, shift.view(1, k), scale.view(1, k), 1e-6, inv, pds, tokens=m,
                                         block_m=bm, block_k=bk, num_warps=w), args.reps)
                    cells.append(f"{t:.1f} ({base / t:.2f}x)")
                except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
                    cells.append(f"{type(e).__name__}")
                print(name, mode, (bm, w, bk), cells[-1], flush=True)
            lines.append(f"| {name} | {m}x{k}, {r} | {mode} | {base:.1f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
