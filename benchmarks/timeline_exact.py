"""Kernel timeline of the whole linear's forward (H100/H200), each path in the same run:

    python benchmarks/timeline_exact.py [--out FILE] [--shapes fused_qkv,single_out,1x3072x3072] [--modes exact,fast]
                                        [--reps 20] [--rounds 3]

Why: timed alone, the exact one read is 4-31 us faster than the pass and ``lora_act`` it replaces, yet the
module's forward with it was no faster (``bench_exact_parts.py``); and each part timed alone as a graph replay
carries the replay's own fixed time. The device's profiler (CUPTI, through ``torch.profiler``) records each
kernel's start and end inside a CUDA-graph replay, so this shows where a forward's time goes: each kernel's own
duration in the forward, and the gap (negative: overlap) between the end of the kernel before and its start.

For each layer (``bench_lowrank``'s whole-linear rows, rank 32), in ``--rounds`` alternating rounds: cuBLAS
bf16 (``F.linear``); in the exact mode the module forward with the two plain launches (``SVDQ_SM90_PDL=0``),
with the one read (``SVDQ_SM90_EXACT_LORA``) and by default (in a graph: the PDL pair), and the GEMM alone on
the one read's outputs; in the fast mode the forward with the plain launches and by default. Each is one graph
of ``--reps`` back-to-back calls, replayed under the profiler; a forward's period is the replay's span over
``--reps``. Per kernel (by name): how many a call, the median duration and the median gap before it, us.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cuda import graph_of  # noqa: E402
from bench_lowrank import FLUX, whole_module  # noqa: E402

from svdq_linear import backends  # noqa: E402
from svdq_linear.backends import sm90  # noqa: E402
from svdq_linear.backends.sm90 import kernels, tuning  # noqa: E402


def kernel_spans(g) -> list[tuple[float, float, str]]:
    """(start, end, name) of every GPU kernel of one replay of ``g``, in start order (us, the profiler's clock)."""
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
             and "memset" not in e.name.lower()]
    if not spans:
        raise RuntimeError("the profiler recorded no kernel of the graph replay (CUPTI not available here?)")
    return sorted(spans)


def short(name: str) -> str:
    name = name.replace("\n", " ")
    return name if len(name) <= 70 else name[:67] + "..."


