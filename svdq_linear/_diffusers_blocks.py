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

import dataclasses

import torch
from diffusers.models import activations as _activations
from diffusers.models import attention as _attention
from diffusers.models import attention_processor as _attention_processor
from diffusers.models import normalization as _normalization
from diffusers.models.transformers import transformer_flux as _flux

from .linear import SVDQW4A4Linear
from .linear import call_is_wrapped as _wrapped  # a fused path skips no module whose call is wrapped

# The subclasses keep the diffusers class names: diffusers finds blocks by class name
# (``compile_repeated_blocks``' ``_repeated_blocks``, ``_no_split_modules``), and pickle finds these by
# their own module and name. Its hooks that cache or skip whole blocks (first-block cache, layer skip, MagCache)
# look blocks up by class object in ``TransformerBlockRegistry``: ``_register_block_metadata`` (below) gives
# each subclass its base's entry.


def _mods_fit(x: torch.Tensor, *mods: torch.Tensor) -> bool:
    """Whether the modulation vectors ``mods`` are what ``SVDQW4A4Linear.forward_ada_norm`` takes for ``x [B, S,
    K]``: one ``[B, K]`` row per sample, x's dtype and device. diffusers' norms also broadcast a single row over
    the batch and promote mixed dtypes (autocast gives the adaLN linear's 16-bit output beside an fp32 stream): such
    calls take the norm's own forward."""
    want = (x.shape[0], x.shape[-1])
    return all(tuple(t.shape) == want and t.dtype == x.dtype and t.device == x.device for t in mods)


def _offloaded(*layers) -> bool:
    """Whether an offloader holds the weights of any of ``layers`` elsewhere: accelerate's offloading hook
    (sequential offload, ``dispatch_model`` with offloaded modules) leaves meta placeholders and loads a module's
    tensors from its ``state_dict`` snapshot as the module is called. A fused layer's keys are not in
    ``state_dict`` (checkpoints keep the separate layers), so no hook can load it: its block runs the separate
    layers, whose hooks load them. Attributes only: a trace reads no tensor here (the layers' prepared stand-ins
    replace them while it runs)."""
    for layer in layers:
        hook = getattr(layer, "_hf_hook", None)
        if hook is not None and any(getattr(h, "offload", False) for h in getattr(hook, "hooks", (hook,))):
            return True
    return False


class _SeparateProjections:
    """``attn.fused_projections`` off for one call, so diffusers' processor reads q/k/v from the separate layers."""

    def __init__(self, attn):
        self.attn = attn

    def __enter__(self):
        self.was = self.attn.fused_projections
        self.attn.fused_projections = False

    def __exit__(self, *exc):
        self.attn.fused_projections = self.was


