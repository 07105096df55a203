"""LoRA adapters on quantized layers (``svdq_linear.lora``): each layer type against the adapter's formula written
here (``y + scale * (x @ A^T) @ B^T``), a tiny Flux transformer against the unquantized one with the same LoRA
merged into its weights, undoing bit for bit, and the refusals (CPU, reference backend; one sm90 test)."""

from __future__ import annotations

import copy

import pytest
import torch

from svdq_linear import NVFP4W4A16Linear, SVDQW4A4Linear, fuse_lora, unfuse_lora

diffusers = pytest.importorskip("diffusers")


def _adapter(n, k, r, seed, gain=0.05):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, k, generator=g) * gain, torch.randn(n, r, generator=g) * gain


def _calibrated(k=128, n=96, rank=8, dtype=torch.float32, seed=0):
    """A W4A4 layer with a smoothing factor far from 1 (outlier input channels, small calibrated inputs)."""
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n)
    act_max = torch.rand(k) * 1e-3 + 1e-4
    act_max[:4] *= 300
    return SVDQW4A4Linear.from_linear(lin, rank=rank, act_max=act_max).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w4a4_layer_adds_the_adapter_to_its_output(dtype):
    """The adapter joins the low-rank branch as ``smooth ⊙ A^T`` / ``B``: the output moves by the adapter's term
    and the FP4 product is untouched; alpha scales by ``alpha / r``."""
    m = _calibrated(dtype=dtype)
    a, b = _adapter(96, 128, 4, seed=1)
    x = (torch.randn(7, 128) * 1e-3).to(dtype)
    with torch.no_grad():
        base = m(x).double()
        lora = {"layer.lora_A.weight": a, "layer.lora_B.weight": b, "layer.alpha": torch.tensor(8.0)}
        model = torch.nn.ModuleDict({"layer": m})
        assert fuse_lora(model, lora, scale=0.5, prefix="") == 1
        got = m(x).double()
    assert m.rank == 12 and m.proj_down.shape == (128, 12) and m.proj_down.dtype == dtype
    want = base + 0.5 * (8.0 / 4) * (x.double() @ a.double().T) @ b.double().T
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    assert (got - want).abs().max() <= tol * want.abs().max(), (got - want).abs().max().item()


def test_w4a16_and_16_bit_layers_add_the_adapter():
    torch.manual_seed(3)
    w16 = NVFP4W4A16Linear.from_linear(torch.nn.Linear(64, 48))
    plain = torch.nn.Linear(64, 32)
    model = torch.nn.ModuleDict({"w16": w16, "plain": plain})
    (a1, b1), (a2, b2) = _adapter(48, 64, 4, seed=4), _adapter(32, 64, 2, seed=5)
    x = torch.randn(5, 64)
    with torch.no_grad():
        base16, base = w16(x), plain(x)
        lora = {"transformer.w16.lora_A.weight": a1, "transformer.w16.lora_B.weight": b1,
                "transformer.plain.lora_A.weight": a2, "transformer.plain.lora_B.weight": b2}
        assert fuse_lora(model, lora, scale=2.0) == 2
        got16, got = w16(x), plain(x)
    torch.testing.assert_close(got16, base16 + 2.0 * (x @ a1.T) @ b1.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, base + 2.0 * (x @ a2.T) @ b2.T, rtol=1e-5, atol=1e-6)
    assert "lora_branch.down" not in w16.state_dict() and set(w16.state_dict()) == {
        "qweight", "wscales", "wcscale", "bias"}


def _tiny_flux(seed=0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    return model


def _quantize(model):
    """Every linear of the blocks to 4 bits: the adaLN ones weight-only, the rest W4A4 at rank 8; diffusers'
    ``fuse_qkv_projections`` then stacks them (as after loading a checkpoint)."""
    from svdq_linear.fuse import fuse_attention_projections

    for name, mod in list(model.named_modules()):
        if "transformer_blocks" not in name:
            continue
        for child_name, child in list(mod.named_children()):
            if type(child) is torch.nn.Linear:
                cls = NVFP4W4A16Linear if name.endswith(("norm1", "norm1_context", "norm")) else SVDQW4A4Linear
                new = cls.from_linear(child) if cls is NVFP4W4A16Linear else cls.from_linear(child, rank=8)
                setattr(mod, child_name, new)
    fuse_attention_projections(model)
    return model


def _flux_inputs():
    g = torch.Generator().manual_seed(9)
    return dict(hidden_states=torch.randn(1, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), return_dict=False)


def _flux_lora(model, seed=11, gain=0.15):
    """A diffusers-format LoRA on every linear of the blocks, the embedder and the final projection."""
    sd, g = {}, seed
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Linear, SVDQW4A4Linear, NVFP4W4A16Linear)) and (
                "transformer_blocks" in name or name in ("x_embedder", "proj_out")):
            a, b = _adapter(mod.out_features, mod.in_features, 4, seed=g, gain=gain)
            g += 1
            sd[f"transformer.{name}.lora_A.weight"], sd[f"transformer.{name}.lora_B.weight"] = a, b
    return sd


