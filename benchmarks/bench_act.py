"""Build, check and time the activation passes against a device copy of the same bytes (H100/H200).

    python benchmarks/bench_act.py [--out FILE] [--defaults]
    python benchmarks/bench_act.py --exact-lora [--baseline OLD/kernels.py] [--out FILE]   # Triton and torch only

``--exact-lora``: the exact mode's pass and ``lora_act`` in one read of x (``kernels.quantize_act_lora``)
over its blocks and splits at the fused q/k/v shape, then its best configs at every shape and the config
``SVDQ_SM90_EXACT_LORA=one`` runs (``tuning.exact_lora_plan``), against the backend's two launches (the
pass, then cuBLAS ``x @ pds``) in the same run. Each config's ``xq``
must be the pass's bytes and its ``lora_act`` within half a bf16 ulp (plus fp32 summation) of the
float64 product before it is timed.

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
from _baseline import load_beside  # noqa: E402
from _cuda import graphed  # noqa: E402
from _table import emit  # noqa: E402

from svdq_linear.backends.sm90 import fast_layout, kernels, tuning  # noqa: E402

SHAPES = [(4096, 3072), (4608, 3072), (4352, 3840), (4096, 12288), (4608, 15360), (512, 3072)]


def bench(fn) -> float:
    return do_bench(graphed(fn), warmup=10, rep=100, return_mode="median")


def first_diff(a, b) -> str:
    d = (a != b).nonzero()
    return f"{d.shape[0]} differ, first at {tuple(d[0].tolist())}" if d.numel() else "same"


def xq_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    """``first_diff`` of two 16-bit float tensors' bits, any NaN equal to any NaN (a NaN block's payload is the
    GPU's canonical NaN in one kernel and a NaN constant in another: the contract leaves it open)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return first_diff(nan, b.isnan()) + " (NaN places)"
    return first_diff(a.masked_fill(nan, 0).view(torch.int16), b.masked_fill(nan, 0).view(torch.int16))


LORA_SHAPES = [  # (M, K, R'): R' the prepared proj_down's columns (fused q/k/v: 3 x 32; single fused in: 4 x 32)
    (4096, 3072, 96), (4096, 3072, 32), (4608, 3072, 128), (4352, 3840, 32), (4096, 12288, 32), (4608, 15360, 32),
    (512, 3072, 32), (1024, 3072, 96)]


def lora_close(got: torch.Tensor, x: torch.Tensor, pds: torch.Tensor) -> bool:
    """``got`` (bf16) within half a bf16 ulp of ``x.bf16 @ pds`` (float64) plus an fp32 summation's error."""
    xd, pd = x.bfloat16().double(), pds.double()
    want = xd @ pd
    return bool(((got.double() - want).abs() <= want.abs() * 2.0**-8 + (xd.abs() @ pd.abs()) * 2.0**-20).all())


def load_baseline(path: str):
    """An older ``kernels.py`` (``--baseline``) loaded beside the current one, as a module of the same package."""
    return load_beside(path, "svdq_linear.backends.sm90", "_baseline_kernels")


