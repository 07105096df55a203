"""svdq-convert's promises to its user: options checked before any work, failures in one line, a
``.partial`` that can always be continued or restarted without deleting it by hand, quiet runs,
private pushes, outputs that share no file with their source, and a reported activation headroom.

In-process (``cli.main``) on tiny offline pipelines, CPU, float32; ``capfd`` reads what a user sees.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import svdq_linear.convert.convert as convert_mod
from svdq_linear.convert import calibrate, cli
from svdq_linear.convert.convert import FAIL_AFTER_ENV, ConvertError, ConvertOptions, convert
from svdq_linear.convert.tiny import save_tiny_pipeline

FAST = ["--rank", "8", "--dtype", "float32", "--calib-num", "2", "--calib-steps", "1", "--calib-resolution", "64",
        "--quiet"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {kind: save_tiny_pipeline(kind, root / kind) for kind in ("flux", "sd3")}


def run(capfd, *args) -> tuple[int, str, str]:
    capfd.readouterr()
    rc = cli.main([str(a) for a in args])
    out, err = capfd.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, *needles):
    # the rank note (FAST's rank 8 is not the Blackwell kernel's) may come first, on its own line
    lines = [line for line in err.strip().splitlines() if not line.startswith("svdq-convert: warning: rank ")]
    assert rc == 2, f"exit status {rc}, stderr:\n{err}"
    assert "Traceback" not in err and lines and lines[0].startswith("svdq-convert: error: "), err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"


def tensors_of(folder: Path) -> dict:
    out = {}
    for f in sorted((folder / "transformer").glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture
def no_calibration(monkeypatch):
    """Fail the test if calibration starts: options must be refused before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("calibration ran before the options were checked")

    monkeypatch.setattr(calibrate, "collect_act_max", refuse)


# ---- item 6: every option is checked before calibration -------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["--rank", "33"], "expected --rank <= min(in_features, out_features) of every W4A4 layer, got 33 > 32"),
    (["--rank", "-1"], "expected --rank >= 0, got -1"),
    (["--alpha", "1.5"], "expected --alpha to be a number in [0, 1], got 1.5"),
    (["--calib-num", "0"], "expected --calib-num >= 1, got 0"),
    (["--calib-steps", "0"], "expected --calib-steps >= 1, got 0"),
    (["--act-headroom", "13"], "expected --act-headroom in 0..12, got 13"),
    (["--calib-resolution", "512"], "expected --calib-resolution <= 128 for this pipeline"),
    (["--calib-resolution", "102"], "expected --calib-resolution to be a multiple of 4"),
    (["--device", "gpu7"], "expected --device cpu, cuda or cuda:N, got 'gpu7'"),
    (["--device", "meta"], "expected --device cpu, cuda or cuda:N, got 'meta'"),
    (["--calib-prompts", "/nonexistent/prompts.txt"], "calibration prompt file /nonexistent/prompts.txt not found"),
    # calibration settings beside --no-calib were ignored without a word
    (["--no-calib", "--calib-steps", "3"], "--calib-steps sets up the calibration runs, which --no-calib skips"),
    (["--no-calib", "--calib-num", "2", "--calib-offload"],
     "--calib-num, --calib-offload set up the calibration runs, which --no-calib skips"),
    (["--calib-resolution", "64", "--no-calib"], "--calib-resolution sets up the calibration runs"),
    (["--no-calib", "--calib-prompts", "/nonexistent/prompts.txt"], "--calib-prompts sets up the calibration runs"),
])
def test_bad_options_are_refused_before_calibration(sources, tmp_path, capfd, no_calibration, args, needle):
    rc, _, err = run(capfd, sources["sd3"], tmp_path / "o", "--quiet", *args)
    assert_one_line_error(rc, err, needle)
    assert "--resume" not in err, "resuming with the same options cannot succeed"
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


