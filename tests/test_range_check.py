"""The opt-in activation range check ($SVDQ_LINEAR_CHECK_RANGE=1) and the range rule it reads.

Single-level NVFP4 represents a block whose max |x / smooth| lies between 6 * 2**-6 (smallest normal
E4M3 scale; below it the scale is subnormal or zero) and 6 * 448 (above it the scale saturates).
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch

import svdq_linear.linear as linear_mod
from svdq_linear import SVDQW4A4Linear, nvfp4
from svdq_linear.linear import name_layers

LOW, HIGH = 6 * 2.0**-6, 6 * 448.0  # independent of nvfp4's constants


def _block(amax: float) -> torch.Tensor:
    x = torch.zeros(1, 16)
    x[0, 3] = amax
    x[0, 7] = -amax / 3
    return x


@pytest.mark.parametrize("amax, saturated, underflow", [
    (HIGH, False, False),
    (HIGH * 1.001, True, False),
    (1e6, True, False),
    (LOW, False, False),  # scale exactly 2**-6: normal
    (LOW * 0.9, False, True),  # subnormal scale
    (1e-5, False, True),  # scale 0: every code 0
    (0.0, False, False),  # an all-zero block is exact
    (float("nan"), False, False),  # NaN blocks are the contract's NaN rule, not a range problem
])
def test_range_rule(amax, saturated, underflow):
    sat, under = nvfp4.range_violations(_block(amax))
    assert (bool(sat), bool(under)) == (saturated, underflow), f"block max {amax}"


def _layer(seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    return SVDQW4A4Linear.from_linear(lin, rank=4, act_max=x.abs().amax(0)), x


def test_check_is_off_by_default():
    assert os.environ.get("SVDQ_LINEAR_CHECK_RANGE") is None and linear_mod._CHECK_RANGE is False
    layer, x = _layer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x * 1e6)  # saturates, silently
        layer(x * 1e-9)  # underflows, silently


def test_check_warns_once_per_layer_and_problem(monkeypatch):
    monkeypatch.setattr(linear_mod, "_CHECK_RANGE", True)
    model = torch.nn.Sequential(*[_layer(s)[0] for s in (0, 1)])
    name_layers(model)
    _, x = _layer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model[0](x)  # the calibration's own range: quiet
    with pytest.warns(RuntimeWarning) as record:
        model[0](x * 64)
        model[0](x * 128)  # the same problem again: no second warning
        model[0](x * 1e-6)
        model[0](x * 1e-7)
        model[1](x * 64)  # another layer warns on its own
    messages = [str(w.message) for w in record]
    assert len(messages) == 3, messages
    assert messages[0].startswith("svdq-linear: 0: ") and "activation blocks saturate" in messages[0]
    assert "larger --act-headroom" in messages[0]
    assert messages[1].startswith("svdq-linear: 0: ") and "nonzero activation blocks underflow" in messages[1]
    assert messages[2].startswith("svdq-linear: 1: ") and "saturate" in messages[2]


def test_check_counts_blocks_through_the_contract(monkeypatch):
    monkeypatch.setattr(linear_mod, "_CHECK_RANGE", True)
    layer, x = _layer()
    xs = nvfp4.smooth_input(x * 64, layer.smooth)
    expected = int((xs.reshape(8, 4, 16).abs().amax(-1) > HIGH).sum())
    with pytest.warns(RuntimeWarning, match=f"{expected} of 32 activation blocks saturate"):
        layer(x * 64)


@pytest.mark.parametrize("check", [False, True])
def test_compiles_fullgraph_with_the_check_on_or_off(monkeypatch, check):
    monkeypatch.setattr(linear_mod, "_CHECK_RANGE", check)
    layer, x = _layer()
    eager = layer(x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), eager)


def test_environment_variable_turns_it_on():
    code = ("import warnings, torch, svdq_linear.linear as m\n"
            "lin = m.SVDQW4A4Linear.from_linear(torch.nn.Linear(32, 16), rank=2, act_max=torch.ones(32))\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    lin(torch.full((2, 32), 1e4))\n"
            "print(m._CHECK_RANGE, sum('saturate' in str(x.message) for x in w))\n")
    env = {**os.environ, "SVDQ_LINEAR_CHECK_RANGE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["True", "1"], r.stdout + r.stderr


@pytest.mark.parametrize("value, on", [("false", False), ("OFF", False), ("no", False), ("true", True), ("on", True)])
def test_environment_variable_reads_words_as_they_say(value, on, monkeypatch):
    """Any value but "" and "0" turned the check on: SVDQ_LINEAR_CHECK_RANGE=false too."""
    monkeypatch.setenv("SVDQ_LINEAR_CHECK_RANGE", value)
    assert linear_mod._flag("SVDQ_LINEAR_CHECK_RANGE") is on


def test_environment_variable_of_another_word_is_refused(monkeypatch):
    monkeypatch.setenv("SVDQ_LINEAR_CHECK_RANGE", "maybe")
    with pytest.raises(ValueError, match=r"SVDQ_LINEAR_CHECK_RANGE='maybe': expected 1/true/yes/on, 0/false"):
        linear_mod._flag("SVDQ_LINEAR_CHECK_RANGE")


def test_the_check_covers_the_fused_entry_points(monkeypatch):
    """``SVDQ_LINEAR_CHECK_RANGE`` watches ``forward_cat_gelu`` and ``forward_ada_norm`` too (only ``forward`` was
    tested)."""
    import svdq_linear.linear as linear_mod

    monkeypatch.setattr(linear_mod, "_CHECK_RANGE", True)
    layer, x = _layer()
    with pytest.warns(RuntimeWarning, match="activation blocks saturate"):
        layer.forward_cat_gelu(x[:, :32] * 1e4, x[:, 32:])
    layer, x = _layer(1)
    shift, scale = torch.zeros(1, 64), torch.full((1, 64), 1e5)
    with pytest.warns(RuntimeWarning, match="activation blocks saturate"):
        layer.forward_ada_norm(x[None], shift, scale, 1e-6)
