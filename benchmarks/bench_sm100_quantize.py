"""The sm100 backend's activation pass (``backends/sm100/quantize.py``, Triton) on any CUDA GPU: bytes a second
against a device copy of the same tensor, by rows a program and warps, checked bit for bit across configurations.

    python benchmarks/bench_sm100_quantize.py [--out FILE] [--quick] [--configs 8x256x4,...] [--baseline FILE]

No Blackwell GPU exists here; the kernel is plain Triton (loads, integer and float arithmetic, stores), so its
memory behaviour on an H100/H200 is the measurable part of its speed. Each configuration is a CUDA graph of 20
calls, median of 30 replays (``_cuda.graph_call_ms``). GB/s counts x read, the codes written and the scale atoms
written; the copy moves x once each way. ``--baseline`` times another revision's ``quantize.py`` (at its default tile)
in the same run, e.g. ``git show REV:svdq_linear/backends/sm100/quantize.py > .devcarry/base_quantize.py``.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from _baseline import load_beside
from _cuda import graph_call_ms
from _table import emit

from svdq_linear.backends.sm100 import quantize

SHAPES = [(4096, 3072), (4352, 3840), (4608, 15360)]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="two shapes, fewer configurations")
    ap.add_argument("--configs", help="rows x cols x warps a program, comma separated (default: a sweep)")
    ap.add_argument("--baseline", help="another revision's quantize.py, timed at its default tile beside this one")
    args = ap.parse_args()
    shapes = SHAPES[:2] if args.quick else SHAPES
    blocks = (4, 8, 16) if args.quick else (1, 2, 4, 8, 16)
    ks = (256,) if args.quick else (128, 256, 512)
    warps = (2, 4) if args.quick else (2, 4, 8)
    configs = list(itertools.product(blocks, ks, warps))
    if args.configs:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    base = None
    if args.baseline:
        base = load_beside(args.baseline, "svdq_linear.backends.sm100", "_baseline_quantize")
    rows = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; graphs of 20 calls, median of 30 replays",
            "", "| M x K | copy us (GB/s) | rows x cols x warps | us | GB/s | of copy | same bits |",
            "|---|---|---|---|---|---|---|"]
    for m, k in shapes:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        recip = 1.0 / (torch.rand(k, device="cuda") + 0.5)
        y = torch.empty_like(x)
        copy_us = graph_call_ms(lambda: y.copy_(x), 20) * 1e3
        copy_gbs = 2 * x.numel() * 2 / copy_us / 1e3
        codes0, sf0, _ = quantize.quantize_act(x, recip, block_m=1, block_k=64, num_warps=2)  # a reference tile
        moved = x.numel() * 2 + codes0.numel() + sf0.numel()
        first = True
        if base is not None:
            codes, sf, _ = base.quantize_act(x, recip)
            same = torch.equal(codes, codes0) and torch.equal(sf, sf0)
            us = graph_call_ms(lambda: base.quantize_act(x, recip), 20) * 1e3
            gbs = moved / us / 1e3
            rows.append(f"| {m} x {k} | {copy_us:.1f} ({copy_gbs:.0f}) | baseline {args.baseline} (its default) | "
                        f"{us:.1f} | {gbs:.0f} | {gbs / copy_gbs:.2f} | {'yes' if same else 'NO'} |")
            first = False
        for bm, bk, w in configs:
            codes, sf, _ = quantize.quantize_act(x, recip, block_m=bm, block_k=bk, num_warps=w)
            same = torch.equal(codes, codes0) and torch.equal(sf, sf0)
            us = graph_call_ms(lambda: quantize.quantize_act(x, recip, block_m=bm, block_k=bk, num_warps=w), 20) * 1e3
            gbs = moved / us / 1e3
            default = (bm, bk, w) == (quantize.BLOCK_M, quantize.BLOCK_K, quantize.NUM_WARPS)
            rows.append(f"| {m} x {k} | {f'{copy_us:.1f} ({copy_gbs:.0f})' if first else ''} | {bm} x {bk} x {w}"
                        f"{' (default)' if default else ''} | "
                        f"{us:.1f} | {gbs:.0f} | {gbs / copy_gbs:.2f} | {'yes' if same else 'NO'} |")
            first = False
        # beside it, sm90's pass on the same x (its default tile): packed codes + row-major scales, and the exact
        # mode's written bf16 values
        from svdq_linear.backends.sm90 import kernels as sm90_kernels

        for what, packed in (("sm90 pass, packed codes", True), ("sm90 pass, bf16 values", False)):
            us = graph_call_ms(lambda: sm90_kernels.quantize_act(x, recip, packed=packed, inv_smooth=recip), 20) * 1e3
            sm90_moved = x.numel() * 2 + (codes0.numel() + x.numel() // 16 if packed else x.numel() * 2)
            gbs = sm90_moved / us / 1e3
            rows.append(f"| {m} x {k} |  | {what} | {us:.1f} | {gbs:.0f} | {gbs / copy_gbs:.2f} | - |")
    emit(rows, args.out)


if __name__ == "__main__":
    main()