@pytest.mark.parametrize("rank, says", [
    (8, "svdq-convert: warning: rank 8 is not a positive multiple of 16, which the Blackwell kernel needs"),
    (16, None),
])
def test_a_rank_that_leaves_a_gpu_kernel_is_said_in_one_line_before_the_work(sources, tmp_path, capfd, rank, says):
    """A rank the Blackwell kernel does not take converted without a word, and the layers then ran on the PyTorch
    reference on a B200. It is said before the work, in one line, and the conversion goes on; at every run, under
    a process that ignores warnings (``-W ignore``: the GPU machine's test runs) and at a second run in one process
    (whose warning registry had swallowed it)."""
    for attempt in ("first", "second"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc, out, err = run(capfd, sources["flux"], tmp_path / attempt, "--no-calib", "--dtype", "float32",
                               "--quiet", "--rank", rank)
        assert rc == 0, err
        warnings_said = [line for line in err.splitlines() if line.startswith("svdq-convert: warning: ")]
        if says is None:
            assert not warnings_said, err
        else:
            assert len(warnings_said) == 1 and says in warnings_said[0] and "PyTorch reference" in warnings_said[0], (
                f"{attempt} run: {err!r}")
            assert "Traceback" not in err and "ConvertWarning" not in err, "one line, not Python's warning format"
        assert (tmp_path / attempt / "model_index.json").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_cuda_device_on_a_cpu_only_torch_is_refused(sources, tmp_path, capfd, no_calibration):
    rc, _, err = run(capfd, sources["sd3"], tmp_path / "o", "--device", "cuda", "--quiet")
    assert_one_line_error(rc, err, "--device cuda: expected an available CUDA device")


def _partial_with(out: Path, settings: dict, done: dict | None = None, failed: dict | None = None) -> Path:
    """A ``.partial`` as a run killed at that point leaves it (SIGKILL: no chance to clean up)."""
    partial = out.with_name(out.name + ".partial")
    (partial / "transformer").mkdir(parents=True)
    state = {"settings": settings, "done": done or {}}
    if failed:
        state["failed"] = failed
    (partial / "progress.json").write_text(json.dumps(state))
    return partial


def test_partial_without_a_finished_block_gives_way_to_other_settings(sources, tmp_path, capfd):
    out = tmp_path / "o"
    # killed during calibration at a size that did not fit in memory
    _partial_with(out, ConvertOptions(rank=8, dtype="float32", calib_resolution=128).settings(str(sources["sd3"])))
    rc, stdout, err = run(capfd, sources["sd3"], out, *FAST)
    assert rc == 0, err
    assert "starting" in err and "over" in err and "calib_resolution: 128 there, 64 now" in err
    assert (out / "transformer" / "config.json").is_file() and not out.with_name("o.partial").exists()


def test_partial_with_progress_needs_resume_or_overwrite(sources, tmp_path, capfd, monkeypatch):
    out = tmp_path / "o"
    monkeypatch.setenv(FAIL_AFTER_ENV, "1")
    rc, _, err = run(capfd, sources["flux"], out, *FAST)
    assert rc == 2 and "rerun with --resume to continue" in err
    monkeypatch.delenv(FAIL_AFTER_ENV)
    rc, _, err = run(capfd, sources["flux"], out, *FAST)  # same settings, no --resume
    assert_one_line_error(rc, err, "holds an unfinished conversion with these settings (1 finished blocks",
                          "pass --resume to continue it, or --overwrite to start over")
    rc, _, err = run(capfd, sources["flux"], out, *FAST, "--rank", "4")  # other settings
    assert_one_line_error(rc, err, "other settings (rank: 8 there, 4 now)", "--overwrite")
    rc, _, err = run(capfd, sources["flux"], out, *FAST, "--rank", "4", "--overwrite")
    assert rc == 0, err
    qcfg = json.loads((out / "transformer" / "config.json").read_text())["quantization_config"]
    assert qcfg["rank"] == 4


def test_damaged_calibration_on_resume_is_one_line_and_other_settings_restart(sources, tmp_path, capfd, monkeypatch):
    out = tmp_path / "o"
    monkeypatch.setenv(FAIL_AFTER_ENV, "2")
    assert run(capfd, sources["flux"], out, *FAST)[0] == 2
    monkeypatch.delenv(FAIL_AFTER_ENV)
    partial = tmp_path / "o.partial"
    calib = partial / "calibration.safetensors"
    calib.write_bytes(calib.read_bytes()[:-40])  # truncated (by a disk fault: the converter writes atomically)
    rc, _, err = run(capfd, sources["flux"], out, *FAST, "--resume")
    assert_one_line_error(rc, err, "calibration.safetensors is corrupted or truncated", "delete it")
    assert "rerun with --resume" not in err, "the same --resume would fail again"
    state = json.loads((partial / "progress.json").read_text())
    assert state["failed"]["resumable"] is False and len(state["done"]) == 2
    # The failed run's blocks cannot serve other settings: a run with them starts over on its own.
    rc, _, err = run(capfd, sources["flux"], out, *FAST, "--rank", "4")
    assert rc == 0, err
    assert "starting" in err and "its last run failed" in err


def test_non_finite_calibration_maxima_are_named_and_not_resumed_from(sources, tmp_path, capfd, monkeypatch):
    """A calibration run that overflowed (fp16) gave NaN or Inf maxima without a word, and the conversion then failed
    on "act_max holds NaN or Inf values", naming no layer; a saved calibration file with them failed the same way on
    every --resume. Calibration now names the first such layer and the remedy; a saved file with them is refused
    as damaged, with the way out."""
    from safetensors.torch import load_file, save_file

    from svdq_linear.convert.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("flux")
    target = "transformer_blocks.0.attn.to_q"

    def overflow(module, args):  # what an fp16 overflow upstream hands the layer: Inf in one channel
        x = args[0].clone()
        x[..., 3] = float("inf")
        return (x, *args[1:])

    pipe.transformer.get_submodule(target).register_forward_pre_hook(overflow)
    with pytest.raises(ValueError, match=rf"NaN or Inf inputs at \d+ target layers \(first {target!r}\).*"
                                         rf"calibrate in bfloat16 or float32"):
        calibrate.collect_act_max(pipe, [target, "transformer_blocks.0.attn.to_k"], ["a cat"], steps=1,
                                  call_kwargs={"height": 64, "width": 64}, progress=False)

    out = tmp_path / "o"
    monkeypatch.setenv(FAIL_AFTER_ENV, "1")
    assert run(capfd, sources["flux"], out, *FAST)[0] == 2
    monkeypatch.delenv(FAIL_AFTER_ENV)
    calib = tmp_path / "o.partial" / "calibration.safetensors"
    maxima = load_file(calib)
    name = sorted(maxima)[0]
    maxima[name][5] = float("nan")
    save_file(maxima, calib)
    rc, _, err = run(capfd, sources["flux"], out, *FAST, "--resume")
    assert_one_line_error(rc, err, f"{name} holds 1 NaN or Inf maxima", "delete it to calibrate again")


# ---- item 7: the default calibration size suits the pipeline ---------------------------------------


def test_default_calibration_size_fits_the_positional_embedding(sources, tmp_path, capfd):
    # the tiny SD3 transformer's positional embedding covers 32 patches: 128 pixels, less than 512
    rc, _, err = run(capfd, sources["sd3"], tmp_path / "o", "--rank", "8", "--calib-num", "1", "--calib-steps", "1",
                     "--quiet")
    assert rc == 0, err
    qcfg = json.loads((tmp_path / "o" / "transformer" / "config.json").read_text())["quantization_config"]
    assert qcfg["calibration"]["resolution"] == 64  # its own sample_size (32 latents) x the VAE's factor 2


@pytest.mark.parametrize("cls, transformer, vae, expected", [
    # FLUX.1-dev: 128 latents x 8 = 1024, capped at 512; RoPE has no maximum; 2x2 packed latents
    ("FluxTransformer2DModel", {"patch_size": 1}, {"block_out_channels": [128, 256, 512, 512]},
     calibrate.Resolution(512, None, 16)),
    # SD3-medium: sample_size 128, pos_embed_max_size 192 patches of 2
    ("SD3Transformer2DModel", {"sample_size": 128, "patch_size": 2, "pos_embed_max_size": 192},
     {"block_out_channels": [128, 256, 512, 512]}, calibrate.Resolution(512, 3072, 16)),
    # a pipeline whose positional embedding covers less than 512
    ("SD3Transformer2DModel", {"sample_size": 64, "patch_size": 2, "pos_embed_max_size": 24},
     {"block_out_channels": [128, 256, 512, 512]}, calibrate.Resolution(384, 384, 16)),
])
def test_resolution_limits(cls, transformer, vae, expected):
    assert calibrate.resolution_limits(cls, transformer, vae) == expected


# ---- item 8: one-line errors -----------------------------------------------------------------------


class _FullDisk:
    """``open`` for convert.py whose writes fail with ENOSPC once ``after`` shards were written."""

    def __init__(self, after: int):
        self.shards_left = after

    def __call__(self, path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        if "w" in mode and ".safetensors.tmp" in str(path) and "diffusion_pytorch_model-" in str(path):
            if self.shards_left == 0:
                def full(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                f.write = full
            self.shards_left -= 1
        return f


def test_full_disk_is_one_line_and_keeps_the_partial_for_resume(sources, tmp_path, capfd, monkeypatch):
    out = tmp_path / "o"
    monkeypatch.setattr(convert_mod, "open", _FullDisk(after=2), raising=False)
    rc, _, err = run(capfd, sources["flux"], out, *FAST)
    assert_one_line_error(rc, err, "diffusion_pytorch_model-00003-of-00005.safetensors.tmp: No space left on device "
                          "(ENOSPC)")
    assert "rerun with --resume to continue" in err
    partial = tmp_path / "o.partial"
    assert not out.exists() and not list(partial.rglob("*.tmp")), "a failed write leaves no half-written file"
    assert len(json.loads((partial / "progress.json").read_text())["done"]) == 2
    monkeypatch.undo()  # space freed
    rc, stdout, err = run(capfd, sources["flux"], out, *FAST, "--resume")
    assert rc == 0 and "3 blocks converted, 2 resumed" in stdout, err
    reference = tmp_path / "ref"
    assert run(capfd, sources["flux"], reference, *FAST)[0] == 0
    a, b = tensors_of(out), tensors_of(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_read_only_output_folder_is_one_line(sources, tmp_path, capfd, monkeypatch):
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    rc, _, err = run(capfd, sources["sd3"], tmp_path / "ro" / "o", *FAST)
    assert_one_line_error(rc, err, "Read-only file system (EROFS)")
    assert "--resume" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 555")
def test_unwritable_output_folder_is_one_line(sources, tmp_path, capfd):
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        rc, _, err = run(capfd, sources["sd3"], parent / "o", *FAST)
    finally:
        parent.chmod(0o755)
    assert_one_line_error(rc, err, "Permission denied (EACCES)")


@pytest.mark.parametrize("content", ['{"settings": {"rank": 8}, "do', '{"settings": {}, "done": []}', "[]"])
def test_malformed_progress_file_is_one_line(sources, tmp_path, capfd, monkeypatch, content):
    out = tmp_path / "o"
    monkeypatch.setenv(FAIL_AFTER_ENV, "1")
    assert run(capfd, sources["sd3"], out, *FAST)[0] == 2
    monkeypatch.delenv(FAIL_AFTER_ENV)
    (tmp_path / "o.partial" / "progress.json").write_text(content)
    rc, _, err = run(capfd, sources["sd3"], out, *FAST, "--resume")
    assert_one_line_error(rc, err, "progress.json is malformed", "--overwrite")
    assert "rerun with --resume" not in err
    assert run(capfd, sources["sd3"], out, *FAST, "--overwrite")[0] == 0


def test_config_values_of_the_wrong_type_are_one_line(sources, tmp_path, capfd, no_calibration):
    src = tmp_path / "bad"
    shutil.copytree(sources["sd3"], src)
    cfg = src / "transformer" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "num_layers": "two"}))
    rc, _, err = run(capfd, src, tmp_path / "o", *FAST)
    assert_one_line_error(rc, err, "transformer/config.json: cannot build SD3Transformer2DModel from this config")
    for bad in ({"rank": "8"}, {"rank": 8.0}, {"calib_steps": "4"}, {"alpha": "0.5"}, {"act_headroom": 1.5}):
        with pytest.raises(ConvertError, match="expected --"):
            convert(sources["sd3"], tmp_path / "o2", ConvertOptions(progress=False, **bad))
    assert not (tmp_path / "o2.partial").exists()


@pytest.mark.parametrize("model_id", ["./no-such-model", "{tmp}/no-such-model", "~/no-such-svdq-model",
                                      "models/flux/no-such", "existing-dir/no-such-model"])
def test_local_looking_path_is_not_looked_up_on_the_hub(tmp_path, capfd, monkeypatch, model_id):
    import huggingface_hub

    def hub(*args, **kwargs):
        raise AssertionError("the Hugging Face Hub was asked")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing-dir").mkdir()
    rc, _, err = run(capfd, model_id.format(tmp=tmp_path), tmp_path / "o")
    assert_one_line_error(rc, err, "is not a local folder", "does not exist", "Hub is not asked")


def test_hub_lookup_honours_hf_hub_offline(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "svdq_linear.convert.cli", "some-org/not-cached", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "HF_HUB_OFFLINE is set" in r.stderr and "no copy of it" in r.stderr, r.stderr
    assert time.perf_counter() - t0 < 120, "no network retries in offline mode"


# ---- item 9: quiet runs, CPU calibration of large models, private pushes, no links -----------------


def test_quiet_silences_the_libraries_and_truncation_is_reported_once(tmp_path, capfd):
    rc, stdout, err = run(capfd, "tiny:sd3", tmp_path / "quiet", "--rank", "8", "--calib-num", "4", "--calib-steps",
                          "1", "--quiet")
    assert rc == 0 and "svdq-convert: wrote" in stdout
    for noise in ("[transformers]", "Loading", "it/s", "%|", "truncated", "Warning"):
        assert noise not in err, f"--quiet printed {noise!r}:\n{err}"
    rc, stdout, err = run(capfd, "tiny:sd3", tmp_path / "loud", "--rank", "8", "--calib-num", "4", "--calib-steps", "1")
    assert rc == 0
    # the tiny T5 reads 32 tokens: every prompt is cut, and the pipeline would say so once per prompt
    assert err.count("The following part of your input was truncated") == 0, err
    assert err.count("truncation warnings silenced") == 1, err


def test_cpu_calibration_of_a_large_model_is_refused_with_advice(sources, tmp_path, capfd, no_calibration):
    src = tmp_path / "flux-dev-sized"
    shutil.copytree(sources["flux"], src)
    cfg = src / "transformer" / "config.json"
    dev = dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
               joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64, axes_dims_rope=[16, 56, 56])
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **dev}))
    rc, _, err = run(capfd, src, tmp_path / "o", "--device", "cpu", "--quiet")
    assert_one_line_error(rc, err, "calibrating a 11.9 B-parameter transformer on the CPU", "--no-calib")
    assert not (tmp_path / "o.partial").exists()
    # without calibration the size is no obstacle: this run gets as far as the (tiny) weights
    rc, _, err = run(capfd, src, tmp_path / "o", "--device", "cpu", "--no-calib", "--quiet")
    assert_one_line_error(rc, err, "the checkpoint does not match FluxTransformer2DModel")


