"""Tiny, deterministic, random-weight diffusers pipelines for offline tests and the demo.

The real FLUX.1 / SD3-medium / SD3.5-medium checkpoints are tens of gigabytes and need the
Hugging Face Hub.  This module builds structurally faithful miniatures of them entirely in
memory -- transformer, VAE, text encoders, tokenizers and scheduler -- so that the converters
and the ``svdq_linear`` layers can be exercised on CPU, without network access, in seconds.
The README's demo uses the same pipelines.

* :func:`build_tiny_pipeline` returns a ready-to-run ``FluxPipeline`` (``"flux"``),
  ``StableDiffusion3Pipeline`` with an SD3-medium style transformer (``"sd3"``), or one with an
  SD3.5-medium style transformer (``"sd35"``: dual-attention blocks with ``attn2`` and RMS
  q/k norms).
* :func:`save_tiny_pipeline` writes one to a folder (safetensors) that
  ``DiffusionPipeline.from_pretrained(path)`` loads back offline.
* :data:`TINY_CALL_KWARGS` holds, per kind, the call arguments (steps, size, text length,
  guidance) that make a fast run: ``pipe(prompt, **TINY_CALL_KWARGS[kind])``.

Weights are random but a pure function of ``seed``: each component is initialised under its
own ``torch.manual_seed`` inside a forked RNG, so the caller's global RNG state is untouched.
Every ``nn.Linear`` of the transformers has ``in_features`` divisible by 16, as the
quantized kernels require.  Tokenizer vocabularies are written out by hand (no BPE/Unigram
training, whose tie-breaking is not stable across processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

__all__ = ["KINDS", "TINY_CALL_KWARGS", "build_tiny_pipeline", "save_tiny_pipeline"]

KINDS = ("flux", "sd3", "sd35")

# Text-encoder widths.  SD3 pads the concatenated CLIP hidden states (2 * CLIP_DIM) up to the
# T5 width, so T5_DIM must be at least that; Flux uses T5 states and the pooled CLIP output.
CLIP_DIM = 32
T5_DIM = 64
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 32
# VAE: two resolution levels (scale factor 2), 4 latent channels.
VAE_LATENT_CHANNELS = 4
VAE_BLOCK_OUT_CHANNELS = (16, 32)

_COMMON_CALL_KWARGS = dict(num_inference_steps=2, height=64, width=64, max_sequence_length=T5_MAX_LENGTH)
TINY_CALL_KWARGS: dict[str, dict[str, Any]] = {
    "flux": dict(_COMMON_CALL_KWARGS, guidance_scale=3.5),
    "sd3": dict(_COMMON_CALL_KWARGS, guidance_scale=5.0),
    "sd35": dict(_COMMON_CALL_KWARGS, guidance_scale=5.0),
}

_T = TypeVar("_T")


def _seeded(seed: int, factory: Callable[[], _T]) -> _T:
    """Run ``factory`` under ``torch.manual_seed(seed)`` with float32 as the default dtype,
    restoring the caller's global RNG state and default dtype afterwards."""
    default_dtype = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        try:
            return factory()
        finally:
            torch.set_default_dtype(default_dtype)


# --------------------------------------------------------------------------------------
# Tokenizers (hand-written vocabularies)
# --------------------------------------------------------------------------------------

