"""Build, check and time the sm90 backend against cuBLAS bf16 in one run (H100/H200).

    python benchmarks/bench_sm90.py [--sweep] [--out DIR] [--shapes flux|all] [--quack]

1. device-to-device copy bandwidth (the ceiling of ``quantize_act``) and ``quantize_act`` GB/s;
2. ``--sweep``: each candidate GEMM configuration per token bucket on two weight shapes; the fastest
   is written to ``DIR/configs.json`` (copy it to ``svdq_linear/backends/sm90/configs.json``);
3. per shape (M, K, N): ``F.linear`` bf16 (cuBLAS, with bias), the W4 GEMM alone with its fused
   epilogue at R = 0 / 32 / 128 (activations quantized beforehand), the whole linear (quantization +
   GEMM, the module's forward) at R = 32, each checked against the contract before it is timed;
   ``--quack`` adds quack-kernels' bare ``gemm_w4a16`` (nvfp4) for the same shapes.
Random data, ``triton.testing.do_bench`` medians (ms); baselines from the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_conformance import random_w4a4  # noqa: E402

from svdq_linear import NVFP4W4A16Linear, nvfp4  # noqa: E402
from svdq_linear.backends.sm90 import kernels, tuning  # noqa: E402

FLUX = [  # (label, M, K, N)
    ("attn qkv/out img+txt", 4096, 3072, 3072), ("attn txt", 512, 3072, 3072),
    ("ff up", 4096, 3072, 12288), ("ff down", 4096, 12288, 3072),
    ("ff up txt", 512, 3072, 12288), ("ff down txt", 512, 12288, 3072),
    ("single qkv", 4608, 3072, 3072), ("single mlp", 4608, 3072, 12288), ("single out", 4608, 15360, 3072),
    ("fused qkv", 4096, 3072, 9216), ("single fused in", 4608, 3072, 21504),
    ("ref 4352x3840x3072", 4352, 3840, 3072), ("ref 4352x3840x15360", 4352, 3840, 15360),
    ("ref 4352x15360x3840", 4352, 15360, 3840), ("ref 4352x10240x3072", 4352, 10240, 3072),
    ("small M=64", 64, 3072, 3072), ("small M=7", 7, 3072, 3072), ("small M=1", 1, 3072, 3072),
]
ADALN = [("adaLN b1", 1, 3072, 18432), ("adaLN b4", 4, 3072, 9216)]


def bench(fn, rep=100) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def tflops(m, k, n, ms):
    return 2 * m * k * n / ms / 1e9


def candidates(m: int) -> list[tuning.GemmConfig]:
    G = tuning.GemmConfig
    if m <= 64:
        out = []
        for bn, bk, w, st in [(64, 256, 4, 4), (128, 128, 4, 4), (64, 128, 4, 5), (64, 512, 4, 3), (128, 256, 8, 3)]:
            out.append(G(bn, 16, bk, split_k=0, num_warps=w, num_stages=st))
        return out
    if m <= 512:
        return [G(128, 64, 128, num_warps=4, num_stages=4), G(64, 64, 128, num_warps=4, num_stages=4),
                G(128, 128, 64, num_warps=8, num_stages=4), G(128, 64, 64, split_k=0, num_warps=4, num_stages=5),
                G(128, 128, 128, num_warps=8, num_stages=3)]
    return [G(128, 128, 64, num_warps=8, num_stages=4), G(128, 256, 64, num_warps=8, num_stages=3),
            G(256, 128, 64, num_warps=8, num_stages=3), G(128, 128, 128, num_warps=8, num_stages=3),
            G(128, 256, 64, num_warps=8, num_stages=4), G(128, 128, 64, num_warps=4, num_stages=4)]


def _resolve(cfg, m, n, k):
    return replace(cfg, block_m=max(16, min(cfg.block_m, 1 << (max(m, 1) - 1).bit_length())),
                   split_k=tuning.split_for(cfg, m, n, k) if cfg.split_k == 0 else cfg.split_k)


def check(y, m, x, what):
    args = (m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale)
    want = nvfp4.w4a4_linear(x, *args, m.bias, accum_dtype=torch.float64)
    bound = nvfp4.tolerance(x, *args, m.bias, x.dtype)
    excess = ((y.double() - want).abs() / bound).max().item()
    if not excess <= 1.0:
        raise AssertionError(f"{what}: error {excess:.3g}x the contract tolerance")


def sweep(out_dir: Path, log) -> None:
    table = {}
    for bucket, shapes in [(1, [(1, 3072, 3072), (1, 3072, 18432)]), (16, [(7, 3072, 3072), (4, 3072, 9216)]),
                           (64, [(64, 3072, 3072), (64, 3072, 12288)]), (512, [(512, 3072, 3072), (512, 12288, 3072)]),
                           (4096, [(4096, 3072, 3072), (4096, 3072, 12288)])]:
        best = None
        for cfg in candidates(bucket):
            total = 0.0
            for m, k, n in shapes:
                w = random_w4a4(k, n, 32, torch.bfloat16, "cuda")
                xq = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                lora = xq @ w.proj_down
                c = _resolve(cfg, m, n, k)
                try:
                    fn = lambda: kernels.w4_gemm(xq, w.qweight, w.wscales, w.wcscale, w.bias, w.proj_up, lora,  # noqa: E731
                                                 torch.bfloat16, c)
                    fn()
                    total += bench(fn, rep=50)
                except Exception as e:  # a config that does not compile (shared memory, registers)
                    log(f"  sweep M<={bucket} {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    total = float("inf")
                    break
            log(f"  sweep M<={bucket} {cfg.as_dict()}: {total * 1e3:.1f} us")
            if best is None or total < best[0]:
                best = (total, cfg)
        table[bucket] = best[1].as_dict()
    for b in tuning.M_BUCKETS:  # buckets not swept take the next swept one up
        if b not in table:
            table[b] = table[min(s for s in table if s >= b)] if any(s >= b for s in table) else table[4096]
    (out_dir / "configs.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
         "configs": {str(b): table[b] for b in sorted(table)}}, indent=1))
    tuning._table.cache_clear()
    tuning._TABLE = out_dir / "configs.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--quack", action="store_true")
    p.add_argument("--quant-only", action="store_true", help="only the copy and quantize_act tables")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    torch.manual_seed(0)
    log(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")

    # 1. copy bandwidth and quantize_act
    src = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() * 2 / t / 1e6
    log(f"copy: {copy_bw:.0f} GB/s (read + write, 512 MiB each way)")
    del src, dst
    log("")
    log("| quantize_act M x K (tile) | ms | GB/s | of 1 GiB copy | same-size copy ms | of same-size copy |")
    log("|---|---|---|---|---|---|")
    for m, k, r in [(4096, 3072, 32), (4608, 3072, 128), (4096, 12288, 32), (4608, 15360, 32), (8192, 3072, 32)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        sm = torch.rand(k, device="cuda") + 0.5
        pd = torch.randn(k, r, device="cuda", dtype=torch.bfloat16)
        xc = torch.empty_like(x)
        t_copy = bench(lambda: xc.copy_(x))  # the same bytes read and written: launch and tail included
        for bm, bk, nw in [(32, 256, 4), (16, 512, 4), (64, 128, 4)]:
            t = bench(lambda: kernels.quantize_act(x, sm, block_m=bm, block_k=bk, num_warps=nw))
            gbs = m * k * 4 / t / 1e6
            log(f"| {m} x {k} ({bm}x{bk}) | {t:.4f} | {gbs:.0f} | {gbs / copy_bw:.0%} | {t_copy:.4f} | "
                f"{t_copy / t:.0%} |")
    if args.quant_only:
        (out_dir / "bench_sm90.md").write_text("\n".join(lines) + "\n")
        return

    if args.sweep:
        log("")
        sweep(out_dir, log)

    # 3. the linear
    log("")
    log("| layer | M | K | N | cuBLAS bf16 ms | W4 GEMM R=0 | R=32 | R=128 | R=32 / R=0 | GEMM R=32 vs bf16 | "
        "linear R=32 ms | linear vs bf16 | config |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, m, k, n in FLUX:
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t_ref = bench(lambda: F.linear(x, lin.weight, lin.bias))
        times = {}
        cfg = tuning.pick(m, n, k)
        for r in (0, 32, 128):
            w = random_w4a4(k, n, r, torch.bfloat16, "cuda")
            xq, _, _ = kernels.quantize_act(x, w.smooth)
            lora = (x @ (w.proj_down.float() / w.smooth[:, None]).to(x.dtype)) if r else None
            fn = lambda: kernels.w4_gemm(xq, w.qweight, w.wscales, w.wcscale, w.bias, w.proj_up if r else None,  # noqa: E731
                                         lora, torch.bfloat16, cfg)
            if m * k * n <= 4096 * 3072 * 3072 and r == 32:
                check(fn(), w, x, f"{label} R={r}")
            times[r] = bench(fn)
            if r == 32:
                t_lin = bench(lambda: w(x))
        log(f"| {label} | {m} | {k} | {n} | {t_ref:.4f} | {times[0]:.4f} | {times[32]:.4f} | {times[128]:.4f} | "
            f"{times[32] / times[0]:.3f} | {t_ref / times[32]:.2f}x | {t_lin:.4f} | {t_ref / t_lin:.2f}x | "
            f"{cfg.block_n}x{cfg.block_m}x{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages} |")
    log("")
    log("| adaLN (W4A16) | M | K | N | cuBLAS bf16 ms | W4A16 ms | vs bf16 | weight GB/s |")
    log("|---|---|---|---|---|---|---|---|")
    for label, m, k, n in ADALN:
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        q = NVFP4W4A16Linear.from_linear(lin)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t_ref = bench(lambda: F.linear(x, lin.weight, lin.bias))
        t_q = bench(lambda: q(x))
        gbs = (n * k // 2 + n * k // 16) / t_q / 1e6
        log(f"| {label} | {m} | {k} | {n} | {t_ref:.4f} | {t_q:.4f} | {t_ref / t_q:.2f}x | {gbs:.0f} |")

    if args.quack:
        log("")
        try:
            from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight

            log("| quack gemm_w4a16 nvfp4 (bare) | M | K | N | cuBLAS bf16 ms | quack ms | vs bf16 | ours R=0 ms |")
            log("|---|---|---|---|---|---|---|---|")
            for label, m, k, n in FLUX:
                lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = random_w4a4(k, n, 0, torch.bfloat16, "cuda")
                blob, sf = prepare_w4_weight(w.qweight, w.wscales, "nvfp4")
                t_ref = bench(lambda: F.linear(x, lin.weight, lin.bias))
                t_q = bench(lambda: gemm_w4a16(x, blob, sf, wformat="nvfp4"))
                cfg = tuning.pick(m, n, k)
                t_o = bench(lambda: kernels.w4_gemm(x, w.qweight, w.wscales, w.wcscale, w.bias, None, None,
                                                    torch.bfloat16, cfg))
                log(f"| {label} | {m} | {k} | {n} | {t_ref:.4f} | {t_q:.4f} | {t_ref / t_q:.2f}x | {t_o:.4f} |")
        except Exception as e:
            log(f"quack comparison failed: {type(e).__name__}: {e}")
    (out_dir / "bench_sm90.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