@pytest.mark.parametrize("public", [False, True])
def test_push_to_hub_creates_a_private_repository_unless_public(sources, tmp_path, capfd, monkeypatch, public):
    from huggingface_hub import HfApi

    calls = {}
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.update(create=(repo_id, kw)))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: calls.update(upload=kw))
    rc, stdout, err = run(capfd, sources["sd3"], tmp_path / "o", "--no-calib", "--rank", "4", "--quiet",
                          "--push-to-hub", "me/x", *(["--public"] if public else []))
    assert rc == 0, err
    repo_id, kw = calls["create"]
    assert repo_id == "me/x" and kw["private"] is (not public)
    assert calls["upload"]["folder_path"] == str(tmp_path / "o") and calls["upload"]["repo_id"] == "me/x"


def test_outputs_share_no_file_with_the_source(sources, tmp_path, capfd):
    # a Hub snapshot: component files are symlinks into a shared blob store
    src, blobs = tmp_path / "snapshot", tmp_path / "blobs"
    shutil.copytree(sources["sd3"], src)
    blobs.mkdir()
    for f in sorted((src / "vae").iterdir()):
        blob = blobs / f.name
        shutil.move(f, blob)
        f.symlink_to(blob)
    rc, _, err = run(capfd, src, tmp_path / "o", "--no-calib", "--rank", "4", "--quiet")
    assert rc == 0, err
    checked = 0
    for f in (tmp_path / "o").rglob("*"):
        source = src / f.relative_to(tmp_path / "o")
        if f.is_file() and "transformer" not in f.parts and source.exists():
            st = os.lstat(f)
            assert not f.is_symlink() and st.st_nlink == 1, f"{f} links to another file"
            assert st.st_ino != os.stat(source).st_ino, f"{f} shares its inode with {source}"
            checked += 1
    assert checked >= 8


