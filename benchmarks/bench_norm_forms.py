"""The norm pass's forms alone (``sm90.norm_pass``: the pair form, the library's default, against the rows form), at
the Flux shapes that read an adaLN norm's input, both modes; Triton only (no quack GEMM, no CuTe DSL: it runs on a
bare GPU machine).

    python benchmarks/bench_norm_forms.py [--out FILE] [--modes exact,fast] [--reps 20] [--rounds 5]
                                          [--rows-tiles 1x4,4x8]

Per shape and mode, in ``--rounds`` alternating rounds, each form as a CUDA graph of ``--reps`` back-to-back calls
(PDL launches, as the backend takes them in captured graphs) timed by its kernels' span (torch.profiler, as
``timeline_exact.py``), median over the rounds; beside them a copy of x (``torch.Tensor.copy_``, the bandwidth a
read and a write of x get here). Before timing, the rows form's outputs are compared with the pair form's: the same
bits but where a row's statistics, summed in another order, round the other way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cuda import graph_of, with_env  # noqa: E402
from timeline_exact import time_rounds  # noqa: E402

from svdq_linear.backends.sm90 import norm_pass, tuning  # noqa: E402

# (label, tokens, R): the Flux layers after an adaLN norm, 3072 columns: the double blocks' fused q/k/v (image and
# text streams, three parts of rank 32) and feed-forward up (rank 32), the single blocks' fused q/k/v + MLP (four)
SHAPES = [("double img qkv", 4096, 96), ("double txt qkv", 512, 96), ("double img ff up", 4096, 32),
          ("single qkv+mlp", 4608, 128)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default="exact,fast")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows-tiles", default="", help="the rows form at these SVDQ_SM90_ADA_ROWS_TILE tiles too")
    args = ap.parse_args()
    dev = torch.device("cuda")
    k = 3072
    lines: list[str] = []

    def log(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    log(f"# The norm pass's forms alone — {torch.cuda.get_device_name()}")
    log("")
    log("us a call (graphs of back-to-back calls, PDL as captured graphs take it); ratio = pair / rows; copy = x "
        "copied once (read + write of x).")
    log("")
    log("| layer | M x K, R | mode | copy of x | pair | rows | pair / rows | rows bits = pair's (a8 / xq, sa) | "
        "pair kernels | rows kernels |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    tiles = [t for t in args.rows_tiles.split(",") if t]
    for t in tiles:
        tuning.parse_ada_rows_tile(t)  # a malformed one fails here, before any capture
    with torch.no_grad():
        for label, m, r in SHAPES:
            g = torch.Generator(device=dev).manual_seed(0)
            x = (torch.randn(m, k, device=dev, generator=g) * 2 + 0.5).bfloat16()
            x[:, 7] *= 30  # an outlier channel
            shift = (torch.randn(1, k, device=dev, generator=g) * 0.3).bfloat16()
            scale = (torch.randn(1, k, device=dev, generator=g) * 0.3).bfloat16()
            inv = (torch.rand(k, device=dev, generator=g) + 0.5).reciprocal()
            pds = (torch.randn(k, r, device=dev, generator=g) / k ** 0.5).bfloat16()
            y = torch.empty_like(x)
            for mode in args.modes.split(","):
                def run(form, mode=mode):
                    def fn():
                        if mode == "fast":
                            return norm_pass.ada_norm_fast(x, shift, scale, 1e-6, inv, pds, tokens=m, form=form,
                                                           pdl=True)
                        return norm_pass.ada_norm_exact(x, shift, scale, 1e-6, inv, pds, tokens=m, form=form,
                                                        out_dtype=torch.bfloat16, pdl=True)
                    return fn
                a, b = run("pair")(), run("rows")()
                if mode == "fast":
                    same = (a[0].view(torch.uint8) == b[0].view(torch.uint8)).float().mean().item()
                    same_s = (a[1] == b[1]).float().mean().item()
                else:
                    same = (a[0] == b[0]).float().mean().item()
                    same_s = float("nan")
                graphs = {"copy": graph_of(lambda: y.copy_(x), args.reps), "pair": graph_of(run("pair"), args.reps),
                          "rows": graph_of(run("rows"), args.reps)}
                for t in tiles:
                    graphs[f"rows {t}"] = graph_of(with_env({tuning.ENV_ADA_ROWS_TILE: t}, run("rows")), args.reps)
                periods, kernels_of = time_rounds(graphs, args.rounds, args.reps)
                med = {what: statistics.median(p) for what, p in periods.items()}
                gain = statistics.median(p / q for p, q in zip(periods["pair"], periods["rows"]))

                def ks(what: str) -> str:
                    return "; ".join(f"`{n[:24]}` {d:.1f}" for n, _, d, _ in kernels_of[what])
                log(f"| {label} | {m}x{k}, {r} | {mode} | {med['copy']:.1f} | {med['pair']:.1f} | {med['rows']:.1f} | "
                    f"{gain:.3f}x | {same:.4f}, {same_s:.4f} | {ks('pair')} | {ks('rows')} |")
                if tiles:
                    log("|  | rows form at SVDQ_SM90_ADA_ROWS_TILE: " + "; ".join(
                        f"{t} {med['rows ' + t]:.1f} ({ks('rows ' + t)})" for t in tiles) + " |" * 8)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
