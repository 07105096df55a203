"""Where an exact whole linear's time goes, two launches against the one read (H100/H200), same run:

    python benchmarks/bench_exact_parts.py [--out FILE] [--shapes "single out,fused qkv"]

For each layer (``bench_lowrank``'s whole-linear rows, rank 32): the module's forward with the default two
launches and with ``SVDQ_SM90_EXACT_LORA=one``, then each part on the module's own prepared tensors: the pass,
cuBLAS ``lora_act``, the two of them, the one read at the plan the module takes, and the GEMM that follows
(quack's, with the low-rank MMA in its accumulator) on the one read's outputs. The forward less the sum of
its parts is the time between them (or, negative, what the parts timed alone cost more). The forwards are
timed again last. CUDA-graph replays, ``do_bench`` medians, us.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cuda import graphed  # noqa: E402
from _table import emit  # noqa: E402
from bench_lowrank import FLUX, whole_module  # noqa: E402

from svdq_linear import backends  # noqa: E402
from svdq_linear.backends import sm90  # noqa: E402
from svdq_linear.backends.sm90 import kernels, tuning  # noqa: E402


def us(fn) -> float:
    return do_bench(graphed(fn), warmup=10, rep=100, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="single out,fused qkv,ff down")
    args = ap.parse_args()
    want = [s.strip() for s in args.shapes.split(",")]
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| shape | forward two | forward one | pass | cuBLAS lora_act | pass + lora_act | one read (plan) | "
             "GEMM | two: forward - parts | one: forward - parts | forwards again, last: two / one |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    dev = torch.device("cuda")
    with torch.no_grad():
        for label, m, k, n in [s for s in FLUX if s[0] in want]:
            torch.manual_seed(0)
            mod = whole_module(label, k, n, dev).set_mode("exact")
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            def forwards():
                out = {}
                os.environ[sm90.ENV_PDL] = "0"  # the plain launches (by default a captured call takes the PDL pair)
                for env in ("two", "one"):
                    os.environ[tuning.ENV_EXACT_LORA] = env
                    out[env] = us(lambda: mod(x))
                os.environ.pop(tuning.ENV_EXACT_LORA)
                os.environ.pop(sm90.ENV_PDL)
                return out

            fwd = forwards()
            be, prep = backends.resolve(mod, x)
            extra = be.extra_tensors(prep)
            inv, ex = sm90._exact_inv(extra)
            pds = ex[0]
            smooth = mod.smooth
            plan = tuning.exact_lora_plan(m, k, pds.shape[1], "one", tuning.sm_count(dev))
            t_pass = us(lambda: kernels.quantize_act(x, smooth, out_dtype=torch.bfloat16, inv_smooth=inv))
            t_lora = us(lambda: x @ pds)
            t_two = us(lambda: (x @ pds, kernels.quantize_act(x, smooth, out_dtype=torch.bfloat16, inv_smooth=inv)))

            def one():
                return kernels.quantize_act_lora(x, smooth, pds, out_dtype=torch.bfloat16, block_m=plan.block_m,
                                                 block_k=plan.block_k, split=plan.split, num_warps=plan.num_warps,
                                                 num_stages=plan.num_stages, inv_smooth=inv)

            t_one = us(one)
            xq, lora = one()
            t = mod._parameters  # not the attributes: a stood-in tensor would be rebuilt
            t_gemm = us(lambda: be._exact_gemm(xq, lora, True, x.dtype, t["qweight"], t["wscales"], t["proj_up"],
                                               t["wcscale"], t["bias"], ex))
            again = forwards()  # timed last: how far the card's state (clocks, power) moved the first ones
            lines.append(f"| {label} {m}x{k}->{n} | {fwd['two']:.1f} | {fwd['one']:.1f} | {t_pass:.1f} | "
                         f"{t_lora:.1f} | {t_two:.1f} | {t_one:.1f} ({plan.block_m}x{plan.block_k} w{plan.num_warps} "
                         f"s{plan.split} st{plan.num_stages}) | {t_gemm:.1f} | {fwd['two'] - t_two - t_gemm:.1f} | "
                         f"{fwd['one'] - t_one - t_gemm:.1f} | {again['two']:.1f} / {again['one']:.1f} |")
            print(lines[-1], flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