def exact_lora(lines: list[str], base=None) -> None:
    """``kernels.quantize_act_lora`` against the pass plus cuBLAS ``lora_act``, same run (see the module doc);
    ``base``: an older kernels module (``--baseline``), whose pass and one read are timed beside."""
    # t-1 / t-2 (H100): 64 x 64 blocks, 2-3 stages best; the sweep runs with inv_smooth (the cheaper loop)
    configs = [(bm, bk, w, s, st) for bm, bk, w in ((64, 64, 8), (64, 64, 4), (64, 128, 8), (128, 64, 8), (128, 32, 8),
                                                   (32, 64, 4)) for s in (2, 4, 8) for st in (1, 2, 3)]
    lines += ["### The exact pass with lora_act in one read of x (us; GB/s: x read once, xq written once)", "",
              "'base': the kernels of " + (getattr(base, "__file__", "") or "-") + "; 'inv': `inv_smooth` given "
              "(no division a column). Two launches: the pass (inv) then cuBLAS `x @ pds`.", "",
              "| M | K | R | copy GB/s | pass base / now / inv | cuBLAS lora_act | two launches | one read base | "
              "one read now | one read inv: best (bm x bk, warps, split, stages) | % copy | gain over two | "
              "second / third | as `=one` runs it (inv) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    best_first: list = []
    for i, (m, k, r) in enumerate(LORA_SHAPES):
        torch.manual_seed(i)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        x[1, 7] = float("nan")
        x[2, 16:32] = 0.0
        x[3, 0:16] = -0.0
        smooth = torch.rand(k, device="cuda") + 0.5
        inv = (1.0 / smooth).contiguous()
        pds = (torch.randn(k, r, device="cuda") / 20).bfloat16()
        nbytes = m * k * 4
        src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8)
        dst = torch.empty_like(src)
        copy_gbs = nbytes / bench(lambda: dst.copy_(src)) / 1e6
        ref = kernels.quantize_act(x, smooth)[0]
        passes = {"now": lambda: kernels.quantize_act(x, smooth),
                  "inv": lambda: kernels.quantize_act(x, smooth, inv_smooth=inv)}
        if base is not None:
            passes["base"] = lambda: base.quantize_act(x, smooth)
        t_pass = {}
        for name, fn in passes.items():
            same = xq_diff(fn()[0], ref)
            t_pass[name] = f"{bench(fn) * 1e3:.1f}" if same == "same" else f"xq {same}"
        t_lora = bench(lambda: x @ pds)
        t_two = bench(lambda: (x @ pds, kernels.quantize_act(x, smooth, inv_smooth=inv)))

        def one_read(mod, cfg, use_inv):
            bm, bk, w, sp, st = cfg
            kw = {"inv_smooth": inv} if use_inv else {}
            fn = lambda: mod.quantize_act_lora(x, smooth, pds, block_m=bm, block_k=bk, split=sp,  # noqa: E731
                                               num_warps=w, num_stages=st, **kw)
            try:
                xq, lora = fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - report and go on
                return f"error {type(e).__name__}"
            same = xq_diff(xq, ref)
            rows = torch.tensor([0] + list(range(2, m)), device=x.device)  # row 1 holds a NaN: NaN either way
            ok = lora_close(lora[rows], x[rows], pds) and bool(lora[1].isnan().all())
            if same != "same" or not ok:
                return f"xq {same}, lora_act {'close' if ok else 'NOT close'}"
            return bench(fn)

        plan = tuning.exact_lora_plan(m, k, r, "one", tuning.sm_count(x.device))
        planned = (plan.block_m, plan.block_k, plan.num_warps, plan.split, plan.num_stages) if plan else None
        timed, bad = [], []
        for cfg in dict.fromkeys((configs if i == 0 else best_first) + ([planned] if planned else [])):
            t = one_read(kernels, cfg, True)
            (timed if isinstance(t, float) else bad).append((t, cfg))
        for t, (bm, bk, w, sp, st) in bad:
            lines.append(f"| {m} | {k} | {r} | | | | | | | {bm}x{bk} w{w} s{sp} st{st}: {t} | | | | |")
        t_plan = next((t for t, c in timed if c == planned), None)
        timed = sorted(timed)
        if not timed:
            lines.append(f"| {m} | {k} | {r} | no config ran |")
            continue
        if i == 0:
            best_first = [c for _, c in timed[:6]]
            lines.append("")
            lines.append("All configs at the first shape, inv (us): " + ", ".join(
                f"{bm}x{bk} w{w} s{sp} st{st} {t * 1e3:.1f}" for t, (bm, bk, w, sp, st) in timed))
            lines.append("")
        t, cfg = timed[0]
        now = one_read(kernels, cfg, False)
        old = one_read(base, cfg, False) if base is not None else "-"
        fmt = lambda v: f"{v * 1e3:.1f}" if isinstance(v, float) else v  # noqa: E731
        gbs = nbytes / t / 1e6
        rest = " / ".join(f"{tt * 1e3:.1f} ({c[0]}x{c[1]} w{c[2]} s{c[3]} st{c[4]})" for tt, c in timed[1:3])
        lines.append(f"| {m} | {k} | {r} | {copy_gbs:.0f} | {t_pass.get('base', '-')} / {t_pass['now']} / "
                     f"{t_pass['inv']} | {t_lora * 1e3:.1f} | {t_two * 1e3:.1f} | {fmt(old)} | {fmt(now)} | "
                     f"**{t * 1e3:.1f}** ({cfg[0]}x{cfg[1]}, w{cfg[2]}, s{cfg[3]}, st{cfg[4]}) | "
                     f"{100 * gbs / copy_gbs:.0f} | {t_two / t:.2f}x | {rest} | "
                     + (f"{t_plan * 1e3:.1f} ({t_two / t_plan:.2f}x) |" if t_plan else "- |"))
        print("\n".join(lines[-3:]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--defaults", action="store_true",
                    help="FP8 pass: only the two-pass reference and the default block in both k orders; no NVFP4 sweep")
    ap.add_argument("--exact-lora", action="store_true",
                    help="only the exact pass with lora_act in one read of x against the two launches")
    ap.add_argument("--baseline", default=None,
                    help="with --exact-lora: an older kernels.py, its pass and one read timed beside (same run)")
    args = ap.parse_args()
    torch.manual_seed(0)
    lines = [f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}", ""]
    if args.exact_lora:
        exact_lora(lines, load_baseline(args.baseline) if args.baseline else None)
        emit(lines, args.out)
        return
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
    emit(lines, args.out)


if __name__ == "__main__":
    main()
