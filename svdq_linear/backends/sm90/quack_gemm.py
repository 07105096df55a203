"""The large-M main product on quack-kernels' NVFP4 W4 GEMM with the contract's epilogue fused.

quack's SM90 W4 GEMM (CuTe DSL) decodes the repacked NVFP4 weight in registers as the wgmma A
operand (``prepare_w4_weight(q, sf, "nvfp4")`` from exactly our canonical layout), reads the exact
bf16 activations as B and computes ``D^T``. Its epilogue frontend fuses, per element,
``acc * wcscale + bias``. The low-rank product joins the main accumulator before that
(``quack_lowrank``: ``R / 16`` bf16 wgmmas of ``lora_act`` and ``proj_up / wcscale`` after the
K-loop); the earlier form, ``+ C`` with ``C [M, N] = lora_act @ proj_up^T`` from one cuBLAS GEMM,
stays for ranks whose operands do not fit the shared memory (``quack_lowrank.fits``).

Imported only when the sm90 backend first serves a large-M call on a GPU (quack needs cutlass).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.ops import RowVecLoad, TileLoad
from quack.gemm_runtime.identity import TORCH_OP_TRANSFORM_MODS
from quack.operand_transform.frontend import PackedFormatMod
from quack.operand_transform.transform import TransformAW4

from . import quack_launch, quack_lowrank, tuning
from .quack_layout import repack_scales, repack_weight, unpack_scales, unpack_weight  # noqa: F401 (this API)

TILE_K = 64  # the k-tile quack requires for nvfp4


@gemm_epilogue(ops={"wc": RowVecLoad("wc"), "bias": RowVecLoad("bias"), "lr": TileLoad("lr")})
def _epi_bias_lowrank(acc, lr, wc, bias):
    return {"D": acc * wc + bias + lr}


@quack_lowrank.lowrank_epilogue(ops={"wc": RowVecLoad("wc"), "bias": RowVecLoad("bias")})
def _epi_bias(acc, wc, bias):
    return {"D": acc * wc + bias}


class _ExactTransform(quack_lowrank.LowRankTransformHook, TransformAW4):
    """quack's nvfp4 W4 decode, with the per-work-tile seam that starts the low-rank prefetch."""


class _ExactMod(PackedFormatMod):
    """The ``transform_a=`` handle: quack's ``nvfp4`` format run by ``_ExactTransform``."""

    def __init__(self):
        super().__init__("nvfp4")
        TORCH_OP_TRANSFORM_MODS.pop(self.semantic_digest, None)
        self._registry_name = None  # not quack's by-name ref: that would rebuild the plain transform
        self.name = "svdq_w4a16"
        self.semantic_digest = hashlib.sha256(
            (self.semantic_digest + quack_lowrank.source_digest()).encode()).hexdigest()
        TORCH_OP_TRANSFORM_MODS[self.semantic_digest] = self

    def __call__(self, gemm):
        return _ExactTransform(gemm, self.fmt)


EXACT_MOD = _ExactMod()


@dataclass
class QuackWeight:
    """The weight repacked for quack's decode (``blob``, ``sf``), prepared once per device."""

    blob: torch.Tensor
    sf: torch.Tensor
    wc: torch.Tensor  # [1, N] fp32
    bias: torch.Tensor  # [1, N] fp32 (zeros without a bias)
    warm: dict = field(default_factory=dict, repr=False, compare=False)  # quack_launch's plans and views

    def tensors(self) -> list[torch.Tensor]:  # the order QuackWeight(*tensors) takes back
        return [self.blob, self.sf, self.wc, self.bias]


def weight(tensors: list[torch.Tensor]) -> QuackWeight:
    """The prepared ``QuackWeight`` these ``tensors()`` came from (its launch cache with it), or a new one."""
    return quack_launch.weight(QuackWeight, tensors)


def prepare(qweight: torch.Tensor, wscales: torch.Tensor, wcscale: torch.Tensor, bias) -> QuackWeight:
    """Requires N % 128 == 0 and K % 128 == 0 (the sm90 backend checks; no padding needed then)."""
    blob, sf = repack_weight(qweight), repack_scales(wscales)
    n = qweight.shape[0]
    b = torch.zeros(n, device=qweight.device) if bias is None else bias.float()
    return quack_launch.register(QuackWeight(blob, sf, wcscale.float().reshape(1, n).contiguous(),
                                             b.reshape(1, n).contiguous()))


def tiles(m: int, n: int, sms: int = tuning.SM_COUNT) -> tuple[int, int]:
    """(tile over weight rows, tile over tokens): above 1024 tokens ``tuning.prefill_tiles`` (quack's
    prefill rule, with a narrower token tile where its last wave is mostly empty); narrower token tiles
    between (more CTAs on 132 SMs: 48 at M=512, N=3072 with the prefill rule)."""
    return tuning.prefill_tiles(m, n, sms) if m > 1024 else (64, 256) if m > 256 else (64, 128)


def gemm(xq: torch.Tensor, w: QuackWeight, lowrank: torch.Tensor | None = None, launch: bool = True,
         lr_acc: tuple[torch.Tensor, ...] | None = None, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """``out [M, N] bf16 = (xq @ Wq^T) * wcscale + bias (+ low-rank)``; ``xq`` bf16 contiguous. The
    low-rank term comes either as the [M, N] tile ``lowrank`` or, into the accumulator, as
    ``lr_acc = (proj_up / wcscale [N, W], lora_act [M, S * W][, segments [N / 64] int32])`` (bf16,
    ``quack_lowrank``).
    ``launch=False`` compiles (into quack's caches) without launching; ``tile`` overrides ``tiles``."""
    m, k = xq.shape
    n = w.wc.shape[1]
    out = torch.empty(m, n, device=xq.device, dtype=torch.bfloat16)
    tm, tn = tile or tiles(m, n, tuning.sm_count(xq.device))
    args = {"wc": w.wc, "bias": w.bias}
    mod = _epi_bias.chosen()
    if lowrank is not None:
        args["lr"], mod = lowrank, _epi_bias_lowrank
    elif lr_acc is not None:
        args.update(quack_lowrank.lowrank_args(lr_acc))
    quack_launch.launch(mod, w, w.sf, xq, out, args, EXACT_MOD, tile_m=tm, tile_n=tn, tile_k=TILE_K, launch=launch)
    return out
