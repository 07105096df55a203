"""The large-M main product on quack-kernels' NVFP4 W4 GEMM with the contract's epilogue fused.

quack's SM90 W4 GEMM (CuTe DSL) decodes the repacked NVFP4 weight in registers as the wgmma A
operand (``prepare_w4_weight(q, sf, "nvfp4")`` from exactly our canonical layout), reads the exact
bf16 activations as B and computes ``D^T``. Its epilogue frontend fuses, per element,
``acc * wcscale + bias + C`` where ``C [M, N]`` is the low-rank tile ``lora_act @ proj_up^T``
(bf16, one cuBLAS GEMM of inner dimension R). The low-rank product is not yet in the main
accumulator (see docs/perf.md for what that costs and what bounds it).

Imported only when the sm90 backend first serves a large-M call on a GPU (quack needs cutlass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.ops import RowVecLoad, TileLoad
from quack.gemm_w4 import prepare_w4_weight

TILE_K = 64  # the k-tile quack requires for nvfp4


@gemm_epilogue(ops={"wc": RowVecLoad("wc"), "bias": RowVecLoad("bias"), "lr": TileLoad("lr")})
def _epi_bias_lowrank(acc, lr, wc, bias):
    return {"D": acc * wc + bias + lr}


@gemm_epilogue(ops={"wc": RowVecLoad("wc"), "bias": RowVecLoad("bias")})
def _epi_bias(acc, wc, bias):
    return {"D": acc * wc + bias}


@dataclass
class QuackWeight:
    """The weight repacked for quack's decode (``blob``, ``sf``), prepared once per device."""

    blob: torch.Tensor
    sf: torch.Tensor
    wc: torch.Tensor  # [1, N] fp32
    bias: torch.Tensor  # [1, N] fp32 (zeros without a bias)


def prepare(qweight: torch.Tensor, wscales: torch.Tensor, wcscale: torch.Tensor, bias) -> QuackWeight:
    blob, sf = prepare_w4_weight(qweight, wscales, "nvfp4")
    n = qweight.shape[0]
    b = torch.zeros(n, device=qweight.device) if bias is None else bias.float()
    return QuackWeight(blob, sf, wcscale.float().reshape(1, n).contiguous(), b.reshape(1, n).contiguous())


def tiles(m: int, n: int) -> tuple[int, int]:
    """(tile over weight rows, tile over tokens): quack's prefill rule above 1024 tokens; narrower
    token tiles between (more CTAs on 132 SMs: 48 at M=512, N=3072 with the prefill rule)."""
    return (128, 256) if m > 1024 else (64, 256) if m > 256 else (64, 128)


def gemm(xq: torch.Tensor, w: QuackWeight, lowrank: torch.Tensor | None) -> torch.Tensor:
    """``out [M, N] bf16 = (xq @ Wq^T) * wcscale + bias (+ lowrank)``; ``xq`` bf16 contiguous."""
    m, k = xq.shape
    n = w.wc.shape[1]
    out = torch.empty(m, n, device=xq.device, dtype=torch.bfloat16)
    tm, tn = tiles(m, n)
    common = dict(transform_a="nvfp4", transform_sf=w.sf, tile_M=tm, tile_N=tn, tile_K=TILE_K, cluster_M=1,
                  cluster_N=1, max_swizzle_size=8, split_k=1)
    if lowrank is None:
        _epi_bias.gemm(xq, w.blob, out, epi_args={"wc": w.wc, "bias": w.bias}, **common)
    else:
        _epi_bias_lowrank.gemm(xq, w.blob, out, epi_args={"wc": w.wc, "bias": w.bias, "lr": lowrank},
                               **common)
    return out