def _merged(model, sd):
    """The oracle: the unquantized model with ``W += B @ A`` for every adapter."""
    model = copy.deepcopy(model)
    mods = dict(model.named_modules())
    with torch.no_grad():
        for key in sd:
            if key.endswith(".lora_A.weight"):
                name = key[len("transformer."):-len(".lora_A.weight")]
                mods[name].weight += sd[key.replace("lora_A", "lora_B")] @ sd[key]
    return model


def _changed_keys(after, before):
    """The keys whose tensors differ, bit for bit (float8 compared as bytes)."""
    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return sorted(k for k in before if k not in after or after[k].shape != before[k].shape
                  or not torch.equal(bits(after[k]), bits(before[k])))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_a_quantized_flux_transformer_takes_a_lora_as_the_merged_model_does():
    """The LoRA moves the quantized model as it moves the unquantized one: against the unquantized model with the
    adapters merged into its weights, the quantized model with them is as close as without them, while the LoRA
    itself moves the output far more than that. ``unfuse_lora`` brings back every tensor bit for bit."""
    ref = _tiny_flux()
    model = _quantize(copy.deepcopy(ref))
    sd = _flux_lora(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = _flux_inputs()
    with torch.no_grad():
        q, fp = model(**inputs)[0], ref(**inputs)[0]
        fp_lora = _merged(ref, sd)(**inputs)[0]
        assert fuse_lora(model, sd) == len(sd) // 2
        q_lora = model(**inputs)[0]
    base_err = _rel(q, fp)
    assert _rel(fp_lora, fp) > 10 * base_err, "the LoRA must move the output well beyond the quantization error"
    assert _rel(q_lora, fp_lora) <= 1.5 * base_err + 1e-3, (_rel(q_lora, fp_lora), base_err)
    assert unfuse_lora(model) == len(sd) // 2
    after = model.state_dict()
    assert set(after) == set(before)
    assert not _changed_keys(after, before), _changed_keys(after, before)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], q)


def test_adapters_then_fused_qkv_and_compile():
    """Adapters first, then diffusers' ``fuse_qkv_projections`` (the stacked layer carries the longer branches)
    and ``torch.compile``: the same output. A fused model refuses adapters by name, and refuses to undo them."""
    model = _quantize(_tiny_flux())
    sd = _flux_lora(model)
    inputs = _flux_inputs()
    fuse_lora(model, sd)
    with torch.no_grad():
        want = model(**inputs)[0]
        model.fuse_qkv_projections()
        fused = model(**inputs)[0]
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs)[0]
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(compiled, fused, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="fused"):
        fuse_lora(model, {k: v for k, v in sd.items() if ".attn.to_q." in k})
    with pytest.raises(ValueError, match="fused"):
        unfuse_lora(model)


def test_a_pipeline_reads_a_lora_file_through_its_own_loader(tmp_path):
    """Given a pipeline, a safetensors file goes through the pipeline class's ``lora_state_dict`` (its format
    conversions), alphas included."""
    from safetensors.torch import save_file

    from svdq_linear.convert.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("flux", seed=0)
    _quantize(pipe.transformer)
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    a, b = _adapter(layer.out_features, layer.in_features, 4, seed=2)
    key = "transformer.transformer_blocks.0.attn.to_q"
    save_file({f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b, f"{key}.alpha": torch.tensor(2.0)},
              tmp_path / "lora.safetensors")
    x = torch.randn(3, layer.in_features)
    with torch.no_grad():
        base = layer(x)
        assert fuse_lora(pipe, tmp_path / "lora.safetensors") == 1
        torch.testing.assert_close(layer(x), base + 0.5 * (x @ a.T) @ b.T, rtol=1e-5, atol=1e-6)


