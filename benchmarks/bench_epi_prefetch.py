"""What the quack GEMMs do at each work tile's edges, before and after (H100/H200; one run, in rounds).

    python benchmarks/bench_epi_prefetch.py [--out FILE] [--rounds 7] [--quick]

Two changes, each behind a switch read per call (``quack_lowrank``):
- ``SVDQ_SM90_EPI_PREFETCH``: the epilogue's per-row vectors (``wcscale``, ``bias``; the fast mode's ``sa``
  and ``cs``) copied at the work tile's start beside the low-rank operands ("1", the default), or at the
  epilogue's start with a wait right after, as quack's ``VecLoad`` does ("0");
- ``SVDQ_SM90_LR_RUNS``: a fused linear's low-rank window from two packed words passed as kernel parameters
  (default), or from the segment table, one global load at every tile's start that the ``la`` copies wait
  on ("0").

GEMM alone (activations ready; CUDA graphs of 20 calls, per-call ms): R = 0 old / new, and with the low-rank
MMA: old (table, vectors at the epilogue), table + prefetch, words + prefetch. Every variant's output must be
bit-identical to the old one's. Then the whole fused linears (module forward, quantization included),
old (both switches "0") against new. Each round times every variant once; the table gives the median over
rounds of each variant's ratio to the old one timed in the same round (and to cuBLAS bf16).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _cuda import graph_of, replay_call_ms  # noqa: E402
from _table import Log  # noqa: E402
from bench_lowrank import FUSED, mode_gemm, whole_module  # noqa: E402
from test_conformance import random_w4a4  # noqa: E402

from svdq_linear.backends.sm90 import quack_lowrank  # noqa: E402

CALLS = 20
# (label, M, K, N, segment widths of the low-rank branch, R = 32 each)
SHAPES = [("fused qkv", 4096, 3072, 9216, (3072, 3072, 3072)),
          ("single fused in", 4608, 3072, 21504, (3072, 3072, 3072, 12288)),
          ("attn out", 4096, 3072, 3072, (3072,)),
          ("ff down", 4096, 12288, 3072, (3072,)),
          ("single out", 4608, 15360, 3072, (3072,))]
OLD = {quack_lowrank.ENV_PREFETCH: "0", quack_lowrank.ENV_RUNS: "0"}
GEMM_VARIANTS = {  # name: (low-rank MMA, environment)
    "R=0 old": (False, {quack_lowrank.ENV_PREFETCH: "0"}),
    "R=0 new": (False, {}),
    "LR old": (True, OLD),
    "LR table+pf": (True, {quack_lowrank.ENV_RUNS: "0"}),
    "LR new": (True, {}),
}


class env:
    """These environment variables set inside, as they were after."""

    def __init__(self, values: dict):
        self.values, self.saved = values, {}

    def __enter__(self):
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def captured(fn, values: dict):
    """``fn``'s output under ``values`` (checked later) and a graph of ``CALLS`` calls captured under them."""
    with env(values):
        out = fn().clone()
        torch.cuda.synchronize()
        return out, graph_of(fn, CALLS)


