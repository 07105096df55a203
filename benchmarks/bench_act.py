"""Build, check and time the activation passes against a device copy of the same bytes (H100/H200).

    python benchmarks/bench_act.py [--out FILE] [--defaults]

The fast mode's FP8 pass (``kernels.quantize_act_fp8``: per-token E4M3): the two-pass kernel and the
one-pass kernel at its default block and others; the exact mode's NVFP4 pass (``kernels.quantize_act``:
exact bf16 dequantized values) per block. Every variant's bytes are compared with a reference's (the
two-pass kernel; the default block) before it is timed, and the GPU tests hold those bit-exact to the
contract; a variant that differs is reported, with where, and not timed. GB/s counts x read once and the output written once; the
copy moves the same number of bytes (read + write) in the same run. CUDA-graph replays,
``do_bench`` medians.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cuda import graphed  # noqa: E402

from svdq_linear.backends.sm90 import fast_layout, kernels  # noqa: E402

SHAPES = [(4096, 3072), (4608, 3072), (4352, 3840), (4096, 12288), (4608, 15360), (512, 3072)]


def bench(fn) -> float:
    return do_bench(graphed(fn), warmup=10, rep=100, return_mode="median")


def first_diff(a, b) -> str:
    d = (a != b).nonzero()
    return f"{d.shape[0]} differ, first at {tuple(d[0].tolist())}" if d.numel() else "same"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--defaults", action="store_true",
                    help="FP8 pass: only the two-pass reference and the default block in both k orders; no NVFP4 sweep")
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = [f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", ""]
    lines += ["### FP8 pass (per-token E4M3): us / GB/s / % of copy", "",
              "| M | K | copy GB/s | variant | us | GB/s | % copy | bytes |", "|---|---|---|---|---|---|---|---|"]
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        x[1, 7] = float("nan")
        x[2, 5:9] = 0.0
        x[3] = 0.0
        x[4, 100] = -0.0
        x.view(torch.int16)[5, 9] = -64  # 0xFFC0: a NaN with its sign bit set
        smooth = torch.rand(k, device="cuda") + 0.5
        inv = 1.0 / smooth
        nbytes = m * k * 3
        src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8)
        dst = torch.empty_like(src)
        t_copy = bench(lambda: dst.copy_(src))
        copy_gbs = nbytes / t_copy / 1e6
        ref8, ref_sa = kernels.quantize_act_fp8(x, smooth, one_pass=False)
        ref8 = ref8.view(torch.uint8)
        t = bench(lambda: kernels.quantize_act_fp8(x, smooth, one_pass=False))
        lines.append(f"| {m} | {k} | {copy_gbs:.0f} | two passes (4x512 w4) | {t * 1e3:.1f} | "
                     f"{nbytes / t / 1e6:.0f} | {100 * nbytes / t / 1e6 / copy_gbs:.0f} | ref |")
        rows_d, c, nch, warps_d = kernels.fp8_rows_config(k)
        variants = [("one pass, default", {}), ("one pass, default, the GEMM's k order", dict(gemm_order=True))]
        if not args.defaults:
            variants.append(("one pass, default, no NaN canon.", dict(canon_nan=False)))
        for rows in (1, 2, 4) if not args.defaults else ():
            for warps in (4, 8, 16):
                if (rows, warps) != (rows_d, warps_d) and rows * nch * c // (32 * warps) <= 128:
                    variants.append((f"one pass, rows={rows} w{warps}", dict(rows=rows, num_warps=warps)))
        for name, kw in variants:
            if "default" in name:
                name += f" (rows={rows_d} {nch}x{c} w{warps_d})"
            fn = lambda: kernels.quantize_act_fp8(x, smooth, inv_smooth=inv, **kw)  # noqa: E731
            try:
                a8, sa = fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - report and go on
                lines.append(f"| {m} | {k} | | {name} | error {type(e).__name__}: {str(e)[:80]} | | | |")
                continue
            want = fast_layout.gemm_k_order(ref8) if kw.get("gemm_order") else ref8
            same = first_diff(a8.view(torch.uint8), want) if torch.equal(sa, ref_sa) else "sa differs"
            if same != "same":
                lines.append(f"| {m} | {k} | | {name} | - | - | - | {same} |")
                continue
            t = bench(fn)
            gbs = nbytes / t / 1e6
            lines.append(f"| {m} | {k} | | {name} | {t * 1e3:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f} | same |")
        print("\n".join(lines[-20:]), flush=True)
    lines += ["", "### NVFP4 pass (exact bf16 values): us / GB/s / % of copy", "",
              "| M | K | copy GB/s | block (m x k, warps) | us | GB/s | % copy | bytes |", "|---|---|---|---|---|---|---|---|"]
    for m, k in SHAPES if not args.defaults else ():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        x[1, 7] = float("nan")
        x[2, 16:32] = 0.0
        smooth = torch.rand(k, device="cuda") + 0.5
        nbytes = m * k * 4
        src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8)
        dst = torch.empty_like(src)
        t_copy = bench(lambda: dst.copy_(src))
        copy_gbs = nbytes / t_copy / 1e6
        ref = kernels.quantize_act(x, smooth)[0].view(torch.int16)
        for bm, bk, w in ((16, 256, 4), (32, 256, 4), (8, 256, 2), (16, 128, 2), (8, 512, 4), (16, 256, 8),
                          (8, 256, 4), (32, 128, 4)):
            name = f"{bm}x{bk} w{w}"
            try:
                xq = kernels.quantize_act(x, smooth, block_m=bm, block_k=bk, num_warps=w)[0].view(torch.int16)
            except Exception as e:  # noqa: BLE001
                lines.append(f"| {m} | {k} | | {name} | error {type(e).__name__} | | | |")
                continue
            same = first_diff(xq, ref)
            if same != "same":
                lines.append(f"| {m} | {k} | | {name} | - | - | - | {same} |")
                continue
            t = bench(lambda: kernels.quantize_act(x, smooth, block_m=bm, block_k=bk, num_warps=w))
            gbs = nbytes / t / 1e6
            lines.append(f"| {m} | {k} | {copy_gbs:.0f} | {name} | {t * 1e3:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f} | same |")
        print("\n".join(lines[-10:]), flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
