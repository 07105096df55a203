"""One quantization pass for linears that read one input: exact concatenation of W4A4 layers.

Linears that read the same input share one smoothing factor (the converter smooths them as a
group), so stacking them along N is exact: the packed rows, block scales, ``wcscale`` and ``bias``
concatenate, ``proj_down`` concatenates along R and ``proj_up`` becomes block-diagonal (the zeros add
exact zeros in the FP32 accumulation). The fused layer quantizes its input once and runs one GEMM.

``fuse_attention_projections`` makes diffusers' ``fuse_qkv_projections()`` work on quantized
transformers: each attention module gets ``to_qkv`` (and ``to_added_qkv``) built this way, the
separate q/k/v modules become views of the fused packed weight (no second copy of it), and the fused
modules stay out of ``state_dict`` so saved checkpoints are unchanged. A Flux single block's attention
fuses its q/k/v with the block's ``proj_mlp`` too (they read the block's one norm output): one layer,
``attn.to_qkv_mlp``, that the block's forward (``svdq_linear._diffusers_blocks``) splits into q, k, v and
the MLP's input.

``fuse_gelu_inputs`` lets the linears after a tanh GELU (Flux single blocks' ``proj_out``, feed-forward
down projections) read the GELU's input, and the tensor concatenated before it, without that input
being written out.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from . import backends
from .linear import SVDQW4A4Linear


_FUSED_NAMES = ("to_qkv", "to_kv", "to_added_qkv", "to_qkv_mlp")  # the stacked modules an attention may hold


@torch.no_grad()
def concat_w4a4(layers: list[SVDQW4A4Linear]) -> SVDQW4A4Linear:
    """The exact stack of ``layers`` along N (they must read one input: same K and ``smooth``)."""
    if not layers:
        raise ValueError("expected at least one SVDQW4A4Linear to concatenate")
    first = layers[0]
    for i, layer in enumerate(layers):
        if not isinstance(layer, SVDQW4A4Linear):
            raise TypeError(f"layer {i} is a {type(layer).__name__}, not an SVDQW4A4Linear")
        if layer.in_features != first.in_features:
            raise ValueError(f"layer {i} has in_features {layer.in_features}, layer 0 {first.in_features}")
        if not torch.equal(layer.smooth, first.smooth):
            raise ValueError(f"layer {i} has another smoothing factor than layer 0: fusing would not be exact")
        if layer.proj_up.dtype != first.proj_up.dtype or layer.qweight.device != first.qweight.device:
            raise ValueError(f"layer {i} differs from layer 0 in dtype or device")
        if _own_mode(layer) != _own_mode(first):
            raise ValueError(f"layer {i} is set to mode {_own_mode(layer)!r}, layer 0 to {_own_mode(first)!r}: the "
                             "fused layer runs one mode (set_mode them alike first)")
    ranks = [layer.rank for layer in layers]
    n_total, r_total = sum(layer.out_features for layer in layers), sum(ranks)
    has_bias = any(layer.bias is not None for layer in layers)
    dev, dt = first.qweight.device, first.proj_up.dtype
    fused = SVDQW4A4Linear(first.in_features, n_total, rank=r_total, bias=has_bias, device="meta", dtype=dt)
    proj_up = torch.zeros(n_total, r_total, dtype=dt, device=dev)
    row = col = 0
    for layer in layers:
        proj_up[row:row + layer.out_features, col:col + layer.rank] = layer.proj_up
        row, col = row + layer.out_features, col + layer.rank
    sd = {
        "qweight": torch.cat([layer.qweight for layer in layers]),
        "wscales": torch.cat([layer.wscales for layer in layers]),
        "wcscale": torch.cat([layer.wcscale for layer in layers]),
        "smooth": first.smooth.clone(),
        "proj_down": torch.cat([layer.proj_down for layer in layers], dim=1),
        "proj_up": proj_up,
    }
    if has_bias:
        sd["bias"] = torch.cat([layer.bias if layer.bias is not None else
                                torch.zeros(layer.out_features, dtype=dt, device=dev) for layer in layers])
    fused.load_state_dict(sd, assign=True)
    fused._backend_pref = first._backend_pref
    fused.set_mode(_own_mode(first))  # set_mode(model, ...) before fusing holds for the fused layer too
    names = [getattr(layer, "layer_name", None) for layer in layers]
    if all(names):  # name_layers ran: warnings name the parts ("blocks.0.attn.to_q+to_k+to_v")
        fused.layer_name = names[0] + "".join("+" + n.rsplit(".", 1)[-1] for n in names[1:])
    return fused


def _own_mode(layer: SVDQW4A4Linear) -> str | None:
    """The mode ``set_mode`` gave ``layer`` (None: the environment's, else "auto")."""
    return layer.__dict__.get("_mode")


def _share_packed_weight(fused: SVDQW4A4Linear, layers: list[SVDQW4A4Linear]) -> None:
    """Point each layer's packed weight at its rows of the fused one (row slices: contiguous views).
    When a backend frees the fused module's canonical tensors (its prepared layout stands in for them,
    ``_stand_in``), the layers free their views too, so the weight stays on the device once."""
    row, parts = 0, []
    for layer in layers:
        parts.append((layer, row, layer.out_features))
        row += layer.out_features
    fused._link_parts(parts)


def _fuse_group(attn: nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    layers = [getattr(attn, n, None) for n in names]
    if not all(isinstance(layer, SVDQW4A4Linear) for layer in layers):
        return False
    fused = concat_w4a4(layers)
    _share_packed_weight(fused, layers)
    setattr(attn, fused_name, fused)
    return True


def _concat_linears(layers: list[nn.Linear]) -> nn.Linear:
    """One ``nn.Linear`` of ``layers`` stacked along N (diffusers' own ``fuse_projections`` for plain layers)."""
    first = layers[0]
    w = torch.cat([layer.weight for layer in layers])
    fused = nn.Linear(w.shape[1], w.shape[0], bias=first.bias is not None, device=w.device, dtype=w.dtype)
    fused.weight.copy_(w)
    if first.bias is not None:
        fused.bias.copy_(torch.cat([layer.bias for layer in layers]))
    return fused


def _single_block_mlp(attn: nn.Module) -> SVDQW4A4Linear | None:
    """The quantized ``proj_mlp`` of the Flux single block ``attn`` belongs to (``fuse_attention_projections``
    noted it), when it can join q/k/v in one layer: same input width, smoothing factor, device and mode."""
    block = attn.__dict__.get("_svdq_single_block")
    mlp = getattr(block, "proj_mlp", None)
    q = getattr(attn, "to_q", None)
    if not (isinstance(mlp, SVDQW4A4Linear) and isinstance(q, SVDQW4A4Linear)):
        return None
    if (mlp.in_features != q.in_features or mlp.qweight.device != q.qweight.device
            or mlp.proj_up.dtype != q.proj_up.dtype or not torch.equal(mlp.smooth, q.smooth)
            or _own_mode(mlp) != _own_mode(q)):
        return None
    return mlp


def _switch_class(block: nn.Module, table: str, hooked: str) -> None:
    """Give ``block`` the svdq class that ``_diffusers_blocks.<table>`` maps its diffusers class to (if any); a
    block whose forward a hook holds keeps calling that forward (``hooked`` says what then stays unfused)."""
    from . import _diffusers_blocks

    fused = getattr(_diffusers_blocks, table).get(type(block))
    if fused is not None:
        if "forward" in block.__dict__:
            warnings.warn(f"svdq-linear: a Flux block's forward is wrapped by a hook (offloading, caching): {hooked}; "
                          "fuse before enabling such hooks", stacklevel=4)
        block.__class__ = fused


def _unswitch_class(block: nn.Module, table: str) -> None:
    """Give ``block`` back the diffusers class that ``_diffusers_blocks.<table>`` maps to its class."""
    from . import _diffusers_blocks

    back = {fused: base for base, fused in getattr(_diffusers_blocks, table).items()}
    if type(block) in back:
        block.__class__ = back[type(block)]


@torch.no_grad()
def _fuse_projections(self, *args, **kwargs):
    """``Attention.fuse_projections`` for quantized q/k/v (diffusers calls it per attention module). In a Flux
    single block the block's ``proj_mlp`` joins them (``to_qkv_mlp``); the attention module then keeps
    ``fused_projections`` False, so a processor other than diffusers' own still finds q/k/v as separate
    layers (row views of the fused weight)."""
    if getattr(self, "fused_projections", False) or "to_qkv_mlp" in self._modules:
        return
    mlp = None if getattr(self, "is_cross_attention", False) else _single_block_mlp(self)
    if mlp is not None:
        block = self.__dict__["_svdq_single_block"]
        layers = [self.to_q, self.to_k, self.to_v, mlp]
        fused = concat_w4a4(layers)
        _share_packed_weight(fused, layers)
        fused._split = [layer.out_features for layer in layers]  # q, k, v, the MLP's input
        self.to_qkv_mlp = fused
        _switch_class(block, "FUSED", "its q/k/v and proj_mlp stay separate calls")
        return
    main = ("to_k", "to_v") if getattr(self, "is_cross_attention", False) else ("to_q", "to_k", "to_v")
    if not all(isinstance(getattr(self, n, None), SVDQW4A4Linear) for n in main):
        raise RuntimeError(f"{type(self).__name__}: expected quantized {'/'.join(main)} to fuse")
    context = ("add_q_proj", "add_k_proj", "add_v_proj")
    ctx = [getattr(self, n, None) for n in context]
    ctx_plain = all(type(layer) is nn.Linear for layer in ctx)
    if any(layer is not None for layer in ctx) and not (ctx_plain or all(isinstance(layer, SVDQW4A4Linear)
                                                                          for layer in ctx)):
        kinds = ", ".join(f"{n}: {type(layer).__name__}" for n, layer in zip(context, ctx))
        raise RuntimeError(f"{type(self).__name__}: the context projections are partly quantized ({kinds}); "
                           "quantize all three or none to fuse them")
    _fuse_group(self, main, "to_kv" if len(main) == 2 else "to_qkv")
    if ctx_plain:  # the context stream kept in 16 bits: one nn.Linear of the three, as diffusers fuses them
        self.to_added_qkv = _concat_linears(ctx)
    else:
        _fuse_group(self, context, "to_added_qkv")
    self.fused_projections = True
    block = self.__dict__.get("_svdq_double_block")
    if block is not None:
        _switch_class(block, "NORM_IN", "its linears keep reading the written norm outputs")


@torch.no_grad()
def _unfuse_projections(self, *args, **kwargs):
    block = self.__dict__.get("_svdq_single_block")
    parts = [getattr(self, name, None) for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")]
    if "to_qkv_mlp" in self._modules:
        parts.append(getattr(block, "proj_mlp", None))
    for layer in parts:
        if isinstance(layer, SVDQW4A4Linear):
            layer._restore()  # rows rebuilt from the fused module now, so nothing keeps it alive
    for name in _FUSED_NAMES:
        if hasattr(self, name):
            fused = getattr(self, name)
            if isinstance(fused, SVDQW4A4Linear):
                # dropped: no longer a live layer whose parts a trace must leave alone (a graph compiled while
                # fused may keep it alive; its parts are unprepared and would be prepared part way through the
                # next trace, after it read them)
                fused.__dict__.pop("_view_parts", None)
                backends.LIVE_LAYERS.discard(fused)
            delattr(self, name)
    self.fused_projections = False
    if block is not None and not block.__dict__.get("_svdq_gelu_in"):
        _unswitch_class(block, "FUSED")
    double = self.__dict__.get("_svdq_double_block")
    if double is not None:
        _unswitch_class(double, "NORM_IN")


def _drop_fused_from_state_dict(module, state_dict, prefix, local_metadata):
    for key in [k for k in state_dict if k.startswith(tuple(prefix + name + "." for name in _FUSED_NAMES))]:
        del state_dict[key]


def _unfuse_for_load(module, state_dict, prefix, *args):
    """Load pre-hook of a patched attention module: a state_dict holds the separate layers' keys only (the fused
    modules stay out of it), so a fused module is undone before its parts load, and ``_refuse_after_load`` stacks
    the loaded parts again. Loading into the parts alone would leave the fused layer's own tensors (smoothing,
    ``wcscale``, low-rank branch, bias) as they were, and a strict load would miss the fused keys."""
    if any(name in module._modules for name in _FUSED_NAMES):
        module.__dict__["_svdq_refuse"] = True
        _unfuse_projections(module)


def _refuse_after_load(module, incompatible_keys):
    if module.__dict__.pop("_svdq_refuse", False):
        _fuse_projections(module)


class _Bound:
    """``fn`` bound to an attention module, stored in its ``__dict__``. Not a bound method: pickle rebuilds
    one by looking its name up on the object, which is not restored yet at that point (and holds it under
    another name), so a quantized transformer would not pickle."""

    def __init__(self, fn, attn: nn.Module):
        self.fn, self.attn = fn, attn

    def __call__(self, *args, **kwargs):
        return self.fn(self.attn, *args, **kwargs)


def fuse_attention_projections(model: nn.Module) -> int:
    """Give every attention module of ``model`` whose q/k/v are quantized the quantized ``fuse_projections``.

    Called on quantized transformers (``mark_quantized``); diffusers' ``fuse_qkv_projections()`` then
    builds the fused modules through it. Returns how many attention modules were patched.
    """
    patched = 0
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if type(module).__name__ == "FluxSingleTransformerBlock" and isinstance(attn, nn.Module):
            # its proj_mlp reads the same input as q/k/v: _fuse_projections stacks the four. Held outside
            # _modules (no second path to the block in modules() or state_dict; copies and pickles keep it)
            attn.__dict__["_svdq_single_block"] = module
        if type(module).__name__ == "FluxTransformerBlock" and isinstance(attn, nn.Module):
            # once its q/k/v are fused, the block's fused layers (and feed-forwards) read its norms' inputs
            attn.__dict__["_svdq_double_block"] = module
        if isinstance(getattr(module, "to_q", None), SVDQW4A4Linear) and hasattr(module, "fuse_projections"):
            module.fuse_projections = _Bound(_fuse_projections, module)
            module.unfuse_projections = _Bound(_unfuse_projections, module)
            module._register_state_dict_hook(_drop_fused_from_state_dict)
            module._register_load_state_dict_pre_hook(_unfuse_for_load, with_module=True)
            module.register_load_state_dict_post_hook(_refuse_after_load)
            patched += 1
    if patched and callable(getattr(model, "fuse_qkv_projections", None)) and "fuse_qkv_projections" not in \
            model.__dict__:
        model.fuse_qkv_projections = _Bound(_fuse_model_projections, model)
        model.unfuse_qkv_projections = _Bound(_unfuse_model_projections, model)
    return patched


def _fuse_model_projections(model: nn.Module, *args, **kwargs):
    """The model's own ``fuse_qkv_projections``, then SD3's fused processors replaced by one that applies SD3.5's
    q/k norms and takes an attention without a context stream (``_diffusers_blocks.FusedJointAttnProcessor``)."""
    out = type(model).fuse_qkv_projections(model, *args, **kwargs)
    from ._diffusers_blocks import replace_fused_joint_processors

    replace_fused_joint_processors(model)
    return out


def _unfuse_model_projections(model: nn.Module, *args, **kwargs):
    """The model's own ``unfuse_qkv_projections``, then every attention that still holds fused layers unfused.
    SD3's only puts the processors back: its layers stayed fused, q/k/v views of the stacked weight, and
    ``fuse_lora`` / ``unfuse_lora`` then refused them as fused."""
    out = type(model).unfuse_qkv_projections(model, *args, **kwargs)
    for module in model.modules():
        if any(name in module._modules for name in _FUSED_NAMES) and isinstance(
                module.__dict__.get("unfuse_projections"), _Bound):
            module.unfuse_projections()
    return out


def _gelu_tanh_module(m) -> bool:
    """An activation module computing ``gelu(x, approximate="tanh")`` of its whole input."""
    return type(m) is nn.GELU and m.approximate == "tanh"


def _reads_gelu_input(block: nn.Module, base: type, fused: type) -> bool:
    """Whether ``block`` (of class ``base`` exactly, or a single block switched for ``to_qkv_mlp`` whose
    ``proj_out`` does not read the GELU's parts yet) ends in a quantized linear on a tanh-GELU'd input."""
    if type(block) is not base and not (type(block) is fused and base.__name__ == "FluxSingleTransformerBlock"
                                        and not block._svdq_gelu_in):
        return False
    if base.__name__ == "FluxSingleTransformerBlock":
        return _gelu_tanh_module(block.act_mlp) and isinstance(block.proj_out, SVDQW4A4Linear)
    net = block.net
    gelu = net[0] if len(net) == 3 else None
    return (type(gelu).__name__ == "GELU" and getattr(gelu, "approximate", None) == "tanh"
            and isinstance(getattr(gelu, "proj", None), nn.Module) and isinstance(net[1], nn.Dropout)
            and isinstance(net[2], SVDQW4A4Linear))


def fuse_gelu_inputs(model: nn.Module) -> int:
    """Let the quantized linears that read a tanh-GELU'd input read its parts instead: every Flux single
    block's ``proj_out`` (``cat([attn, gelu(mlp)])``) and every feed-forward's down projection
    (``gelu(h)``) of ``model`` goes through ``SVDQW4A4Linear.forward_cat_gelu``
    (``svdq_linear._diffusers_blocks``). On Hopper (sm90, both modes, above 64 tokens) the GELU'd input
    is then never written (the activation pass and ``lora_act`` apply it as they load); elsewhere the
    blocks compute what they did, bit for bit. Blocks of other classes, or whose linear is not quantized, are left alone. Returns how many
    blocks were switched; ``unfuse_gelu_inputs`` switches them back. Needs diffusers. Call it before
    enabling hooks that wrap a block's ``forward`` (diffusers' caching and group offloading, accelerate's
    offloading): such a block keeps its forward (a warning names it). A layer whose own call is hooked
    gets the written input, as before."""
    from ._diffusers_blocks import FUSED

    done, wrapped = 0, []
    for name, module in model.named_modules():
        for base, fused in FUSED.items():
            if _reads_gelu_input(module, base, fused):
                if "forward" in module.__dict__:  # a hook holds the class's forward already: no effect
                    wrapped.append(name)
                    continue
                module.__class__ = fused
                if hasattr(fused, "_svdq_gelu_in"):
                    module._svdq_gelu_in = True
                done += 1
    if wrapped:
        warnings.warn(f"svdq-linear: fuse_gelu_inputs left {len(wrapped)} blocks as they are (first: {wrapped[0]!r}): "
                      "their forward is wrapped by a hook (offloading, caching) that kept the original; call it "
                      "before enabling such hooks", stacklevel=2)
    return done


def unfuse_gelu_inputs(model: nn.Module) -> int:
    """Undo ``fuse_gelu_inputs``: the blocks get their diffusers classes back. Returns how many. A hook that kept a
    switched block's forward keeps calling it, and that forward then runs diffusers' own (``_diffusers_blocks``)."""
    from ._diffusers_blocks import FUSED

    back = {fused: base for base, fused in FUSED.items()}
    done = 0
    for module in model.modules():
        if type(module) not in back:
            continue
        if hasattr(type(module), "_svdq_gelu_in"):  # a single block: its flag, and its class if nothing else needs it
            if not module._svdq_gelu_in:
                continue
            del module._svdq_gelu_in
            if hasattr(module.attn, "to_qkv_mlp"):
                done += 1
                continue
        module.__class__ = back[type(module)]
        done += 1
    return done
