"""Build, check and time the sm90 fast mode (FP8 wgmma on the 4-bit weight) in one run (H100/H200).

    python benchmarks/bench_fast.py [--out DIR] [--shapes flux|quick] [--tiles]

Per shape (M, K, N), each path checked before it is timed:
- ``F.linear`` bf16 (cuBLAS, with bias): the baseline;
- ``torch._scaled_mm`` FP8 with per-token / per-channel scales (8-bit weights, no low-rank branch);
- the exact W4A4 linear (the module's forward, ``mode="exact"``);
- the fast GEMM alone (E4M3 activations and ``lora_act / sa`` ready; the low-rank MMA in its
  accumulator, ``* sa * cs + bias`` fused) at R = 32, and its low-rank-free form;
- the whole fast linear (the module's forward, ``mode="fast"``: ``lora_act``, quantize_act_fp8, the
  fast GEMM), and its quantization pass alone (with ``lora_act / sa``).
Then the accuracy of the FP8 accumulation at K = 3072 / 12288 / 15360 against the fast formula in
float64, and (``--tiles``) the GEMM per tile shape. Random data; ``do_bench`` medians (ms); ratios are
cuBLAS time / path time, from the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_conformance import random_w4a4  # noqa: E402

from _cuda import graphed  # noqa: E402

from svdq_linear import nvfp4  # noqa: E402
from svdq_linear.backends.sm90 import kernels, quack_fast  # noqa: E402

FLUX = [  # (label, M, K, N)
    ("fused qkv", 4096, 3072, 9216), ("single fused in", 4608, 3072, 21504),
    ("attn out", 4096, 3072, 3072), ("ff up", 4096, 3072, 12288), ("ff down", 4096, 12288, 3072),
    ("single out", 4608, 15360, 3072), ("attn txt", 512, 3072, 3072), ("ff down txt", 512, 12288, 3072),
    ("ref 4352x3840x15360", 4352, 3840, 15360), ("ref 4352x15360x3840", 4352, 15360, 3840),
    ("small M=64", 64, 3072, 3072), ("small M=7", 7, 3072, 3072), ("small M=1", 1, 3072, 3072),
]
QUICK = [FLUX[0], FLUX[4], FLUX[6], FLUX[10], FLUX[12]]


def bench(fn, rep=100) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def fast_reference(m, x) -> torch.Tensor:
    args = [t.cpu() if t is not None else None for t in (m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up,
                                                            m.wcscale, m.bias)]
    return nvfp4.w4a8_fast_linear(x.cpu(), *args, torch.float64)


def _gemm_operands(mod, x):
    """The fast GEMM's weight and low-rank operands as the backend prepares them (the low-rank MMA in
    the accumulator), and ``lora_act`` for the activation pass."""
    from svdq_linear.backends.sm90 import Sm90Backend, _mm_f32

    prep = Sm90Backend().prepare(mod, x.device)
    lora = _mm_f32(x, prep.proj_down_smoothed)
    _, sa, la = kernels.quantize_act_fp8(x, mod.smooth, lora=lora)
    return prep.quack, (prep.proj_up_bf16, la, prep.lowrank_segments), lora


def scaled_mm_fp8(x, w):
    """Per-token / per-channel FP8 ``torch._scaled_mm`` operands and call."""
    sa = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    sw = w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    a8 = (x.float() / sa).to(torch.float8_e4m3fn)
    w8 = (w.float() / sw).to(torch.float8_e4m3fn)
    return lambda: torch._scaled_mm(a8, w8.T, scale_a=sa, scale_b=sw.T, out_dtype=torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--shapes", choices=["flux", "quick"], default="flux")
    p.add_argument("--tiles", action="store_true")
    p.add_argument("--graphs", action="store_true", help="time every path as a CUDA graph replay (GPU time)")
    p.add_argument("--profile", action="store_true", help="cProfile the module's eager forward (host cost)")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    timer = (lambda fn: bench(graphed(fn))) if args.graphs else bench

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    dev = torch.device("cuda")
    if args.profile:
        import cProfile
        import io
        import pstats

        for mode in ("exact", "fast"):
            mod = random_w4a4(3072, 3072, 32, torch.bfloat16, dev).set_mode(mode)
            x = torch.randn(64, 3072, device=dev, dtype=torch.bfloat16)
            for _ in range(3):
                mod(x)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(50):
                mod(x)
            prof.disable()
            torch.cuda.synchronize()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
            print(f"## {mode}: {(time.perf_counter() - t0) / 50 * 1e6:.0f} us a call\n{out.getvalue()}")
        return
    log(f"# fast mode — {torch.cuda.get_device_name()} — {time.strftime('%Y-%m-%d %H:%M')}"
        f"{' — CUDA graph replays (GPU time)' if args.graphs else ' — eager launches'}")
    log("\nms (ratio = cuBLAS bf16 / path); fast GEMM: E4M3 activations and lora_act / sa ready; "
        "whole: the module's forward. check: relative error against the fast formula (float64).\n")
    log("| shape | M | K | N | cuBLAS bf16 | _scaled_mm fp8 | exact linear | fast GEMM R=32 | fast GEMM R=0 | "
        "fast whole R=32 | quant pass | check |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, m_tok, k, n in (QUICK if args.shapes == "quick" else FLUX):
        torch.manual_seed(0)
        mod = random_w4a4(k, n, 32, torch.bfloat16, dev)
        x = torch.randn(m_tok, k, device=dev, dtype=torch.bfloat16)
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        bias = mod.bias
        t_ref = timer(lambda: F.linear(x, w16, bias))
        t_smm = timer(scaled_mm_fp8(x, w16))
        mod.set_mode("exact")
        mod(x)
        t_exact = timer(lambda: mod(x))
        mod.set_mode("fast")
        y = mod(x)
        err = rel(y.cpu(), fast_reference(mod, x))
        fw, lr_acc, lora = _gemm_operands(mod, x)
        a8, sa = kernels.quantize_act_fp8(x, mod.smooth, gemm_order=True)
        t_gemm = timer(lambda: quack_fast.gemm(a8, sa, fw, lr_acc=lr_acc))
        t_gemm0 = timer(lambda: quack_fast.gemm(a8, sa, fw, None))
        t_whole = timer(lambda: mod(x))
        t_quant = timer(lambda: kernels.quantize_act_fp8(x, mod.smooth, lora=lora, gemm_order=True))

        def cell(t):
            return f"{t:.4f} ({t_ref / t:.2f}x)"

        log(f"| {label} | {m_tok} | {k} | {n} | {t_ref:.4f} | {cell(t_smm)} | {cell(t_exact)} | {cell(t_gemm)} | "
            f"{cell(t_gemm0)} | {cell(t_whole)} | {t_quant:.4f} | {err:.2e} |")
        del fw, a8, lr_acc
        torch.cuda.empty_cache()

    log("\n## FP8 accumulation: error of the fast linear against the fast formula in float64\n")
    log("| M | K | N | rel. error (norm) | max abs err / max |y| | bf16 output rounding alone |")
    log("|---|---|---|---|---|---|")
    for m_tok, k, n in [(512, 3072, 3072), (512, 12288, 3072), (512, 15360, 3072)]:
        torch.manual_seed(1)
        mod = random_w4a4(k, n, 32, torch.bfloat16, dev)
        mod.set_mode("fast")
        x = torch.randn(m_tok, k, device=dev, dtype=torch.bfloat16)
        y = mod(x).cpu().double()
        want = fast_reference(mod, x)
        log(f"| {m_tok} | {k} | {n} | {rel(y, want):.2e} | {((y - want).abs().max() / want.abs().max()).item():.2e} "
            f"| {rel(want.bfloat16(), want):.2e} |")

    if args.tiles:
        log("\n## fast GEMM (R=32) by tile (weight rows x tokens), ms\n")
        tiles = [(128, 256), (128, 192), (128, 128), (64, 256), (64, 128), (64, 64), (64, 32), (64, 16)]
        log("| M | K | N | " + " | ".join(f"{a}x{b}" for a, b in tiles) + " |")
        log("|---|---|---|" + "---|" * len(tiles))
        for m_tok, k, n in [(4096, 3072, 9216), (4608, 15360, 3072), (512, 3072, 3072), (64, 3072, 3072),
                            (1, 3072, 3072)]:
            torch.manual_seed(0)
            mod = random_w4a4(k, n, 32, torch.bfloat16, dev)
            x = torch.randn(m_tok, k, device=dev, dtype=torch.bfloat16)
            fw, lr_acc, _ = _gemm_operands(mod.set_mode("fast"), x)
            a8, sa = kernels.quantize_act_fp8(x, mod.smooth, gemm_order=True)
            cells = []
            for tile in tiles:
                if tile[1] > 2 * max(m_tok, 16) and tile[1] > 16:
                    cells.append("-")
                    continue
                try:
                    cells.append(f"{timer(lambda: quack_fast.gemm(a8, sa, fw, tile=tile, lr_acc=lr_acc)):.4f}")
                except Exception as e:  # a tile the kernel cannot build (registers, shared memory)
                    cells.append(f"fail: {type(e).__name__}")
            log(f"| {m_tok} | {k} | {n} | " + " | ".join(cells) + " |")

    (out_dir / "bench_fast.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