# ---- item 3: the headroom is an option and the summary reports it ----------------------------------


def test_act_headroom_option_and_per_layer_report(sources, tmp_path, capfd):
    rc, stdout, err = run(capfd, sources["flux"], tmp_path / "o", *FAST, "--act-headroom", "5")
    assert rc == 0, err
    assert "W4A4 activation headroom (powers of two between the calibrated block max and saturation)" in stdout
    layers = json.loads((tmp_path / "o" / "svdq_layers.json").read_text())
    w4a4 = [layer for layer in layers if layer["kind"] == "w4a4"]
    assert len(w4a4) == 34 and all(5 <= layer["act_headroom"] < 6 for layer in w4a4), w4a4
    qcfg = json.loads((tmp_path / "o" / "transformer" / "config.json").read_text())["quantization_config"]
    assert qcfg["conversion"]["act_headroom"] == 5
    # the reported headroom is where the calibrated maxima sit in the written tensors
    act_max = load_file(tmp_path / "o" / "svdq_calibration.safetensors")
    smooth = tensors_of(tmp_path / "o")["transformer_blocks.0.attn.to_q.smooth"]
    top = (act_max["transformer_blocks.0.attn.to_q"] / smooth).max().item()
    expected = next(x["act_headroom"] for x in w4a4 if x["name"] == "transformer_blocks.0.attn.to_q")
    assert abs(2688.0 / top - 2.0**expected) < 1e-3 * 2.0**expected


