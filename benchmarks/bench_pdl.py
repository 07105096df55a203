"""lora_act and the activation pass: one after the other against the PDL pair (kernels alone, us).

For each shape, same run: ``lora_act`` (Triton, the backend's plan) alone, each pass alone, the two one after the
other, and the PDL pair (``lora_act(pdl=True)`` then ``quantize_act_after_lora`` / ``quantize_act_fp8(lora_pdl=
True)``), timed as CUDA-graph replays and as eager loops (CUDA events over 50 calls: does the graph keep the
programmatic edges?). Each pair's outputs are checked against the plain launches' first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cuda import graphed  # noqa: E402

SHAPES = [  # (label, M, K, R)
    ("fused qkv", 4096, 3072, 96), ("attn out", 4096, 3072, 32), ("ff down", 4096, 12288, 32),
    ("single fused in", 4608, 3072, 128), ("single out", 4608, 15360, 32), ("attn txt", 512, 3072, 32),
]


def eager_us(fn, n=50) -> float:
    for _ in range(5):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out/bench_pdl.md")
    args = p.parse_args()
    from svdq_linear.backends.sm90 import kernels, tuning

    lines: list[str] = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    log(f"# lora_act and the pass, plain against PDL — {torch.cuda.get_device_name()} — "
        f"{time.strftime('%Y-%m-%d %H:%M')}\n")
    log("us; graph = CUDA-graph replays (median), eager = 50 calls between CUDA events\n")
    log("| shape | M | K | R | lora_act | exact pass | exact: serial | exact: PDL | gain | FP8 pass | FP8: serial | "
        "FP8: PDL | gain | eager exact serial / PDL | eager FP8 serial / PDL |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, m, k, r in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(m + k + r)
        x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16) * 3
        smooth = torch.rand(k, device="cuda", generator=g) + 0.5
        inv = 1.0 / smooth
        pds = (torch.randn(k, r, device="cuda", generator=g) / k**0.5).bfloat16()
        plan = tuning.lora_act_plan(m, k, r)
        kw = dict(block_m=plan.block_m, split=plan.split, num_warps=plan.num_warps, num_stages=plan.num_stages)

        def lora(pdl=False):
            return kernels.lora_act(x, pds, torch.float32, pdl=pdl, **kw)

        def ex_serial():
            return lora(), kernels.quantize_act(x, smooth)[0]

        def ex_pdl():
            return kernels.quantize_act_after_lora(x, smooth, lora(True))

        def f8_serial():
            return kernels.quantize_act_fp8(x, smooth, lora=lora(), inv_smooth=inv, gemm_order=True)

        def f8_pdl():
            return kernels.quantize_act_fp8(x, smooth, lora=lora(True), inv_smooth=inv, gemm_order=True, lora_pdl=True)

        part, xq0 = ex_serial()
        la0 = part.sum(0) if part.dim() == 3 else part  # (another fp32 order: compared within a bound)
        xq1, la1 = ex_pdl()
        f0, f1 = f8_serial(), f8_pdl()
        torch.cuda.synchronize()
        assert torch.equal(xq0, xq1), label
        assert ((la1.float() - la0).abs() <= la0.abs() * 2.0**-7 + 1e-3).all(), label
        for a, b in zip(f0, f1):
            assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                               if b.dtype.itemsize == 1 else b), label
        t = {}
        for name, fn in (("lora", lora), ("ex_pass", lambda: kernels.quantize_act(x, smooth)),
                         ("ex_serial", ex_serial), ("ex_pdl", ex_pdl),
                         ("f8_pass", lambda: kernels.quantize_act_fp8(x, smooth, inv_smooth=inv, gemm_order=True)),
                         ("f8_serial", f8_serial), ("f8_pdl", f8_pdl)):
            t[name] = do_bench(graphed(fn), warmup=10, rep=100, return_mode="median") * 1e3
        e = {name: eager_us(fn) for name, fn in (("ex_serial", ex_serial), ("ex_pdl", ex_pdl),
                                                  ("f8_serial", f8_serial), ("f8_pdl", f8_pdl))}
        log(f"| {label} | {m} | {k} | {r} | {t['lora']:.1f} | {t['ex_pass']:.1f} | {t['ex_serial']:.1f} | "
            f"{t['ex_pdl']:.1f} | {t['ex_serial'] / t['ex_pdl']:.2f}x | {t['f8_pass']:.1f} | {t['f8_serial']:.1f} | "
            f"{t['f8_pdl']:.1f} | {t['f8_serial'] / t['f8_pdl']:.2f}x | {e['ex_serial']:.1f} / {e['ex_pdl']:.1f} | "
            f"{e['f8_serial']:.1f} / {e['f8_pdl']:.1f} |")
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