def summarize(spans, reps: int) -> tuple[float, list[tuple[str, int, float, float]]]:
    """The period (span / reps) and, per kernel name in order of first appearance: calls a rep, median duration,
    median gap from the end of the kernel before (the first kernel of the replay has no gap)."""
    period = (spans[-1][1] - spans[0][0]) / reps
    rows: dict[str, tuple[list[float], list[float]]] = {}
    prev_end = None
    for start, end, name in spans:
        durs, gaps = rows.setdefault(short(name), ([], []))
        durs.append(end - start)
        if prev_end is not None:
            gaps.append(start - prev_end)
        prev_end = max(end, prev_end) if prev_end is not None else end
    out = [(name, len(d) // reps, statistics.median(d), statistics.median(gp) if gp else float("nan"))
           for name, (d, gp) in rows.items()]
    return period, out


def time_rounds(graphs: dict, rounds: int, reps: int) -> tuple[dict[str, list[float]], dict[str, list]]:
    """Each graph of ``graphs`` (name -> a graph of ``reps`` calls) timed in ``rounds`` alternating rounds:
    ``(periods, kernels)``, per name the period of each round (``summarize``) and the first round's kernel rows."""
    periods: dict[str, list[float]] = {}
    kernels_of: dict[str, list] = {}
    for _ in range(rounds):
        for what, gr in graphs.items():
            period, rows = summarize(kernel_spans(gr), reps)
            periods.setdefault(what, []).append(period)
            kernels_of.setdefault(what, rows)
    return periods, kernels_of


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="fused qkv,single out")
    ap.add_argument("--modes", default="exact")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    want = [s.strip().replace("_", " ") for s in args.shapes.split(",")]  # "fused_qkv": no space to split on
    modes = [s.strip() for s in args.modes.split(",")]
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; graphs of {args.reps} calls, "
             f"{args.rounds} rounds", ""]

    def log(s: str = "") -> None:
        lines.append(s)
        print(s, flush=True)

    dev = torch.device("cuda")
    with torch.no_grad():
        # a FLUX label, or MxKxN for any layer (rank 32): e.g. 1x3072x3072, a token at attention's shape
        shapes = [s for s in FLUX if s[0] in want] + [(w, *map(int, w.split("x"))) for w in want
                                                       if w.count("x") == 2 and w.replace("x", "").isdigit()]
        for label, m, k, n, mode in [(*s, md) for s in shapes for md in modes]:
            torch.manual_seed(0)
            mod = whole_module(label, k, n, dev).set_mode(mode)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5

            def forward(envs: dict[str, str]):
                def fn():
                    os.environ.update(envs)
                    try:
                        return mod(x)
                    finally:
                        for name in envs:
                            os.environ.pop(name)
                return fn

            graphs = {"cuBLAS bf16": graph_of(lambda: F.linear(x, w), args.reps)}
            plan = None
            if mode == "exact" and m >= 128:  # the one read and the GEMM alone: the large-M path
                be, prep = backends.resolve(mod, x)
                inv, ex = sm90._exact_inv(be.extra_tensors(prep))
                pds = ex[0]
                plan = tuning.exact_lora_plan(m, k, pds.shape[1], "one", tuning.sm_count(dev))
                xq, lora = kernels.quantize_act_lora(x, mod.smooth, pds, out_dtype=torch.bfloat16,
                                                     block_m=plan.block_m, block_k=plan.block_k, split=plan.split,
                                                     num_warps=plan.num_warps, num_stages=plan.num_stages,
                                                     inv_smooth=inv)
                t = mod._parameters  # not the attributes: a stood-in tensor would be rebuilt

                def gemm():
                    return be._exact_gemm(xq, lora, True, x.dtype, t["qweight"], t["wscales"], t["proj_up"],
                                          t["wcscale"], t["bias"], ex)

                graphs.update({
                    "forward two": graph_of(forward({tuning.ENV_EXACT_LORA: "two", sm90.ENV_PDL: "0"}), args.reps),
                    "forward one": graph_of(forward({tuning.ENV_EXACT_LORA: "one"}), args.reps),
                    "forward (default)": graph_of(forward({}), args.reps),  # in a graph: the PDL pair
                    "GEMM alone": graph_of(gemm, args.reps)})
            elif mode == "exact":
                graphs["forward"] = graph_of(forward({}), args.reps)
            elif m % 16 == 0:  # _scaled_mm's FP8 GEMM wants whole 16-row blocks
                # torch's FP8 GEMM with per-row / per-column scales (8-bit weights), the yardstick
                sa = x.abs().amax(1, keepdim=True).float() / 448
                a8 = (x / sa).to(torch.float8_e4m3fn)
                sw = w.abs().amax(1, keepdim=True).float() / 448
                w8 = (w / sw).to(torch.float8_e4m3fn)
                graphs["_scaled_mm FP8"] = graph_of(
                    lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw.t(), out_dtype=torch.bfloat16),
                    args.reps)
            if mode == "fast":
                graphs.update({"forward plain": graph_of(forward({sm90.ENV_PDL: "0"}), args.reps),
                               "forward (default)": graph_of(forward({}), args.reps)})  # in a graph: the PDL pair
            one = "" if plan is None else (f" (one read: {plan.block_m}x{plan.block_k} w{plan.num_warps} "
                                           f"s{plan.split} st{plan.num_stages})")
            log(f"\n## {mode}: {label} {m}x{k}->{n}{one}\n")
            log("| round | what | period | kernel | calls a rep | median duration | median gap before |")
            log("|---|---|---|---|---|---|---|")
            periods: dict[str, list[float]] = {}
            for rnd in range(args.rounds):
                for what, g in graphs.items():
                    period, rows = summarize(kernel_spans(g), args.reps)
                    periods.setdefault(what, []).append(period)
                    for i, (name, calls, dur, gap) in enumerate(rows):
                        log(f"| {rnd} | {what if i == 0 else ''} | {f'{period:.1f}' if i == 0 else ''} | `{name}` | "
                            f"{calls} | {dur:.1f} | {gap:.1f} |")
            med = {what: statistics.median(p) for what, p in periods.items()}
            base = med["cuBLAS bf16"]
            log("\nMedian periods over the rounds (us; ratio = cuBLAS bf16 / it): " + ", ".join(
                f"{what} {p:.1f} ({base / p:.3f}x)" for what, p in med.items()))
            # the card's clock moves every path of a round together (a GEMM's period by 10 % between rounds), so
            # each round's ratio to the cuBLAS timed just before it is the steadier figure
            ratios = {what: sorted(b / q for b, q in zip(periods["cuBLAS bf16"], p)) for what, p in periods.items()
                      if what != "cuBLAS bf16"}
            log("Per-round ratios to that round's cuBLAS bf16, median [min, max]: " + ", ".join(
                f"{what} {statistics.median(r):.3f}x [{r[0]:.3f}, {r[-1]:.3f}]" for what, r in ratios.items()))
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
