"""Tests for svdq_linear.convert.tiny: tiny random-weight Flux / SD3 / SD3.5 pipelines (CPU, offline); and, on tiny
models, svdq_linear.pipeline and the svdq_w4a4 quantization config (the converter's tests are in test_convert.py)."""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # must precede the huggingface_hub import

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusion3Pipeline

from svdq_linear.convert.tiny import KINDS, TINY_CALL_KWARGS, build_tiny_pipeline, save_tiny_pipeline

PROMPT = "a photo of an astronaut riding a horse"
PIPELINE_CLASS = {"flux": FluxPipeline, "sd3": StableDiffusion3Pipeline, "sd35": StableDiffusion3Pipeline}


def _generate(pipe, kind):
    pipe.set_progress_bar_config(disable=True)
    out = pipe(PROMPT, generator=torch.Generator().manual_seed(0), output_type="np", **TINY_CALL_KWARGS[kind])
    return out.images


@pytest.fixture(scope="module", params=KINDS)
def built(request):
    kind = request.param
    pipe = build_tiny_pipeline(kind, seed=0)
    return kind, pipe, _generate(pipe, kind)


def test_pipeline_class_and_dtype(built):
    kind, pipe, _ = built
    assert type(pipe) is PIPELINE_CLASS[kind]
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            assert {p.dtype for p in component.parameters()} == {torch.float32}, name


def test_runs_and_output_is_sane(built):
    kind, _, image = built
    kw = TINY_CALL_KWARGS[kind]
    assert image.shape == (1, kw["height"], kw["width"], 3)
    assert np.isfinite(image).all()
    assert image.std() > 1e-3


def test_transformer_linears_are_multiple_of_16(built):
    _, pipe, _ = built
    linears = {n: m for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears
    assert not {n: m.in_features for n, m in linears.items() if m.in_features % 16}


def test_sd35_has_dual_attention_and_rms_qk_norm(built):
    kind, pipe, _ = built
    if kind == "flux":
        pytest.skip("SD3-family only")
    blocks = pipe.transformer.transformer_blocks
    has_attn2 = [getattr(b, "attn2", None) is not None for b in blocks]
    has_qk_norm = blocks[0].attn.norm_q is not None
    assert any(has_attn2) == (kind == "sd35")
    assert has_qk_norm == (kind == "sd35")


def test_save_load_roundtrip(built, tmp_path):
    kind, pipe, image = built
    path = save_tiny_pipeline(kind, tmp_path / kind, seed=0)
    assert (path / "model_index.json").is_file()
    assert list((path / "transformer").glob("*.safetensors"))
    loaded = DiffusionPipeline.from_pretrained(path)
    assert type(loaded) is PIPELINE_CLASS[kind]
    for name, component in pipe.components.items():
        if name.startswith("tokenizer"):
            reloaded = loaded.components[name]
            assert reloaded(PROMPT).input_ids == component(PROMPT).input_ids, name
            assert reloaded.model_max_length == component.model_max_length, name
    # Loaded weights can sit at different memory alignments, which may change CPU GEMM
    # rounding in the last ulp, hence allclose rather than exact equality.
    np.testing.assert_allclose(_generate(loaded, kind), image, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_given_seed(kind):
    rng_state = torch.random.get_rng_state()
    a = build_tiny_pipeline(kind, seed=0).transformer.state_dict()
    b = build_tiny_pipeline(kind, seed=0).transformer.state_dict()
    c = build_tiny_pipeline(kind, seed=1).transformer.state_dict()
    assert torch.equal(torch.random.get_rng_state(), rng_state)  # caller's RNG untouched
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown tiny pipeline kind"):
        build_tiny_pipeline("sdxl")


# ---- svdq_linear.pipeline and the svdq_w4a4 config on tiny models (the converter's own tests: test_convert.py) --


def test_load_svdq_pipeline_gives_every_w4a4_layer_the_mode_it_is_asked_for(tmp_path):
    """``load_svdq_pipeline(..., mode=m)`` sets ``m`` on every W4A4 layer, over the environment's default (the tests
    run under ``SVDQ_LINEAR_MODE=exact``, so the mode asked for is the other one)."""
    import svdq_linear
    from svdq_linear import SVDQW4A4Linear, load_svdq_pipeline

    pipe = build_tiny_pipeline("flux", seed=0)
    svdq_linear.quantize_pipeline(pipe, rank=16, calib=False, progress=False)
    pipe.save_pretrained(tmp_path)
    mode = "exact" if os.environ.get("SVDQ_LINEAR_MODE") == "fast" else "fast"
    layers = [m for m in load_svdq_pipeline(tmp_path, mode=mode).transformer.modules()
              if isinstance(m, SVDQW4A4Linear)]
    modes = {m.mode for m in layers}
    assert layers and modes == {mode}, f"asked for {mode!r}, the layers run {modes}"


@pytest.mark.parametrize("edit, match", [
    ({"quant_method": "bitsandbytes_4bit"}, "expected quant_method 'svdq_w4a4', got 'bitsandbytes_4bit'"),
    ({"rnak": 16}, r"unknown svdq_w4a4 quantization_config keys: \['rnak'\]"),
    ({"format_version": 2}, "format_version 2 is not supported by this svdq-linear"),
])
def test_a_quantization_config_this_version_cannot_read_is_refused(edit, match):
    """A config of another quantizer, with a key this version does not know (a typo, a newer converter's), or of a
    newer format is refused by name (as diffusers builds it, ``from_dict``), not read as one it knows."""
    from svdq_linear.diffusers_quantizer import FORMAT_VERSION, SVDQuantizationConfig

    assert FORMAT_VERSION == 1
    with pytest.raises(ValueError, match=match):
        SVDQuantizationConfig.from_dict({"quant_method": "svdq_w4a4", "rank": 8, **edit})


def test_a_smoothing_group_takes_the_channel_maxima_of_all_its_members():
    """Layers of one ``smooth_groups`` group share one smoothing factor from the per-channel maxima of all their
    inputs: each member's own statistics give the layers that the group's maxima, given to every member, give."""
    from svdq_linear import quantize_linears

    torch.manual_seed(40)
    base = torch.nn.ModuleDict({"a": torch.nn.Linear(64, 32), "b": torch.nn.Linear(64, 48)})
    g = torch.Generator().manual_seed(41)
    act = {n: torch.rand(64, generator=g) * 4 + 0.1 for n in ("a", "b")}
    group = torch.maximum(act["a"], act["b"])
    own, shared = copy.deepcopy(base), copy.deepcopy(base)
    for model, stats in ((own, act), (shared, {"a": group, "b": group})):
        quantize_linears(model, w4a4=["a", "b"], rank=4, act_max=stats, smooth_groups={"a": "ab", "b": "ab"})
    assert torch.equal(own["a"].smooth, own["b"].smooth), "the group's layers have different smoothing factors"
    for n in ("a", "b"):
        got, want = own[n].state_dict(), shared[n].state_dict()
        differ = [k for k in want if not torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))]
        assert not differ, f"{n}: {differ} differ from the layer quantized with the group's maxima"


