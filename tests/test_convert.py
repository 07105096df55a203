"""svdq-convert, load_svdq_pipeline, the diffusers quantizer and in-place quantization, on tiny pipelines.

All offline on CPU in float32: tiny Flux / SD3 / SD3.5 pipelines are built and saved by the tests.
"""

import io
import json
import os
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import svdq_linear
from svdq_linear.convert import recipes
from svdq_linear.convert.convert import FAIL_AFTER_ENV
from svdq_linear.convert.tiny import KINDS, TINY_CALL_KWARGS, build_tiny_pipeline, save_tiny_pipeline
from svdq_linear import NVFP4W4A16Linear, SVDQW4A4Linear, load_svdq_pipeline
from svdq_linear.svdquant import SVDQuantConfig

PROMPT = "a photo of a cat wearing a hat"
PSNR_MIN_DB = 30.0  # W4A4 rank 8 of the tiny random models lands near 50 dB; plain noise is ~8 dB
CONVERT_ARGS = ["--rank", "8", "--dtype", "float32", "--calib-num", "2", "--calib-steps", "2",
                "--calib-resolution", "64", "--quiet"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "svdq_linear.convert.cli", *map(str, args)], capture_output=True,
                          text=True, env={**ENV, **(env or {})}, timeout=600)


def generate(pipe, kind):
    pipe.set_progress_bar_config(disable=True)
    out = pipe(PROMPT, generator=torch.Generator().manual_seed(0), output_type="np", **TINY_CALL_KWARGS[kind])
    return out.images[0]


def psnr(a, b):
    return 10 * np.log10(1.0 / max(float(np.mean((a - b) ** 2)), 1e-12))


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    srcs = {kind: save_tiny_pipeline(kind, root / kind) for kind in KINDS}
    (srcs["flux"] / "stray.safetensors").write_bytes(b"not a component")  # like flux1-dev.safetensors
    return srcs


@pytest.fixture(scope="module")
def references():
    return {kind: generate(build_tiny_pipeline(kind), kind) for kind in KINDS}


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("out")
    outs = {}
    for kind in KINDS:
        r = run_cli(sources[kind], root / kind, *CONVERT_ARGS)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "W4A4 relative weight error: median" in r.stdout, r.stdout
        outs[kind] = root / kind
    return outs


@pytest.mark.parametrize("kind", KINDS)
def test_convert_then_load_both_ways_keeps_the_image(kind, converted, references):
    out = converted[kind]
    assert not out.with_name(out.name + ".partial").exists()
    mine = load_svdq_pipeline(out, dtype=torch.float32)
    stock = svdq_linear_stock_load(out)
    assert isinstance(mine.transformer.transformer_blocks[0].attn.to_q, SVDQW4A4Linear)
    assert isinstance(stock.transformer.transformer_blocks[0].norm1.linear, NVFP4W4A16Linear)
    a, b = generate(mine, kind), generate(stock, kind)
    assert np.array_equal(a, b), "load_svdq_pipeline and DiffusionPipeline.from_pretrained differ"
    assert psnr(a, references[kind]) > PSNR_MIN_DB, f"PSNR {psnr(a, references[kind]):.1f} dB"


def svdq_linear_stock_load(path):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(path, dtype=torch.float32)