def test_refused_loras_change_nothing():
    model = _quantize(_tiny_flux())
    sd = _flux_lora(model)
    before = copy.deepcopy(model.state_dict())
    name = "transformer.transformer_blocks.0.attn.to_k"
    cases = [
        ({**sd, "text_encoder.x.lora_A.weight": torch.zeros(4, 8)}, ValueError, "outside 'transformer'"),
        ({**sd, f"{name}.lora_magnitude_vector": torch.ones(32)}, ValueError, "DoRA"),
        ({k: v for k, v in sd.items() if k != f"{name}.lora_B.weight"}, ValueError, "lacks its lora_B"),
        ({**sd, f"{name}.lora_A.weight": torch.zeros(4, 48)}, ValueError, r"lora_A \[r, 32\]"),
        ({**sd, f"{name}.lora_B.weight": torch.zeros(32, 3)}, ValueError, r"lora_A \[r, K\] and lora_B \[N, r\]"),
        ({**sd, "transformer.transformer_blocks.0.attn.to_z.lora_A.weight": torch.zeros(4, 32),
          "transformer.transformer_blocks.0.attn.to_z.lora_B.weight": torch.zeros(32, 4)}, ValueError, "to_z"),
        ({**sd, f"{name}.lora_A.weight": torch.full((4, 32), float("nan"))}, ValueError, "NaN"),
    ]
    for lora, exc, match in cases:
        with pytest.raises(exc, match=match):
            fuse_lora(model, lora)
    with pytest.raises(ValueError, match="finite scale"):
        fuse_lora(model, sd, scale=float("inf"))
    after = model.state_dict()
    assert not _changed_keys(after, before), _changed_keys(after, before)
    assert unfuse_lora(model) == 0


@pytest.mark.gpu
def test_gpu_a_lora_runs_on_the_sm90_kernels():
    """On an sm90 GPU the longer branch runs on the kernels (both modes) and matches the reference within the
    contract's tolerance: the adapter is part of ``proj_down`` / ``proj_up``, which every backend reads."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    pytest.importorskip("quack")
    from svdq_linear import backends

    m = _calibrated(k=1024, n=768, rank=32).to("cuda", torch.bfloat16).set_mode("exact")
    a, b = _adapter(768, 1024, 16, seed=7)
    x = (torch.randn(1000, 1024, device="cuda") * 1e-3).bfloat16()
    compiled = torch.compile(m, fullgraph=True)
    with torch.no_grad():
        compiled(x)  # prepared (the kernels' state stands in) and compiled before the LoRA
        fuse_lora(torch.nn.ModuleDict({"l": m}), {"l.lora_A.weight": a, "l.lora_B.weight": b}, prefix="")
        assert torch.equal(compiled(x), m(x)), "the compiled graph kept the state from before the LoRA"
    for mode in ("exact", "fast"):
        m.set_mode(mode)
        assert backends.choose(m, x).name == "sm90"
        with torch.no_grad():
            got = m(x).float()
            want = m.to("cpu").set_backend("reference")(x.cpu()).float().cuda()
        m.to("cuda").set_backend(None)
        err = (got - want).abs()
        assert err.mean() <= 2e-2 * want.abs().mean(), (mode, err.mean().item())


def test_a_kohya_lora_goes_through_diffusers_conversion():
    """A kohya-format Flux LoRA (BFL module names, a stacked q/k/v adapter, alphas): the pipeline's converter splits
    it onto ``to_q`` / ``to_k`` / ``to_v`` and folds ``alpha / r``; each layer then moves by its share."""
    from svdq_linear.convert.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("flux", seed=0)
    _quantize(pipe.transformer)
    attn = pipe.transformer.transformer_blocks[0].attn
    d, r = attn.to_q.in_features, 4
    (down_p, up_p), (down_q, up_q) = _adapter(d, d, r, seed=20, gain=0.1), _adapter(3 * d, d, r, seed=21, gain=0.1)
    sd = {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": down_p,
          "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": up_p,
          "lora_unet_double_blocks_0_img_attn_proj.alpha": torch.tensor(2.0),
          "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": down_q,
          "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up_q,
          "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(2.0)}
    x = torch.randn(5, d)
    layers = [attn.to_out[0], attn.to_q, attn.to_k, attn.to_v]
    with torch.no_grad():
        base = [m(x) for m in layers]
        assert fuse_lora(pipe, sd) == 4
        got = [m(x) for m in layers]
    ups = [up_p, up_q[:d], up_q[d:2 * d], up_q[2 * d:]]
    downs = [down_p] + [down_q] * 3
    for g, b0, down, up in zip(got, base, downs, ups):
        torch.testing.assert_close(g, b0 + (2.0 / r) * (x @ down.T) @ up.T, rtol=1e-4, atol=1e-5)


def test_a_model_compiled_before_the_lora_runs_it():
    """A graph compiled (and prepared) before ``fuse_lora`` reads the new branch, the side branch and the edited
    16-bit weight: the compiled model's output with the LoRA is the eager one's; after ``unfuse_lora``, the base's."""
    model = _quantize(_tiny_flux())
    sd = _flux_lora(model)
    inputs = _flux_inputs()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        base = compiled(**inputs)[0]
        fuse_lora(model, sd)
        got, want = compiled(**inputs)[0], model(**inputs)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert _rel(got, base) > 0.05
        unfuse_lora(model)
        torch.testing.assert_close(compiled(**inputs)[0], base, rtol=1e-5, atol=1e-6)


