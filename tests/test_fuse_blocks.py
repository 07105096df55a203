"""Flux blocks under ``fuse_qkv_projections``: a single block's q/k/v and ``proj_mlp`` stacked into one layer
(``attn.to_qkv_mlp``) that the block splits, and the linears after an adaLN norm reading the norm's input
(``forward_ada_norm``) in single and double blocks; on the CPU (reference backend), against the blocks' own
diffusers forward as the oracle."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from svdq_linear import SVDQW4A4Linear

diffusers = pytest.importorskip("diffusers")
from diffusers.models.transformers import transformer_flux as flux  # noqa: E402

from svdq_linear.fuse import fuse_attention_projections, fuse_gelu_inputs, unfuse_gelu_inputs  # noqa: E402

DIM, HEADS = 64, 2


def _block(seed: int = 0) -> torch.nn.Module:
    """A Flux single block with every linear but the adaLN one quantized (no calibration: unit smoothing, so
    q/k/v and proj_mlp share it as the converter's group smoothing makes them)."""
    torch.manual_seed(seed)
    block = flux.FluxSingleTransformerBlock(DIM, HEADS, DIM // HEADS).float().eval()
    attn = block.attn
    for owner, name in ((attn, "to_q"), (attn, "to_k"), (attn, "to_v"), (block, "proj_mlp"), (block, "proj_out")):
        setattr(owner, name, SVDQW4A4Linear.from_linear(getattr(owner, name), rank=4))
    return block


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hs, enc = torch.randn(2, 12, DIM, generator=g), torch.randn(2, 4, DIM, generator=g)
    temb = torch.randn(2, DIM, generator=g)
    pos = torch.randn(16, DIM // HEADS // 2, generator=g)
    rope = (pos.cos().repeat_interleave(2, -1), pos.sin().repeat_interleave(2, -1))
    return hs, enc, temb, rope


def _run(block, inputs, **kwargs):
    hs, enc, temb, rope = inputs
    with torch.no_grad():
        return torch.cat(block(hs, enc, temb, image_rotary_emb=rope, **kwargs), dim=1)


def _fused_block():
    block = _block()
    model = torch.nn.ModuleDict({"b": block})
    assert fuse_attention_projections(model) == 1
    return block


def _calls(block):
    """Which of the separate layers run during a call (forward hooks)."""
    seen, hooks = [], []
    for name, layer in (("to_q", block.attn.to_q), ("proj_mlp", block.proj_mlp), ("to_qkv_mlp", block.attn.to_qkv_mlp)):
        hooks.append(layer.register_forward_hook(lambda *a, n=name: seen.append(n)))
    return seen, hooks


def test_single_block_runs_one_layer_for_qkv_and_mlp_with_the_same_outputs():
    block = _fused_block()
    inputs = _inputs()
    before = _run(block, inputs)
    keys = set(block.state_dict())
    block.attn.fuse_projections()  # what FluxTransformer2DModel.fuse_qkv_projections calls per attention module
    fused = block.attn.to_qkv_mlp
    assert isinstance(fused, SVDQW4A4Linear) and fused.out_features == 3 * DIM + block.mlp_hidden_dim
    assert fused.rank == 4 * 4 and type(block).__name__ == "FluxSingleTransformerBlock"
    assert type(block) is not flux.FluxSingleTransformerBlock
    # the four layers keep row views of the stacked packed weight: the weight is held once
    assert block.proj_mlp.qweight.data_ptr() == fused.qweight.data_ptr() + 3 * DIM * DIM // 2
    assert block.attn.to_q.qweight.data_ptr() == fused.qweight.data_ptr()
    assert not hasattr(block.attn, "to_qkv") and not block.attn.fused_projections
    seen, hooks = _calls(block)
    after = _run(block, inputs)
    assert seen == ["to_qkv_mlp"]
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert set(block.state_dict()) == keys, "fusing must not change what a checkpoint holds"
    block.attn.fuse_projections()  # a second call changes nothing
    assert block.attn.to_qkv_mlp is fused
    for h in hooks:
        h.remove()


def test_single_block_takes_the_separate_layers_for_another_processor_or_attention_kwargs():
    block = _fused_block()
    inputs = _inputs(2)
    before = _run(block, inputs)
    block.attn.fuse_projections()

    class Mine(flux.FluxAttnProcessor):
        pass

    seen, hooks = _calls(block)
    block.attn.set_processor(Mine())
    torch.testing.assert_close(_run(block, inputs), before, rtol=1e-5, atol=1e-5)
    assert seen == ["proj_mlp", "to_q"]
    block.attn.set_processor(flux.FluxAttnProcessor())
    seen.clear()
    _run(block, inputs, joint_attention_kwargs={"attention_mask": None})
    assert seen == ["proj_mlp", "to_q"]
    for h in hooks:
        h.remove()


def test_single_block_fusions_combine_and_undo_in_any_order():
    block = _fused_block()
    inputs = _inputs(3)
    with torch.no_grad():
        before = _run(block, inputs)
    block.attn.fuse_projections()
    assert fuse_gelu_inputs(block) == 1 and block._svdq_gelu_in
    both = _run(block, inputs)
    torch.testing.assert_close(both, before, rtol=1e-5, atol=1e-5)
    assert unfuse_gelu_inputs(block) == 1
    assert hasattr(block.attn, "to_qkv_mlp") and type(block) is not flux.FluxSingleTransformerBlock
    assert not block._svdq_gelu_in
    torch.testing.assert_close(_run(block, inputs), before, rtol=1e-5, atol=1e-5)
    assert fuse_gelu_inputs(block) == 1
    block.attn.unfuse_projections()
    assert not hasattr(block.attn, "to_qkv_mlp") and block._svdq_gelu_in
    assert type(block) is not flux.FluxSingleTransformerBlock  # the GELU fusion still needs the class
    assert block.proj_mlp.qweight.numel() == block.proj_mlp.out_features * DIM // 2  # its rows back
    torch.testing.assert_close(_run(block, inputs), before, rtol=1e-5, atol=1e-5)
    assert unfuse_gelu_inputs(block) == 1 and type(block) is flux.FluxSingleTransformerBlock
    assert torch.equal(_run(block, inputs), before)


def _held_bytes(module) -> int:
    """The bytes of the distinct storages behind ``module``'s tensors."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*module.parameters(), *module.buffers())}
    return sum(storages.values())


def test_fused_single_block_copies_pickles_and_compiles():
    block = _fused_block()
    inputs = _inputs(4)
    block.attn.fuse_projections()
    want = _run(block, inputs)
    buf = io.BytesIO()
    torch.save(block, buf)  # a whole module: torch's pickle, the block held in its attention's __dict__
    buf.seek(0)
    for twin in (copy.deepcopy(block), torch.load(buf, weights_only=False)):
        assert twin.attn.__dict__["_svdq_single_block"] is twin
        # the twin's parts are views of its fused layer's rows (a deepcopy cloned them: q/k/v held twice), and
        # the fused layer knows them, to free them with its own tensors when a backend prepares it
        fused, parts = twin.attn.to_qkv_mlp, [twin.attn.to_q, twin.attn.to_k, twin.attn.to_v, twin.proj_mlp]
        assert [ref() for ref, *_ in fused.__dict__["_view_parts"]] == parts
        assert all(p.qweight.untyped_storage().data_ptr() == fused.qweight.untyped_storage().data_ptr()
                   and p.wscales.untyped_storage().data_ptr() == fused.wscales.untyped_storage().data_ptr()
                   for p in parts)
        assert _held_bytes(twin) == _held_bytes(block)
        assert torch.equal(_run(twin, inputs), want)
        twin.attn.unfuse_projections()  # the twin's own parts, not the original's
        assert type(twin) is flux.FluxSingleTransformerBlock and hasattr(block.attn, "to_qkv_mlp")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(_run(compiled, inputs), want, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


def test_a_single_block_whose_mlp_has_its_own_smoothing_fuses_qkv_only():
    block = _block()
    block.proj_mlp.smooth.mul_(2.0)  # another smoothing factor: stacking would not be exact
    fuse_attention_projections(block)
    block.attn.fuse_projections()
    assert isinstance(block.attn.to_qkv, SVDQW4A4Linear) and block.attn.fused_projections
    assert not hasattr(block.attn, "to_qkv_mlp") and type(block) is flux.FluxSingleTransformerBlock


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_the_fused_layer_runs_the_mode_set_before_fusing(mode):
    """``set_mode(model, ...)`` and then ``fuse_qkv_projections``: the stacked layer runs that mode, not "auto" (which
    on an sm90 GPU is the fast mode), so its columns are the separate layers' outputs in that mode."""
    from svdq_linear import nvfp4, set_mode

    block = _block()
    set_mode(block, mode)
    fuse_attention_projections(block)
    x = torch.randn(2, 16, DIM, generator=torch.Generator().manual_seed(3))
    parts = (block.attn.to_q, block.attn.to_k, block.attn.to_v, block.proj_mlp)
    with torch.no_grad():
        block.attn.fuse_projections()
        fused = block.attn.to_qkv_mlp
        assert fused.mode == mode
        got = fused(x).reshape(-1, fused.out_features)
        x2 = x.reshape(-1, DIM)
        # the oracle: each layer's contract in that mode, from its own tensors
        run = nvfp4.w4a8_fast_linear if mode == "fast" else nvfp4.w4a4_linear
        want = torch.cat([run(x2, p.qweight, p.wscales, p.smooth, p.proj_down, p.proj_up, p.wcscale, p.bias)
                          for p in parts], dim=1)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert not hasattr(fused, "layer_name")  # name_layers has not run
    other = "exact" if mode == "fast" else "fast"
    set_mode(block, other)  # after fusing: the stacked layer is one of the model's modules
    assert fused.mode == other and block.attn.to_q.mode == other


def test_the_fused_layer_is_named_after_its_parts():
    from svdq_linear.linear import name_layers

    block = _block()
    name_layers(torch.nn.ModuleDict({"b": block}))
    fuse_attention_projections(block)
    block.attn.fuse_projections()
    assert block.attn.to_qkv_mlp.layer_name == "b.attn.to_q+to_k+to_v+proj_mlp"


def test_layers_set_to_other_modes_do_not_stack():
    from svdq_linear import set_mode
    from svdq_linear.fuse import concat_w4a4

    block = _block()
    set_mode(block, "exact")
    block.attn.to_k.set_mode("fast")
    with pytest.raises(ValueError, match="layer 1 is set to mode 'fast', layer 0 to 'exact'"):
        concat_w4a4([block.attn.to_q, block.attn.to_k, block.attn.to_v])
    # a single block whose proj_mlp alone runs another mode fuses q/k/v only
    block = _block()
    set_mode(block, "exact")
    block.proj_mlp.set_mode("fast")
    fuse_attention_projections(block)
    block.attn.fuse_projections()
    assert not hasattr(block.attn, "to_qkv_mlp") and block.attn.to_qkv.mode == "exact"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["single", "double"])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gpu_fused_blocks_match_their_separate_layers(mode, kind):
    """On an sm90 GPU (quack's GEMMs; 2100 + 64 tokens, bf16, so the fused layers normalize as they load), the
    fused block's output against the same block with its layers apart and its norms written, in both modes: the
    stacked layers' columns are the same products (the zero blocks of a block-diagonal proj_up add exact zeros),
    and the norm pass's inputs differ from the written ones by a rounding in a few elements."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    pytest.importorskip("quack")
    from svdq_linear import set_mode

    dim, heads = 512, 4
    torch.manual_seed(5)
    if kind == "single":
        block = flux.FluxSingleTransformerBlock(dim, heads, dim // heads)
        places = ((block.attn, ("to_q", "to_k", "to_v")), (block, ("proj_mlp", "proj_out")))
    else:
        block = flux.FluxTransformerBlock(dim, heads, dim // heads)
        a = block.attn
        places = ((a, ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
                  (a.to_out, ("0",)), (block.ff.net[0], ("proj",)), (block.ff_context.net[0], ("proj",)))
    block = block.cuda().bfloat16().eval()
    for owner, names in places:
        for name in names:
            setattr(owner, name, SVDQW4A4Linear.from_linear(getattr(owner, name), rank=32))
    set_mode(block, mode)
    fuse_attention_projections(block)
    g = torch.Generator(device="cuda").manual_seed(6)
    hs = torch.randn(1, 2100, dim, device="cuda", generator=g).bfloat16()
    enc = torch.randn(1, 64, dim, device="cuda", generator=g).bfloat16()
    temb = torch.randn(1, dim, device="cuda", generator=g).bfloat16()
    with torch.no_grad():
        apart = torch.cat(block(hs, enc, temb), dim=1)
        block.attn.fuse_projections()
        assert type(block).__module__ == "svdq_linear._diffusers_blocks"
        fused = torch.cat(block(hs, enc, temb), dim=1)
        block.attn.unfuse_projections()
        again = torch.cat(block(hs, enc, temb), dim=1)
    assert torch.equal(again, apart)
    err = (fused.float() - apart.float()).abs()
    assert err.max().item() <= 3e-2 * apart.float().abs().max().item(), err.max().item()
    assert err.mean().item() <= 2e-3 * apart.float().abs().mean().item()
    # autocast and a hooked attention module take the block's fallbacks (the norm's own forward; diffusers'
    # attention call) on the GPU kernels, within the fused path's bound
    block.attn.fuse_projections()
    seen = []
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            cast = torch.cat(block(hs, enc, temb), dim=1)
            base_cast = _base_forward(block, hs, enc, temb)
        h = block.attn.register_forward_hook(lambda *a: seen.append(1))
        hooked = torch.cat(block(hs, enc, temb), dim=1)
        h.remove()
    assert seen == [1], "the attention module's hook did not run"
    assert cast.dtype == base_cast.dtype  # autocast runs the norms in fp32, in diffusers' forward too
    assert hooked.dtype == fused.dtype
    # autocast's oracle is diffusers' forward under it, which rounds the modulated norm once from fp32 where the
    # contract's ada_norm rounds each step in bf16: most inputs differ by a rounding, more NVFP4 codes flip, hence
    # the looser mean (0.39 % / 0.26 % single / double on the CPU with CUDA's fp32 layer_norm emulated)
    for out, want, mean in ((cast, base_cast, 1e-2), (hooked, apart, 2e-3)):
        err = (out.float() - want.float()).abs()
        assert err.max().item() <= 3e-2 * want.float().abs().max().item(), err.max().item()
        assert err.mean().item() <= mean * want.float().abs().mean().item()


def _double_block(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    block = flux.FluxTransformerBlock(DIM, HEADS, DIM // HEADS).float().eval()
    attn = block.attn
    for owner, names in ((attn, ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
                         (attn.to_out, ("0",)), (block.ff.net[0], ("proj",)), (block.ff_context.net[0], ("proj",)),
                         (block.ff.net, ("2",)), (block.ff_context.net, ("2",))):
        for name in names:
            setattr(owner, name, SVDQW4A4Linear.from_linear(getattr(owner, name), rank=4))
    return block


def test_double_block_linears_read_their_norms_inputs(monkeypatch):
    block = _double_block()
    fuse_attention_projections(block)
    hs, enc, temb, rope = _inputs(5)
    with torch.no_grad():
        before = block(hs, enc, temb, image_rotary_emb=rope)
    block.attn.fuse_projections()
    assert type(block) is not flux.FluxTransformerBlock and type(block).__name__ == "FluxTransformerBlock"
    calls = []
    real = SVDQW4A4Linear.forward_ada_norm
    monkeypatch.setattr(SVDQW4A4Linear, "forward_ada_norm",
                        lambda self, *a: calls.append(self.out_features) or real(self, *a))
    with torch.no_grad():
        after = block(hs, enc, temb, image_rotary_emb=rope)
    # to_qkv, to_added_qkv, then each feed-forward's first linear (4 x DIM wide)
    assert calls == [3 * DIM, 3 * DIM, 4 * DIM, 4 * DIM]
    for a, b in zip(after, before):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert fuse_gelu_inputs(block) == 2  # the feed-forwards: their down projections read the GELU's input
    calls.clear()
    with torch.no_grad():
        both = block(hs, enc, temb, image_rotary_emb=rope)
    assert len(calls) == 4
    for a, b in zip(both, before):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    calls.clear()
    with torch.no_grad():  # attention kwargs: diffusers' own forward
        block(hs, enc, temb, image_rotary_emb=rope, joint_attention_kwargs={"attention_mask": None})
    assert calls == []
    block.attn.unfuse_projections()
    assert type(block) is flux.FluxTransformerBlock
    with torch.no_grad():
        again = block(hs, enc, temb, image_rotary_emb=rope)
    for a, b in zip(again, before):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---- what diffusers' own blocks accept, the fused ones accept too -------------------------------------------


def _fused_pair(seed: int = 0):
    """A fused Flux single block and a fused double block (q/k/v stacked; the double one switched to read its
    norms' inputs), fp32, on the reference backend."""
    single, double = _block(seed), _double_block(seed)
    fuse_attention_projections(torch.nn.ModuleDict({"s": single, "d": double}))
    single.attn.fuse_projections()
    double.attn.fuse_projections()
    assert type(single) is not flux.FluxSingleTransformerBlock and type(double) is not flux.FluxTransformerBlock
    return single, double


def _base_forward(block, *args, **kwargs):
    """diffusers' own forward of the block's base class on the same (fused) layers: the oracle."""
    base = flux.FluxSingleTransformerBlock if isinstance(block, flux.FluxSingleTransformerBlock) else \
        flux.FluxTransformerBlock
    with torch.no_grad():
        return torch.cat(base.forward(block, *args, **kwargs), dim=1)


def test_fused_blocks_run_under_autocast_and_broadcast_a_single_temb_row():
    """diffusers' norms promote mixed dtypes (autocast makes the adaLN linear's output bf16 beside an fp32 stream)
    and broadcast a one-row ``temb`` over the batch. The fused blocks used to refuse both (``forward_ada_norm``'s
    shape and dtype check); they now take diffusers' modulation steps for such calls, from the modulation vectors
    already made: each adaLN linear runs once a call (it ran twice, the block falling back to diffusers' forward)."""
    single, double = _fused_pair()
    hs, enc, temb, rope = _inputs(7)
    calls = []
    for block in (single, double):
        for norm in (block.norm, ) if block is single else (block.norm1, block.norm1_context):
            norm.linear.register_forward_hook(lambda *_: calls.append(1))
    for block in (single, double):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            calls.clear()
            got = torch.cat(block(hs, enc, temb, image_rotary_emb=rope), dim=1)
            assert len(calls) == (1 if block is single else 2), len(calls)
            want = _base_forward(block, hs, enc, temb, image_rotary_emb=rope)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        row = temb[:1]
        with torch.no_grad():
            calls.clear()
            got = torch.cat(block(hs, enc, row, image_rotary_emb=rope), dim=1)
            assert len(calls) == (1 if block is single else 2), len(calls)
        assert got.shape[0] == hs.shape[0]
        torch.testing.assert_close(got, _base_forward(block, hs, enc, row, image_rotary_emb=rope), rtol=1e-5,
                                   atol=1e-5)


def test_double_block_mlp_takes_diffusers_steps_when_the_stream_turned_fp32():
    """CUDA autocast returns the attention in fp32, so the stream after it is fp32 beside the 16-bit MLP modulation
    vectors (seen on an H100: ``forward_ada_norm`` refused the dtypes). The MLP then runs as diffusers writes it."""
    from svdq_linear import _diffusers_blocks

    block = _double_block()
    fuse_attention_projections(block)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, DIM, generator=g)
    shift, scale = (torch.randn(2, DIM, generator=g).bfloat16() for _ in range(2))
    with torch.no_grad():
        got = _diffusers_blocks._ff_from_norm(block.ff, x, shift, scale, block.norm2)
        want = block.ff(block.norm2(x) * (1 + scale[:, None]) + shift[:, None])
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_switched_single_block_concatenates_an_attention_of_another_dtype():
    """An attention processor may return another dtype than the MLP branch (an upcasting attention backend):
    diffusers' ``torch.cat`` promotes. A block switched by ``fuse_gelu_inputs`` passed both to
    ``forward_cat_gelu``, which refuses mixed dtypes; it now takes diffusers' concatenation for such calls."""

    class Fp32Out(flux.FluxAttnProcessor):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs).float()

    hs, enc, temb, rope = _inputs()
    block = _block().bfloat16()
    block.attn.set_processor(Fp32Out())
    args = (hs.bfloat16(), enc.bfloat16(), temb.bfloat16())
    with torch.no_grad():
        want = torch.cat(block(*args, image_rotary_emb=rope), 1)
        fuse_gelu_inputs(block)
        got = torch.cat(block(*args, image_rotary_emb=rope), 1)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fused_blocks_call_a_hooked_attention_module():
    """A hook on the attention module (diffusers' attention caches and layer skip replace its forward; a plain
    forward hook) is called: the fused path, which computes the attention itself, gives way to the block's path
    through ``attn(...)``. The same holds for a hooked norm."""
    single, double = _fused_pair(1)
    inputs = _inputs(8)
    for block in (single, double):
        plain = _run(block, inputs)
        seen = []
        h = block.attn.register_forward_hook(lambda *a: seen.append(1))
        torch.testing.assert_close(_run(block, inputs), plain, rtol=1e-5, atol=1e-5)
        assert seen == [1], "the attention module's hook did not run"
        h.remove()
        norm = block.norm if isinstance(block, flux.FluxSingleTransformerBlock) else block.norm2
        h = norm.register_forward_pre_hook(lambda *a: seen.append(2))
        torch.testing.assert_close(_run(block, inputs), plain, rtol=1e-5, atol=1e-5)
        assert seen[1:] == [2], "the norm's hook did not run"
        h.remove()


def test_diffusers_block_hooks_find_the_switched_classes():
    """diffusers' block hooks (first-block cache, layer skip, MagCache) look blocks up by class object: the switched
    classes carry their bases' entries."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks._helpers import TransformerBlockRegistry

    single, double = _fused_pair(2)
    for block, base in ((single, flux.FluxSingleTransformerBlock), (double, flux.FluxTransformerBlock)):
        ours, theirs = TransformerBlockRegistry.get(type(block)), TransformerBlockRegistry.get(base)
        assert ours is not theirs and ours._cls is type(block)
        assert (ours.return_hidden_states_index, ours.return_encoder_hidden_states_index) == \
            (theirs.return_hidden_states_index, theirs.return_encoder_hidden_states_index)
    model = torch.nn.ModuleDict({"transformer_blocks": torch.nn.ModuleList([double, _double_block(3)])})
    apply_first_block_cache(model, FirstBlockCacheConfig(threshold=0.1))  # raised "not registered" before


def test_a_fused_model_loads_a_state_dict_of_its_keys():
    """A fused model's ``state_dict`` holds the separate layers' keys only (checkpoints unchanged). Loading one
    (strict) into another fused model undoes its fused layers, loads the parts and stacks them again: its outputs
    become the source's, the parts are views of the new stacked weight again. Loading into the parts alone used to
    miss the fused keys (strict) or leave the fused layers' own tensors stale."""
    src_s, src_d = _fused_pair(4)
    dst_s, dst_d = _fused_pair(5)
    src, dst = torch.nn.ModuleDict({"s": src_s, "d": src_d}), torch.nn.ModuleDict({"s": dst_s, "d": dst_d})
    sd = src.state_dict()
    assert not [k for k in sd if ".to_qkv" in k or ".to_added_qkv." in k]
    inputs = _inputs(9)
    assert not torch.allclose(_run(dst_s, inputs), _run(src_s, inputs))
    result = dst.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    for got, want in ((dst_s, src_s), (dst_d, src_d)):
        assert type(got) is type(want)
        torch.testing.assert_close(_run(got, inputs), _run(want, inputs), rtol=0, atol=0)
    fused = dst_s.attn.to_qkv_mlp
    assert dst_s.attn.to_q.qweight.data_ptr() == fused.qweight.data_ptr()
    assert dst_s.proj_mlp.qweight.data_ptr() == fused.qweight.data_ptr() + 3 * DIM * DIM // 2
    assert dst_d.attn.to_k.qweight.data_ptr() == dst_d.attn.to_qkv.qweight.data_ptr() + DIM * DIM // 2
    assert set(dst.state_dict()) == set(sd)


# The separate layers against the stacked one in float32 on the reference backend: the same products, summed by the
# CPU's BLAS in blocks that may differ between a [3N, K] and an [N, K] weight (bit for bit on the Intel machines
# these tests were written on; one float32 unit in ~9 % of the values on an AMD EPYC)
SEPARATE_FP32 = dict(rtol=1e-5, atol=1e-6)


def test_fused_blocks_run_their_separate_layers_under_sequential_offload():
    """accelerate's sequential offload (``enable_sequential_cpu_offload``) loads each module's tensors from the
    model's ``state_dict`` as it is called, and a fused layer's keys are not there (checkpoints keep the separate
    layers): its hook raised ``KeyError: 's.attn.to_qkv_mlp.qweight'``. Held by the offloader, the fused blocks run
    the separate layers (diffusers' processor reads the double block's q/k/v from them), with the same outputs."""
    from accelerate import cpu_offload

    single, double = _fused_pair(4)
    inputs = _inputs(9)
    want = {"s": _run(single, inputs), "d": _run(double, inputs)}
    cpu_offload(torch.nn.ModuleDict({"s": single, "d": double}), execution_device=torch.device("cpu"))
    for name, block in (("s", single), ("d", double)):
        assert block.attn.to_q.qweight.is_meta  # the offloader holds the weights
        torch.testing.assert_close(_run(block, inputs), want[name], **SEPARATE_FP32)
        assert block.attn.to_q.qweight.is_meta
    assert double.attn.fused_projections  # put back after the call


def test_unfusing_under_a_hook_that_kept_the_switched_forward():
    """A hook added after fusing keeps the switched class's forward; after unfusing (class back to diffusers')
    that forward runs diffusers' own instead of failing on ``super()`` or a missing flag."""
    from diffusers.hooks import HookRegistry, ModelHook

    single, double = _fused_pair(6)
    fuse_gelu_inputs(torch.nn.ModuleDict({"s": single, "d": double}))
    inputs = _inputs(10)
    before = [_run(b, inputs) for b in (single, double)]
    for b in (single, double):
        HookRegistry.check_if_exists_or_initialize(b).register_hook(ModelHook(), "noop")
        b.attn.unfuse_projections()
    unfuse_gelu_inputs(torch.nn.ModuleDict({"s": single, "d": double}))
    assert type(single) is flux.FluxSingleTransformerBlock and type(double) is flux.FluxTransformerBlock
    for b, want in zip((single, double), before):
        torch.testing.assert_close(_run(b, inputs), want, rtol=1e-5, atol=1e-5)


def test_a_context_stream_kept_in_16_bits_fuses_as_diffusers_does():
    """q/k/v quantized, the context projections plain ``nn.Linear``: those stack into one plain ``to_added_qkv``
    (diffusers' own fusion) instead of leaving the processor a missing layer; partly quantized context
    projections are refused by name before anything changes."""
    block = _double_block(7)
    for name in ("add_q_proj", "add_k_proj", "add_v_proj"):
        layer = getattr(block.attn, name)
        plain = torch.nn.Linear(layer.in_features, layer.out_features)
        setattr(block.attn, name, plain)
    fuse_attention_projections(block)
    hs, enc, temb, rope = _inputs(11)
    with torch.no_grad():
        before = torch.cat(block(hs, enc, temb, image_rotary_emb=rope), dim=1)
    keys = set(block.state_dict())
    block.attn.fuse_projections()
    assert type(block.attn.to_added_qkv) is torch.nn.Linear and isinstance(block.attn.to_qkv, SVDQW4A4Linear)
    with torch.no_grad():
        after = torch.cat(block(hs, enc, temb, image_rotary_emb=rope), dim=1)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert set(block.state_dict()) == keys
    block.attn.unfuse_projections()

    mixed = _double_block(8)
    fuse_attention_projections(mixed)
    add_k = mixed.attn.add_k_proj
    mixed.attn.add_k_proj = torch.nn.Linear(add_k.in_features, add_k.out_features)
    with pytest.raises(RuntimeError, match="partly quantized.*add_k_proj: Linear"):
        mixed.attn.fuse_projections()
    assert not hasattr(mixed.attn, "to_qkv") and not mixed.attn.fused_projections


def _parts(outs, biases, seed):
    """W4A4 layers of one input (64 wide) with the given output widths and biases, sharing one smoothing factor."""
    torch.manual_seed(seed)
    layers = [SVDQW4A4Linear.from_linear(torch.nn.Linear(DIM, n, bias=b), rank=4, act_max=torch.rand(DIM) + 0.5)
              for n, b in zip(outs, biases)]
    for layer in layers[1:]:
        layer.smooth.copy_(layers[0].smooth)  # one input, one smoothing factor (as the converter groups them)
    return layers


def test_stacked_layer_keeps_the_bias_of_parts_after_one_without():
    """``concat_w4a4`` of layers where only some have a bias, the first one without: the stacked layer has a bias,
    zeros on the rows of the layers without one, and its output is the parts' outputs side by side."""
    from svdq_linear.fuse import concat_w4a4

    layers = _parts((32, 48, 16), (False, True, False), seed=12)
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        want = torch.cat([layer(x) for layer in layers], dim=-1)
        fused = concat_w4a4(layers)
        got = fused(x)
    assert fused.bias is not None, "the stacked layer dropped the bias of layer 1"
    assert not fused.bias[:32].any() and not fused.bias[80:].any(), "the parts without a bias got a nonzero one"
    err = (got - want).abs().max().item()
    assert err <= 1e-5, f"stacked output differs from the parts' outputs by {err} (largest |y| {want.abs().max():.3f})"


def test_stacked_layer_keeps_the_backend_preference_of_its_parts():
    """``set_backend`` on the parts before fusing holds for the stacked layer too (as ``set_mode`` does)."""
    from svdq_linear.fuse import concat_w4a4

    layers = _parts((32, 32), (True, True), seed=14)
    for layer in layers:
        layer.set_backend("reference")
    assert concat_w4a4(layers)._backend_pref == "reference"


def test_layers_of_other_dtypes_do_not_stack():
    """A part cast to another dtype (the 16-bit branch of one layer in bf16, the rest fp32) is refused: the stacked
    layer would run every part in the first one's dtype."""
    from svdq_linear.fuse import concat_w4a4

    layers = _parts((32, 32), (True, True), seed=15)
    layers[1].bfloat16()
    with pytest.raises(ValueError, match="layer 1 differs from layer 0 in dtype or device"):
        concat_w4a4(layers)


def test_blocks_whose_gelu_is_not_the_tanh_form_keep_their_forward():
    """``fuse_gelu_inputs`` switches only blocks whose quantized linear reads a tanh GELU (what
    ``forward_cat_gelu`` applies): a single block with the exact GELU, and a feed-forward built with
    ``activation_fn="gelu"``, are left as they are, with their outputs."""
    from diffusers.models.attention import FeedForward

    block = _block(16)
    block.act_mlp = torch.nn.GELU()  # approximate="none"
    torch.manual_seed(17)
    ff = FeedForward(DIM, activation_fn="gelu").eval()
    ff.net[2] = SVDQW4A4Linear.from_linear(ff.net[2], rank=4)
    model = torch.nn.ModuleDict({"b": block, "ff": ff})
    inputs = _inputs(18)
    with torch.no_grad():
        before = _run(block, inputs), ff(inputs[0])
        assert fuse_gelu_inputs(model) == 0
        after = _run(block, inputs), ff(inputs[0])
    assert type(block) is flux.FluxSingleTransformerBlock and type(ff) is FeedForward
    for name, a, b in zip(("single block", "feed-forward"), after, before):
        assert torch.equal(a, b), f"{name}: output changed by {(a - b).abs().max().item()}"


def _random_qk_norms(attn, seed):
    """Distinct weights for the attention's RMS q/k norms (they start at ones, which hides a swapped norm)."""
    g = torch.Generator().manual_seed(seed)
    for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        norm = getattr(attn, name, None)
        if getattr(norm, "weight", None) is not None:
            with torch.no_grad():
                norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) * 1.5 + 0.25)


