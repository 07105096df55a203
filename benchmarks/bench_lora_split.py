"""``lora_act = x @ (proj_down / smooth)`` on the H100/H200: one cuBLAS GEMM against K split into S
slices run as one strided batched GEMM (``x`` viewed as ``[S, M, K/S]``, no copy) and summed in slice
order.

    python benchmarks/bench_lora_split.py [--out FILE] [--triton]

``--triton`` adds ``kernels.lora_act`` (Triton, one launch, x streamed once) over row blocks, K splits
(its ``[S, M, R]`` partial sums, which the fast mode's activation pass adds: the kernel is timed
alone), warps and pipeline stages: larger row blocks re-read ``proj_down`` fewer times, splits give
back the programs they cost. ``--best-env FILE`` writes the ``SVDQ_SM90_LORA_ACT`` value of the config
that beat cuBLAS by the most (geometric mean over the shapes of >= 1024 tokens), or ``cublas``.

The product is skinny (R = 32-128 columns): one GEMM gives few output tiles (M / 128 of them), so its
CTAs leave SMs idle and read ``x`` at a fraction of the bandwidth; S slices give S times the CTAs.
Every variant is checked against float64 before it is timed (relative error of the fp32 result).
CUDA-graph replays, ``do_bench`` medians, us.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cuda import graphed  # noqa: E402

SHAPES = [(4096, 3072, 32), (4096, 3072, 96), (4608, 3072, 128), (4096, 12288, 32), (4608, 15360, 32),
          (4352, 3840, 32), (512, 3072, 32)]
SPLITS = (2, 4, 8, 16)


def split_mm(x: torch.Tensor, pds: torch.Tensor, s: int, out_dtype=torch.float32) -> torch.Tensor:
    m, k = x.shape
    xs = x.view(m, s, k // s).transpose(0, 1)  # [S, M, K/S], strides (K/S, K, 1): no copy
    ws = pds.view(s, k // s, -1)
    try:
        part = torch.bmm(xs, ws, out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError, TypeError):  # no mixed-dtype bmm on this device
        part = torch.bmm(xs, ws).float()
    return part.sum(0, dtype=out_dtype)


def operands(m: int, k: int, r: int):
    """x [M, K] bf16, pds [K, R] bf16 and their float64 product (the same seed for every table)."""
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    pds = (torch.randn(k, r, device="cuda") / k**0.5).bfloat16()
    return x, pds, x.double() @ pds.double()


def rel_err(y: torch.Tensor, want: torch.Tensor) -> float:
    return ((y.double() - want).norm() / want.norm()).item()


def graph_us(fn) -> float:
    return do_bench(graphed(fn), warmup=10, rep=100, return_mode="median") * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--triton", action="store_true", help="also kernels.lora_act over its block / warp / stage choices")
    p.add_argument("--best-env", default=None, help="with --triton: write the best config's SVDQ_SM90_LORA_ACT here")
    p.add_argument("--fused", action="store_true",
                   help="the fast mode's activation pass computing lora_act itself (two-pass kernel, row blocks x "
                        "k-chunks x warps) against the pass + lora_act as the backend runs them")
    args = p.parse_args()
    lines = [f"# lora_act: one GEMM against K split — {torch.cuda.get_device_name()}", "",
             "us (relative error against float64); bf16 out = what the exact mode passes on, fp32 out = the fast mode's", "",
             "| M | K | R | mm bf16 out | mm fp32 out | " + " | ".join(f"S={s} (bmm + sum)" for s in SPLITS) + " |",
             "|---|---|---|---|---|" + "---|" * len(SPLITS)]
    print("\n".join(lines), flush=True)
    for m, k, r in SHAPES:
        x, pds, want = operands(m, k, r)

        def err(y):
            return rel_err(y, want)

        t = graph_us
        cells = [f"{t(lambda: x @ pds):.1f} ({err(x @ pds):.0e})",
                 f"{t(lambda: torch.mm(x, pds, out_dtype=torch.float32)):.1f} "
                 f"({err(torch.mm(x, pds, out_dtype=torch.float32)):.0e})"]
        for s in SPLITS:
            if k % s:
                cells.append("-")
                continue
            y = split_mm(x, pds, s)
            cells.append(f"{t(lambda: split_mm(x, pds, s)):.1f} ({err(y):.0e})")
        lines.append(f"| {m} | {k} | {r} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    if args.triton:
        from svdq_linear.backends.sm90 import kernels, tuning

        # (block_m, split (0: tuning.lora_split's rule), warps, stages); 16 rows unsplit: the first version
        configs = [(16, 1, 4, 4)] + [(bm, sp, 4 if bm <= 64 else 8, st) for bm in (64, 128) for sp in (0, 1, 2, 4, 8)
                                     for st in (3, 4)]
        lines += ["", "kernels.lora_act (fp32 out; the kernel alone: the fast mode's activation pass adds a split's partial sums), us (relative error against float64); "
                  "block_m x split (S0 = the rule) x warps x stages; cuBLAS fp32 out repeated for reference", "",
                  "| M | K | R | cuBLAS fp32 out | " + " | ".join(f"{bm} S{sp} w{w} s{st}" for bm, sp, w, st in configs)
                  + " |", "|---|---|---|---|" + "---|" * len(configs)]
        print("\n".join(lines[-4:]), flush=True)
        ratios: dict[tuple, list[float]] = {c: [] for c in configs}
        for m, k, r in SHAPES:
            x, pds, want = operands(m, k, r)
            t = graph_us
            t_cu = t(lambda: torch.mm(x, pds, out_dtype=torch.float32))
            cells = [f"{t_cu:.1f}"]
            for cfg in configs:
                bm, sp, w, st = cfg
                split = sp or tuning.lora_split(m, k, bm, 128 if r <= 64 else 64)

                def run(bm=bm, w=w, st=st, split=split):  # timed alone: the fast mode's pass adds the partials
                    return kernels.lora_act(x, pds, block_m=bm, num_warps=w, num_stages=st, split=split)

                try:
                    y = run()
                    y = y.sum(0) if y.dim() == 3 else y
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a config Triton cannot build (shared memory)
                    cells.append(type(e).__name__)
                    continue
                tc = t(run)
                if m >= 1024:
                    ratios[cfg].append(t_cu / tc)
                cells.append(f"{tc:.1f} ({rel_err(y, want):.0e})" + (f" S={split}" if sp == 0 else ""))
            lines.append(f"| {m} | {k} | {r} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        n_big = sum(m >= 1024 for m, _, _ in SHAPES)
        gm = {c: math.exp(sum(map(math.log, v)) / len(v)) for c, v in ratios.items() if len(v) == n_big}
        best = max(gm, key=gm.get) if gm else None
        choice = "cublas" if best is None or gm[best] < 1.02 else ",".join(map(str, best))
        lines += ["", "cuBLAS / config, geometric mean over the shapes of >= 1024 tokens: "
                  + ", ".join(f"{','.join(map(str, c))} {v:.2f}x" for c, v in sorted(gm.items(), key=lambda kv: -kv[1])),
                  f"SVDQ_SM90_LORA_ACT={choice}"]
        print("\n".join(lines[-3:]), flush=True)
        if args.best_env:
            Path(args.best_env).write_text(choice + "\n")
    if args.fused:
        fused_sweep(lines)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


FUSED_SHAPES = [(4096, 3072, 32), (4096, 3072, 96), (4608, 3072, 128), (4096, 12288, 32), (512, 3072, 32)]


def fused_sweep(lines: list[str]) -> None:
    """One kernel for the pass and lora_act (x read twice inside it, the second time from L2) against
    the two launches the backend makes (lora_act by its plan or cuBLAS, then the one-pass FP8 kernel
    adding the partials): same outputs checked, then timed as one graph each."""
    import os

    from svdq_linear.backends.sm90 import Sm90Backend, kernels, tuning

    be = Sm90Backend()
    configs = [(bm, bk, w) for bm in (16, 32, 64) for bk in (64, 128) for w in (4, 8)]
    lines += ["", "The fast mode's pass with lora_act inside (us; block_m x block_k x warps) against the "
              "pass + lora_act launches", "",
              "| M | K | R | pass + Triton lora | pass + cuBLAS lora | " + " | ".join(
                  f"{bm}x{bk} w{w}" for bm, bk, w in configs) + " |",
              "|---|---|---|---|---|" + "---|" * len(configs)]
    print("\n".join(lines[-4:]), flush=True)
    for m, k, r in FUSED_SHAPES:
        x, pds, _ = operands(m, k, r)
        smooth = torch.rand(k, device="cuda") + 0.5
        inv = 1.0 / smooth

        def two(env):
            def run():
                os.environ[tuning.ENV_LORA_ACT] = env
                return kernels.quantize_act_fp8(x, smooth, lora=be._lora_act(x, pds), inv_smooth=inv, gemm_order=True)
            return run

        a8, sa, la = two("64,4,4,3")()
        t_tri = graph_us(two("64,4,4,3"))
        t_cu = graph_us(two("cublas"))
        os.environ.pop(tuning.ENV_LORA_ACT, None)
        bound = (x.float().abs() @ pds.float().abs()) / sa[:, None] * 2.0**-7 + 1e-30
        cells = [f"{t_tri:.1f}", f"{t_cu:.1f}"]
        for bm, bk, w in configs:
            def run(bm=bm, bk=bk, w=w):
                return kernels.quantize_act_fp8(x, smooth, proj_down_smoothed=pds, gemm_order=True, block_m=bm,
                                                block_k=bk, num_warps=w)
            try:
                fa8, fsa, fla = run()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a config Triton cannot build
                cells.append(type(e).__name__)
                continue
            ok = (torch.equal(fa8.view(torch.uint8), a8.view(torch.uint8)) and torch.equal(fsa, sa)
                  and bool(((fla.float() - la.float()).abs() <= bound).all()))
            cells.append(f"{graph_us(run):.1f}" + ("" if ok else " WRONG"))
        lines.append(f"| {m} | {k} | {r} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
