"""Quantize one Flux-sized linear with SVDQuant W4A4 and compare it with plain NVFP4 and the original.

    python examples/quantize_layer.py [--in-features 3072] [--out-features 3072] [--rank 32]

Synthetic weights and activations with a few outlier input channels (as diffusion transformers have);
prints the output error of each variant and the weight memory.
"""

import argparse
import time

import torch

from svdq_linear import SVDQW4A4Linear


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in-features", type=int, default=3072)
    p.add_argument("--out-features", type=int, default=3072)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()

    torch.manual_seed(0)
    lin = torch.nn.Linear(args.in_features, args.out_features)
    x = torch.randn(args.tokens, args.in_features)
    x[:, torch.randperm(args.in_features)[:16]] *= 50  # outlier channels
    ref = lin(x).detach()
    act_max = x.abs().amax(dim=0)

    print(f"{'variant':<24}{'rel. output error':>18}{'weight MiB':>12}{'convert s':>11}")
    bf16_mib = lin.weight.numel() * 2 / 2**20
    print(f"{'nn.Linear (bf16)':<24}{0.0:>18.4f}{bf16_mib:>12.2f}{0.0:>11.2f}")
    for name, kwargs in [
        ("plain NVFP4 W4A4", dict(rank=0, smooth="none")),
        ("SVDQuant W4A4", dict(rank=args.rank, act_max=act_max)),
    ]:
        t0 = time.perf_counter()
        m = SVDQW4A4Linear.from_linear(lin, **kwargs)
        dt = time.perf_counter() - t0
        err = ((m(x) - ref).norm() / ref.norm()).item()
        m_bf16 = m.to(torch.bfloat16)  # low-rank branch as it ships; packed buffers keep their dtypes
        mib = sum(t.numel() * t.element_size() for n, t in m_bf16.state_dict().items() if n != "bias") / 2**20
        print(f"{name:<24}{err:>18.4f}{mib:>12.2f}{dt:>11.2f}")


if __name__ == "__main__":
    main()
