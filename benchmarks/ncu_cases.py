"""The kernels of a few linears, one forward each, for Nsight Compute to read counters on:

    ncu --profile-from-start off --nvtx --clock-control none --section SpeedOfLight ... \\
        python3 benchmarks/ncu_cases.py [--cases NAME,...]

Each case warms its layer up (compiles, prepares), then runs one forward between
cudaProfilerStart/Stop inside an NVTX range named after the case, so ncu's report names the case of
every kernel it profiled. ``benchmarks/h200_sm90.sh`` step ``ncu`` runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_conformance import random_w4a4  # noqa: E402

# name -> (M, K, N, variant): variant "bf16" is F.linear, "exact"/"fast" the W4A4 module in that mode,
# "w4a16" NVFP4W4A16Linear (the adaLN modulation)
CASES = {
    "adaln-w4a16-m1": (1, 3072, 18432, "w4a16"),
    "adaln-bf16-m1": (1, 3072, 18432, "bf16"),
    "small-attn-exact-m1": (1, 3072, 3072, "exact"),
    "small-attn-bf16-m1": (1, 3072, 3072, "bf16"),
    "small-ffdown-fast-m1": (1, 12288, 3072, "fast"),
    "single-out-exact-4608": (4608, 15360, 3072, "exact"),
    "single-out-bf16-4608": (4608, 15360, 3072, "bf16"),
    "qkv-fast-4096": (4096, 3072, 9216, "fast"),
    "qkv-bf16-4096": (4096, 3072, 9216, "bf16"),
    # the fast mode's one-launch kernel (sm90/small_m_fast.py) called directly
    "fastone-attn-m1": (1, 3072, 3072, "fastone"),
    "fastone-ffdown-m1": (1, 12288, 3072, "fastone"),
    "fastone-ffdown-m16": (16, 12288, 3072, "fastone"),
    "fastone-attn-m64": (64, 3072, 3072, "fastone"),
    # 9 tokens run the FP8 dots' loop ~35 % slower than the same 9 with 7 zero tokens appended (16 rows either
    # way, same grid and code; docs/perf.md, twentieth session): the two launches' counters side by side
    "fastone-ffdown-m9": (9, 12288, 3072, "fastone"),
    "fastone-ffdown-m9pad16": (9, 12288, 3072, "fastonepad"),
    # the exact activation pass alone, and with lora_act in one read of x (kernels.quantize_act_lora at the plan
    # SVDQ_SM90_EXACT_LORA=one runs), fused q/k/v's input (N: the prepared proj_down's columns, 3 x 32)
    "exactpass-qkv-4096": (4096, 3072, 96, "pass"),
    "oneread-qkv-4096": (4096, 3072, 96, "oneread"),
}


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    import svdq_linear  # noqa: F401

    dev = torch.device("cuda")
    for name in args.cases.split(","):
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}; known: {', '.join(CASES)}")
        m, k, n, variant = CASES[name]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        if variant == "bf16":
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
            b = torch.randn(n, device=dev, dtype=torch.bfloat16)
            fn = lambda: F.linear(x, w, b)  # noqa: E731
        elif variant == "w4a16":
            from svdq_linear import NVFP4W4A16Linear

            lin = NVFP4W4A16Linear.from_linear(torch.nn.Linear(k, n, device=dev, dtype=torch.bfloat16))
            fn = lambda: lin(x)  # noqa: E731
        elif variant in ("fastone", "fastonepad"):
            from test_sm90_small_m_fast import _layer, _operands

            from svdq_linear.backends.sm90 import small_m_fast

            ops = _operands(*_layer(n, k, 32, torch.Generator().manual_seed(0)), None)
            if variant == "fastonepad":  # zero tokens up to the tile's 16 rows
                x = torch.cat([x, x.new_zeros(16 - m, k)])
            fn = lambda: small_m_fast.linear(x, **ops)  # noqa: E731
        elif variant in ("pass", "oneread"):
            from svdq_linear.backends.sm90 import kernels, tuning

            smooth = torch.rand(k, device=dev) + 0.5
            inv = 1.0 / smooth
            pds = (torch.randn(k, n, device=dev) / 20).bfloat16()
            plan = tuning.exact_lora_plan(m, k, n, "one", tuning.sm_count(dev))
            if variant == "pass":
                fn = lambda: kernels.quantize_act(x, smooth, inv_smooth=inv)  # noqa: E731
            else:
                fn = lambda: kernels.quantize_act_lora(  # noqa: E731
                    x, smooth, pds, block_m=plan.block_m, block_k=plan.block_k, split=plan.split,
                    num_warps=plan.num_warps, num_stages=plan.num_stages, inv_smooth=inv)
        else:
            lin = random_w4a4(k, n, 32, torch.bfloat16, dev).set_mode(variant)
            fn = lambda: lin(x)  # noqa: E731
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"case {name}: M={m} K={k} N={n} {variant}", flush=True)


if __name__ == "__main__":
    main()
