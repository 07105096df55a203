"""Which linears of a Flux / SD3 transformer become what.

- W4A4 (``SVDQW4A4Linear``): attention q/k/v/out and their context twins, the feed-forwards, Flux
  single blocks' ``proj_mlp``/``proj_out`` (input ``cat[attn, mlp]``), SD3.5's ``attn2``.
- W4A16 (``NVFP4W4A16Linear``): the adaLN modulation linears (``norm1.linear``,
  ``norm1_context.linear``, ``norm.linear``): a quarter of Flux's parameters, GEMVs at M = batch.
- Kept as they are: embedders, ``norm_out``, the top-level ``proj_out``, the patch embedding.

Linears that read the same input share one smoothing factor: q/k/v (and, in Flux single blocks,
``proj_mlp``), the context q/k/v, ``attn2`` q/k/v.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from svdq_linear.linear import W4A4, W4A16

SUPPORTED_TRANSFORMERS = ("FluxTransformer2DModel", "SD3Transformer2DModel")

# A block is one unit of conversion: its tensors are loaded, quantized, written and freed together.
BLOCK_PREFIX = re.compile(r"^((?:single_)?transformer_blocks\.\d+)\.")

# (pattern on the name inside a block, kind, smoothing group inside the block or None)
_RULES = (
    (r"attn\.(to_q|to_k|to_v)", W4A4, "attn.qkv"),
    (r"proj_mlp", W4A4, "attn.qkv"),  # Flux single blocks: reads the same norm output as q/k/v
    (r"attn\.(add_q_proj|add_k_proj|add_v_proj)", W4A4, "attn.add_qkv"),
    (r"attn2\.(to_q|to_k|to_v)", W4A4, "attn2.qkv"),
    (r"attn2?\.(to_out\.0|to_add_out)", W4A4, None),
    (r"(ff|ff_context)\.net\.(0\.proj|2)", W4A4, None),
    (r"proj_out", W4A4, None),  # Flux single blocks (the top-level proj_out is not in a block)
    (r"(norm1|norm1_context|norm)\.linear", W4A16, None),
)
_COMPILED = tuple((re.compile(rf"^{p}$"), kind, group) for p, kind, group in _RULES)


@dataclass
class Recipe:
    """Targets of one transformer: module name -> kind, and W4A4 name -> smoothing group name."""

    transformer_class: str
    kinds: dict[str, str] = field(default_factory=dict)
    groups: dict[str, str] = field(default_factory=dict)

    @property
    def w4a4(self) -> list[str]:
        return [n for n, k in self.kinds.items() if k == W4A4]

    @property
    def w4a16(self) -> list[str]:
        return [n for n, k in self.kinds.items() if k == W4A16]


def check_supported(transformer_class: str) -> None:
    if transformer_class not in SUPPORTED_TRANSFORMERS:
        raise ValueError(
            f"unsupported transformer class {transformer_class!r}: svdq-convert handles "
            f"{', '.join(SUPPORTED_TRANSFORMERS)} (Flux and SD3/SD3.5 pipelines)"
        )


def recipe_for(model: nn.Module) -> Recipe:
    """The recipe of a Flux or SD3 transformer (an error for any other class)."""
    cls = type(model).__name__
    check_supported(cls)
    recipe = Recipe(cls)
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        m = BLOCK_PREFIX.match(name)
        if m is None:
            continue  # embedders, norm_out, top-level proj_out: kept
        block, inner = m.group(1), name[m.end():]
        for pattern, kind, group in _COMPILED:
            if pattern.match(inner):
                recipe.kinds[name] = kind
                if group is not None:
                    recipe.groups[name] = f"{block}.{group}"
                break
    if not recipe.w4a4:
        raise ValueError(f"{cls} has no linears that the recipe quantizes; is it already quantized?")
    return recipe


def unit_of(key: str) -> str:
    """The conversion unit of a state_dict key: its block, or ``"other"`` outside blocks."""
    m = BLOCK_PREFIX.match(key)
    return m.group(1) if m else "other"