def lowrank_operands(m: int, n: int, widths, col, to_la, dev):
    """``lr_acc`` of a fused linear with one rank-32 branch a part (``widths``): proj_up's own window a row,
    ``la`` S windows wide, the segment table registered as the preparation registers it."""
    s = len(widths)
    seg = torch.tensor([i for i, w in enumerate(widths) for _ in range(w // 64)], device=dev, dtype=torch.int32)
    up = (torch.randn(n, 32, device=dev) * 1e-2 / col).bfloat16()
    la = to_la(torch.randn(m, 32 * s, device=dev, dtype=torch.bfloat16))
    if s > 1:
        quack_lowrank.register_runs(seg)
        return up, la, seg
    return up, la


def rounds_table(log, rows, rounds: int, names, base_of):
    """``rows``: (label, mode, ref graph, {name: graph}); logs the median over rounds of ms, of cuBLAS / each, and
    of each one's gain over its old form (``base_of[name]``) timed in the same round. The order within a round
    turns by one each round (no variant always first after cuBLAS)."""
    log("| shape | mode | cuBLAS bf16 | " + " | ".join(names) + " |")
    log("|---|---|---|" + "---|" * len(names))
    for label, mode, ref, graphs in rows:
        t = {name: [] for name in ["ref", *names]}
        order = ["ref", *names]
        for r in range(rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                t[name].append(replay_call_ms(ref if name == "ref" else graphs[name], CALLS, 10))
        cells = []
        for name in names:
            ms = statistics.median(t[name])
            vs = statistics.median(r / a for a, r in zip(t[name], t["ref"]))
            base = base_of[name]
            gain = "" if base == name else f"; {statistics.median(b / a for a, b in zip(t[name], t[base])):.3f}x old"
            cells.append(f"{ms:.4f} ({vs:.3f}x{gain})")
        log(f"| {label} | {mode} | {statistics.median(t['ref']):.4f} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out/bench_epi_prefetch.md")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--quick", action="store_true", help="fused q/k/v and attn out only")
    args = p.parse_args()
    log = Log()

    dev = torch.device("cuda")
    log(f"# quack GEMMs' work-tile edges, old against new — {torch.cuda.get_device_name()} — "
        f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    log(f"ms a call (graphs of {CALLS} calls, median of {args.rounds} rounds, the order turning); "
        "(x) = cuBLAS bf16 / variant; 'x old' = its old form / it, same round\n")
    shapes = SHAPES[:1] + SHAPES[2:3] if args.quick else SHAPES
    names = list(GEMM_VARIANTS)
    rows = []
    keep = []  # what the graphs read but do not own (inputs, weights): alive until they are timed
    for label, m, k, n, widths in shapes:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        ref = graph_of(lambda: F.linear(x, w16), CALLS)
        base = random_w4a4(k, n, 0, torch.bfloat16, dev)
        for mode in ("exact", "fast"):
            run, col, to_la = mode_gemm(mode, x, base)
            lr = lowrank_operands(m, n, widths, col, to_la, dev)
            graphs, outs = {}, {}
            for name, (with_lr, values) in GEMM_VARIANTS.items():
                outs[name], graphs[name] = captured(lambda with_lr=with_lr: run(lr_acc=lr if with_lr else None), values)
            for name in names:
                want = outs["LR old" if GEMM_VARIANTS[name][0] else "R=0 old"]
                if not torch.equal(outs[name], want):
                    raise AssertionError(f"{label} {mode} {name}: not the old variant's bits")
            rows.append((label, mode, ref, graphs))
            keep.append((run, lr))
        keep.append((x, w16, base))
        torch.cuda.synchronize()
    log("## The GEMM alone\n")
    rounds_table(log, rows, args.rounds, names, {n: ("LR old" if GEMM_VARIANTS[n][0] else "R=0 old") for n in names})
    del rows, keep
    torch.cuda.empty_cache()
    keep = []

    log("\n## The whole fused linears (module forward, quantization included; R = 32 a part)\n")
    rows = []
    for label, m, k, n, _ in [s for s in shapes if s[0] in FUSED]:
        torch.manual_seed(0)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        ref = graph_of(lambda: F.linear(x, w16), CALLS)
        for mode in ("exact", "fast"):
            mod = whole_module(label, k, n, dev).set_mode(mode)
            o_old, g_old = captured(lambda: mod(x), OLD)
            o_new, g_new = captured(lambda: mod(x), {})
            if not torch.equal(o_old, o_new):
                raise AssertionError(f"{label} {mode}: the whole linear's bits changed")
            rows.append((label, mode, ref, {"old": g_old, "new": g_new}))
            keep.append(mod)
        keep.append((x, w16))
    rounds_table(log, rows, args.rounds, ["old", "new"], {"old": "old", "new": "old"})
    log.write(args.out)


if __name__ == "__main__":
    main()
