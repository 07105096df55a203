"""quantize_act_fp8 on the GPU: the one-pass (row in registers) and two-pass kernels against a copy.

    python benchmarks/bench_quant_fp8.py
"""
import torch
from triton.testing import do_bench

from svdq_linear import nvfp4
from svdq_linear.backends.sm90 import kernels

print("| M | K | copy us | one-pass us | % of copy | two-pass us | bit-exact |")
print("|---|---|---|---|---|---|---|")
for m, k in [(4096, 3072), (4608, 3072), (4096, 12288), (4608, 15360), (512, 3072), (64, 3072)]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    sm = torch.rand(k, device="cuda") + 0.5
    y = torch.empty_like(x)
    # copy moves 4 bytes an element (2 read, 2 written); quantization 3 (2 read, 1 written)
    t_copy = do_bench(lambda: y.copy_(x), return_mode="median") * 1e3
    t1 = do_bench(lambda: kernels.quantize_act_fp8(x, sm, one_pass=True), return_mode="median") * 1e3
    t2 = do_bench(lambda: kernels.quantize_act_fp8(x, sm, one_pass=False), return_mode="median") * 1e3
    a8, sa = kernels.quantize_act_fp8(x, sm)
    ra8, rsa = nvfp4.fast_act(nvfp4.smooth_input(x, sm))
    exact = torch.equal(a8.view(torch.uint8), ra8.view(torch.uint8)) and torch.equal(sa, rsa)
    print(f"| {m} | {k} | {t_copy:.1f} | {t1:.1f} | {100 * t_copy * 3 / 4 / t1:.0f} | {t2:.1f} | {exact} |")
