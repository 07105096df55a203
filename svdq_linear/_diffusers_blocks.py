"""diffusers blocks whose quantized linear reads a GELU'd (and concatenated) input from its parts.

A Flux single block's ``proj_out`` reads ``cat([attn, gelu_tanh(mlp)], -1)`` and a feed-forward's down
projection ``gelu_tanh(h)``. Written out, that input costs a read and a write of [tokens, 15360] or
[tokens, 12288] 16-bit values before the linear's own activation pass reads it again. These subclasses
hand the parts to ``SVDQW4A4Linear.forward_cat_gelu`` instead, which on Hopper (sm90, both modes,
above 64 tokens) reads them directly and applies the GELU as it loads; elsewhere it writes the input
and runs the layer as before. ``svdq_linear.fuse.fuse_gelu_inputs`` switches a block's class to these and back;
they add no state, so a switched model saves, copies and pickles as the original (with this class).

Imported only by ``fuse_gelu_inputs``: it needs diffusers.
"""

from __future__ import annotations

import torch
from diffusers.models import attention as _attention
from diffusers.models.transformers import transformer_flux as _flux

# The subclasses keep the diffusers class names: diffusers finds blocks by class name
# (``compile_repeated_blocks``' ``_repeated_blocks``, ``_no_split_modules``), and pickle finds these by
# their own module and name.


class FluxSingleTransformerBlock(_flux.FluxSingleTransformerBlock):
    """diffusers' ``FluxSingleTransformerBlock`` whose ``proj_out`` reads the attention output and the
    MLP's output before its GELU: the same operations otherwise, in the same order."""

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                joint_attention_kwargs=None):
        n_text = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        normed, gate = self.norm(x, emb=temb)
        mlp = self.proj_mlp(normed)  # act_mlp (GELU, tanh form) is applied by proj_out as it reads it
        attn = self.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
        out = x + gate.unsqueeze(1) * self.proj_out.forward_cat_gelu(attn, mlp)
        if out.dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out[:, :n_text], out[:, n_text:]


class FeedForward(_attention.FeedForward):
    """diffusers' ``FeedForward`` (``GELU`` with ``approximate="tanh"``, dropout, linear) whose last linear reads the
    GELU's input; in training with a dropout probability the original order runs."""

    def forward(self, hidden_states, *args, **kwargs):
        gelu, dropout, down = self.net[0], self.net[1], self.net[2]
        if args or kwargs or (self.training and dropout.p > 0):
            return super().forward(hidden_states, *args, **kwargs)
        return down.forward_cat_gelu(None, gelu.proj(hidden_states))


FUSED = {_flux.FluxSingleTransformerBlock: FluxSingleTransformerBlock, _attention.FeedForward: FeedForward}