def test_calibration_hooks_are_removed_when_a_target_does_not_resolve():
    """``collect_act_max`` registers a hook a target; a name that does not resolve used to leave the hooks before it
    on the transformer for good. A step count given twice (``steps`` and ``call_kwargs``) that disagrees is refused:
    the run would take one and the checkpoint record the other. A prompt limit below 1 is refused."""
    from svdq_linear.convert import recipes
    from svdq_linear.convert.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline("sd3")
    names = recipes.recipe_for(pipe.transformer).w4a4[:3] + ["transformer_blocks.0.attn.bogus"]
    with pytest.raises(AttributeError, match="bogus"):
        calibrate.collect_act_max(pipe, names, ["a cat"], 1, progress=False)
    assert not [m for m in pipe.transformer.modules() if m._forward_pre_hooks], "hooks left behind"
    with pytest.raises(ValueError, match=r"num_inference_steps \(2\) differs from steps \(3\)"):
        calibrate.collect_act_max(pipe, names[:3], ["a cat"], 3, {"num_inference_steps": 2}, progress=False)
    with pytest.raises(ValueError, match="at least 1, got 0"):
        calibrate.read_prompts(None, 0)
    assert len(calibrate.read_prompts(None, 2)) == 2


# ---- pipelines that need images besides the prompt (img2img, inpainting, fill, control) ----------------------