def test_output_folder_layout_and_config(converted):
    out = converted["flux"]
    qcfg = json.loads((out / "transformer" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"].startswith("svdq_w4a4") and qcfg["format_version"] == 1 and qcfg["rank"] == 8
    assert qcfg["dtype"] == "float32"  # what the 16-bit tensors are stored in (--dtype)
    assert "transformer_blocks.0.attn.to_q" in qcfg["w4a4_modules"]
    assert "single_transformer_blocks.0.proj_out" in qcfg["w4a4_modules"]
    assert "transformer_blocks.0.norm1_context.linear" in qcfg["w4a16_modules"]
    assert qcfg["calibration"]["enabled"] and qcfg["calibration"]["num_prompts"] == 2
    for part in ("model_index.json", "scheduler", "tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "vae"):
        assert (out / part).exists(), part
    assert not (out / "stray.safetensors").exists(), "root files outside the components are not copied"
    index = json.loads((out / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 5  # 2 double blocks + 2 single blocks + the rest
    sd = load_file(out / "transformer" / index["weight_map"]["transformer_blocks.0.attn.to_q.qweight"])
    assert sd["transformer_blocks.0.attn.to_q.qweight"].dtype == torch.uint8
    assert sd["transformer_blocks.0.attn.to_q.wscales"].dtype == torch.float8_e4m3fn
    # q/k/v read one input: one smoothing factor.
    assert torch.equal(sd["transformer_blocks.0.attn.to_q.smooth"], sd["transformer_blocks.0.attn.to_v.smooth"])
    assert not any(k.endswith(".weight") and "attn.to_" in k for k in index["weight_map"])


def test_stock_model_from_pretrained_builds_quantized_modules(converted):
    from diffusers import FluxTransformer2DModel

    out = converted["flux"]
    model = FluxTransformer2DModel.from_pretrained(out, subfolder="transformer", dtype=torch.bfloat16)
    layer = model.single_transformer_blocks[1].attn.to_k
    assert isinstance(layer, SVDQW4A4Linear) and layer.proj_down.dtype == torch.bfloat16
    assert layer.wcscale.dtype == torch.float32 and layer.wscales.dtype == torch.float8_e4m3fn
    index = json.loads((out / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    key = "single_transformer_blocks.1.attn.to_k.qweight"
    assert torch.equal(layer.qweight, load_file(out / "transformer" / index["weight_map"][key])[key])


def test_without_svdq_linear_the_folder_fails_saying_to_import_it(converted):
    code = ("from diffusers import FluxTransformer2DModel as M\n"
            f"M.from_pretrained({str(converted['flux'])!r}, subfolder='transformer')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and "Unknown quantization type, got svdq_w4a4" in last, r.stderr[-2000:]
    assert "import svdq_linear" in last and "pip install svdq-linear" in last, last


def test_folders_written_before_the_hint_still_load(converted, tmp_path):
    from diffusers import FluxTransformer2DModel

    out = _copy(converted, tmp_path)
    _edit_json(out / "transformer" / "config.json", lambda c: c["quantization_config"].update(quant_method="svdq_w4a4"))
    model = FluxTransformer2DModel.from_pretrained(out, subfolder="transformer")
    assert isinstance(model.transformer_blocks[0].attn.to_q, SVDQW4A4Linear)


def _transformer_inputs(model, g=None):
    """Random inputs of a tiny transformer's forward from its config (16 image and 8 text tokens; ``g`` or the global
    generator)."""
    cfg = model.config
    text = dict(encoder_hidden_states=torch.randn(1, 8, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g))
    if "guidance_embeds" in cfg:  # Flux
        return dict(hidden_states=torch.randn(1, 16, cfg.in_channels, generator=g), **text,
                    timestep=torch.rand(1, generator=g), img_ids=torch.randint(0, 4, (16, 3), generator=g).float(),
                    txt_ids=torch.zeros(8, 3), guidance=torch.full((1,), 3.5) if cfg.guidance_embeds else None)
    return dict(hidden_states=torch.randn(1, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g), **text,
                timestep=torch.rand(1, generator=g) * 1000)


@pytest.mark.parametrize("kind", KINDS)
def test_fuse_qkv_projections_is_exact_and_keeps_the_checkpoint(converted, kind):
    """Fusing q/k/v is exact (SD3.5 too: diffusers' fused SD3 processor skipped its q/k norms and failed on its
    attention without a context stream), keeps what a checkpoint holds, pickles, and unfuses back to separate
    layers (SD3's own unfuse put the processors back only, leaving the layers fused)."""
    from svdq_linear.fuse import _FUSED_NAMES
    from svdq_linear.linear import SVDQW4A4Linear

    pipe = load_svdq_pipeline(converted[kind], dtype=torch.float32)
    model = pipe.transformer
    keys = set(model.state_dict())
    attn = model.transformer_blocks[0].attn
    torch.manual_seed(1)
    inputs = _transformer_inputs(model)
    with torch.no_grad():
        before = model(**inputs).sample
        model.fuse_qkv_projections()
        assert isinstance(attn.to_qkv, SVDQW4A4Linear) and attn.fused_projections
        assert attn.to_qkv.out_features == 3 * attn.to_q.out_features
        # q/k/v keep views of the fused packed weight: no second copy
        assert attn.to_q.qweight.data_ptr() == attn.to_qkv.qweight.data_ptr()
        calls = []
        hooks = [attn.to_q.register_forward_hook(lambda *a: calls.append(1))]
        if kind == "flux":  # single blocks: q/k/v and proj_mlp in one layer (tests/test_fuse_single.py)
            single = model.single_transformer_blocks[0]
            assert single.attn.to_qkv_mlp.out_features == 3 * single.attn.to_q.out_features + single.mlp_hidden_dim
            hooks.append(single.proj_mlp.register_forward_hook(lambda *a: calls.append(2)))
        after = model(**inputs).sample
        for hook in hooks:
            hook.remove()
    assert not calls, "the fused model still ran a separate projection"
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == keys, "fusing must not change what a checkpoint holds"
    buf = io.BytesIO()
    torch.save(model, buf)  # the whole fused model pickles (its attention modules' fuse methods included)
    buf.seek(0)
    twin = torch.load(buf, weights_only=False)
    with torch.no_grad():  # (the unpickled tensors may take other CPU matmul paths: an fp32 ulp)
        torch.testing.assert_close(twin(**inputs).sample, after, rtol=1e-6, atol=1e-6)
    model.unfuse_qkv_projections()
    assert not [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in _FUSED_NAMES]
    assert not [n for n, m in model.named_modules() if getattr(m, "fused_projections", False)]
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).sample, before, rtol=1e-5, atol=1e-5)
    k_proj = attn.to_k  # no longer part of a fused layer: it takes a LoRA
    lora = {"transformer.transformer_blocks.0.attn.to_k.lora_A.weight": torch.randn(2, k_proj.in_features),
            "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": torch.randn(k_proj.out_features, 2)}
    assert svdq_linear.fuse_lora(model, lora) == 1 and svdq_linear.unfuse_lora(model) == 1


def test_fused_sd3_attention_runs_its_separate_layers_under_sequential_offload(converted):
    """accelerate's sequential offload loads each module from a ``state_dict`` snapshot, where the stacked layers
    are not: the fused SD3 processor runs the separate layers there (it raised ``KeyError: ...to_qkv.qweight``)."""
    from accelerate import cpu_offload

    model = load_svdq_pipeline(converted["sd3"], dtype=torch.float32).transformer
    model.fuse_qkv_projections()
    torch.manual_seed(1)
    inputs = _transformer_inputs(model)
    with torch.no_grad():
        want = model(**inputs).sample
        cpu_offload(model, execution_device=torch.device("cpu"))
        assert model.transformer_blocks[0].attn.to_qkv.qweight.is_meta
        # the separate layers' float32 products, summed by the CPU's BLAS in other blocks than the stacked layer's
        # (one float32 unit in a third of the values on an AMD EPYC; bit for bit on Intel)
        torch.testing.assert_close(model(**inputs).sample, want, rtol=1e-5, atol=1e-6)


def test_concat_refuses_layers_that_do_not_share_an_input():
    from svdq_linear.fuse import concat_w4a4
    from svdq_linear.linear import SVDQW4A4Linear

    a = SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=4, act_max=torch.rand(64) + 1)
    b = SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=4, act_max=torch.rand(64) + 1)
    with pytest.raises(ValueError, match="smoothing factor"):
        concat_w4a4([a, b])
    with pytest.raises(ValueError, match="in_features"):
        concat_w4a4([a, SVDQW4A4Linear.from_linear(torch.nn.Linear(48, 32), rank=4)])


def test_no_calib_uses_unit_smoothing(sources, tmp_path):
    r = run_cli(sources["sd3"], tmp_path / "o", "--no-calib", "--rank", "4", "--dtype", "float32", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    qcfg = json.loads((tmp_path / "o" / "transformer" / "config.json").read_text())["quantization_config"]
    assert qcfg["calibration"]["enabled"] is False and qcfg["rank"] == 4
    model = load_svdq_pipeline(tmp_path / "o", dtype=torch.float32).transformer
    assert torch.all(model.transformer_blocks[0].attn.to_q.smooth == 1.0)


def _all_tensors(folder: Path) -> dict:
    out = {}
    for f in sorted((folder / "transformer").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_resume_after_a_crash_gives_the_same_output(sources, converted, tmp_path):
    out = tmp_path / "o"
    crashed = run_cli(sources["flux"], out, *CONVERT_ARGS, env={FAIL_AFTER_ENV: "2"})
    assert crashed.returncode != 0 and "simulated crash" in crashed.stderr and "rerun with --resume" in crashed.stderr
    assert not out.exists(), "a failed run must not leave a complete-looking out_dir"
    assert (tmp_path / "o.partial" / "progress.json").is_file()
    again = run_cli(sources["flux"], out, *CONVERT_ARGS)
    assert again.returncode != 0 and "--resume" in again.stderr
    other = run_cli(sources["flux"], out, *CONVERT_ARGS[:-1], "--rank", "4", "--resume", "--quiet")
    assert other.returncode != 0 and "other settings (rank: 8 there, 4 now)" in other.stderr
    resumed = run_cli(sources["flux"], out, *CONVERT_ARGS, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "3 blocks converted, 2 resumed" in resumed.stdout
    a, b = _all_tensors(out), _all_tensors(converted["flux"])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def test_missing_path_is_a_clear_error(tmp_path):
    r = run_cli(tmp_path / "nope", tmp_path / "o")
    assert r.returncode == 2 and "is not a local folder" in r.stderr and not (tmp_path / "o").exists()


def test_existing_out_dir_is_refused(sources, converted):
    r = run_cli(sources["flux"], converted["flux"], *CONVERT_ARGS)
    assert r.returncode == 2 and "already exists; pass --overwrite to replace it" in r.stderr


def test_overwrite_replaces_only_an_svdq_convert_output(sources, tmp_path):
    from svdq_linear.convert.convert import ConvertOptions, convert

    opts = ConvertOptions(rank=4, calib=False, dtype="float32", progress=False, overwrite=True)
    mine = tmp_path / "not-ours"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not an svdq-convert output"):
        convert(str(sources["sd3"]), mine, opts)
    assert (mine / "notes.txt").read_text() == "keep me"
    out = tmp_path / "o"
    convert(str(sources["sd3"]), out, opts)
    (out / "stale").write_text("from the earlier run")
    convert(str(sources["sd3"]), out, opts)
    assert not (out / "stale").exists() and (out / "transformer" / "config.json").is_file()
    assert not out.with_name("o.partial").exists() and not out.with_name("o.replaced").exists()


def test_overwrite_removes_no_partial_or_replaced_folder_it_did_not_write(sources, tmp_path):
    """``--overwrite`` removes ``<out>.partial`` only when it is an unfinished svdq-convert run (its progress.json,
    or the empty ``transformer/`` a run leaves before writing it), and the swap's ``<out>.replaced`` only when it
    is an svdq-convert output (an earlier swap's leftover); other folders there are refused by name, untouched."""
    from svdq_linear.convert.convert import ConvertError, ConvertOptions, convert

    opts = ConvertOptions(rank=4, calib=False, dtype="float32", progress=False, overwrite=True)
    out, partial, replaced = tmp_path / "o", tmp_path / "o.partial", tmp_path / "o.replaced"
    (partial / "precious").mkdir(parents=True)
    (partial / "precious" / "notes.txt").write_text("keep me")
    for o in (opts, ConvertOptions(rank=4, calib=False, dtype="float32", progress=False)):
        with pytest.raises(ConvertError, match="not an unfinished svdq-convert run.*remove it or pick another"):
            convert(str(sources["sd3"]), out, o)
        assert (partial / "precious" / "notes.txt").read_text() == "keep me" and not out.exists()
    shutil.rmtree(partial / "precious")
    (partial / "transformer").mkdir()  # what a run leaves when stopped before its progress.json
    convert(str(sources["sd3"]), out, opts)
    assert (out / "transformer" / "config.json").is_file() and not partial.exists()
    (replaced / "precious").mkdir(parents=True)
    (replaced / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="o.replaced exists and is not an svdq-convert output"):
        convert(str(sources["sd3"]), out, opts)
    assert (replaced / "precious" / "notes.txt").read_text() == "keep me" and (out / "transformer").is_dir()
    shutil.rmtree(replaced)
    shutil.copytree(out, replaced)  # an earlier swap's leftover goes
    convert(str(sources["sd3"]), out, opts)
    assert not replaced.exists() and not partial.exists() and (out / "transformer" / "config.json").is_file()


def test_unsupported_pipeline_is_a_clear_error(sources, tmp_path):
    src = tmp_path / "pixart"
    shutil.copytree(sources["flux"], src)
    _edit_json(src / "transformer" / "config.json", lambda c: c.update(_class_name="PixArtTransformer2DModel"))
    r = run_cli(src, tmp_path / "o", *CONVERT_ARGS)
    assert r.returncode == 2 and "unsupported transformer class 'PixArtTransformer2DModel'" in r.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def _copy(converted, tmp_path, kind="flux"):
    dst = tmp_path / f"copy-{kind}"
    shutil.copytree(converted[kind], dst)
    return dst


def test_corrupted_source_checkpoint_is_a_clear_error(sources, tmp_path):
    src = tmp_path / "broken"
    shutil.copytree(sources["sd3"], src)
    ckpt = src / "transformer" / "diffusion_pytorch_model.safetensors"
    ckpt.write_bytes(ckpt.read_bytes()[:-64])
    r = run_cli(src, tmp_path / "o", *CONVERT_ARGS)
    assert r.returncode == 2 and "diffusion_pytorch_model.safetensors is corrupted or truncated" in r.stderr
    assert not (tmp_path / "o").exists()


def test_checkpoint_missing_tensors_is_a_clear_error(sources, tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "incomplete"
    shutil.copytree(sources["flux"], src)
    ckpt = src / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(ckpt)
    del tensors["transformer_blocks.1.attn.to_k.weight"]
    save_file(tensors, ckpt)
    r = run_cli(src, tmp_path / "o", *CONVERT_ARGS)
    assert r.returncode == 2 and "1 missing (e.g. ['transformer_blocks.1.attn.to_k.weight'])" in r.stderr


def test_corrupted_shard_is_a_clear_error(converted, tmp_path):
    out = _copy(converted, tmp_path)
    shard = sorted((out / "transformer").glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{shard.name} is corrupted or truncated"):
        load_svdq_pipeline(out, dtype=torch.float32)


def test_shards_are_held_to_their_index(converted, tmp_path):
    """A sharded checkpoint's tensors are what its index lists, each in one shard: a second copy in another shard
    (which would silently replace the one the index names) and a tensor the index does not list (which would load
    unchecked) are refused by name, as is an index key no shard holds."""
    from safetensors.torch import save_file

    def shard_of(folder, key):
        index = json.loads((folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
        return folder / "transformer" / index["weight_map"][key], sorted(set(index["weight_map"].values()))

    key = "transformer_blocks.0.attn.to_q.proj_up"
    for case, match in (("copy", f"{key} is in two checkpoint files"),
                        ("unlisted", r"1 tensors in the checkpoint's shards are not in its index \(e.g. \['extra'\]"),
                        ("absent", rf"index lists 1 tensors that no shard holds \(e.g. \['{key}'\]")):
        out = _copy(converted, tmp_path / case)
        home, shards = shard_of(out, key)
        other = out / "transformer" / next(s for s in shards if s != home.name)
        tensors = load_file(other)
        if case == "copy":
            tensors[key] = torch.full_like(load_file(home)[key], 7.0)
        elif case == "unlisted":
            tensors["extra"] = torch.zeros(3)
        save_file(tensors, other)
        if case == "absent":
            tensors = load_file(home)
            del tensors[key]
            save_file(tensors, home)
        with pytest.raises(ValueError, match=match):
            load_svdq_pipeline(out, dtype=torch.float32)


def test_disk_offload_is_refused_by_name(converted, tmp_path):
    """A device_map that puts modules on disk (too little max_memory) is refused before loading, naming them; it
    used to end in "N tensors were never loaded"."""
    from diffusers import FluxTransformer2DModel

    with pytest.raises(ValueError, match=r"do not load with disk offload \(the device_map puts \d+ modules on disk"):
        FluxTransformer2DModel.from_pretrained(converted["flux"], subfolder="transformer", device_map="auto",
                                               max_memory={"cpu": "60KB"}, offload_folder=str(tmp_path / "off"))


def test_config_that_does_not_match_the_weights_is_a_clear_error(converted, tmp_path):
    from diffusers import FluxTransformer2DModel

    out = _copy(converted, tmp_path)
    cfg_path = out / "transformer" / "config.json"
    _edit_json(cfg_path, lambda c: c["quantization_config"]["w4a4_modules"].remove("transformer_blocks.1.ff.net.2"))
    with pytest.raises(ValueError, match="does not match its quantization_config"):
        load_svdq_pipeline(out, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not match its quantization_config"):
        FluxTransformer2DModel.from_pretrained(out, subfolder="transformer")
    _edit_json(cfg_path, lambda c: c["quantization_config"]["w4a4_modules"].append("transformer_blocks.1.ff.net.2"))
    _edit_json(cfg_path, lambda c: c["quantization_config"].update(rank=4))
    with pytest.raises(ValueError, match=r"proj_down: expected shape \[32, 4\]"):
        load_svdq_pipeline(out, dtype=torch.float32)


def _damage(folder: Path, key: str, edit) -> None:
    """Rewrite one tensor of a converted folder's transformer checkpoint."""
    from safetensors.torch import save_file

    index = json.loads((folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shard = folder / "transformer" / index["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = edit(tensors[key])
    save_file(tensors, shard)


def _with(t, index, value):
    t = t.clone()
    t.view(-1)[index] = value
    return t


LAYER = "transformer_blocks.1.attn.to_k"


@pytest.mark.parametrize("name, edit, match", [
    ("proj_up", lambda t: t.to(torch.bfloat16),
     r"proj_up: expected torch.float32, the checkpoint's recorded dtype \(quantization_config.dtype\), got torch.bfloat16"),
    ("bias", lambda t: t.to(torch.float16), r"bias: expected torch.float32, the checkpoint's recorded dtype"),
    ("wcscale", lambda t: t.to(torch.bfloat16), r"wcscale: expected dtype torch.float32, got torch.bfloat16"),
    ("smooth", lambda t: t.double(), r"smooth: expected dtype torch.float32, got torch.float64"),
    ("smooth", lambda t: _with(t, 3, 0.0), r"smooth: expected finite positive smoothing factors, got 1 zero "
                                           r"\(first at index 3: 0.0\)"),
    ("smooth", lambda t: _with(t, 5, -2.0), r"smooth: .* got 1 negative \(first at index 5: -2.0\)"),
    ("smooth", lambda t: _with(t, 0, float("nan")), r"smooth: .* got 1 NaN \(first at index 0: nan\)"),
    ("smooth", lambda t: _with(t, 7, float("inf")), r"smooth: .* got 1 Inf \(first at index 7: inf\)"),
    ("wcscale", lambda t: _with(t, 2, 0.0), r"wcscale: expected finite positive per-row weight scales, got 1 zero "
                                            r"\(first at index 2: 0.0\)"),
    ("wcscale", lambda t: -t, r"wcscale: .* got 32 negative"),
    ("wcscale", lambda t: _with(t, 1, float("nan")), r"wcscale: .* got 1 NaN \(first at index 1: nan\)"),
    ("wscales", lambda t: _with(t.view(torch.uint8), 5, 0x7F).view(torch.float8_e4m3fn),
     r"wscales: expected finite E4M3 block scales, got 1 NaN scale bytes \(0x7F/0xFF; first at \[row, block\] = \[2, 1\]\)"),
    ("wscales", lambda t: _with(t.view(torch.uint8), 0, 0xFF).view(torch.float8_e4m3fn),
     r"wscales: .* got 1 NaN scale bytes \(0x7F/0xFF; first at \[row, block\] = \[0, 0\]\)"),
])
def test_damaged_tensor_is_refused_by_name(converted, tmp_path, name, edit, match):
    from diffusers import FluxTransformer2DModel

    out = _copy(converted, tmp_path)
    _damage(out, f"{LAYER}.{name}", edit)
    with pytest.raises(ValueError, match=rf"{LAYER}\.{match}"):
        FluxTransformer2DModel.from_pretrained(out, subfolder="transformer", dtype=torch.bfloat16)


def test_loading_in_another_dtype_records_it_for_the_next_save(converted, tmp_path):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(converted["flux"], subfolder="transformer", dtype=torch.bfloat16)
    assert model.transformer_blocks[0].attn.to_q.proj_down.dtype == torch.bfloat16
    model.save_pretrained(tmp_path / "bf16")
    qcfg = json.loads((tmp_path / "bf16" / "config.json").read_text())["quantization_config"]
    assert qcfg["dtype"] == "bfloat16" and qcfg["quant_method"].startswith("svdq_w4a4")
    again = FluxTransformer2DModel.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert torch.equal(again.transformer_blocks[0].attn.to_q.proj_up, model.transformer_blocks[0].attn.to_q.proj_up)


def test_a_save_that_would_not_load_again_is_refused_before_writing(converted, tmp_path):
    """``safe_serialization=False`` wrote a pickle that the loader refuses; a cast past diffusers' refusal wrote the
    new dtype under the old record (a folder that did not load), and a cast of some blocks wrote two dtypes."""
    from diffusers import FluxTransformer2DModel

    pipe = load_svdq_pipeline(converted["flux"], dtype=torch.float32)
    model = pipe.transformer
    for save, where in ((model.save_pretrained, tmp_path / "pickled"), (pipe.save_pretrained, tmp_path / "pipe")):
        with pytest.raises(ValueError, match="saved as safetensors only: save_pretrained.safe_serialization=False"):
            save(where, safe_serialization=False)
        assert not where.exists(), "nothing written"
    with pytest.raises(ValueError, match="saved as safetensors only"):
        model.save_pretrained(tmp_path / "positional", True, None, False)  # is_main_process, save_function, safe
    # Not quantized by this library: saved as before.
    torch.nn.Module.to(pipe.vae, torch.float16).save_pretrained(tmp_path / "vae", safe_serialization=False)
    assert (tmp_path / "vae" / "diffusion_pytorch_model.bin").exists()

    torch.nn.Module.to(model.transformer_blocks, torch.float16)
    with pytest.raises(ValueError, match=r"16-bit tensors hold 2 dtypes, float16 \(transformer_blocks.0.*"
                                         r"float32 \(single_transformer_blocks.0"):
        model.save_pretrained(tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
    torch.nn.Module.to(model, torch.float16)  # the whole model, past diffusers' refusal of .to(dtype)
    model.save_pretrained(tmp_path / "fp16")
    assert json.loads((tmp_path / "fp16" / "config.json").read_text())["quantization_config"]["dtype"] == "float16"
    again = FluxTransformer2DModel.from_pretrained(tmp_path / "fp16", dtype=torch.float16)
    assert torch.equal(again.transformer_blocks[0].attn.to_q.proj_up, model.transformer_blocks[0].attn.to_q.proj_up)


@pytest.mark.parametrize("edit, match", [
    ({"rank": 8.7}, "rank: expected an integer >= 0, got 8.7"),
    ({"rank": "8"}, "rank: expected an integer >= 0, got '8'"),
    ({"rank": True}, "rank: expected an integer >= 0, got True"),
    ({"w4a4_modules": "transformer_blocks.0.attn.to_q"},
     "w4a4_modules: expected a list of module names, got str 'transformer_blocks.0.attn.to_q'"),
    ({"w4a16_modules": [1, 2]}, "w4a16_modules: expected a list of module names, got list"),
    ({"smooth_groups": ["a"]}, "smooth_groups: expected a mapping, got list"),
    ({"format_version": "1"}, "format_version: expected an integer >= 1, got '1'"),
    ({"format_version": 0}, "format_version: expected an integer >= 1, got 0"),
])
def test_quantization_config_of_the_wrong_type_is_refused_by_key(converted, tmp_path, edit, match):
    out = _copy(converted, tmp_path)
    _edit_json(out / "transformer" / "config.json", lambda c: c["quantization_config"].update(edit))
    with pytest.raises(ValueError, match=match):
        load_svdq_pipeline(out, dtype=torch.float32)


def test_load_svdq_pipeline_goes_through_the_diffusers_quantizer(converted, monkeypatch):
    from diffusers.quantizers import auto

    from svdq_linear.diffusers_quantizer import QUANT_METHOD_KEYS, SVDQuantizer

    claimed = []
    create = SVDQuantizer.create_quantized_param
    monkeypatch.setattr(SVDQuantizer, "create_quantized_param",
                        lambda self, model, value, name, *a, **k: claimed.append(name) or create(
                            self, model, value, name, *a, **k))

    class Foreign:  # another package under our name: register() failed at import
        pass

    for key in QUANT_METHOD_KEYS:
        monkeypatch.setitem(auto.AUTO_QUANTIZER_MAPPING, key, Foreign)
    pipe = load_svdq_pipeline(converted["sd3"], dtype=torch.float32)
    assert isinstance(pipe.transformer.hf_quantizer, SVDQuantizer) and pipe.transformer.is_quantized
    layers = {n for n, m in pipe.transformer.named_modules() if isinstance(m, (SVDQW4A4Linear, NVFP4W4A16Linear))}
    assert {c.rpartition(".")[0] for c in claimed} == layers, "every quantized tensor loads through the quantizer"
    assert all(auto.AUTO_QUANTIZER_MAPPING[k] is Foreign for k in QUANT_METHOD_KEYS), "the foreign entry is put back"


def test_load_svdq_pipeline_takes_torch_dtype_as_dtype(converted):
    """diffusers' older keyword ``torch_dtype`` sets the pipeline's dtype as ``dtype`` does (it used to clash with
    the ``dtype`` default passed along); both at once are refused."""
    pipe = load_svdq_pipeline(converted["sd3"], torch_dtype=torch.float16)
    assert pipe.transformer.dtype == torch.float16
    assert load_svdq_pipeline(converted["sd3"]).transformer.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype or torch_dtype"):
        load_svdq_pipeline(converted["sd3"], dtype=torch.float16, torch_dtype=torch.float16)


def test_newer_format_version_is_refused(converted, tmp_path):
    out = _copy(converted, tmp_path)
    _edit_json(out / "transformer" / "config.json", lambda c: c["quantization_config"].update(format_version=99))
    with pytest.raises(ValueError, match="format_version 99 is not supported"):
        load_svdq_pipeline(out, dtype=torch.float32)


def test_push_to_hub_offline_fails_after_a_complete_conversion(sources, tmp_path):
    r = run_cli(sources["sd3"], tmp_path / "o", "--no-calib", "--rank", "4", "--quiet", "--push-to-hub", "me/x")
    assert r.returncode == 3 and "could not push to me/x" in r.stderr
    assert (tmp_path / "o" / "transformer" / "config.json").is_file()


def test_help():
    r = run_cli("--help")
    assert r.returncode == 0 and "--calib-prompts" in r.stdout and "--resume" in r.stdout


# ---- in place -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["flux", "sd35"])
def test_quantize_pipeline_in_place_then_save_and_load(kind, references, tmp_path):
    pipe = build_tiny_pipeline(kind)
    call = {k: v for k, v in TINY_CALL_KWARGS[kind].items() if k != "num_inference_steps"}
    stats = svdq_linear.quantize_pipeline(pipe, rank=8, calib_prompts=[PROMPT, "a dog"], calib_steps=2,
                                          call_kwargs=call, progress=False)
    recipe_count = len(stats)
    assert recipe_count == sum(isinstance(m, (SVDQW4A4Linear, NVFP4W4A16Linear)) for m in pipe.transformer.modules())
    img = generate(pipe, kind)
    assert psnr(img, references[kind]) > PSNR_MIN_DB
    pipe.save_pretrained(tmp_path / "saved")
    again = load_svdq_pipeline(tmp_path / "saved", dtype=torch.float32)
    assert np.array_equal(generate(again, kind), img)


def test_quantize_pipeline_refuses_a_partly_quantized_transformer(monkeypatch):
    """A run stopped partway (an error, Ctrl-C) leaves its quantized layers in place and no quantization_config.
    Quantizing again would take the rest only and record only those, so the saved folder would not load: refused,
    naming what is there."""
    from svdq_linear.convert import convert as convert_mod

    pipe = build_tiny_pipeline("flux")
    real, calls = convert_mod.quantize_linears, []

    def stop_after_two(*a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(convert_mod, "quantize_linears", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        svdq_linear.quantize_pipeline(pipe, rank=4, calib=False, progress=False)
    monkeypatch.setattr(convert_mod, "quantize_linears", real)
    held = sum(isinstance(m, (SVDQW4A4Linear, NVFP4W4A16Linear)) for m in pipe.transformer.modules())
    assert held > 0
    with pytest.raises(ValueError, match=rf"already holds {held} quantized layers .*load it again"):
        svdq_linear.quantize_pipeline(pipe, rank=4, calib=False, progress=False)


def test_quantize_pipeline_checks_the_rank_before_calibrating(monkeypatch):
    """A rank above a layer's size failed only after the calibration runs (minutes on a real model), and a rank the
    Blackwell kernel does not take went by without a word. Both are said before calibration starts."""
    from svdq_linear.convert import calibrate
    from svdq_linear.convert.convert import ConvertWarning

    def refuse(*a, **k):
        raise AssertionError("calibration ran before the rank was checked")

    monkeypatch.setattr(calibrate, "collect_act_max", refuse)
    pipe = build_tiny_pipeline("flux")
    with pytest.raises(ValueError, match=r"expected rank <= min\(in_features, out_features\) of every W4A4 layer"):
        svdq_linear.quantize_pipeline(pipe, rank=33, calib_prompts=["a cat"], progress=False)
    with pytest.warns(ConvertWarning, match="rank 24 is not a positive multiple of 16") as said:
        with pytest.raises(AssertionError, match="calibration ran"):  # said first, then calibration starts
            svdq_linear.quantize_pipeline(pipe, rank=24, calib_prompts=["a cat"], progress=False)
    assert len(said) == 1


class _AdapterLayer(torch.nn.Module):
    """What peft's LoRA layers look like from outside: the linear held as ``base_layer``, not an ``nn.Linear``."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x)


def test_quantize_pipeline_refuses_loaded_lora_adapter_layers():
    """After ``pipe.load_lora_weights`` the attention linears are peft's wrappers: the recipe passed them over and
    left them in 16 bits with no word. Refused, naming the first and saying what to do."""
    pipe = build_tiny_pipeline("flux")
    attn = pipe.transformer.transformer_blocks[0].attn
    attn.to_q = _AdapterLayer(attn.to_q)
    with pytest.raises(ValueError, match=r"1 LoRA adapter layers .*'transformer_blocks.0.attn.to_q'.*fuse_lora"):
        svdq_linear.quantize_pipeline(pipe, rank=4, calib=False, progress=False)
    assert not any(isinstance(m, (SVDQW4A4Linear, NVFP4W4A16Linear)) for m in pipe.transformer.modules())


def test_quantize_pipeline_refuses_a_pipeline_with_peft_loras():
    pytest.importorskip("peft")
    pipe = build_tiny_pipeline("flux")
    lin = pipe.transformer.transformer_blocks[0].attn.to_k
    g = torch.Generator().manual_seed(0)
    key = "transformer.transformer_blocks.0.attn.to_k"
    pipe.load_lora_weights({f"{key}.lora_A.weight": torch.randn(4, lin.in_features, generator=g),
                            f"{key}.lora_B.weight": torch.randn(lin.out_features, 4, generator=g)})
    with pytest.raises(ValueError, match="LoRA adapter layers"):
        svdq_linear.quantize_pipeline(pipe, rank=4, calib=False, progress=False)


def test_quantize_linears_in_any_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    x = torch.randn(16, 64)
    ref = model(x).detach()
    one_by_one = torch.nn.Sequential(SVDQW4A4Linear.from_linear(model[0], rank=8), model[1],
                                     NVFP4W4A16Linear.from_linear(model[2]))
    stats = svdq_linear.quantize_linears(model, w4a4=["0"], w4a16=["2"], rank=8)
    assert isinstance(model[0], SVDQW4A4Linear) and isinstance(model[2], NVFP4W4A16Linear)
    assert [s.kind for s in stats] == ["w4a4", "w4a16"] and stats[0].bytes_after < stats[0].bytes_before
    assert torch.equal(model(x), one_by_one(x))
    assert ((model(x) - ref).norm() / ref.norm()) < 0.25  # two 4-bit layers, no calibration
    with pytest.raises(TypeError, match="not an nn.Linear"):
        svdq_linear.quantize_linears(model, w4a4=["1"])


def test_quantize_linears_checks_everything_before_a_layer_changes():
    """A float64 linear among the targets failed after the swap (the layers before it quantized, it an empty meta
    layer); a string of names was taken letter by letter, a layer in both lists became W4A16 silently, a rank beside
    a config was dropped, and under a float64 default dtype no layer could be built."""
    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32).double())

    m = model()
    first = m[0]
    with pytest.raises(TypeError, match=r"1: expected a float16/bfloat16/float32 linear, got torch.float64"):
        svdq_linear.quantize_linears(m, w4a4=["0", "1"], rank=8)
    assert m[0] is first and type(m[1]) is torch.nn.Linear, "a layer changed"
    with pytest.raises(TypeError, match="w4a4: expected a list of module names, got '0'"):
        svdq_linear.quantize_linears(m, w4a4="0")
    with pytest.raises(ValueError, match=r"\['0'\] named in both w4a4 and w4a16"):
        svdq_linear.quantize_linears(m, w4a4=["0"], w4a16=["0"])
    with pytest.raises(TypeError, match="rank=16 disagrees with config.rank=4"):
        svdq_linear.quantize_linears(m, w4a4=["0"], rank=16, config=SVDQuantConfig(rank=4))
    mha = torch.nn.TransformerEncoderLayer(64, 4)
    with pytest.raises(TypeError, match="MultiheadAttention's out_proj"):
        svdq_linear.quantize_linears(mha, w4a4=["self_attn.out_proj"], rank=8)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        m = torch.nn.Sequential(torch.nn.Linear(64, 64, dtype=torch.float32))
        svdq_linear.quantize_linears(m, w4a4=["0"], rank=8)
    finally:
        torch.set_default_dtype(default)
    assert isinstance(m[0], SVDQW4A4Linear) and m[0].proj_down.dtype == torch.float32


def test_quantize_linears_names_the_layer_and_refuses_statistics_it_would_not_use():
    """Found by a helper's probe: ``act_max`` under a key that matches no target (a prefix typo) was ignored and those
    layers quantized without smoothing; an ``act_max`` of the wrong width, or a smoothing group of layers of different
    widths, failed in torch's words; a layer's own refusal (rank, width, NaN bias) did not say which layer; a meta
    linear failed on ``Tensor.item()``. A float layer with a NaN bias is refused by both siblings, as NaN weights
    are."""
    def model():
        m = torch.nn.Module()
        m.a, m.b, m.c = torch.nn.Linear(64, 64), torch.nn.Linear(128, 64), torch.nn.Linear(64, 64)
        return m

    cases = [
        (dict(w4a4=["a"], act_max={"transformer.a": torch.full((64,), 5.0)}),
         r"act_max names 1 modules the model has no linear under \(e.g. \[.transformer.a.\]\)"),
        (dict(w4a4=["a"], act_max={"a": torch.ones(32)}), r"a: expected act_max as a real tensor \[64\] .*\[32\]"),
        (dict(w4a4=["a"], act_max={"a": torch.ones(64, dtype=torch.bool)}), r"a: expected act_max as a real tensor"),
        (dict(w4a4=["a", "b"], smooth_groups={"a": "g", "b": "g"}),
         r"smoothing group 'g' joins layers of different in_features \(a: 64, b: 128\)"),
        (dict(w4a4=["a", "c"], rank=65), r"^a: rank 65 exceeds min\(out_features, in_features\) = 64"),
    ]
    for kwargs, match in cases:
        m = model()
        before = dict(m.named_children())
        with pytest.raises(ValueError, match=match):
            svdq_linear.quantize_linears(m, **{"rank": 8, **kwargs})
        assert dict(m.named_children()) == before, "a layer changed"
    m = model()  # a dict calibrated once and quantized block by block: another layer's key is fine
    svdq_linear.quantize_linears(m, w4a4=["a"], rank=8, act_max={"a": torch.ones(64), "c": torch.ones(64)})
    assert isinstance(m.a, SVDQW4A4Linear) and type(m.c) is torch.nn.Linear
    m = model()
    with torch.no_grad():
        m.c.bias[5] = float("nan")
    with pytest.raises(ValueError, match=r"^c: bias holds 1 NaN or Inf values"):
        svdq_linear.quantize_linears(m, w4a4=["a"], w4a16=["c"], rank=8)
    for build in (lambda lin: SVDQW4A4Linear.from_linear(lin, rank=8), NVFP4W4A16Linear.from_linear):
        with pytest.raises(ValueError, match="bias holds 1 NaN or Inf values"):
            build(m.c)
    m.a = torch.nn.Linear(64, 64, device="meta")
    with pytest.raises(ValueError, match="a: the weight is on the meta device"):
        svdq_linear.quantize_linears(m, w4a4=["a"], rank=8)


# ---- recipes --------------------------------------------------------------------------------------


def test_recipes_cover_the_targets():
    flux = recipes.recipe_for(build_tiny_pipeline("flux").transformer)
    assert len(flux.w4a4) == 2 * 12 + 2 * 5 and len(flux.w4a16) == 2 * 2 + 2
    assert sorted(n for n, g in flux.groups.items() if g == "single_transformer_blocks.0.attn.qkv") == [
        "single_transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.attn.to_q",
        "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp"]
    assert "proj_out" not in flux.kinds and "norm_out.linear" not in flux.kinds
    assert not any("embed" in n for n in flux.kinds)
    sd35 = recipes.recipe_for(build_tiny_pipeline("sd35").transformer)
    assert "transformer_blocks.0.attn2.to_out.0" in sd35.w4a4
    assert sd35.groups["transformer_blocks.0.attn2.to_k"] == "transformer_blocks.0.attn2.qkv"
    assert "transformer_blocks.1.attn.to_add_out" not in sd35.kinds  # the last block is context_pre_only
    with pytest.raises(ValueError, match="unsupported transformer class 'Sequential'"):
        recipes.recipe_for(torch.nn.Sequential(torch.nn.Linear(16, 16)))


def test_quantized_transformer_compiles_fullgraph():
    pipe = build_tiny_pipeline("flux")
    svdq_linear.quantize_pipeline(pipe, rank=8, calib=False, progress=False)
    eager = generate(pipe, "flux")
    pipe.transformer = torch.compile(pipe.transformer, fullgraph=True, backend="aot_eager")
    assert np.array_equal(generate(pipe, "flux"), eager)


def test_hub_ids_fetch_only_the_pipeline_components(monkeypatch, tmp_path, sources):
    import huggingface_hub

    from svdq_linear.files import resolve_model_path

    calls = {}
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, name: str(sources["flux"] / name))
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, **kw: calls.update(repo=repo, **kw) or str(sources["flux"]))
    assert resolve_model_path("org/flux-like") == sources["flux"]
    assert calls["repo"] == "org/flux-like"
    assert sorted(calls["allow_patterns"]) == sorted(["model_index.json", "scheduler/*", "text_encoder/*",
        "text_encoder_2/*", "tokenizer/*", "tokenizer_2/*", "transformer/*", "vae/*"])
    assert "*.bin" in calls["ignore_patterns"]


# ---- the README's main job and the converters/ scripts -----------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def test_readme_main_job_runs_again_over_its_earlier_output(converted, tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Set up and run"):readme.index("## Test")]
    block = section[section.index("```bash") + len("```bash"):]
    main_job = block[:block.index("```")].strip().splitlines()[1]
    assert main_job.startswith("svdq-convert tiny:flux out/tiny-flux") and "examples/generate.py" in main_job
    assert "the image is noise" in section
    # A first run's output is there (the fixture's conversion of the same tiny Flux, other settings).
    shutil.copytree(converted["flux"], tmp_path / "out" / "tiny-flux")
    # The installed commands, spelled through this interpreter so the test runs from any environment.
    command = main_job.replace("svdq-convert ", f"{shlex.quote(sys.executable)} -m svdq_linear.convert.cli ")
    command = command.replace("python examples/", f"{shlex.quote(sys.executable)} {shlex.quote(str(ROOT))}/examples/")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "svdq-convert: warning" not in r.stderr, f"the main job gets no warning of ours: {r.stderr[-3000:]}"
    assert "wrote" in r.stdout and (tmp_path / "out" / "tiny-flux.png").is_file()
    assert "image is noise" in r.stdout, "generate.py says where to look next"
    qcfg = json.loads((tmp_path / "out" / "tiny-flux" / "transformer" / "config.json").read_text())
    assert qcfg["quantization_config"]["calibration"]["num_prompts"] == 16, "the earlier output was replaced"
    assert not (tmp_path / "out" / "tiny-flux.replaced").exists()


@pytest.mark.parametrize("args, says", [
    (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
    (["-o", "image"], "-o image: expected an image file name"),
    (["--dtype", "float64"], "argument --dtype: invalid choice"),
])
def test_generate_refuses_bad_arguments_before_it_loads(converted, args, says):
    """--steps 0 meant the default, and a bad -o failed only after the whole generation."""
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "generate.py"), str(converted["flux"]), *args],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_converter_scripts_run_svdq_convert(sources, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "converters"))
    out = tmp_path / "o"
    monkeypatch.setattr(sys, "argv", ["sd3.py", str(out), "--model", str(sources["sd3"]), "--no-calib",
                                      "--rank", "4", "--dtype", "float32", "--quiet"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "converters" / "sd3.py"), run_name="__main__")
    assert exit_.value.code == 0, capsys.readouterr().err[-2000:]
    qcfg = json.loads((out / "transformer" / "config.json").read_text())["quantization_config"]
    assert qcfg["conversion"]["source"] == str(sources["sd3"]) and qcfg["rank"] == 4
    for script, name, hub_id in (("flux", "dev", "black-forest-labs/FLUX.1-dev"),
                                 ("sd3", "sd35-medium", "stabilityai/stable-diffusion-3.5-medium")):
        assert runpy.run_path(str(ROOT / "converters" / f"{script}.py"))["MODELS"][name] == hub_id


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_controlnet_from_a_quantized_transformer_is_refused(kind):
    """diffusers' ``ControlNetModel.from_transformer`` copies the blocks with ``strict=False`` into 16-bit linears:
    from a quantized transformer, every linear of the new ControlNet kept its random weights, silently, and the
    ControlNet carried the transformer's ``quantization_config`` (its saved form then failed to load). Refused now,
    naming the way; from an unquantized transformer it works as before."""
    from diffusers import FluxControlNetModel, SD3ControlNetModel

    cls = FluxControlNetModel if kind == "flux" else SD3ControlNetModel
    plain = build_tiny_pipeline(kind)
    pipe = build_tiny_pipeline(kind)
    svdq_linear.quantize_pipeline(pipe, rank=8, calib=False, progress=False)
    cfg = plain.transformer.config
    kwargs = (dict(num_layers=1, num_single_layers=1, attention_head_dim=cfg.attention_head_dim,
                   num_attention_heads=cfg.num_attention_heads) if kind == "flux" else dict(num_layers=1))
    with pytest.raises(ValueError, match=r"from_transformer cannot copy svdq-linear's 4-bit layers.*unquantized"):
        cls.from_transformer(pipe.transformer, **kwargs)
    net = cls.from_transformer(plain.transformer, **kwargs)
    src = plain.transformer.transformer_blocks[0].attn.to_q.weight
    assert torch.equal(net.transformer_blocks[0].attn.to_q.weight, src)


def test_load_svdq_pipeline_as_another_pipeline_class(converted):
    """A converted text-to-image folder loads as a ControlNet pipeline with ``pipeline_cls``. Without it, the
    folder's class took ``controlnet=`` and diffusers dropped it with a warning: now refused by name."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    plain = build_tiny_pipeline("flux")
    cfg = plain.transformer.config
    net = FluxControlNetModel.from_transformer(plain.transformer, num_layers=1, num_single_layers=1,
                                               attention_head_dim=cfg.attention_head_dim,
                                               num_attention_heads=cfg.num_attention_heads)
    with pytest.raises(ValueError, match=r"FluxPipeline takes no component 'controlnet'.*pipeline_cls"):
        load_svdq_pipeline(converted["flux"], dtype=torch.float32, controlnet=net)
    with pytest.raises(TypeError, match="expected pipeline_cls to be a diffusers pipeline class"):
        load_svdq_pipeline(converted["flux"], pipeline_cls=FluxControlNetModel, controlnet=net)
    pipe = load_svdq_pipeline(converted["flux"], dtype=torch.float32, pipeline_cls=FluxControlNetPipeline,
                              controlnet=net)
    assert type(pipe) is FluxControlNetPipeline and pipe.controlnet is net
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, SVDQW4A4Linear)


# ---- the source and the output folder under interruption (a helper's probe) ----------------------


def _quick(**kw):
    from svdq_linear.convert.convert import ConvertOptions

    return ConvertOptions(rank=8, calib=False, dtype="float32", progress=False, device="cpu", **kw)


def test_resume_holds_the_source_to_the_one_it_started_from(sources, tmp_path, monkeypatch):
    """A resume from another folder at the same typed path finished the output with the other model's blocks; the
    same folder typed another way was refused as other settings."""
    from svdq_linear.convert.convert import ConvertError, convert

    src = tmp_path / "src"
    shutil.copytree(sources["flux"], src)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(FAIL_AFTER_ENV, "1")
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert("src", tmp_path / "o", _quick())
    monkeypatch.delenv(FAIL_AFTER_ENV)
    t = load_file(next((src / "transformer").glob("*.safetensors")))
    save_file({k: v + 1 for k, v in t.items()}, next((src / "transformer").glob("*.safetensors")))  # another model
    with pytest.raises(ConvertError, match="is not the source .* finished blocks were made from"):
        convert(f"{src}/", tmp_path / "o", _quick(resume=True))  # the same folder, typed another way: not "settings"
    shutil.rmtree(src)
    shutil.copytree(sources["flux"], src)
    summary = convert("./src", tmp_path / "o", _quick(resume=True))
    assert summary.resumed_units == 1 and not (tmp_path / "o" / "progress.json").exists()


def test_a_run_stopped_while_it_swaps_in_the_output_is_finished_by_resume(sources, tmp_path, monkeypatch):
    """progress.json went before the rename: a run stopped there left a complete partial folder that neither
    --resume nor --overwrite took, and with --overwrite the earlier output sat in .replaced for good."""
    import svdq_linear.convert.convert as cv

    out = tmp_path / "o"
    cv.convert(sources["flux"], out, _quick())
    real = os.replace

    def stop_at_the_swap(a, b):  # --overwrite: out -> out.replaced, then partial -> out (stopped there)
        if Path(b) == out:
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(cv.os, "replace", stop_at_the_swap)
    with pytest.raises(KeyboardInterrupt):
        cv.convert(sources["flux"], out, _quick(overwrite=True))
    monkeypatch.setattr(cv.os, "replace", real)
    assert not out.exists() and (tmp_path / "o.replaced").is_dir()
    assert (tmp_path / "o.partial" / "progress.json").is_file(), "the partial folder still says what it is"
    cv.convert(sources["flux"], out, _quick(resume=True))
    assert out.is_dir() and not (out / "progress.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"], "no .replaced, .partial or .lock left"


def test_a_source_missing_a_component_or_naming_an_unknown_class_is_refused(sources, tmp_path):
    from svdq_linear.convert.convert import ConvertError, convert

    src = tmp_path / "src"
    shutil.copytree(sources["flux"], src)
    shutil.rmtree(src / "vae")
    with pytest.raises(ConvertError, match=r"lacks the component folders \['vae'\]"):
        convert(src, tmp_path / "o", _quick())
    shutil.copytree(sources["flux"] / "vae", src / "vae")
    _edit_json(src / "model_index.json", lambda c: c.update(_class_name="NoSuchPipeline"))
    with pytest.raises(ConvertError, match="names the pipeline class 'NoSuchPipeline'"):
        convert(src, tmp_path / "o", _quick())
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_a_second_conversion_into_the_same_folder_is_refused_while_the_first_runs(sources, tmp_path):
    import fcntl

    from svdq_linear.convert.convert import ConvertError, convert

    out = tmp_path / "o"
    with open(tmp_path / "o.lock", "a+") as held:  # the first run's lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConvertError, match=r"another svdq-convert is writing .*o \(it holds .*o.lock\)"):
            convert(sources["flux"], out, _quick())
    convert(sources["flux"], out, _quick())
    assert out.is_dir() and not (tmp_path / "o.lock").exists()


def test_the_filesystem_root_as_output_is_refused_in_words(sources):
    from svdq_linear.convert.convert import ConvertError, convert

    with pytest.raises(ConvertError, match="is a filesystem root: name a folder to create"):
        convert(sources["flux"], "/", _quick())


# ---- gaps a second mutation probe found (each test fails on its mutation) -------------------------


def test_a_w4a4_layer_listed_as_w4a16_is_refused(converted, tmp_path):
    """The key check refuses tensors the config does not expect, not only missing ones: a W4A4 layer recorded as
    W4A16 would otherwise load without its smoothing and low-rank branch."""
    out = _copy(converted, tmp_path)
    name = "transformer_blocks.1.ff.net.2"

    def edit(c):
        q = c["quantization_config"]
        q["w4a4_modules"].remove(name)
        q["w4a16_modules"].append(name)

    _edit_json(out / "transformer" / "config.json", edit)
    with pytest.raises(ValueError, match=r"does not match its quantization_config: 3 unexpected tensors"):
        load_svdq_pipeline(out, dtype=torch.float32)


@pytest.mark.parametrize("size_mib", [1.5, 3])
def test_the_source_fingerprint_sees_the_tail_of_a_file(tmp_path, size_mib):
    """A resume holds the source to its fingerprint; the tail of a large file (another model of the same shapes
    differs in its last tensor) must move it, and so must the bytes past the first MiB of a file under 2 MiB, which
    had not been read at all."""
    from svdq_linear.convert.convert import _source_fingerprint

    index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    (tmp_path / "transformer").mkdir()
    f = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    data = bytearray(int(size_mib * (1 << 20)))
    f.write_bytes(bytes(data))
    before = _source_fingerprint(tmp_path, index)
    data[-10] = 1
    f.write_bytes(bytes(data))
    assert _source_fingerprint(tmp_path, index) != before


def test_a_refused_second_run_leaves_the_first_runs_partial_alone(sources, tmp_path, monkeypatch):
    """The lock is taken before the ``.partial`` is opened: a second run refused by it must not have discarded the
    first run's finished blocks (``overwrite`` would)."""
    import fcntl

    from svdq_linear.convert.convert import ConvertError, convert

    out = tmp_path / "o"
    monkeypatch.setenv(FAIL_AFTER_ENV, "1")
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert(sources["flux"], out, _quick())  # the first run, one block done
    monkeypatch.delenv(FAIL_AFTER_ENV)
    progress = (tmp_path / "o.partial" / "progress.json").read_text()
    with open(tmp_path / "o.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConvertError, match="another svdq-convert is writing"):
            convert(sources["flux"], out, _quick(overwrite=True))
    assert (tmp_path / "o.partial" / "progress.json").read_text() == progress


def test_the_summary_counts_bytes_and_kept_tensors_take_the_dtype(sources, tmp_path):
    """The summary's sizes are the checkpoints' bytes (no test read them), and tensors the recipe keeps (embedders,
    the final norm) take ``--dtype``: the tiny sources are float32 and the other tests convert to float32."""
    from svdq_linear.convert.convert import ConvertOptions, convert
    from svdq_linear.linear import FIXED_DTYPES

    src = load_file(sources["flux"] / "transformer" / "diffusion_pytorch_model.safetensors")
    s = convert(sources["flux"], tmp_path / "o",
                ConvertOptions(rank=8, calib=False, dtype="bfloat16", progress=False, device="cpu"))
    out = {}
    for f in (tmp_path / "o" / "transformer").glob("*.safetensors"):
        out.update(load_file(f))
    assert s.bytes_before == sum(t.numel() * t.element_size() for t in src.values())
    assert s.bytes_after == sum(t.numel() * t.element_size() for t in out.values()) < s.bytes_before
    assert f"({s.bytes_before / s.bytes_after:.2f}x smaller)" in s.text()
    wrong = {k: t.dtype for k, t in out.items()
             if k.rpartition(".")[2] not in FIXED_DTYPES and t.dtype != torch.bfloat16}
    assert not wrong, list(wrong.items())[:3]


def test_load_svdq_pipeline_never_unpickles_a_component(converted, tmp_path):
    """A component saved as a pickle (``.bin``) is refused, not loaded: the loader asks diffusers for safetensors."""
    out = _copy(converted, tmp_path)
    st = out / "vae" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(st), out / "vae" / "diffusion_pytorch_model.bin")
    st.unlink()
    with pytest.raises((OSError, ValueError), match="safetensors"):
        load_svdq_pipeline(out, dtype=torch.float32)


def test_a_sharded_source_converts_like_the_single_file(sources, tmp_path):
    """FLUX.1-dev's transformer is sharded (an index and several files); the tiny sources are single files. The same
    tensors split in two shards convert to the same bytes."""
    from svdq_linear.convert.convert import convert

    src = tmp_path / "sharded"
    shutil.copytree(sources["flux"], src)
    single = src / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(single)
    single.unlink()
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, src / "transformer" / name)
        weight_map.update(dict.fromkeys(part, name))
    (src / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = convert(src, tmp_path / "a", _quick())
    b = convert(sources["flux"], tmp_path / "b", _quick())
    assert a.bytes_after == b.bytes_after
    for f in sorted((tmp_path / "b" / "transformer").glob("*.safetensors")):
        x, y = load_file(f), load_file(tmp_path / "a" / "transformer" / f.name)
        assert x.keys() == y.keys() and all(torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)) for k in x)


def test_quantize_linears_keeps_a_missing_bias_missing():
    """Every target of the tiny pipelines has a bias; a layer without one stays without one, in both kinds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(32, 16, bias=False))
    svdq_linear.quantize_linears(model, w4a4=["0"], w4a16=["1"], rank=8)
    assert model[0].bias is None and model[1].bias is None
    assert "0.bias" not in model.state_dict() and model(torch.randn(4, 64)).shape == (4, 16)


def test_collect_act_max_is_the_max_abs_input_over_every_call_and_leaves_no_hook():
    """Calibration's maxima were checked only through PSNR and headroom, which tolerate signed or averaged maxima:
    each is the max |x| per channel over every call of every prompt and step, and no hook stays behind."""
    from svdq_linear.convert import calibrate

    pipe = build_tiny_pipeline("sd3")
    names = recipes.recipe_for(pipe.transformer).w4a4[:4]
    seen = {n: [] for n in names}
    spies = [pipe.transformer.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: seen[n].append(a[0].detach().reshape(-1, a[0].shape[-1]).clone())) for n in names]
    got = calibrate.collect_act_max(pipe, names, ["a cat", "a dog"], 2, {"height": 64, "width": 64}, progress=False)
    for h in spies:
        h.remove()
    assert not [m for m in pipe.transformer.modules() if m._forward_pre_hooks], "hooks left behind"
    for n in names:
        x = torch.cat(seen[n])
        assert len(seen[n]) >= 4 and (x < 0).any()  # 2 prompts x 2 steps; signed inputs
        assert torch.equal(got[n], x.abs().amax(0).float())


@pytest.mark.parametrize("kind", ["flux", "sd35"])
def test_smoothing_groups_are_exactly_the_linears_that_read_one_input(kind):
    """One smoothing factor serves a group, so a group's members must read the very same tensor, and every two W4A4
    linears of a block that read one tensor must share a group (else the fused q/k/v cannot be built, and their
    statistics differ for nothing). Seen in a forward of the tiny transformer with hooks, not from the names: the
    image and context q/k/v of a joint block read different streams, Flux single blocks' ``proj_mlp`` reads q/k/v's
    input."""
    from svdq_linear.convert import tiny

    torch.manual_seed(0)
    transformer = tiny._flux_transformer() if kind == "flux" else tiny._sd3_transformer("sd35")
    recipe = recipes.recipe_for(transformer)
    seen = {}
    hooks = [transformer.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: seen.setdefault(n, a[0].detach().clone())) for n in recipe.w4a4]
    with torch.no_grad():
        transformer(**_transformer_inputs(transformer, torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))))
    for h in hooks:
        h.remove()
    assert set(seen) == set(recipe.w4a4)
    same = lambda a, b: seen[a].shape == seen[b].shape and torch.equal(seen[a], seen[b])  # noqa: E731
    members = {}
    for name, group in recipe.groups.items():
        members.setdefault(group, []).append(name)
    for group, names in members.items():
        assert len(names) > 1 and all(same(names[0], n) for n in names), f"{group}: {names} read different inputs"
    for a in recipe.w4a4:
        for b in recipe.w4a4:
            if a < b and recipes.unit_of(a) == recipes.unit_of(b) and same(a, b):
                assert recipe.groups.get(a) is not None and recipe.groups.get(a) == recipe.groups.get(b), (a, b)


class _SeedRecorder:
    """A pipeline stand-in for ``collect_act_max``: each call runs its transformer (one linear) ``steps`` times on
    inputs drawn from the call's generator, and records the generator's seed."""

    def __init__(self):
        self.transformer = torch.nn.Sequential(torch.nn.Linear(8, 4))
        self.seeds = []

    def __call__(self, prompt, generator, num_inference_steps, output_type):
        self.seeds.append(generator.initial_seed())
        for _ in range(num_inference_steps):
            self.transformer(torch.randn(3, 8, generator=generator) * 4)


def test_each_calibration_prompt_runs_from_its_own_seed():
    """Prompt ``i`` runs from seed ``seed + i`` (not one noise for every prompt), and the maxima are those of the
    inputs those seeds draw (regenerated here)."""
    from svdq_linear.convert import calibrate

    seed, steps = int(torch.randint(1 << 20, ())), 2
    pipe = _SeedRecorder()
    got = calibrate.collect_act_max(pipe, ["0"], ["a cat", "a dog", "a hat"], steps, seed=seed, progress=False)
    assert pipe.seeds == [seed, seed + 1, seed + 2], pipe.seeds
    want = torch.zeros(8)
    for i in range(3):
        g = torch.Generator().manual_seed(seed + i)
        for _ in range(steps):
            want = torch.maximum(want, (torch.randn(3, 8, generator=g) * 4).abs().amax(0))
    assert torch.equal(got["0"], want), (got["0"], want)


def test_prompt_files_skip_blank_lines_and_comments(tmp_path):
    """A prompt file holds one prompt a line; blank lines and lines starting with ``#`` (after spaces) are skipped,
    a ``#`` inside a prompt is kept; ``limit`` takes the first prompts."""
    from svdq_linear.convert import calibrate

    f = tmp_path / "prompts.txt"
    f.write_text("# calibration set\n\n  a cat  \n   # an indented comment\n\t\na dog # on a mat\nthe end\n")
    assert calibrate.read_prompts(f) == ["a cat", "a dog # on a mat", "the end"]
    assert calibrate.read_prompts(f, 2) == ["a cat", "a dog # on a mat"]
    f.write_text("# only\n  # comments\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        calibrate.read_prompts(f)