def test_fused_flux_blocks_apply_each_qk_norm_to_its_own_projection():
    """The fused single and double blocks compute the attention themselves from the stacked projections: each of
    q, k (and the context stream's) goes through its own trained RMS norm, as in diffusers' processor (the
    oracle: the block's output before fusing, with the same norms)."""
    single, double = _block(19), _double_block(19)
    _random_qk_norms(single.attn, 20)
    _random_qk_norms(double.attn, 21)
    fuse_attention_projections(torch.nn.ModuleDict({"s": single, "d": double}))
    inputs = _inputs(22)
    for name, block in (("single", single), ("double", double)):
        before = _run(block, inputs)
        block.attn.fuse_projections()
        assert type(block).__module__ == "svdq_linear._diffusers_blocks"
        err = (_run(block, inputs) - before).abs().max().item()
        assert err <= 1e-5, f"fused {name} block differs from its separate layers by {err}"


def test_fused_sd35_attention_applies_each_qk_norm_to_its_own_projection():
    """SD3.5's attention with fused q/k/v runs ``FusedJointAttnProcessor`` (what SD3's ``fuse_qkv_projections``
    leaves, once ``replace_fused_joint_processors`` ran): q, k and the context stream's go through their own
    trained RMS norms, as before fusing."""
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.attention_processor import FusedJointAttnProcessor2_0

    from svdq_linear._diffusers_blocks import FusedJointAttnProcessor, replace_fused_joint_processors

    torch.manual_seed(23)
    block = JointTransformerBlock(DIM, HEADS, DIM // HEADS, qk_norm="rms_norm").eval()
    attn = block.attn
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        setattr(attn, name, SVDQW4A4Linear.from_linear(getattr(attn, name), rank=4))
    _random_qk_norms(attn, 24)
    fuse_attention_projections(block)
    hs, enc, temb, _ = _inputs(25)
    with torch.no_grad():
        before = torch.cat(block(hs, enc, temb), dim=1)
        attn.fuse_projections()
        attn.set_processor(FusedJointAttnProcessor2_0())  # what SD3's fuse_qkv_projections sets
        replace_fused_joint_processors(block)
        assert type(attn.processor) is FusedJointAttnProcessor
        after = torch.cat(block(hs, enc, temb), dim=1)
    err = (after - before).abs().max().item()
    assert err <= 1e-5, f"fused SD3.5 attention differs from its separate layers by {err}"


def test_switched_blocks_keep_their_dropout_in_training_mode():
    """In training mode with a dropout probability the feed-forwards' dropout runs as in diffusers' forward (the
    same masks from the same seed): in a feed-forward switched by ``fuse_gelu_inputs`` and in a fused double
    block, whose feed-forwards read their norm's input."""
    from diffusers.models.attention import FeedForward

    torch.manual_seed(26)
    ff = FeedForward(DIM, dropout=0.5, activation_fn="gelu-approximate")
    ff.net[2] = SVDQW4A4Linear.from_linear(ff.net[2], rank=4)
    double = _double_block(27)
    fuse_attention_projections(double)
    double.attn.fuse_projections()
    assert fuse_gelu_inputs(torch.nn.ModuleDict({"ff": ff, "d": double})) == 3
    for m in (double.ff.net[1], double.ff_context.net[1]):
        m.p = 0.5
    ff.train()
    double.train()
    hs, enc, temb, rope = _inputs(28)
    with torch.no_grad():
        torch.manual_seed(29)
        got = ff(hs)
        torch.manual_seed(29)
        want = FeedForward.forward(ff, hs)  # diffusers' own
        assert torch.equal(got, want), "the switched feed-forward skipped or moved its dropout"
        torch.manual_seed(30)
        got = torch.cat(double(hs, enc, temb, image_rotary_emb=rope), dim=1)
        torch.manual_seed(30)
        want = _base_forward(double, hs, enc, temb, image_rotary_emb=rope)
    err = (got - want).abs().max().item()
    assert err <= 1e-5, f"fused double block in training mode differs from diffusers' forward by {err}"


def test_fused_blocks_with_affine_norms_take_diffusers_steps():
    """The fused layers normalize their inputs as they load with a plain layer norm (no weight, no bias): a block
    whose norms carry affine parameters runs them as diffusers does, with the outputs from before fusing."""
    single, double = _block(31), _double_block(31)
    g = torch.Generator().manual_seed(32)
    for owner, name in ((single.norm, "norm"), (double.norm1, "norm"), (double.norm1_context, "norm"),
                        (double, "norm2"), (double, "norm2_context")):
        norm = torch.nn.LayerNorm(DIM, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(DIM, generator=g) + 0.5)
            norm.bias.copy_(torch.randn(DIM, generator=g))
        setattr(owner, name, norm)
    fuse_attention_projections(torch.nn.ModuleDict({"s": single, "d": double}))
    inputs = _inputs(33)
    for name, block in (("single", single), ("double", double)):
        before = _run(block, inputs)
        block.attn.fuse_projections()
        err = (_run(block, inputs) - before).abs().max().item()
        assert err <= 1e-5, f"fused {name} block with affine norms differs from its separate layers by {err}"


def test_fused_blocks_clip_fp16_outputs_as_diffusers_does():
    """In fp16 diffusers' Flux blocks clip the residual stream to +-65504 (a single block's output, a double block's
    context stream) instead of letting it overflow to inf: the fused blocks do too."""
    single, double = _block(34).half(), _double_block(34).half()
    fuse_attention_projections(torch.nn.ModuleDict({"s": single, "d": double}))
    with torch.no_grad():  # large gates: the residual sums pass fp16's largest value
        single.norm.linear.bias[2 * DIM:] += 1000  # gate
        double.norm1_context.linear.bias[5 * DIM:] += 1000  # the context stream's MLP gate
    g = torch.Generator().manual_seed(35)
    hs, enc, temb, rope = _inputs(36)
    hs, enc = (65000 + 100 * torch.randn(t.shape, generator=g) for t in (hs, enc))
    args = (hs.half(), enc.half(), temb.half())
    for name, block in (("single", single), ("double", double)):
        block.attn.fuse_projections()
        want = _base_forward(block, *args, image_rotary_emb=rope)
        assert want.abs().max() == 65504, "the inputs do not reach the clipping"
        got = _run(block, (*args, rope))
        assert torch.isfinite(got).all(), f"fused {name} block overflowed: {(~torch.isfinite(got)).sum()} inf"
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=1e-2)


def test_fused_single_block_under_chained_offload_hooks_runs_its_separate_layers():
    """accelerate chains the hook it adds to a module that holds one already into a ``SequentialHook``; the
    offloading hook inside one holds the weights all the same, so the fused layer (whose keys the offloader does not
    have) is not called."""
    from accelerate import cpu_offload
    from accelerate.hooks import ModelHook, add_hook_to_module

    block = _fused_block()
    block.attn.fuse_projections()
    inputs = _inputs(37)
    want = _run(block, inputs)
    add_hook_to_module(block.attn.to_qkv_mlp, ModelHook())  # a hook there before the offloader's
    cpu_offload(block, execution_device=torch.device("cpu"))
    assert type(block.attn.to_qkv_mlp._hf_hook).__name__ == "SequentialHook"
    torch.testing.assert_close(_run(block, inputs), want, **SEPARATE_FP32)