class FusedJointAttnProcessor(_attention_processor.JointAttnProcessor2_0):
    """diffusers' ``JointAttnProcessor2_0`` (SD3, SD3.5) with q/k/v from the fused layers (``to_qkv``,
    ``to_added_qkv``): one activation pass per stream, the same operations otherwise. ``fuse_qkv_projections`` of
    a quantized SD3 model installs it in place of diffusers' ``FusedJointAttnProcessor2_0``, which skips SD3.5's
    q/k norms and fails on its attention without a context stream (``attn2``). An attention without fused layers,
    or whose fused layers an offloader holds, runs the separate layers."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        qkv, ctx = getattr(attn, "to_qkv", None), getattr(attn, "to_added_qkv", None)
        with_ctx = encoder_hidden_states is not None
        if (qkv is None or (with_ctx and ctx is None) or hidden_states.ndim != 3
                or (with_ctx and encoder_hidden_states.ndim != 3) or _offloaded(qkv, ctx)):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        batch, tokens = hidden_states.shape[:2]
        query, key, value = qkv(hidden_states).chunk(3, dim=-1)
        head_dim = key.shape[-1] // attn.heads

        def heads(t, norm=None):
            t = t.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
            return t if norm is None else norm(t)

        query, key, value = heads(query, attn.norm_q), heads(key, attn.norm_k), heads(value)
        if with_ctx:
            e_query, e_key, e_value = ctx(encoder_hidden_states).chunk(3, dim=-1)
            query = torch.cat([query, heads(e_query, attn.norm_added_q)], dim=2)
            key = torch.cat([key, heads(e_key, attn.norm_added_k)], dim=2)
            value = torch.cat([value, heads(e_value)], dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        enc_out = None
        if with_ctx:
            out, enc_out = out[:, :tokens], out[:, tokens:]
            if not attn.context_pre_only:
                enc_out = attn.to_add_out(enc_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, enc_out) if with_ctx else out


def replace_fused_joint_processors(model: torch.nn.Module) -> None:
    """Give every attention of ``model`` that diffusers' ``fuse_qkv_projections`` set to ``FusedJointAttnProcessor2_0``
    the processor above."""
    for module in model.modules():
        if type(getattr(module, "processor", None)) is _attention_processor.FusedJointAttnProcessor2_0:
            module.set_processor(FusedJointAttnProcessor())


def _heads(attn, t, norm=None):
    """A projection ``[B, S, H * D]`` as heads ``[B, S, H, D]`` (``attn.head_dim``), through ``norm`` if given."""
    t = t.unflatten(-1, (-1, attn.head_dim))
    return t if norm is None else norm(t)


def _attend(attn, query, key, value, image_rotary_emb):
    """The tail of diffusers' ``FluxAttnProcessor`` from the normed heads: the rotary embedding, the attention
    backend and parallel config the processor carries, the heads flattened back (no mask)."""
    proc = attn.processor
    if image_rotary_emb is not None:
        query = _flux.apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = _flux.apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
    out = _flux.dispatch_attention_fn(query, key, value, attn_mask=None, backend=proc._attention_backend,
                                      parallel_config=proc._parallel_config)
    return out.flatten(2, 3).to(query.dtype)


def _single_attention(attn, query, key, value, image_rotary_emb):
    """What diffusers' ``FluxAttnProcessor`` computes for a single block's attention (no context stream) from the
    projections already made."""
    return _attend(attn, _heads(attn, query, attn.norm_q), _heads(attn, key, attn.norm_k), _heads(attn, value),
                   image_rotary_emb)


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
        if not isinstance(self, FluxSingleTransformerBlock):  # unfused since a hook took this forward: diffusers'
            return _flux.FluxSingleTransformerBlock.forward(self, hidden_states, encoder_hidden_states, temb,
                                                            image_rotary_emb, joint_attention_kwargs)
        n_text = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        fused = getattr(self.attn, "to_qkv_mlp", None)
        norm = self.norm
        if (fused is not None and not joint_attention_kwargs and type(self.attn.processor) is _flux.FluxAttnProcessor
                and not _wrapped(self.attn) and not _offloaded(fused)):
            qkvm = None
            if (type(norm) is _normalization.AdaLayerNormZeroSingle and _plain_layer_norm(norm.norm)
                    and not (_wrapped(norm) or _wrapped(norm.norm))):
                # AdaLayerNormZeroSingle's steps, the norm and modulation left to the fused layer's activation pass
                shift, scale, gate = norm.linear(norm.silu(temb)).chunk(3, dim=1)
                qkvm = _modulated(fused, x, shift, scale, norm.norm)
            if qkvm is None:
                normed, gate = norm(x, emb=temb)
                qkvm = fused(normed)
            query, key, value, mlp = qkvm.split(fused._split, dim=-1)
            attn = _single_attention(self.attn, query, key, value, image_rotary_emb)
        else:
            normed, gate = norm(x, emb=temb)
            mlp = self.proj_mlp(normed)
            attn = self.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb,
                             **(joint_attention_kwargs or {}))
        if self._svdq_gelu_in and not _wrapped(self.act_mlp) and attn.dtype == mlp.dtype:
            # act_mlp (GELU, tanh form) applied by proj_out; an attention processor that returns another dtype
            # takes diffusers' concatenation, which promotes
            y = self.proj_out.forward_cat_gelu(attn, mlp)
        else:
            y = self.proj_out(torch.cat([attn, self.act_mlp(mlp)], dim=2))
        out = x + gate.unsqueeze(1) * y
        if out.dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out[:, :n_text], out[:, n_text:]


def _plain_layer_norm(norm) -> bool:
    """A ``nn.LayerNorm`` without affine parameters (what ``nvfp4.ada_norm`` computes)."""
    return type(norm) is torch.nn.LayerNorm and norm.weight is None and norm.bias is None


def _ada_zero_ok(norm) -> bool:
    """An ``AdaLayerNormZero`` whose steps ``_ada_zero`` reproduces (no class embedding, a plain layer norm)."""
    return type(norm) is _normalization.AdaLayerNormZero and norm.emb is None and _plain_layer_norm(norm.norm)


def _ada_zero(norm, temb):
    """``AdaLayerNormZero``'s modulation vectors (shift, scale, gate of the attention; shift, scale, gate of the MLP)
    without its norm."""
    return norm.linear(norm.silu(temb)).chunk(6, dim=1)


def _ff_from_norm(ff, x, shift, scale, norm):
    """``ff(norm(x) * (1 + scale) + shift)`` for diffusers' tanh-GELU ``FeedForward`` whose first linear is
    quantized: that linear normalizes as it loads (``forward_ada_norm``); the rest as ``ff`` runs it (its down
    projection reading the GELU's input where ``fuse_gelu_inputs`` switched it). A stream that autocast made fp32
    after the attention, beside 16-bit modulation vectors, takes diffusers' steps."""
    if not _mods_fit(x, shift, scale):
        return ff(norm(x) * (1 + scale[:, None]) + shift[:, None])
    gelu, dropout, down = ff.net[0], ff.net[1], ff.net[2]
    h = gelu.proj.forward_ada_norm(x, shift, scale, norm.eps)
    if type(ff) is FeedForward and not (ff.training and dropout.p > 0):
        return down.forward_cat_gelu(None, h)
    return down(dropout(gelu.gelu(h)))


def _ff_reads_norm(ff) -> bool:
    net = getattr(ff, "net", None)
    if not isinstance(ff, _attention.FeedForward) or len(net) != 3 or _wrapped(ff):
        return False
    gelu = net[0]
    return (type(gelu) is _activations.GELU and gelu.approximate == "tanh" and isinstance(gelu.proj, SVDQW4A4Linear)
            and isinstance(net[1], torch.nn.Dropout) and not (_wrapped(gelu) or _wrapped(net[1])))


def _modulated(layer, x, shift, scale, norm):
    """``layer(norm(x) * (1 + scale) + shift)``, the input an adaLN-Zero norm hands it, from modulation vectors
    already made: normalized as the layer loads (``forward_ada_norm``) where they fit ``x``; diffusers' own steps
    otherwise (a single ``temb`` row broadcast over the batch, a 16-bit modulation beside an autocast fp32 stream),
    so that the norm's linear does not run a second time."""
    if _mods_fit(x, shift, scale):
        return layer.forward_ada_norm(x, shift, scale, norm.eps)
    return layer(norm(x) * (1 + scale[:, None]) + shift[:, None])


def _joint_attention(attn, x, enc, mods, norms, image_rotary_emb):
    """What diffusers' ``FluxAttnProcessor`` computes for a double block (image and context streams, no mask), its
    fused q/k/v layers normalizing their inputs as they load: ``mods = (shift, scale, c_shift, c_scale)``, ``norms``
    the two streams' layer norms."""
    shift, scale, c_shift, c_scale = mods
    query, key, value = _modulated(attn.to_qkv, x, shift, scale, norms[0]).chunk(3, dim=-1)
    e_query, e_key, e_value = _modulated(attn.to_added_qkv, enc, c_shift, c_scale, norms[1]).chunk(3, dim=-1)
    out = _attend(attn, torch.cat([_heads(attn, e_query, attn.norm_added_q), _heads(attn, query, attn.norm_q)], dim=1),
                  torch.cat([_heads(attn, e_key, attn.norm_added_k), _heads(attn, key, attn.norm_k)], dim=1),
                  torch.cat([_heads(attn, e_value), _heads(attn, value)], dim=1), image_rotary_emb)
    enc_out, out = out.split_with_sizes([enc.shape[1], out.shape[1] - enc.shape[1]], dim=1)
    out = attn.to_out[1](attn.to_out[0](out.contiguous()))
    return out, attn.to_add_out(enc_out.contiguous())


class FluxTransformerBlock(_flux.FluxTransformerBlock):
    """diffusers' ``FluxTransformerBlock`` whose quantized linears after an adaLN norm read the norm's input
    (``SVDQW4A4Linear.forward_ada_norm``): the fused ``to_qkv`` / ``to_added_qkv`` (``fuse_qkv_projections``
    switches the block to this class) and each feed-forward's first linear. The same operations otherwise,
    in the same order. A call with ``joint_attention_kwargs``, another processor class, or norms other than
    diffusers' plain ones runs diffusers' own forward."""

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                joint_attention_kwargs=None):
        if not isinstance(self, FluxTransformerBlock):  # unfused since a hook took this forward: diffusers'
            return _flux.FluxTransformerBlock.forward(self, hidden_states, encoder_hidden_states, temb,
                                                      image_rotary_emb, joint_attention_kwargs)
        attn = self.attn
        if attn.fused_projections and _offloaded(getattr(attn, "to_qkv", None), getattr(attn, "to_added_qkv", None)):
            with _SeparateProjections(attn):  # sequential offload: the separate layers, which its hooks load
                return super().forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                       joint_attention_kwargs)
        norms = (self.norm1, self.norm1_context, self.norm2, self.norm2_context)
        if (joint_attention_kwargs or type(attn.processor) is not _flux.FluxAttnProcessor or _wrapped(attn)
                or not isinstance(getattr(attn, "to_qkv", None), SVDQW4A4Linear)
                or not isinstance(getattr(attn, "to_added_qkv", None), SVDQW4A4Linear)
                or not (_ada_zero_ok(self.norm1) and _ada_zero_ok(self.norm1_context))
                or not (_plain_layer_norm(self.norm2) and _plain_layer_norm(self.norm2_context))
                or any(_wrapped(n) for n in norms) or _wrapped(self.norm1.norm) or _wrapped(self.norm1_context.norm)
                or not (_ff_reads_norm(self.ff) and _ff_reads_norm(self.ff_context))):
            return super().forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                   joint_attention_kwargs)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _ada_zero(self.norm1, temb)
        c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = _ada_zero(self.norm1_context, temb)
        attn_output, context_attn_output = _joint_attention(
            attn, hidden_states, encoder_hidden_states, (shift_msa, scale_msa, c_shift_msa, c_scale_msa),
            (self.norm1.norm, self.norm1_context.norm), image_rotary_emb)
        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        ff_output = _ff_from_norm(self.ff, hidden_states, shift_mlp, scale_mlp, self.norm2)
        hidden_states = hidden_states + gate_mlp.unsqueeze(1) * ff_output
        encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
        context_ff_output = _ff_from_norm(self.ff_context, encoder_hidden_states, c_shift_mlp, c_scale_mlp,
                                          self.norm2_context)
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * context_ff_output
        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states


