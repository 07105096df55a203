"""Host (CPU) time of one linear call on the GPU: what a forward that is not captured in a CUDA graph
pays per layer, eager and ``torch.compile``d, against ``F.linear`` bf16 measured in the same run.

    python benchmarks/host_overhead.py [--out FILE] [--profile]

Host time of a call = wall time from entering the call to its return, with the GPU idle before it
(the launches are asynchronous: the call returns once its kernels are queued). The median of 50
calls, each after a synchronize. ``--profile`` adds cProfile's top functions (by own time) of the eager
fast-mode call, the compiled call and the GPU kernels' launches.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _cuda import host_profile  # noqa: E402
from test_conformance import random_w4a4  # noqa: E402

CALLS = 50


def host_us(fn, calls: int = CALLS) -> float:
    """Median host microseconds of one call of ``fn`` issued onto an idle GPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6


class Wrap(nn.Module):
    """One layer as a compiled region sees it (a block of one linear)."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x)


def profile_text(fn, calls: int = 20, top: int = 22) -> str:
    return host_profile(fn, calls=calls, top=top, warmup=3)[0]


@torch.library.custom_op("svdq_bench::noop_linear", mutates_args=())
def _noop_linear(x: torch.Tensor, qweight: torch.Tensor, wscales: torch.Tensor, smooth: torch.Tensor,
                 proj_down: torch.Tensor, proj_up: torch.Tensor, wcscale: torch.Tensor, bias: torch.Tensor | None,
                 extra: list[torch.Tensor], backend: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], wcscale.shape[0])


def breakdown(dev, shapes) -> list[str]:
    """Host us of each layer of the fast-mode call, outermost first (each row includes the rows below)."""
    from svdq_linear import backends

    rows = ["", "### Host time of the pieces of one fast-mode call (us, median of 50)", "",
            "| M x K x N | module forward | resolve (dispatch) | custom op | run_w4a4_fast | quantize_act_fp8 | "
            "lora_act | quack GEMM (warm launch) | quack GEMM (frontend each call) | a no-op custom op, same schema |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for m, k, n in shapes:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        lin = random_w4a4(k, n, 32, torch.bfloat16, dev).set_mode("fast")
        lin(x)
        be, prep = backends.resolve(lin, x)
        extra = be.extra_tensors(prep)
        t = lin._parameters
        args = (x, t["qweight"], t["wscales"], t["smooth"], t["proj_down"], t["proj_up"], t["wcscale"], t["bias"], extra)
        cells = [host_us(lambda: lin(x)), host_us(lambda: backends.resolve(lin, x)),
                 host_us(lambda: backends.w4a4_fast_linear(*args, be.name)),
                 host_us(lambda: be.run_w4a4_fast(*args))]
        if len(extra) == 8 and m > 64:  # the accumulator path: time its three launches alone
            from svdq_linear.backends.sm90 import quack_fast

            inv, ex = extra[-1], extra[:-1]
            fw = quack_fast.weight(ex[-4:])  # the prepared object, with its warm launch cache
            pds, up, seg = ex[:3]
            la = be._lora_act(x, pds)
            a8, sa, la2 = be.kernels.quantize_act_fp8(x, t["smooth"], lora=la, inv_smooth=inv, gemm_order=True)
            cells += [host_us(lambda: be.kernels.quantize_act_fp8(x, t["smooth"], lora=la, inv_smooth=inv,
                                                                  gemm_order=True)),
                      host_us(lambda: be._lora_act(x, pds)),
                      host_us(lambda: quack_fast.gemm(a8, sa, fw, out_dtype=torch.bfloat16, lr_acc=(up, la2, seg)))]
            os.environ["SVDQ_SM90_QUACK_WARM"] = "0"  # the same launch through quack's frontend every call
            cells.append(host_us(lambda: quack_fast.gemm(a8, sa, fw, out_dtype=torch.bfloat16, lr_acc=(up, la2, seg))))
            del os.environ["SVDQ_SM90_QUACK_WARM"]
        else:
            cells += [float("nan")] * 4
        cells.append(host_us(lambda: _noop_linear(*args, be.name)))
        rows.append(f"| {m}x{k}x{n} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    return rows


def triton_launch(dev) -> list[str]:
    """Host us of one Triton launch three ways, for the fast mode's two Triton kernels at 16 tokens:
    the library call (allocations and argument checks included), the bare ``kernel[grid](...)`` (Triton's
    JIT: argument binding, specialization key, cache lookup) and the compiled kernel launched directly
    (``CompiledKernel[grid](...)``, what a launch cache keyed by our own arguments would call)."""
    from svdq_linear.backends.sm90 import kernels, tuning

    m, k, r = 16, 3072, 32
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    pds = torch.randn(k, r, device=dev, dtype=torch.bfloat16)
    smooth = torch.rand(k, device=dev) + 0.5
    inv = 1.0 / smooth
    bm, split, w, st = tuning.LORA_ACT_CONFIG
    part = kernels.lora_act(x, pds, block_m=bm, split=split, num_warps=w, num_stages=st)
    a8, sa, la = kernels.quantize_act_fp8(x, smooth, lora=part, inv_smooth=inv, gemm_order=True)
    rows_, c, nch, warps = kernels.fp8_rows_config(k)
    k_split = -(-(-(-k // split)) // 128) * 128
    lora_args = (x, pds, part, m, k, r, x.stride(0), k_split, pds, k, 0)  # one source: xb unused, KA = K
    lora_cx = dict(BLOCK_M=bm, BLOCK_K=128, BLOCK_R=32, NUM_STAGES=st, DOT_F32=False, HAS_B=False, GELU_B=False,
                   RNE_BITS=False)
    pass_args = (x, x, inv, a8, sa, part, la, m, 0, k, r, 0, x.stride(0))  # one source: the row is xb = x
    pass_cx = dict(ROWS=rows_, CA=16, NA=0, CB=c, NB=nch, BLOCK_R=32, HAS_LORA=True, GELU_B=False, HW_CVT=True,
                   CANON_NAN=True, GEMM_ORDER=True, NSPLIT=split, RNE_BITS=False)
    grid_l, grid_p = (-(-m // bm), split), (-(-m // rows_),)
    ck_l = kernels._lora_act_kernel[grid_l](*lora_args, **lora_cx, num_warps=w)
    ck_p = kernels._quantize_act_fp8_rows_kernel[grid_p](*pass_args, **pass_cx, num_warps=warps)
    full_l = lambda: kernels.lora_act(x, pds, block_m=bm, split=split, num_warps=w, num_stages=st)  # noqa: E731
    full_p = lambda: kernels.quantize_act_fp8(x, smooth, lora=part, inv_smooth=inv, gemm_order=True)  # noqa: E731
    jit_l = lambda: kernels._lora_act_kernel[grid_l](*lora_args, **lora_cx, num_warps=w)  # noqa: E731
    jit_p = lambda: kernels._quantize_act_fp8_rows_kernel[grid_p](*pass_args, **pass_cx, num_warps=warps)  # noqa: E731
    rows = ["", "### Host time of one Triton launch (us, median of 50; 16 tokens, K = 3072, R = 32)", "",
            "| kernel | library call | kernel[grid](...) (JIT) | compiled kernel, all args | "
            "compiled kernel, runtime args only |", "|---|---|---|---|---|"]
    for name, full, jit, ck, args, cx, grid in (("lora_act", full_l, jit_l, ck_l, lora_args, lora_cx, grid_l),
                                               ("quantize_act_fp8 (one pass)", full_p, jit_p, ck_p, pass_args, pass_cx,
                                                grid_p)):
        g3 = tuple(grid) + (1,) * (3 - len(grid))
        cells = [host_us(full), host_us(jit)]
        for variant in (tuple(args) + tuple(cx.values()), tuple(args)):
            try:
                ck[g3](*variant)
                torch.cuda.synchronize()
                cells.append(host_us(lambda v=variant: ck[g3](*v)))
            except Exception as e:  # noqa: BLE001 - which argument list this Triton's launcher takes
                cells.append(type(e).__name__)
        rows.append(f"| {name} | {cells[0]:.0f} | {cells[1]:.0f} | " + " | ".join(
            c if isinstance(c, str) else f"{c:.0f}" for c in cells[2:]) + " |")
    return rows


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out/host_overhead.md")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--shapes", default="4096x3072x9216,4096x3072x3072,512x3072x3072,1x3072x3072")
    p.add_argument("--breakdown", action="store_true",
                   help="also the host time of each piece of the fast-mode call (dispatch, op, kernels' launches)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (reference backend)")
    p.add_argument("--triton-launch", action="store_true",
                   help="only the host time of one Triton launch: library call, JIT launch, compiled kernel launched directly")
    args = p.parse_args()
    import svdq_linear  # noqa: F401

    dev = torch.device(args.device)
    if dev.type != "cuda":
        torch.cuda.synchronize = lambda: None  # a smoke run: no GPU to wait for
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    lines = [f"# Host time of one linear call — {name}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}", "",
             "us of host time a call (median of 50, GPU idle before each); eager under torch.no_grad (as "
             "diffusers runs) and torch.inference_mode; compiled = the layer in a torch.compile(fullgraph=True) "
             "region, under no_grad; ratio = ours / F.linear bf16 in the same setting", "",
             "| M x K x N | variant | eager no_grad | eager inference_mode | compiled | compiled / F.linear |",
             "|---|---|---|---|---|---|"]
    profiles = []
    if args.triton_launch:
        lines = triton_launch(dev)
        print("\n".join(lines), flush=True)
        args.shapes, args.breakdown = "", False
    for shape in filter(None, args.shapes.split(",")):
        m, k, n = (int(v) for v in shape.split("x"))
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = {}
        for variant in ("bf16", "exact", "fast"):
            if variant == "bf16":
                lin = nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
            else:
                lin = random_w4a4(k, n, 32, torch.bfloat16, dev).set_mode(variant)
            lin(x)
            eager = host_us(lambda: lin(x))
            with torch.inference_mode():
                eager_im = host_us(lambda: lin(x))
            comp = torch.compile(Wrap(lin), fullgraph=True)
            comp(x)
            compiled = host_us(lambda: comp(x))
            ref.setdefault("c", compiled)
            lines.append(f"| {shape} | {variant} | {eager:.0f} | {eager_im:.0f} | {compiled:.0f} | "
                         f"{compiled / ref['c']:.1f}x |")
            print(lines[-1], flush=True)
            if args.profile and variant == "fast" and shape == args.shapes.split(",")[0]:
                profiles += [f"\n## cProfile, eager {variant} {shape}, 20 calls\n", "```",
                             profile_text(lambda: lin(x)), "```",
                             f"\n## cProfile, compiled {variant} {shape}, 20 calls\n", "```",
                             profile_text(lambda: comp(x)), "```"]
            torch._dynamo.reset()
    if args.breakdown:
        lines += breakdown(dev, [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")])
        print("\n".join(lines[-12:]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines + profiles) + "\n")
    print("\n".join(profiles))


if __name__ == "__main__":
    main()
