"""The fast mode's numerics (FP8 weights and per-token FP8 activations from the same checkpoint) and
its selection. The oracle re-derives the formula in float64 with its own E4M3 rounding."""

import pytest
import torch

import svdq_linear
from svdq_linear import SVDQW4A4Linear, nvfp4

E4M3_GRID = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0x7F is NaN


def _e4m3(v):
    """Nearest E4M3 value (ties to the even code), saturating at 448, by search: an independent rounding."""
    a = v.abs().clamp(max=448)
    d = (a.unsqueeze(-1) - E4M3_GRID).abs()
    best = d == d.min(-1, keepdim=True).values
    idx = torch.arange(127)
    pick = best & ((idx % 2 == 0) | (best.sum(-1, keepdim=True) == 1))
    return E4M3_GRID[torch.where(pick, idx, 999).min(-1).values] * torch.sign(v)


def _outlier_layer(n=96, k=256, tokens=64, outliers=6, gain=40.0):
    lin = torch.nn.Linear(k, n)
    x = torch.randn(tokens, k)
    x[:, torch.randperm(k)[:outliers]] *= gain
    return lin, x


def test_fast_formula_matches_an_independent_derivation():
    lin, x = _outlier_layer()
    m = SVDQW4A4Linear.from_linear(lin, rank=8, act_max=x.abs().amax(0))
    got = nvfp4.w4a8_fast_linear(x, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias,
                                 torch.float64)
    xs32 = (x.float() * (1.0 / m.smooth)).double()
    codes = nvfp4.unpack_e2m1(m.qweight).long()
    vals = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)[codes]
    w = (vals.reshape(96, -1, 16) * m.wscales.double().unsqueeze(-1)).reshape(96, 256)
    nw = 2.0 ** torch.ceil(torch.log2(w.abs().amax(1) / 448))  # the smallest power of two that fits 448
    assert ((w.abs().amax(1) / nw) <= 448).all() and ((w.abs().amax(1) / nw) > 224).all()
    w8 = _e4m3(w / nw[:, None])
    sa = xs32.abs().amax(1) / 448
    a8 = _e4m3((xs32 / sa[:, None]).float().double())
    want = (a8 @ w8.T) * sa[:, None] * (nw * m.wcscale.double())[None, :] + m.bias.double()
    want = want + (xs32 @ m.proj_down.double()) @ m.proj_up.double().T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fast_mode_is_at_least_as_accurate_on_outlier_layers():
    errors = {"exact": [], "fast": []}
    for seed in range(3):
        torch.manual_seed(seed)
        lin, x = _outlier_layer(n=256, k=512, tokens=128)
        ref = lin(x).detach().double()
        m = SVDQW4A4Linear.from_linear(lin, rank=16, act_max=x.abs().amax(0))
        for mode in errors:
            y = m.set_mode(mode)(x).double()
            errors[mode].append(((y - ref).norm() / ref.norm()).item())
    assert max(errors["fast"]) <= min(errors["exact"]), errors


def test_mode_selection_per_module_model_and_environment(monkeypatch):
    lin, x = _outlier_layer()
    m = SVDQW4A4Linear.from_linear(lin, rank=8, act_max=x.abs().amax(0))
    assert m.mode == "exact" and m.kind == "w4a4"
    exact = m(x)
    monkeypatch.setenv("SVDQ_LINEAR_MODE", "fast")
    assert m.mode == "fast" and m.kind == "w4a4_fast"
    fast = m(x)
    assert not torch.equal(fast, exact)
    assert torch.equal(fast, nvfp4.w4a8_fast_linear(x, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up,
                                                    m.wcscale, m.bias))
    m.set_mode("exact")  # the module's own setting wins over the environment
    assert torch.equal(m(x), exact)
    model = torch.nn.Sequential(m, torch.nn.ReLU())
    assert svdq_linear.set_mode(model, "fast") == 1 and m.mode == "fast"
    with pytest.raises(ValueError, match="expected a mode"):
        m.set_mode("turbo")
    monkeypatch.setenv("SVDQ_LINEAR_MODE", "turbo")
    m.set_mode(None)
    with pytest.raises(ValueError, match="SVDQ_LINEAR_MODE"):
        m(x)


def test_mode_is_chosen_per_pipeline_when_loading_and_quantizing(tmp_path):
    from svdq_linear import load_svdq_pipeline, quantize_pipeline
    from svdq_linear.convert.tiny import TINY_CALL_KWARGS, build_tiny_pipeline

    pipe = build_tiny_pipeline("flux")
    quantize_pipeline(pipe, rank=4, calib=False, progress=False, mode="fast")
    layers = [m for m in pipe.transformer.modules() if isinstance(m, SVDQW4A4Linear)]
    assert layers and all(m.mode == "fast" for m in layers)
    pipe.save_pretrained(tmp_path)
    loaded = load_svdq_pipeline(tmp_path, mode="exact")
    assert all(m.mode == "exact" for m in loaded.transformer.modules() if isinstance(m, SVDQW4A4Linear))
    with pytest.raises(ValueError, match="expected a mode"):
        load_svdq_pipeline(tmp_path, mode="quick")


def test_loader_names_layers_and_does_not_ask_the_hub_for_a_missing_path(tmp_path, monkeypatch):
    import huggingface_hub

    from svdq_linear import load_svdq_pipeline, quantize_pipeline
    from svdq_linear.convert.tiny import build_tiny_pipeline

    def no_hub(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    with pytest.raises(FileNotFoundError, match="not asked"):
        load_svdq_pipeline(tmp_path / "missing")
    pipe = build_tiny_pipeline("flux")
    quantize_pipeline(pipe, rank=4, calib=False, progress=False)
    pipe.save_pretrained(tmp_path / "q")
    loaded = load_svdq_pipeline(tmp_path / "q")
    names = [m.layer_name for n, m in loaded.transformer.named_modules() if isinstance(m, SVDQW4A4Linear)]
    assert names and all(names)


def test_set_mode_after_compiling_takes_effect():
    """``set_mode`` on a module that a compiled graph already runs: the graph's guard on the module's mode
    (unset until then) fails and the call recompiles into the new mode, as eager does."""
    torch._dynamo.reset()
    m = SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=4)
    x = torch.randn(3, 64)
    f = torch.compile(m, fullgraph=True, backend="eager")
    with torch.no_grad():
        y_auto = f(x)
        assert torch.equal(y_auto, m(x))  # auto: exact on the CPU
        m.set_mode("fast")
        y_fast = f(x)
        assert torch.equal(y_fast, m(x)) and not torch.equal(y_fast, y_auto)
    torch._dynamo.reset()
