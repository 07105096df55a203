"""Where the fast mode's row scale sa parts from the written path's, on a GPU (the twenty-ninth session's GPU tests
failed there): the norm pass's statistics (rows held in registers, the chunked walk) against ``nvfp4.fast_act`` of
the written norm, and a Flux single block's fused q/k/v/mlp layer against its separate layers, each against the
reference backend's fast mode. Prints a few lines a case; writes nothing."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from svdq_linear import nvfp4  # noqa: E402
from svdq_linear.backends.sm90 import norm_pass  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.float() - b.float()).abs()
    big, avg = b.float().abs().max().item(), b.float().abs().mean().item()
    return f"max {d.max().item() / big:.2e} mean {d.mean().item() / avg:.2e}"


def norm_pass_rows():
    from test_norm_pass import _case

    for m_per, batch, k, r in ((40, 1, 256, 16), (9, 3, 384, 32), (512, 2, 3072, 32)):
        x, shift, scale, smooth, pds = _case(m_per, batch, k, r, torch.bfloat16, device="cuda", seed=1)
        inp = nvfp4.ada_norm(x, shift, scale, 1e-6).reshape(-1, k)
        _, sa_ref = nvfp4.fast_act(nvfp4.smooth_input(inp, smooth))
        x2 = x.reshape(-1, k)
        got = {}
        for name, whole_k in (("registers", 4096), ("walk", 64)):
            norm_pass.WHOLE_K = whole_k
            got[name] = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, 1.0 / smooth, pds, tokens=m_per, split=1)[1]
        norm_pass.WHOLE_K = 4096
        # the statistics alone against PyTorch's (float64 of the same bf16 x)
        xd = x2.double()
        line = [f"M={x2.shape[0]} K={k}:"]
        for name, sa in got.items():
            same = (sa == sa_ref).float().mean().item()
            ratio = (sa.double() / sa_ref.double() - 1).abs().max().item()
            line.append(f"{name}: sa == ref {same:.3f}, max |sa/ref - 1| {ratio:.2e};")
        line.append(f"registers == walk {(got['registers'] == got['walk']).float().mean().item():.3f}")
        print(" ".join(line))
        # which column holds the row max, and is the written norm's value there the same bits as the pass's?
        xs = nvfp4.smooth_input(inp, smooth)
        arg = xs.abs().argmax(dim=1)
        print(f"  row max at column 5 (the outlier) in {(arg == 5).float().mean().item():.3f} of rows;",
              f"ref amax/448 == sa_ref {(xs.abs().amax(1) / 448 == sa_ref).float().mean().item():.3f};",
              f"mean x {xd.mean().item():.3f}")


def fused_single_block():
    from diffusers.models.transformers import transformer_flux as flux

    from svdq_linear import SVDQW4A4Linear, set_mode
    from svdq_linear.fuse import fuse_attention_projections

    dim, heads = 512, 4
    torch.manual_seed(5)
    block = flux.FluxSingleTransformerBlock(dim, heads, dim // heads).cuda().bfloat16().eval()
    for owner, names in ((block.attn, ("to_q", "to_k", "to_v")), (block, ("proj_mlp", "proj_out"))):
        for name in names:
            setattr(owner, name, SVDQW4A4Linear.from_linear(getattr(owner, name), rank=32))
    set_mode(block, "fast")
    fuse_attention_projections(block)
    g = torch.Generator(device="cuda").manual_seed(6)
    normed = torch.randn(1, 2164, dim, device="cuda", generator=g).bfloat16()
    with torch.no_grad():
        apart = torch.cat([block.attn.to_q(normed), block.attn.to_k(normed), block.attn.to_v(normed),
                           block.proj_mlp(normed)], dim=-1)
        block.attn.fuse_projections()
        fused = block.attn.to_qkv_mlp
        one = fused(normed)
        print("single block, fast: fused layer against the separate layers:", _rel(one, apart))
        for name, lay in (("to_q", block.attn.to_q), ("proj_mlp", block.proj_mlp), ("fused", fused)):
            y = lay(normed).float()
            ref = nvfp4.w4a8_fast_linear(normed.reshape(-1, dim), lay.qweight, lay.wscales, lay.smooth,
                                         lay.proj_down, lay.proj_up, lay.wcscale, lay.bias).reshape(y.shape)
            print(f"  {name} (N={lay.out_features}) against the reference fast mode:", _rel(y, ref))
        block.attn.unfuse_projections()


if __name__ == "__main__":
    norm_pass_rows()
    try:
        fused_single_block()
    except ImportError as e:
        print("no single-block case:", e)