_T5_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()"
_WORDS = ("a", "an", "the", "of", "in", "on", "and", "with", "photo", "cat", "dog", "astronaut",
          "riding", "horse", "red", "blue", "city", "night")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-level alphabet: a printable unicode character for every byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]  # mapped to chr(256), chr(257), ...
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _clip_tokenizer() -> CLIPTokenizer:
    """Byte-level BPE over all 256 bytes (plain and word-final ``</w>`` forms), plus the merges
    spelling out a few common words, plus ``<|startoftext|>`` / ``<|endoftext|>``."""
    alphabet = sorted(_bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []  # tokenizers' BPE wants pairs, not "a b" strings
    for word in _WORDS:  # left-to-right merges: (p, h), (ph, o), (pho, t), (phot, o</w>)
        prefix = word[0]
        for i, ch in enumerate(word[1:], start=1):
            right = ch + ("</w>" if i == len(word) - 1 else "")
            merge, merged = (prefix, right), prefix + right
            if merge not in merges:
                merges.append(merge)
                tokens.append(merged)
            prefix = merged
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def _t5_tokenizer() -> T5TokenizerFast:
    """Unigram vocabulary: the special tokens, ``▁``, single characters (with and without the
    ``▁`` word prefix) and a few whole words; scores are fixed so segmentation is stable."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(ch, -5.0) for ch in _T5_ALPHABET]
    pieces += [("▁" + ch, -4.0) for ch in _T5_ALPHABET]
    pieces += [("▁" + word, -3.0) for word in _WORDS]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


# --------------------------------------------------------------------------------------
# Text encoders
# --------------------------------------------------------------------------------------

def _clip_text_config(tokenizer: CLIPTokenizer, projection_dim: int = CLIP_DIM) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=CLIP_DIM,
        intermediate_size=2 * CLIP_DIM,
        projection_dim=projection_dim,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="gelu",
        # The pooled output is read at the first eos position, so the ids must match.
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _t5_encoder(tokenizer: T5TokenizerFast) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=T5_DIM,
        d_kv=16,
        d_ff=2 * T5_DIM,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    return T5EncoderModel(config).eval()


def _text_components(seed: int, num_clip: int) -> dict[str, Any]:
    """Components for ``num_clip`` CLIP encoders (1: Flux's CLIPTextModel; 2: SD3's pair of
    CLIPTextModelWithProjection) followed by a T5 encoder, keyed as the pipelines expect:
    ``text_encoder``/``tokenizer``, ``text_encoder_2``/``tokenizer_2``, ...."""
    clip_tok = _clip_tokenizer()
    t5_tok = _t5_tokenizer()
    clip_cls = CLIPTextModel if num_clip == 1 else CLIPTextModelWithProjection
    encoders = [
        _seeded(seed + 10 + i, lambda: clip_cls(_clip_text_config(clip_tok)).eval()) for i in range(num_clip)
    ]
    encoders.append(_seeded(seed + 20, lambda: _t5_encoder(t5_tok)))
    tokenizers = [clip_tok] * num_clip + [t5_tok]
    out: dict[str, Any] = {}
    for i, (enc, tok) in enumerate(zip(encoders, tokenizers)):
        suffix = "" if i == 0 else f"_{i + 1}"
        out["text_encoder" + suffix] = enc
        out["tokenizer" + suffix] = tok
    return out


# --------------------------------------------------------------------------------------
# VAE, scheduler, transformers
# --------------------------------------------------------------------------------------

def _vae() -> AutoencoderKL:
    levels = len(VAE_BLOCK_OUT_CHANNELS)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=VAE_BLOCK_OUT_CHANNELS,
        layers_per_block=1,
        latent_channels=VAE_LATENT_CHANNELS,
        norm_num_groups=8,
        sample_size=64,
        # Flux/SD3 pipelines decode with (latents / scaling_factor) + shift_factor.
        scaling_factor=1.5035,
        shift_factor=0.0609,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


def _scheduler(kind: str) -> FlowMatchEulerDiscreteScheduler:
    if kind == "flux":  # FLUX.1-dev: resolution-dependent shift (the pipeline passes mu)
        return FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


# Transformer sizes: 2 heads x 16 = 32 hidden channels, so every linear's in_features
# (32, 4*32 = 128 in the MLPs, 32 + 128 = 160 in Flux single blocks, 256 for the timestep
# embedding, 64 for the T5/pooled projections, 16 for Flux's packed latents) is a multiple of 16.
NUM_HEADS = 2
HEAD_DIM = 16


def _flux_transformer() -> FluxTransformer2DModel:
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * VAE_LATENT_CHANNELS,  # latents are packed as 2x2 patches
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=NUM_HEADS,
        joint_attention_dim=T5_DIM,
        pooled_projection_dim=CLIP_DIM,  # CLIPTextModel pooler output
        guidance_embeds=True,  # FLUX.1-dev style
        axes_dims_rope=(4, 6, 6),  # sums to HEAD_DIM
    ).eval()


def _sd3_transformer(kind: str) -> SD3Transformer2DModel:
    extra = dict(dual_attention_layers=(0,), qk_norm="rms_norm") if kind == "sd35" else {}
    return SD3Transformer2DModel(
        sample_size=32,  # latent size of a 64x64 image
        patch_size=2,
        in_channels=VAE_LATENT_CHANNELS,
        out_channels=VAE_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=HEAD_DIM,
        num_attention_heads=NUM_HEADS,
        joint_attention_dim=T5_DIM,
        caption_projection_dim=NUM_HEADS * HEAD_DIM,
        pooled_projection_dim=2 * CLIP_DIM,  # both CLIP projections, concatenated
        pos_embed_max_size=32,
        **extra,
    ).eval()


def build_tiny_pipeline(kind: str, seed: int = 0) -> DiffusionPipeline:
    """Build a tiny random-weight ``FluxPipeline`` ("flux") or ``StableDiffusion3Pipeline``
    ("sd3": SD3-medium style, "sd35": SD3.5-medium style) in float32 on CPU.

    The same ``kind`` and ``seed`` always give identical weights.  Run it fast with
    ``pipe(prompt, **TINY_CALL_KWARGS[kind])``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {KINDS}")
    if kind == "flux":
        pipeline_cls, transformer_factory, num_clip = FluxPipeline, _flux_transformer, 1
    else:
        pipeline_cls, transformer_factory, num_clip = StableDiffusion3Pipeline, lambda: _sd3_transformer(kind), 2
    pipe = pipeline_cls(
        transformer=_seeded(seed, transformer_factory),
        vae=_seeded(seed + 1, _vae),
        scheduler=_scheduler(kind),
        **_text_components(seed, num_clip),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_pipeline(kind: str, path: str | Path, seed: int = 0) -> Path:
    """Build the tiny ``kind`` pipeline and write it to ``path`` (safetensors weights, tokenizer
    files, configs); ``DiffusionPipeline.from_pretrained(path)`` loads it back offline."""
    path = Path(path)
    build_tiny_pipeline(kind, seed=seed).save_pretrained(path, safe_serialization=True)
    return path
