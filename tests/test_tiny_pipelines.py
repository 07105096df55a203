"""Tests for svdq_linear.convert.tiny: tiny random-weight Flux / SD3 / SD3.5 pipelines (CPU, offline)."""

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