def test_layer_stats_count_the_linear_as_16_bit_and_the_quantized_layer_as_held():
    """``quantize_linears``' stats: ``bytes_before`` is the linear as 16-bit weight and bias (whatever its dtype),
    ``bytes_after`` the bytes the quantized layer holds."""
    from svdq_linear import quantize_linears

    model = torch.nn.ModuleDict({"a": torch.nn.Linear(64, 32), "b": torch.nn.Linear(64, 48)})  # fp32
    stats = quantize_linears(model, w4a4=["a"], w4a16=["b"], rank=4)
    for s, (k, n) in zip(stats, ((64, 32), (64, 48))):
        held = sum(t.numel() * t.element_size() for t in model[s.name].state_dict().values())
        assert (s.bytes_before, s.bytes_after) == (2 * (k * n + n), held), (s.name, s.bytes_before, s.bytes_after)


def test_quantize_linears_puts_every_layer_back_when_a_load_fails(monkeypatch):
    """A failure while the quantized layers take their tensors (memory) leaves the model with its own linears, the
    ones already swapped included."""
    from svdq_linear import SVDQW4A4Linear, quantize_linears

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))
    before = list(model)
    calls, real = [], SVDQW4A4Linear.load_state_dict

    def fail_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("simulated")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SVDQW4A4Linear, "load_state_dict", fail_second)
    with pytest.raises(torch.OutOfMemoryError):
        quantize_linears(model, w4a4=["0", "1"], rank=4)
    assert all(a is b for a, b in zip(model, before)), f"left in the model: {[type(m).__name__ for m in model]}"


def test_quantize_state_dict_passes_non_float_tensors_through_uncast():
    """The tensors beside the quantized linears pass through, floats cast to ``dtype`` and others (integer ids,
    masks) as they are."""
    from svdq_linear.pipeline import quantize_state_dict

    g = torch.Generator().manual_seed(42)
    tensors = {"fc.weight": torch.randn(32, 64, generator=g), "fc.bias": torch.randn(32, generator=g),
               "ids": torch.arange(8), "mask": torch.rand(4, generator=g) > 0.5, "scale": torch.randn(3, generator=g)}
    out, _ = quantize_state_dict(tensors, {"fc": "w4a4"}, dtype=torch.bfloat16)
    assert out["fc.proj_down"].dtype == out["scale"].dtype == torch.bfloat16
    for key in ("ids", "mask"):
        assert out[key].dtype == tensors[key].dtype and torch.equal(out[key], tensors[key]), (key, out[key])