def _delta_ratio(layer, base, x, a, b):
    """The layer's output change over ``(x A^T) B^T``: the factor the adapter was applied with."""
    with torch.no_grad():
        d = (layer(x) - base).double()
    t = ((x @ a.T) @ b.T).double()
    return float((d * t).sum() / (t * t).sum())


def test_alphas_scale_as_diffusers_scales_them(tmp_path):
    """``alpha / r`` with the module's own alpha, else the LoRA's most common alpha (diffusers' ``lora_alpha``), else
    1; a file saved by diffusers with its adapter config in the header follows that config (``lora_alpha``). A
    non-finite alpha is refused."""
    from diffusers import FluxPipeline

    from svdq_linear.convert.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("flux", seed=0)
    _quantize(pipe.transformer)
    attn = pipe.transformer.transformer_blocks[0].attn
    d = attn.to_q.in_features
    names = ["to_q", "to_k", "to_v"]
    ab = {n: _adapter(d, d, 4, seed=30 + i) for i, n in enumerate(names)}
    x = torch.randn(5, d)
    base = {n: getattr(attn, n)(x).detach() for n in names}
    key = "transformer.transformer_blocks.0.attn."
    sd = {f"{key}{n}.lora_{p}.weight": t for n, (a, b) in ab.items() for p, t in zip("AB", (a, b))}
    fuse_lora(pipe, {**sd, f"{key}to_q.alpha": torch.tensor(2.0), f"{key}to_k.alpha": torch.tensor(2.0),
                     f"{key}to_v.alpha": torch.tensor(8.0)})
    got = {n: _delta_ratio(getattr(attn, n), base[n], x, *ab[n]) for n in names}
    assert got == pytest.approx({"to_q": 0.5, "to_k": 0.5, "to_v": 2.0}, rel=1e-4)
    unfuse_lora(pipe)
    fuse_lora(pipe, {**sd, f"{key}to_v.alpha": torch.tensor(8.0)})  # to_q, to_k: the most common alpha, 8
    assert _delta_ratio(attn.to_q, base["to_q"], x, *ab["to_q"]) == pytest.approx(2.0, rel=1e-4)
    unfuse_lora(pipe)
    layers = {k[len("transformer."):]: v for k, v in sd.items()}
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=layers,
                                   transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 16,
                                                                      "alpha_pattern": {"to_v": 4},
                                                                      "target_modules": names})
    fuse_lora(pipe, tmp_path / "pytorch_lora_weights.safetensors")
    got = {n: _delta_ratio(getattr(attn, n), base[n], x, *ab[n]) for n in names}
    assert got == pytest.approx({"to_q": 4.0, "to_k": 4.0, "to_v": 1.0}, rel=1e-4)
    unfuse_lora(pipe)
    # rsLoRA (use_rslora): alpha / sqrt(r), as peft scales it; a mutation that ignored the flag passed every test
    (tmp_path / "rs").mkdir()
    FluxPipeline.save_lora_weights(tmp_path / "rs", transformer_lora_layers=layers,
                                   transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 8, "use_rslora": True,
                                                                      "target_modules": names})
    fuse_lora(pipe, tmp_path / "rs" / "pytorch_lora_weights.safetensors")
    got = {n: _delta_ratio(getattr(attn, n), base[n], x, *ab[n]) for n in names}
    assert got == pytest.approx(dict.fromkeys(names, 8 / 4**0.5), rel=1e-4)
    unfuse_lora(pipe)
    with pytest.raises(ValueError, match="alpha nan is not finite"):
        fuse_lora(pipe, {**sd, f"{key}to_q.alpha": torch.tensor(float("nan"))})