@pytest.fixture(scope="module")
def image_sources(tmp_path_factory):
    """A tiny FluxInpaintPipeline and FluxImg2ImgPipeline folder (the text-to-image components), and a 64 px image
    and mask."""
    from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline
    from PIL import Image

    from svdq_linear.convert.tiny import build_tiny_pipeline

    root = tmp_path_factory.mktemp("img")
    base = build_tiny_pipeline("flux")
    out = {}
    for name, cls in (("inpaint", FluxInpaintPipeline), ("img2img", FluxImg2ImgPipeline)):
        cls(**base.components).save_pretrained(root / name, safe_serialization=True)
        out[name] = root / name
    g = torch.Generator().manual_seed(0)
    pixels = (torch.rand(64, 64, 3, generator=g) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(root / "image.png")
    Image.fromarray((pixels[..., 0] > 127).astype("uint8") * 255).save(root / "mask.png")
    (root / "not-an-image.png").write_text("hello")
    out.update(image=root / "image.png", mask=root / "mask.png", bad=root / "not-an-image.png")
    return out


def test_calibration_inputs_are_checked_before_calibration(sources, image_sources, tmp_path, capfd, no_calibration):
    """An inpainting pipeline ran its first calibration call without its image and mask and failed deep in
    diffusers ("Input is in incorrect format"), without naming what was missing or the way out. Now it is refused
    before any weight is read, naming the inputs and ``--calib-input``; so are a malformed or unreadable
    ``--calib-input`` and an argument the pipeline's call does not take."""
    img, mask = image_sources["image"], image_sources["mask"]
    cases = [
        ((image_sources["inpaint"],), "FluxInpaintPipeline needs mask_image and image besides the prompt to run: "
                                      "calibrate with --calib-input NAME=FILE"),
        ((image_sources["inpaint"], "--calib-input", f"image={img}"), "needs mask_image besides the prompt"),
        ((sources["flux"], "--calib-input", f"control_image={img}"),
         "--calib-input control_image: FluxPipeline takes no argument 'control_image'"),
        ((image_sources["inpaint"], "--calib-input", f"mask_image={image_sources['bad']}"),
         f"--calib-input mask_image={image_sources['bad']}: not a readable image"),
        ((image_sources["inpaint"], "--calib-input", str(img)), "--calib-input: expected NAME=FILE"),
        ((image_sources["inpaint"], "--calib-input", f"image={img}", "--calib-input", f"image={mask}"),
         "each NAME once"),
        ((image_sources["inpaint"], "--calib-input", f"image={img}", "--no-calib"), "which --no-calib skips"),
    ]
    for args, needle in cases:
        rc, _, err = run(capfd, args[0], tmp_path / "o", "--quiet", *args[1:])
        assert_one_line_error(rc, err, needle)
        assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_an_inpainting_pipeline_calibrates_on_the_given_image_and_mask(image_sources, tmp_path, capfd, monkeypatch):
    """``--calib-input image=... --calib-input mask_image=...``: the calibration calls get the images, and the
    converted pipeline loads as its own class."""
    seen = []
    real = calibrate.collect_act_max

    def spy(pipe, names, prompts, steps, call_kwargs=None, **kwargs):
        seen.append({k: getattr(v, "size", v) for k, v in (call_kwargs or {}).items()})
        return real(pipe, names, prompts, steps, call_kwargs, **kwargs)

    monkeypatch.setattr(calibrate, "collect_act_max", spy)
    rc, _, err = run(capfd, image_sources["inpaint"], tmp_path / "o", *FAST, "--calib-input",
                     f"image={image_sources['image']}", "--calib-input", f"mask_image={image_sources['mask']}")
    assert rc == 0, err
    assert seen and seen[0]["image"] == (64, 64) and seen[0]["mask_image"] == (64, 64)
    import svdq_linear

    pipe = svdq_linear.load_svdq_pipeline(tmp_path / "o", dtype=torch.float32)
    assert type(pipe).__name__ == "FluxInpaintPipeline"
    # the files are part of the settings a resume must match; runs without them record what they did before
    with_inputs = ConvertOptions(calib_inputs={"image": str(image_sources["image"])}).settings("m")
    assert with_inputs["calib_inputs"] == {"image": str(image_sources["image"].resolve())}
    assert "calib_inputs" not in ConvertOptions().settings("m")


def test_an_img2img_pipeline_without_its_image_names_the_input(image_sources, tmp_path, capfd):
    """A pipeline whose ``image`` is needed (img2img; Kontext's is optional, so it is not refused up front) fails its
    first calibration call: the error names ``image`` and ``--calib-input``, not only diffusers' "Input is in
    incorrect format", and no partial folder is left."""
    rc, _, err = run(capfd, image_sources["img2img"], tmp_path / "o", *FAST)
    assert_one_line_error(rc, err, "calibration could not run FluxImg2ImgPipeline on a prompt alone",
                          "it takes image besides the prompt", "--calib-input NAME=FILE")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
    rc, _, err = run(capfd, image_sources["img2img"], tmp_path / "o", *FAST, "--calib-input",
                     f"image={image_sources['image']}")
    assert rc == 0, err


def test_an_interrupt_is_exit_status_130_in_one_line(tmp_path, capfd, monkeypatch):
    """Ctrl-C: exit status 130 (the shell's convention for SIGINT), one line, no traceback."""
    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "convert", stop)
    assert cli.main(["tiny:flux", str(tmp_path / "o"), "--no-calib", "--quiet"]) == 130
    assert capfd.readouterr().err.strip() == "svdq-convert: error: interrupted"