class FeedForward(_attention.FeedForward):
    """diffusers' ``FeedForward`` (``GELU`` with ``approximate="tanh"``, dropout, linear) whose last linear reads the
    GELU's input; in training with a dropout probability the original order runs."""

    def forward(self, hidden_states, *args, **kwargs):
        if not isinstance(self, FeedForward):  # unfused since a hook took this forward: diffusers'
            return _attention.FeedForward.forward(self, hidden_states, *args, **kwargs)
        gelu, dropout, down = self.net[0], self.net[1], self.net[2]
        if args or kwargs or (self.training and dropout.p > 0) or _wrapped(gelu) or _wrapped(dropout):
            return super().forward(hidden_states, *args, **kwargs)
        return down.forward_cat_gelu(None, gelu.proj(hidden_states))


FUSED = {_flux.FluxSingleTransformerBlock: FluxSingleTransformerBlock, _attention.FeedForward: FeedForward}
# switched by fuse_qkv_projections (svdq_linear.fuse), not by fuse_gelu_inputs
NORM_IN = {_flux.FluxTransformerBlock: FluxTransformerBlock}


def _register_block_metadata() -> None:
    """Give each subclass the ``TransformerBlockRegistry`` entry of its diffusers base (same outputs in the same
    order), so that the block hooks that look blocks up by class find them. A diffusers without the registry, or
    without an entry for a base, leaves the subclass unregistered, as the base is."""
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry
    except ImportError:  # pragma: no cover - diffusers before its hook registry
        return
    for base, ours in (*FUSED.items(), *NORM_IN.items()):
        try:
            meta = TransformerBlockRegistry.get(base)
        except ValueError:  # not a registered block (FeedForward)
            continue
        TransformerBlockRegistry.register(ours, dataclasses.replace(meta, _cached_parameter_indices=None))


_register_block_metadata()