def test_w4a4_columns_pad_to_the_kernels_alignment():
    """A rank-4 adapter on a rank-32 layer adds 16 columns (the Blackwell kernel takes multiples of 16): the extra
    ones are zeros, the output is the unpadded one, and undoing gives back rank 32."""
    m = _calibrated(rank=32)
    a, b = _adapter(96, 128, 4, seed=40)
    x = torch.randn(6, 128) * 1e-3
    with torch.no_grad():
        base = m(x)
        fuse_lora(torch.nn.ModuleDict({"l": m}), {"l.lora_A.weight": a, "l.lora_B.weight": b}, prefix="")
        assert m.rank == 48 and not m.proj_down[:, 36:].any() and not m.proj_up[:, 36:].any()
        torch.testing.assert_close(m(x).double(), base.double() + (x.double() @ a.double().T) @ b.double().T,
                                   rtol=1e-5, atol=1e-9)
    unfuse_lora(m)
    assert m.rank == 32 and m.proj_down.shape == (128, 32)


def test_a_failure_part_way_puts_the_changed_layers_back(monkeypatch):
    from svdq_linear import lora as lora_module

    model = _quantize(_tiny_flux())
    sd = _flux_lora(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls, balanced = [], lora_module._balanced

    def fail_third(down, up):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("simulated")
        return balanced(down, up)

    monkeypatch.setattr(lora_module, "_balanced", fail_third)
    with pytest.raises(torch.OutOfMemoryError):
        fuse_lora(model, sd)
    after = model.state_dict()
    assert set(after) == set(before)
    assert not _changed_keys(after, before), _changed_keys(after, before)
    assert unfuse_lora(model) == 0, "a layer kept an adapter from the failed call"


def test_offloaded_layers_and_loads_into_adapted_layers_are_refused():
    """accelerate's sequential offload keeps the weights in its hook (the parameters here are placeholders): an edit
    would be lost, so it is refused by name. ``load_state_dict`` into a layer that carries an adapter is refused
    (the side branch and the kept base weight would stay on top of the loaded weights)."""
    from accelerate import cpu_offload

    model = _quantize(_tiny_flux())
    sd = _flux_lora(model)
    base_sd = copy.deepcopy(model.state_dict())
    fuse_lora(model, sd)
    with pytest.raises(RuntimeError, match="carries a LoRA"):
        model.load_state_dict(base_sd)
    unfuse_lora(model)
    model.load_state_dict(base_sd)  # without adapters, loads as before
    block = model.transformer_blocks[0]
    cpu_offload(block, execution_device=torch.device("cpu"), offload_buffers=True)
    with pytest.raises(ValueError, match="offloaded"):
        fuse_lora(model, sd)
    assert unfuse_lora(model) == 0


def test_a_graph_compiled_while_fused_runs_after_unfusing_and_removing_the_lora():
    """Compiled while q/k/v were fused, then unfused and the LoRA removed, the compiled model's first call used to
    fail in dynamo ("Guard failed on the same frame it was created"): the dropped fused layer, still alive in the old
    graph, kept its parts out of the trace's eager preparation until it was collected part way through the trace."""
    base = _quantize(_tiny_flux())
    sd = _flux_lora(base)
    inputs = _flux_inputs()
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    with torch.no_grad():
        fuse_lora(model, sd)
        model.fuse_qkv_projections()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        compiled(**inputs)
        model.unfuse_qkv_projections()
        unfuse_lora(model)
        got = compiled(**inputs)[0]
        torch.testing.assert_close(got, model(**inputs)[0], rtol=1e-5, atol=1e-6)
    # the mechanism, which the collector's timing hides from the run above: a dropped fused layer leaves the live
    # layers, and a trace's eager preparation then reaches its parts before the trace reads them
    from svdq_linear import backends

    model = copy.deepcopy(base)
    model.fuse_qkv_projections()
    attn = model.transformer_blocks[0].attn
    fused = attn.to_qkv
    model.unfuse_qkv_projections()
    assert fused not in backends.LIVE_LAYERS and "_view_parts" not in fused.__dict__
    assert not attn.to_k._dispatch_cache
    backends.prepare_before_trace("cpu", None, str(torch.float32))
    assert attn.to_k._dispatch_cache, "the part was left unprepared while the dropped fused layer lived"
    del fused


def test_saving_a_model_with_adapters_is_refused_and_saves_after_unfusing(tmp_path):
    """``save_pretrained`` with adapters wrote W4A4 branches longer than the config's rank (the file then failed to
    load) and left the adaLN adapters out: refused by name before any weight is written. After ``unfuse_lora`` the
    same model saves, and loads back with its outputs."""
    import svdq_linear
    from svdq_linear.convert.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("flux")
    svdq_linear.quantize_pipeline(pipe, rank=8, calib=False, progress=False)
    model = pipe.transformer
    sd, g = {}, 0
    for name, mod in model.named_modules():
        if isinstance(mod, (SVDQW4A4Linear, NVFP4W4A16Linear)) and "transformer_blocks" in name:
            a, b = _adapter(mod.out_features, mod.in_features, 4, seed=g)
            sd[f"transformer.{name}.lora_A.weight"], sd[f"transformer.{name}.lora_B.weight"] = a, b
            g += 1
    assert fuse_lora(model, sd) == len(sd) // 2
    with pytest.raises(ValueError, match="carry a LoRA from svdq_linear.fuse_lora"):
        model.save_pretrained(tmp_path / "with")
    assert not list((tmp_path / "with").glob("*.safetensors"))
    unfuse_lora(model)
    model.save_pretrained(tmp_path / "without")
    loaded = type(model).from_pretrained(tmp_path / "without")
    inputs = dict(hidden_states=torch.randn(1, 16, model.config.in_channels),
                  encoder_hidden_states=torch.randn(1, 8, model.config.joint_attention_dim),
                  pooled_projections=torch.randn(1, model.config.pooled_projection_dim), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), return_dict=False)
    if model.config.guidance_embeds:
        inputs["guidance"] = torch.tensor([3.5])
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs)[0], model(**inputs)[0], rtol=0, atol=0)