def test_every_option_reaches_the_conversion_as_given(tmp_path, capfd, monkeypatch):
    """``main`` hands ``convert`` the options the command line gave, each in its own field: without flags exactly
    ``ConvertOptions()`` (the library's defaults, which the help text states), and every flag set to a value other
    than its default lands in its field (``convert`` is stubbed: the mapping is the promise here). ``--refine-iters``,
    ``--svd`` and a changed ``--alpha`` default were never checked: each could have been dropped silently."""
    calls = []

    class Summary:
        out_dir = str(tmp_path / "o")

        def text(self):
            return "svdq-convert: wrote nothing (stubbed)"

    monkeypatch.setattr(cli, "convert", lambda model_id, out_dir, opts: calls.append((model_id, out_dir, opts))
                        or Summary())
    rc, _, err = run(capfd, "some/model", tmp_path / "o")
    assert rc == 0, err
    assert calls[-1][:2] == ("some/model", str(tmp_path / "o"))
    assert calls[-1][2] == ConvertOptions(), calls[-1][2]
    prompts = tmp_path / "p.txt"
    rc, _, err = run(capfd, "some/model", tmp_path / "o", "--rank", "48", "--alpha", "0.25", "--svd", "full",
                     "--refine-iters", "3", "--act-headroom", "2", "--calib-prompts", prompts, "--calib-num", "5",
                     "--calib-steps", "7", "--calib-resolution", "256", "--calib-offload", "--calib-input",
                     "image=a.png", "--calib-input", "mask_image=m.png", "--device", "cuda:1", "--dtype", "float16",
                     "--resume", "--quiet")
    assert rc == 0, err
    want = ConvertOptions(rank=48, alpha=0.25, svd="full", refine_iters=3, act_headroom=2, calib=True,
                          calib_prompts=str(prompts), calib_num=5, calib_steps=7, calib_resolution=256,
                          calib_offload=True, calib_inputs={"image": "a.png", "mask_image": "m.png"}, device="cuda:1",
                          dtype="float16", resume=True, progress=False)
    assert calls[-1][2] == want, calls[-1][2]
    rc, _, err = run(capfd, "some/model", tmp_path / "o", "--no-calib", "--svd", "lowrank", "--overwrite")
    assert rc == 0 and calls[-1][2] == ConvertOptions(calib=False, svd="lowrank", overwrite=True), calls[-1][2]
