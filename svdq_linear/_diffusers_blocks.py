"""diffusers blocks whose quantized linears read their inputs without a tensor written between.

A Flux single block's ``proj_out`` reads ``cat([attn, gelu_tanh(mlp)], -1)`` and a feed-forward's down
projection ``gelu_tanh(h)``. Written out, that input costs a read and a write of [tokens, 15360] or
[tokens, 12288] 16-bit values before the linear's own activation pass reads it again. These subclasses
hand the parts to ``SVDQW4A4Linear.forward_cat_gelu`` instead, which on Hopper (sm90, both modes,
above 64 tokens) reads them directly and applies the GELU as it loads; elsewhere it writes the input
and runs the layer as before. ``svdq_linear.fuse.fuse_gelu_inputs`` switches a block's class to these and back;
they add no state but a flag, so a switched model saves, copies and pickles as the original (with this class).
A single block whose q/k/v and ``proj_mlp`` are one layer (``fuse_qkv_projections``) takes this class too.

Imported only by ``svdq_linear.fuse`` when it switches a block: it needs diffusers.
"""

from __future__ import annotations

import torch
from diffusers.models import attention as _attention
from diffusers.models import normalization as _normalization
from diffusers.models.transformers import transformer_flux as _flux

# The subclasses keep the diffusers class names: diffusers finds blocks by class name
# (``compile_repeated_blocks``' ``_repeated_blocks``, ``_no_split_modules``), and pickle finds these by
# their own module and name.


def _single_attention(attn, query, key, value, image_rotary_emb):
    """What diffusers' ``FluxAttnProcessor`` computes for a single block's attention (no context stream, no mask)
    from the projections already made: per-head RMS norms, the rotary embedding, the attention backend and
    parallel config the processor carries."""
    proc = attn.processor
    query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
    key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
    value = value.unflatten(-1, (-1, attn.head_dim))
    if image_rotary_emb is not None:
        query = _flux.apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = _flux.apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
    out = _flux.dispatch_attention_fn(query, key, value, attn_mask=None, backend=proc._attention_backend,
                                      parallel_config=proc._parallel_config)
    return out.flatten(2, 3).to(query.dtype)


class FluxSingleTransformerBlock(_flux.FluxSingleTransformerBlock):
    """diffusers' ``FluxSingleTransformerBlock`` with either or both of two fusions, the same operations otherwise:

    - ``attn.to_qkv_mlp`` (``fuse_qkv_projections``): one quantized layer computes q, k, v and the MLP's
      input from the adaLN norm's input (``SVDQW4A4Linear.forward_ada_norm``: one activation pass that
      normalizes as it loads where the backend can, one GEMM), and the attention runs as diffusers'
      ``FluxAttnProcessor`` would on them. A call with ``joint_attention_kwargs`` or another processor class
      takes the separate layers;
    - ``_svdq_gelu_in`` (``fuse_gelu_inputs``): ``proj_out`` reads the attention output and the MLP's output
      before its GELU."""

    _svdq_gelu_in = False  # set on the instance by fuse_gelu_inputs

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                joint_attention_kwargs=None):
        n_text = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        fused = getattr(self.attn, "to_qkv_mlp", None)
        norm = self.norm
        if fused is not None and not joint_attention_kwargs and type(self.attn.processor) is _flux.FluxAttnProcessor:
            if type(norm) is _normalization.AdaLayerNormZeroSingle and norm.norm.weight is None:
                # AdaLayerNormZeroSingle's steps, the norm and modulation left to the fused layer's activation pass
                shift, scale, gate = norm.linear(norm.silu(temb)).chunk(3, dim=1)
                qkvm = fused.forward_ada_norm(x, shift, scale, norm.norm.eps)
            else:
                normed, gate = norm(x, emb=temb)
                qkvm = fused(normed)
            query, key, value, mlp = qkvm.split(fused._split, dim=-1)
            attn = _single_attention(self.attn, query, key, value, image_rotary_emb)
        else:
            normed, gate = norm(x, emb=temb)
            mlp = self.proj_mlp(normed)
            attn = self.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb,
                             **(joint_attention_kwargs or {}))
        if self._svdq_gelu_in:  # act_mlp (GELU, tanh form) is applied by proj_out as it reads it
            y = self.proj_out.forward_cat_gelu(attn, mlp)
        else:
            y = self.proj_out(torch.cat([attn, self.act_mlp(mlp)], dim=2))
        out = x + gate.unsqueeze(1) * y
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