def test_diffusers_load_lora_weights_on_a_quantized_pipeline_points_to_fuse_lora():
    """diffusers' ``pipe.load_lora_weights`` goes through peft, which does not wrap the 4-bit layers: on Flux it
    failed with ``KeyError: '...to_k.weight'``. On a quantized pipeline it now names ``fuse_lora``; an unquantized
    one, and a LoRA for the text encoder alone, go on into diffusers' loader as before."""
    from svdq_linear.convert.tiny import build_tiny_pipeline

    import svdq_linear

    plain = build_tiny_pipeline("flux")
    pipe = build_tiny_pipeline("flux")
    svdq_linear.quantize_pipeline(pipe, rank=8, calib=False, progress=False)
    layer = pipe.transformer.transformer_blocks[0].attn.to_k
    lora = {"transformer.transformer_blocks.0.attn.to_k.lora_A.weight": torch.randn(2, layer.in_features),
            "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": torch.randn(layer.out_features, 2)}
    for args, kwargs in (((dict(lora),), {}), ((), {"pretrained_model_name_or_path_or_dict": dict(lora)})):
        with pytest.raises(ValueError, match=r"load_lora_weights goes through peft.*svdq_linear.fuse_lora"):
            pipe.load_lora_weights(*args, **kwargs)
    text_only = {"text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 8),
                 "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, 2)}
    for target, state in ((plain, lora), (pipe, text_only)):  # on into diffusers' loader
        try:
            target.load_lora_weights(pretrained_model_name_or_path_or_dict=dict(state))
        except (ValueError, KeyError, RuntimeError) as e:  # without peft (or a fitting text encoder): diffusers' own
            assert "fuse_lora" not in str(e), e
    assert fuse_lora(pipe, lora) == 1


def test_the_load_lora_weights_guard_reads_the_lora_as_diffusers_would(tmp_path):
    """The guard tells a LoRA for the transformer by the keys the pipeline's own reader gives: a kohya-format dict
    (``lora_unet_...``) was let through to peft, and a text encoder's LoRA as a file was refused. Files are read as
    safetensors only: a pickle is refused, not loaded. ``fuse_lora`` takes the reader's ``weight_name``."""
    import safetensors.torch
    from svdq_linear.convert.tiny import build_tiny_pipeline

    import svdq_linear

    pipe = build_tiny_pipeline("flux", seed=0)
    svdq_linear.quantize_pipeline(pipe, rank=8, calib=False, progress=False)
    d = pipe.transformer.transformer_blocks[0].attn.to_q.in_features
    down, up = _adapter(d, d, 4, seed=30, gain=0.1)
    kohya = {"lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": down,
             "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": up}
    with pytest.raises(ValueError, match=r"holds keys for the 4-bit transformer.*svdq_linear.fuse_lora"):
        pipe.load_lora_weights(dict(kohya))
    safetensors.torch.save_file(kohya, tmp_path / "kohya.safetensors")
    with pytest.raises(ValueError, match=r"holds keys for the 4-bit transformer"):
        pipe.load_lora_weights(tmp_path / "kohya.safetensors")  # a Path
    torch.save(kohya, tmp_path / "kohya.bin")
    with pytest.raises(ValueError, match=r"could not be read as a safetensors LoRA") as err:
        pipe.load_lora_weights(str(tmp_path), weight_name="kohya.bin")
    assert err.value.__cause__ is not None

    name, enc = next((n, m) for n, m in pipe.text_encoder.named_modules() if n.endswith("q_proj"))
    text_only = {f"text_encoder.{name}.lora_A.weight": torch.randn(2, enc.in_features),
                 f"text_encoder.{name}.lora_B.weight": torch.randn(enc.out_features, 2)}
    safetensors.torch.save_file(text_only, tmp_path / "text.safetensors")
    try:  # on into diffusers' loader
        pipe.load_lora_weights(str(tmp_path), weight_name="text.safetensors")
    except (ValueError, KeyError, RuntimeError) as e:  # without peft: diffusers' own error
        assert "fuse_lora" not in str(e), e

    x = torch.randn(3, d)
    layer = pipe.transformer.transformer_blocks[0].attn.to_out[0]
    with torch.no_grad():
        base = layer(x)
        with pytest.raises(TypeError, match="only a pipeline's lora_state_dict takes"):
            fuse_lora(pipe.transformer, str(tmp_path), weight_name="kohya.safetensors")
        with pytest.raises(ValueError, match="not a .safetensors file"):
            fuse_lora(pipe, str(tmp_path), weight_name="kohya.bin")
        assert fuse_lora(pipe, str(tmp_path), weight_name="kohya.safetensors") == 1
        torch.testing.assert_close(layer(x), base + (x @ down.T) @ up.T, rtol=1e-4, atol=1e-5)


def test_loras_applied_one_after_another_add_up_and_unfuse_removes_them_all():
    """Several adapters stack on every kind of layer (W4A4 branch, W4A16 side branch, 16-bit weight): each layer
    moves by the sum of their terms, and ``unfuse_lora`` gives back every tensor as before the first, bit for bit."""
    torch.manual_seed(50)
    w4 = _calibrated(k=64, n=48, rank=8, seed=50)
    model = torch.nn.ModuleDict({"w4": w4, "w16": NVFP4W4A16Linear.from_linear(torch.nn.Linear(64, 32)),
                                 "plain": torch.nn.Linear(64, 16)})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = {"w4": torch.randn(5, 64) * 1e-3, "w16": torch.randn(5, 64), "plain": torch.randn(5, 64)}
    loras, scales = [{}, {}], (0.5, -1.5)
    for i, lora in enumerate(loras):
        for j, (name, layer) in enumerate(model.items()):
            lora[f"{name}.lora_A.weight"], lora[f"{name}.lora_B.weight"] = _adapter(
                layer.out_features, 64, 4, seed=51 + 10 * i + j)
    with torch.no_grad():
        base = {name: layer(x[name]).double() for name, layer in model.items()}
        for lora, scale in zip(loras, scales):
            assert fuse_lora(model, lora, scale=scale, prefix="") == 3
        for name, layer in model.items():
            want = base[name] + sum(s * (x[name].double() @ lo[f"{name}.lora_A.weight"].double().T)
                                    @ lo[f"{name}.lora_B.weight"].double().T for lo, s in zip(loras, scales))
            err = (layer(x[name]).double() - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item(), f"{name}: off the two adapters' sum by {err}"
    assert unfuse_lora(model) == 3
    changed = _changed_keys(model.state_dict(), before)
    assert w4.rank == 8 and not changed, f"not restored bit for bit: {changed} (W4A4 rank {w4.rank}, was 8)"


def _saved_lora(tmp_path, pipe, names, metadata, seed):
    """Adapters on ``names`` of the tiny Flux pipeline's first double block, written by diffusers'
    ``save_lora_weights`` with ``metadata`` as the adapter config in the header; the file and the adapters."""
    from diffusers import FluxPipeline

    attn = pipe.transformer.transformer_blocks[0].attn
    ab = {n: _adapter(getattr(attn, n).out_features, getattr(attn, n).in_features, 4, seed=seed + i)
          for i, n in enumerate(names)}
    layers = {f"transformer_blocks.0.attn.{n}.lora_{p}.weight": t for n, (a, b) in ab.items()
              for p, t in zip("AB", (a, b))}
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers=layers,
                                   transformer_lora_adapter_metadata={"r": 4, "target_modules": names, **metadata})
    return tmp_path / "pytorch_lora_weights.safetensors", ab


def test_alpha_pattern_keys_match_whole_module_names(tmp_path):
    """An ``alpha_pattern`` key matches a module whose name ends with it at a ``.`` (peft's rule): ``q_proj`` is not
    ``add_q_proj``, which takes ``lora_alpha``; ``attn.to_q`` is ``...attn.to_q``."""
    from svdq_linear.convert.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("flux", seed=0)
    attn = pipe.transformer.transformer_blocks[0].attn
    names = ["add_q_proj", "to_q"]
    for n in names:
        setattr(attn, n, SVDQW4A4Linear.from_linear(getattr(attn, n), rank=8))
    path, ab = _saved_lora(tmp_path, pipe, names, {"lora_alpha": 4, "alpha_pattern": {"q_proj": 16, "attn.to_q": 8}},
                           seed=60)
    x = torch.randn(5, attn.to_q.in_features)
    base = {n: getattr(attn, n)(x).detach() for n in names}
    fuse_lora(pipe, path)
    got = {n: _delta_ratio(getattr(attn, n), base[n], x, *ab[n]) for n in names}
    assert got == pytest.approx({"add_q_proj": 4 / 4, "to_q": 8 / 4}, rel=1e-4), got


def test_a_lora_whose_saved_config_sets_dora_or_adapter_biases_is_refused(tmp_path):
    """A file whose adapter config says DoRA (``use_dora``) or adapter biases (``lora_bias``) would be applied as
    a plain LoRA, a different result: it is refused by name, and nothing changes."""
    from svdq_linear.convert.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("flux", seed=0)
    attn = pipe.transformer.transformer_blocks[0].attn
    attn.to_q = SVDQW4A4Linear.from_linear(attn.to_q, rank=8)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    for key in ("use_dora", "lora_bias"):
        (tmp_path / key).mkdir()
        path, _ = _saved_lora(tmp_path / key, pipe, ["to_q"], {"lora_alpha": 4, key: True}, seed=70)
        with pytest.raises(ValueError, match=f"saved config sets {key}: DoRA and adapter biases are not supported"):
            fuse_lora(pipe, path)
    changed = _changed_keys(pipe.transformer.state_dict(), before)
    assert not changed and unfuse_lora(pipe) == 0, f"a refused LoRA changed {changed}"


def test_unfuse_lora_refuses_offloaded_layers_and_removes_the_adapters_once_the_hooks_are_gone():
    """Under accelerate's sequential offload the hook holds the weights (with the adapters) and loads them every
    call: an edit of the placeholders would not remove anything, so ``unfuse_lora`` refuses by name. With the hooks
    removed it restores the layers."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    model = torch.nn.ModuleDict({"w4": _calibrated(k=64, n=32, rank=8, seed=80), "plain": torch.nn.Linear(64, 16)})
    lora = {}
    for i, (name, layer) in enumerate(model.items()):
        lora[f"{name}.lora_A.weight"], lora[f"{name}.lora_B.weight"] = _adapter(layer.out_features, 64, 4, seed=81 + i)
    x = torch.randn(3, 64) * 1e-3
    with torch.no_grad():
        base = {name: layer(x) for name, layer in model.items()}
        fuse_lora(model, lora, prefix="")
        adapted = {name: layer(x) for name, layer in model.items()}
        cpu_offload(model, execution_device=torch.device("cpu"))
        with pytest.raises(ValueError, match="has its weights offloaded"):
            unfuse_lora(model)
        for name, layer in model.items():
            assert torch.equal(layer(x), adapted[name]), f"{name}: the refused call changed the layer"
        remove_hook_from_module(model, recurse=True)
        assert unfuse_lora(model) == 2
        for name, layer in model.items():
            assert torch.equal(layer(x), base[name]), f"{name}: not the layer from before the LoRA"


def test_unfuse_lora_on_fused_qkv_removes_the_adapters_outside_the_stacked_layers():
    """Adapters on layers that no fused q/k/v layer stacks (output projections, feed-forwards, adaLN, embedders)
    are applied and removed while q/k/v stay fused: only adapters on the stacked layers need unfusing first."""
    model = _quantize(_tiny_flux())
    stacked = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "proj_mlp")
    sd = {k: v for k, v in _flux_lora(model).items() if k.split(".")[-3] not in stacked}
    model.fuse_qkv_projections()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = _flux_inputs()
    with torch.no_grad():
        base = model(**inputs)[0]
        assert fuse_lora(model, sd) == len(sd) // 2
        assert _rel(model(**inputs)[0], base) > 0.01, "the LoRA did not move the output"
        assert unfuse_lora(model) == len(sd) // 2
        assert torch.equal(model(**inputs)[0], base)
    changed = _changed_keys(model.state_dict(), before)
    assert not changed, f"not restored bit for bit: {changed}"
