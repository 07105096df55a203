"""GPU behaviour: CUDA modules against the CPU contract, compile with inductor, GPU conversion paths.

Skipped without a CUDA device (see conftest.py); run on the H200 with ``pytest -m gpu``.
"""

import numpy as np
import pytest
import torch

import svdq_linear
from svdq_linear.convert.tiny import TINY_CALL_KWARGS, build_tiny_pipeline
from svdq_linear import (NVFP4W4A16Linear, SVDQuantConfig, SVDQW4A4Linear, backends, load_svdq_pipeline, nvfp4,
                         svdquant)

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def test_weight_only_cuda_matches_cpu():
    m = NVFP4W4A16Linear.from_linear(torch.nn.Linear(256, 384))
    x = torch.randn(5, 256)
    y = m.to("cuda")(x.cuda())
    assert y.device.type == "cuda" and _rel(y, m.to("cpu")(x)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_16_bit_inputs(dtype):
    lin = torch.nn.Linear(512, 256)
    m = SVDQW4A4Linear.from_linear(lin, rank=16).to("cuda", dtype)
    x = torch.randn(3, 7, 512, device="cuda", dtype=dtype)
    y = m(x)
    assert y.dtype == dtype and y.shape == (3, 7, 256)
    assert _rel(y, lin.cuda()(x.float()).detach()) < 0.2


def test_inductor_fullgraph_on_cuda_matches_eager():
    m = SVDQW4A4Linear.from_linear(torch.nn.Linear(256, 128), rank=16).to("cuda", torch.bfloat16)
    seq = torch.nn.Sequential(m, torch.nn.SiLU())
    compiled = torch.compile(seq, fullgraph=True)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(compiled(x), seq(x))


def test_svdquant_on_gpu_is_as_good_as_on_cpu():
    w = torch.randn(1024, 2048) * torch.exp(torch.randn(2048) * 0.5)
    act_max = torch.exp(torch.randn(2048)).abs() * 10
    cpu = svdquant(w, act_max=act_max, config=SVDQuantConfig(rank=32, device="cpu"))
    gpu = svdquant(w, act_max=act_max, config=SVDQuantConfig(rank=32, device="cuda"))
    assert gpu.qweight.device.type == "cpu"  # results come back to the weight's device
    assert gpu.rel_error < 1.02 * cpu.rel_error, (gpu.rel_error, cpu.rel_error)
    again = svdquant(w, act_max=act_max, config=SVDQuantConfig(rank=32, device="cuda"))
    assert torch.equal(again.qweight, gpu.qweight), "a GPU conversion must be reproducible"


def test_activation_codes_are_bit_identical_on_cuda():
    x = torch.randn(64, 1024) * torch.exp(torch.randn(1, 1024) * 3)
    x[3, 17] = float("nan")
    x[9, 100] = float("inf")
    packed_cpu, scales_cpu = nvfp4.quantize_nvfp4(x)
    packed_gpu, scales_gpu = nvfp4.quantize_nvfp4(x.cuda())
    assert torch.equal(packed_cpu, packed_gpu.cpu())
    assert torch.equal(scales_cpu.view(torch.uint8), scales_gpu.view(torch.uint8).cpu())


def _image(pipe, kind="flux"):
    pipe.set_progress_bar_config(disable=True)
    return pipe("a photo of a cat", generator=torch.Generator().manual_seed(0), output_type="np",
                **TINY_CALL_KWARGS[kind]).images[0]


def _psnr(a, b):
    return 10 * np.log10(1.0 / max(float(np.mean((a - b) ** 2)), 1e-12))


def test_quantize_pipeline_on_cuda_and_reload(tmp_path):
    ref = _image(build_tiny_pipeline("flux"))
    pipe = build_tiny_pipeline("flux").to("cuda")
    call = {k: v for k, v in TINY_CALL_KWARGS["flux"].items() if k != "num_inference_steps"}
    svdq_linear.quantize_pipeline(pipe, rank=8, calib_prompts=["a cat", "a dog"], calib_steps=2,
                                  call_kwargs=call, progress=False)
    layer = pipe.transformer.transformer_blocks[0].attn.to_q
    assert layer.qweight.device.type == "cuda" and layer.backend == svdq_linear.backends.select_backend("cuda").name
    img = _image(pipe)
    assert _psnr(img, ref) > 30.0
    pipe.save_pretrained(tmp_path / "q")
    again = load_svdq_pipeline(tmp_path / "q", device="cuda", dtype=torch.float32)
    assert _psnr(_image(again), img) > 60.0


def test_cuda_matches_cpu_contract():
    lin = torch.nn.Linear(256, 192)
    m = SVDQW4A4Linear.from_linear(lin, rank=16, act_max=torch.rand(256) * 20)
    x = torch.randn(33, 256) * 3
    y_cpu = m(x)
    bound = nvfp4.tolerance(x, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias,
                            torch.float32)
    y = m.to("cuda")(x.cuda())
    assert y.device.type == "cuda"
    # the CPU runs the reference; the GPU's kernels may differ within the contract's tolerance
    assert ((y.cpu().double() - y_cpu.double()).abs() <= bound).all()


@pytest.mark.parametrize("tokens", [7, 300])
def test_cuda_graph_capture_and_replay(tokens):
    m = SVDQW4A4Linear.from_linear(torch.nn.Linear(512, 384), rank=32).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    expected = m(x)  # eager first: prepares and compiles outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        m(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    x.copy_(torch.randn_like(x))  # new data through the captured kernels
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, m(x))


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_quack_paths_hold_one_copy_of_the_weight(mode):
    """On Hopper with quack, the repacked weight stands in for the canonical codes and scales: the GPU
    holds one copy, every call (large and small M) gives what it gave before, and state_dict is
    canonical."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the quack paths run on sm90")
    pytest.importorskip("quack")
    from test_conformance import random_w4a4

    m = random_w4a4(3072, 3072, 32, torch.bfloat16, "cuda").set_mode(mode)
    q, s = m.qweight.clone(), m.wscales.clone()
    xs = [torch.randn(t, 3072, device="cuda", dtype=torch.bfloat16) for t in (512, 7)]
    ys = [m(x) for x in xs]
    stood = {name for name in ("qweight", "wscales") if m._parameters[name].numel() == 0}
    assert stood == {"qweight", "wscales"}  # the fast mode's strip and 2**e give the scales back too
    assert all(torch.equal(m(x), y) for x, y in zip(xs, ys)), "a call after the stand-in differs"
    assert not {name for name in stood if m._parameters[name].numel()}, "a small-M call brought a tensor back"
    sd = m.state_dict()
    assert torch.equal(sd["qweight"], q) and torch.equal(sd["wscales"].view(torch.uint8), s.view(torch.uint8))


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("offload", ["model", "sequential", "group"])
def test_offload_moves_the_4bit_tensors_on_and_off_the_gpu(offload, fused, monkeypatch):
    """Each offload takes the 4-bit tensors to the GPU for a step and off after it, with fused q/k/v too (the
    sequential offload then runs the separate layers: the fused ones' keys are not in the state_dict it loads from)."""
    from svdq_linear.linear import _PackedNVFP4Linear

    pipe = build_tiny_pipeline("flux")
    svdq_linear.quantize_pipeline(pipe, rank=8, calib=False, progress=False)
    if fused:
        pipe.transformer.fuse_qkv_projections()
    ran = {}  # id of a layer that ran -> the devices of its 4-bit tensors at each call
    forward = _PackedNVFP4Linear.forward

    def spy(self, x):  # runs inside the offload hooks, which capture module.forward when installed
        ran.setdefault(id(self), []).append(self.qweight.device.type)
        return forward(self, x)

    monkeypatch.setattr(_PackedNVFP4Linear, "forward", spy)
    expected = _image(pipe)
    running = len(ran)  # fused: the stacked layers, not their q/k/v parts
    ran.clear()
    layers = [m for m in pipe.transformer.modules() if isinstance(m, _PackedNVFP4Linear)]
    packed = sum(t.numel() * t.element_size() for m in layers for t in m.packed_tensors())
    torch.cuda.empty_cache()
    if offload == "model":
        pipe.enable_model_cpu_offload(device="cuda")
    elif offload == "sequential":
        pipe.enable_sequential_cpu_offload(device="cuda")
    else:
        pipe.enable_group_offload(onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                                  offload_type="leaf_level")
    image = _image(pipe)
    torch.cuda.synchronize()
    during = {d for devices in ran.values() for d in devices}
    assert len(ran) >= running and during == {"cuda"}, "the 4-bit tensors were not on the GPU for a step"
    on_gpu = 0  # bytes the quantized layers hold on the GPU after the step: their tensors and prepared states
    for m in layers:
        on_gpu += sum(t.numel() * t.element_size() for t in m.packed_tensors() if t.device.type == "cuda")
        for (name, _), entry in m._dispatch_cache.items():
            extra = backends.get_backend(name).extra_tensors(entry.state)
            on_gpu += sum(t.numel() * t.element_size() for t in extra if t.device.type == "cuda")
    assert on_gpu == 0, f"{on_gpu} bytes of the quantized layers stay on the GPU after the step (4-bit tensors: {packed})"
    assert _psnr(image, expected) > 60.0


def test_cli_calibrates_and_decomposes_on_cuda(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "svdq_linear.convert.cli", "tiny:flux", str(tmp_path / "o"), "--rank", "8",
                        "--dtype", "float32", "--device", "cuda", "--calib-num", "2", "--calib-steps", "2", "--quiet"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "o" / "svdq_calibration.safetensors").is_file()
    pipe = load_svdq_pipeline(tmp_path / "o", device="cuda", dtype=torch.float32)
    assert _psnr(_image(pipe), _image(build_tiny_pipeline("flux"))) > 30.0


def test_fused_qkv_on_cuda_matches_separate_layers():
    from svdq_linear.fuse import concat_w4a4

    torch.manual_seed(0)
    base = torch.nn.Linear(512, 3 * 256)
    act_max = torch.rand(512) * 10 + 0.5
    w = base.weight.detach()
    layers = []
    for i in range(3):
        lin = torch.nn.Linear(512, 256)
        lin.weight.data.copy_(w[256 * i:256 * (i + 1)])
        layers.append(SVDQW4A4Linear.from_linear(lin, rank=16, act_max=act_max, alpha=1.0))  # smooth = f(act_max)
    layers = [m.to("cuda", torch.bfloat16) for m in layers]
    fused = concat_w4a4(layers)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    separate = torch.cat([m(x) for m in layers], dim=-1).float()
    assert _rel(fused(x), separate) < 1e-2  # the same contract; bf16 output rounding and summation order


@pytest.mark.parametrize("kind", ["sd3", "sd35"])
def test_fused_sd3_attention_on_cuda_matches_the_unfused_model(kind):
    """SD3 / SD3.5 with fused q/k/v on the GPU (our fused joint processor: SD3.5's q/k norms and its attention
    without a context stream) against the same model unfused, then unfused again."""
    pipe = build_tiny_pipeline(kind).to(torch.bfloat16)
    svdq_linear.quantize_pipeline(pipe, rank=8, calib=False, progress=False)
    model = pipe.transformer.to("cuda")
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, cfg.in_channels, cfg.sample_size, cfg.sample_size, generator=g),
                  encoder_hidden_states=torch.randn(2, 8, cfg.joint_attention_dim, generator=g),
                  pooled_projections=torch.randn(2, cfg.pooled_projection_dim, generator=g),
                  timestep=torch.tensor([500, 500]))
    inputs = {k: v.to("cuda", torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    with torch.no_grad():
        before = model(**inputs).sample
        model.fuse_qkv_projections()
        fused = model(**inputs).sample
        model.unfuse_qkv_projections()
        after = model(**inputs).sample
    assert _rel(fused, before) < 2e-2  # the same contract: bf16 roundings and another summation order
    assert torch.equal(after, before)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_fused_qkv_keeps_one_copy_of_the_weight_on_cuda(mode):
    """``fuse_qkv_projections``' q/k/v layers hold row views of the fused packed weight; once the fused
    module's kernel layout stands in for its canonical tensors on the GPU, they free those views too
    (else the canonical codes stay beside the kernel's copy), and give the same rows back bit for bit."""
    from test_conformance import random_w4a4

    from svdq_linear.fuse import _share_packed_weight, concat_w4a4

    parts = [random_w4a4(3072, 3072, 32, torch.bfloat16, "cuda") for _ in range(3)]
    for p in parts[1:]:
        p.smooth.copy_(parts[0].smooth)
    codes = [p.qweight.clone() for p in parts]
    fused = concat_w4a4(parts).set_mode(mode)
    _share_packed_weight(fused, parts)
    fused(torch.randn(256, 3072, device="cuda", dtype=torch.bfloat16))
    if fused._parameters["qweight"].numel():
        pytest.skip("no kernel layout stands in for the canonical codes here (quack-kernels missing)")
    assert all(p._parameters["qweight"].numel() == 0 for p in parts), "q/k/v still hold the fused codes"
    assert all(torch.equal(p.state_dict()["qweight"], c) for p, c in zip(parts, codes))


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_a_copy_of_a_fused_model_holds_its_weight_once_on_cuda(mode):
    """``copy.deepcopy`` of a model with fused q/k/v, its fused layer prepared: the copy's q/k/v layers are views of
    its fused layer's rows again and free them once it is prepared (a deepcopy cloned them: the packed q/k/v twice
    in the copy)."""
    import copy

    from test_conformance import random_w4a4

    from svdq_linear.fuse import _share_packed_weight, concat_w4a4

    x = torch.randn(256, 3072, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    parts = [random_w4a4(3072, 3072, 32, torch.bfloat16, "cuda") for _ in range(3)]
    for p in parts[1:]:
        p.smooth.copy_(parts[0].smooth)
    packed = sum(p.qweight.numel() + p.wscales.numel() for p in parts)  # bytes: uint8 and float8
    fused = concat_w4a4(parts).set_mode(mode)
    _share_packed_weight(fused, parts)
    model = torch.nn.ModuleDict({"q": parts[0], "k": parts[1], "v": parts[2], "qkv": fused})
    y = fused(x)
    if fused._parameters["qweight"].numel():
        pytest.skip("no kernel layout stands in for the canonical codes here (quack-kernels missing)")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - start
    twin = copy.deepcopy(model)
    assert torch.equal(twin["qkv"](x), y)
    assert torch.equal(fused(x), y)  # the original stands in again (the copy read its canonical tensors)
    assert all(twin[n]._parameters["qweight"].numel() == 0 for n in "qkv"), "the copy's q/k/v hold their own rows"
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - start - held  # the copy; without y (in held)
    assert grown < held + packed / 2, (grown, held, packed)
