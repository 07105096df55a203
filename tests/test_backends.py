"""The backend seam: lazy per-call choice, preferences that fall back, declines, prepared-state caching.

A counting backend on the CPU stands in for a GPU kernel: it computes through the reference math but
records what the seam asked of it.
"""

import copy
import subprocess
import sys
import warnings

import pytest
import torch

import svdq_linear
from svdq_linear import NVFP4W4A16Linear, SVDQW4A4Linear, backends, nvfp4


def _module(k=64, n=48, rank=8, dtype=torch.float32):
    lin = torch.nn.Linear(k, n, dtype=dtype)
    return SVDQW4A4Linear.from_linear(lin, rank=rank, act_max=torch.rand(k) * 10 + 0.1)


class _Prepared:
    def __init__(self, qweight_t):
        self.qweight_t = qweight_t


class _CountingBackend(backends.Backend):
    """Serves W4A4 layers on the CPU whose rank is a multiple of 8 and 16-bit-or-fp32 inputs it is told."""

    name = "counting"
    kinds = frozenset({"w4a4"})

    def __init__(self):
        self.prepares = 0
        self.calls = 0
        self.refuse_fp64_like = torch.float16  # a call dtype it declines

    def supports(self, device, kind):
        return device.type == "cpu" and kind in self.kinds

    def declines(self, module, device):
        return None if module.rank % 8 == 0 else f"rank {module.rank} is not a multiple of 8"

    def declines_call(self, module, x):
        return "fp16 input" if x.dtype == self.refuse_fp64_like else None

    def prepare(self, module, device):
        self.prepares += 1
        return _Prepared(module.qweight.T.contiguous())

    def extra_tensors(self, prepared):
        return [prepared.qweight_t]

    def run_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        self.calls += 1
        assert torch.equal(extra[0].T, qweight), "stale prepared state"
        return nvfp4.w4a4_linear(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias).to(x.dtype)


@pytest.fixture
def counting():
    backend = _CountingBackend()
    backends.register_backend(backend, priority=100)
    backends._WARNED.clear()
    yield backend
    backends._ENTRIES.pop(backend.name)


def test_highest_priority_backend_serves_and_prepares_once(counting):
    m = _module()
    x = torch.randn(3, 64)
    assert m.backend_for(x) == "counting"
    m(x)
    m(x)
    assert counting.prepares == 1 and counting.calls == 2
    m.set_backend("reference")
    assert m.backend_for(x) == "reference" and "backend=reference" in repr(m)
    # No weight-only kernel: those layers go to the next backend that has one.
    assert NVFP4W4A16Linear(64, 32).backend == "reference"


def test_backend_declines_a_layer_and_a_call(counting):
    odd = _module(rank=6)
    assert odd.backend_for(torch.randn(2, 64)) == "reference"
    m = _module()
    assert m.backend_for(torch.randn(2, 64)) == "counting"
    assert m.backend_for(torch.randn(2, 64, dtype=torch.float16)) == "reference"
    y = m(torch.randn(2, 64, dtype=torch.float16))
    assert y.dtype == torch.float16 and counting.calls == 0


def test_preference_that_cannot_serve_warns_once_and_falls_back(counting, monkeypatch):
    monkeypatch.setenv(backends.ENV_BACKEND, "counting")
    odd = _module(rank=6)
    x = torch.randn(2, 64)
    with pytest.warns(UserWarning, match="declines .* rank 6"):
        y = odd(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(odd(x), y)  # no second warning
    w = NVFP4W4A16Linear(64, 32)
    with pytest.warns(UserWarning, match="does not cover w4a16 layers on cpu"):
        w(torch.randn(2, 64))


def test_preference_wins_over_priority(counting, monkeypatch):
    m = _module()
    monkeypatch.setenv(backends.ENV_BACKEND, "reference")
    assert m.backend_for(torch.randn(1, 64)) == "reference"
    monkeypatch.delenv(backends.ENV_BACKEND)
    assert m.backend_for(torch.randn(1, 64)) == "counting"


def test_unknown_backend_names_are_errors(monkeypatch):
    m = _module()
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        m.set_backend("nope")
    monkeypatch.setenv(backends.ENV_BACKEND, "nope")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        m(torch.randn(1, 64))


def test_prepared_state_follows_buffer_changes(counting):
    m = _module()
    x = torch.randn(2, 64)
    m(x)
    assert counting.prepares == 1
    with torch.no_grad():
        m.qweight[0, 0] ^= 0x11  # an in-place edit
    m(x)  # the counting backend asserts its prepared copy matches the weight
    assert counting.prepares == 2
    # What accelerate's set_module_tensor_to_device does: a new tensor under the same name.
    m._set("qweight", m.qweight.detach().clone())
    m(x)
    assert counting.prepares == 3
    m.to(torch.float32)  # .to() drops prepared state; the next call rebuilds it once
    m(x)
    m(x)
    assert counting.prepares == 4


def test_modules_made_under_inference_mode_dispatch(counting):
    """A model loaded (or fused) inside ``torch.inference_mode()`` holds inference tensors, which keep no
    version counter: the prepared-state key must not read it, and a weight loaded anew (a new tensor)
    still rebuilds the prepared state."""
    from svdq_linear.fuse import concat_w4a4

    with torch.inference_mode():
        m = _module()
        assert m.qweight.is_inference()
        x = torch.randn(2, 64)
        y = m(x)  # the counting backend asserts its prepared copy matches the weight
        fused = concat_w4a4([m, m])
        yf = fused(x)
        assert torch.equal(yf[:, :m.out_features], y) and torch.equal(yf[:, m.out_features:], y)
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        sd["qweight"][0, 0] ^= 0x11
        m.load_state_dict(sd)
        m(x)
    assert counting.prepares == 3  # m, fused, m again after its weight was replaced


def test_sequential_offload_keeps_no_prepared_state(counting):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    m = _module()
    x = torch.randn(2, 64)
    y = m(x)
    assert m._dispatch_cache
    add_hook_to_module(m, AlignDevicesHook(execution_device="cpu", offload=True, io_same_device=True,
                                           weights_map={k: v.clone() for k, v in m.state_dict().items()}))
    before = counting.prepares
    assert torch.equal(m(x), y) and torch.equal(m(x), y)
    assert counting.prepares == before + 2, "under per-call offload the state is rebuilt each call"
    assert not m._dispatch_cache, "nothing may stay cached beside weights that leave after the call"
    assert backends.weights_are_offloaded(m)


def test_group_offload_keeps_no_prepared_state(counting):
    from diffusers.hooks import apply_group_offloading

    model = torch.nn.Sequential(_module(), torch.nn.GELU())
    m = model[0]
    x = torch.randn(2, 64)
    y = model(x)
    assert m._dispatch_cache and not backends.weights_are_offloaded(m)
    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                           offload_type="leaf_level")
    assert backends.weights_are_offloaded(m), "diffusers' leaf-level hook sits on the module itself"
    assert torch.equal(model(x), y) and torch.equal(model(x), y)
    assert not m._dispatch_cache, "nothing may stay cached beside weights that leave after the call"


def test_weights_replaced_before_every_call_are_treated_as_offloaded(counting):
    """A mover whose hook sits elsewhere (diffusers' block-level groups) is seen by its effect: every
    tensor back at a new address between two calls on the same device."""
    m = _module()
    x = torch.randn(2, 64)
    y = m(x)
    m(x)
    assert counting.prepares == 1 and not backends.weights_are_offloaded(m)
    for _ in range(3):
        for p in m.packed_tensors():
            p.data = p.data.clone()
        assert torch.equal(m(x), y)
    assert backends.weights_are_offloaded(m) and not m._dispatch_cache
    assert counting.prepares == 4, "rebuilt for each call once the weights are seen to move"
    m.to(torch.float32)  # a deliberate .to() starts over: cached again
    m(x)
    m(x)
    assert not backends.weights_are_offloaded(m) and m._dispatch_cache


class _StandingBackend(_CountingBackend):
    """Keeps the codes in its own layout (rows reversed) and reads only that: the module frees its
    canonical ``qweight`` while the state is cached."""

    name = "standing"

    def prepare(self, module, device):
        self.prepares += 1
        return _Prepared(module.qweight.flip(0).contiguous())

    def replaced(self, prepared):
        return {"qweight": lambda: prepared.qweight_t.flip(0).contiguous()}

    def run_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        self.calls += 1
        assert qweight.numel() == 0, "the op got the canonical tensor though the state stands in for it"
        q = extra[0].flip(0)
        return nvfp4.w4a4_linear(x, q, wscales, smooth, proj_down, proj_up, wcscale, bias).to(x.dtype)


def _registered(backend):
    """A fixture's body: ``backend`` registered ahead of the others for one test. Layers that earlier tests left
    alive are forgotten: a compile prepares every live layer on the device that has no state yet
    (``prepare_before_trace``), which would add their preparations to this backend's counts."""
    backends.LIVE_LAYERS.clear()
    backends.register_backend(backend, priority=100)
    yield backend
    backends._ENTRIES.pop(backend.name)


@pytest.fixture
def standing():
    yield from _registered(_StandingBackend())


def test_prepared_state_stands_in_for_the_canonical_weight(standing, tmp_path):
    m = _module()
    q = m.qweight.clone()
    x = torch.randn(3, 64)
    y = m(x)
    assert m._parameters["qweight"].numel() == 0, "the canonical codes stay beside their repacked copy"
    assert torch.equal(m(x), y) and standing.prepares == 1
    sd = m.state_dict()  # the canonical layout, without bringing it back to stay
    assert torch.equal(sd["qweight"], q) and m._parameters["qweight"].numel() == 0
    c = copy.deepcopy(m)
    assert torch.equal(c._parameters["qweight"], q) and torch.equal(c(x), y)
    assert torch.equal(m.qweight, q), "reading the attribute rebuilds the tensor bit for bit"
    assert m._parameters["qweight"].numel() > 0
    assert torch.equal(m(x), y) and standing.prepares == 3  # the copy prepared once, m once more
    m.load_state_dict(sd)  # a load while the state stands in copies into the canonical tensor
    assert torch.equal(m(x), y) and standing.prepares == 4
    m.to(torch.float32)  # .to() carries the canonical tensors; a layer that was prepared is prepared again
    assert m._parameters["qweight"].numel() == 0 and standing.prepares == 5
    assert torch.equal(m(x), y) and standing.prepares == 5
    assert torch.equal(m.qweight, q)
    m.set_backend("reference")  # another backend reads the canonical tensors: they come back
    assert torch.equal(m(x), y) and torch.equal(m._parameters["qweight"], q)
    from safetensors.torch import load_file, save_file

    m.set_backend(None)
    m(x)
    assert m._parameters["qweight"].numel() == 0
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "m.safetensors")
    assert torch.equal(load_file(tmp_path / "m.safetensors")["qweight"], q)


def test_stood_in_state_compiles_fullgraph(standing):
    m = _module()
    x = torch.randn(3, 64)
    y = m(x)  # eager first: prepares and stands in
    compiled = torch.compile(torch.nn.Sequential(m, torch.nn.GELU()), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), torch.nn.functional.gelu(y))
    assert m._parameters["qweight"].numel() == 0 and standing.prepares == 1


def test_compiled_before_any_eager_call_prepares_eagerly_and_caches(counting):
    """torch.compile on a fresh module: the preparation runs eagerly at trace time (not in the graph)
    and is cached; a later eager call reuses it."""
    m = _module()
    x = torch.randn(3, 64)
    compiled = torch.compile(torch.nn.Sequential(m, torch.nn.GELU()), fullgraph=True, backend="aot_eager")
    y = compiled(x)
    assert m._dispatch_cache and counting.prepares == 1
    compiled(x)
    assert torch.equal(y, torch.nn.functional.gelu(m(x)))
    assert counting.prepares == 1 and counting.calls == 3


def test_sequential_offload_moves_the_packed_tensors():
    from accelerate import cpu_offload

    model = torch.nn.Sequential(_module(), torch.nn.GELU(), NVFP4W4A16Linear.from_linear(torch.nn.Linear(48, 32)))
    x = torch.randn(3, 64)
    expected = model(x)
    # What diffusers' enable_sequential_cpu_offload does to each component: buffers move only when the
    # top-level module has parameters of its own, which a transformer has not.
    cpu_offload(model, execution_device=torch.device("cpu"), offload_buffers=len(model._parameters) > 0)
    layers = (model[0], model[2])
    kept = [f"{i}.{n}" for i, m in zip((0, 2), layers) for n, t in [*m.named_parameters(), *m.named_buffers()]
            if not t.is_meta]
    assert not kept, f"offload left these tensors in place: {kept}"
    assert torch.equal(model(x), expected), "the tensors are brought in for the call"
    assert all(t.is_meta for m in layers for t in [*m.parameters(), *m.buffers()]), "and leave after it"


def test_prepared_state_is_not_pickled_or_copied(counting, tmp_path):
    m = _module()
    x = torch.randn(2, 64)
    y = m(x)
    assert m._dispatch_cache
    clone = copy.deepcopy(m)
    assert clone._dispatch_cache == {} and torch.equal(clone(x), y)
    torch.save(m, tmp_path / "m.pt")  # no lambdas or backend objects in the module's state
    again = torch.load(tmp_path / "m.pt", weights_only=False)
    assert torch.equal(again(x), y)
    assert clone in backends.LIVE_LAYERS and again in backends.LIVE_LAYERS  # prepare_before_trace sees copies
    m.set_backend("reference")
    torch.save(m, tmp_path / "m.pt")
    assert torch.load(tmp_path / "m.pt", weights_only=False)._backend_pref == "reference"
    assert copy.deepcopy(m)._backend_pref == "reference"


def test_packed_tensors_are_frozen_parameters_and_state_dict_is_canonical():
    m = _module()
    names = {n for n, _ in m.named_parameters()}
    assert names == {"qweight", "wscales", "wcscale", "bias", "smooth", "proj_down", "proj_up"}
    assert not any(p.requires_grad for p in m.parameters())
    sd = m.state_dict()
    assert sd["qweight"].dtype == torch.uint8 and sd["qweight"].shape == (48, 32)
    assert sd["wscales"].dtype == torch.float8_e4m3fn and sd["smooth"].dtype == torch.float32
    m16 = copy.deepcopy(m).to(torch.bfloat16)
    assert m16.qweight.dtype == torch.uint8 and m16.wscales.dtype == torch.float8_e4m3fn
    assert m16.wcscale.dtype == torch.float32 and m16.proj_up.dtype == torch.bfloat16


def test_meta_modules_dispatch_to_the_fake():
    meta = SVDQW4A4Linear(64, 48, rank=8, device="meta")
    assert meta(torch.empty(3, 64, device="meta")).shape == (3, 48)


def test_eager_calls_skip_the_custom_op_only_where_nothing_needs_it(monkeypatch):
    """A plain eager call without gradients (how diffusers pipelines run) calls the backend directly:
    the op's dispatch is host time a call. Grad mode, a dispatch mode (here FlopCounterMode), vmap,
    meta tensors and compile keep the op; every path gives the same output."""
    from torch.utils.flop_counter import FlopCounterMode

    m = _module(rank=8)
    w = NVFP4W4A16Linear.from_linear(torch.nn.Linear(64, 32))
    x = torch.randn(5, 64)
    seen = []
    for name in ("w4a4_linear", "w4a16_linear"):
        op = getattr(backends, name)
        monkeypatch.setattr(backends, name, lambda *a, _op=op, _n=name: seen.append(_n) or _op(*a))
    y = m(x)  # grad mode: the op
    yw = w(x)
    assert seen == ["w4a4_linear", "w4a16_linear"]
    seen.clear()
    with torch.no_grad():
        assert torch.equal(m(x), y) and torch.equal(w(x), yw)
    with torch.inference_mode():
        assert torch.equal(m(x), y) and torch.equal(w(x), yw)
    assert seen == []
    with torch.no_grad(), FlopCounterMode(display=False):
        assert torch.equal(m(x), y)
    assert seen == ["w4a4_linear"]
    seen.clear()
    with torch.no_grad():
        meta = SVDQW4A4Linear(64, 48, rank=8, device="meta")
        assert meta(torch.empty(3, 64, device="meta")).shape == (3, 48)
        assert seen == ["w4a4_linear"]
        assert not backends.plain_eager_call(torch.empty(2, device="meta"))
        assert torch.func.vmap(lambda t: backends.plain_eager_call(t) * t)(torch.ones(3, 2)).sum() == 0
        assert backends.plain_eager_call(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not backends.plain_eager_call(x)
        with torch.device("cpu"):  # a torch-function mode
            assert not backends.plain_eager_call(x)
        traced = torch.jit.trace(m, x, check_trace=False)  # records the op, not the backend's internals
        assert "svdq_linear::w4a4_linear" in str(traced.graph)
        assert torch.equal(traced(x), y)
    assert not backends.plain_eager_call(x)  # grad mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ops_pass_opcheck(dtype):
    """Each entry point's fake against its run, in every input dtype: a fake that reported float32 for a bf16 call
    passed the float32-only form of this test (a mutation probe)."""
    m = _module().to(dtype)
    x = torch.randn(5, 64, dtype=dtype)
    args = (x, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias, [], "reference")
    # test_schema is left out: its mutation check multiplies the float8 inputs, which the CPU lacks.
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(backends.w4a4_linear, args, test_utils=tests)
    torch.library.opcheck(backends.w4a4_fast_linear, args, test_utils=tests)
    w = NVFP4W4A16Linear.from_linear(torch.nn.Linear(64, 32)).to(dtype)
    torch.library.opcheck(backends.w4a16_linear, (x, w.qweight, w.wscales, w.wcscale, w.bias, [], "reference"),
                          test_utils=tests)


def test_import_does_not_load_kernel_libraries():
    code = ("import sys, svdq_linear; "
            "bad = [m for m in ('svdq_linear.backends.sm90', 'cutlass', 'quack') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_public_api():
    assert svdq_linear.SVDQW4A4Linear is SVDQW4A4Linear
    assert {"reference", "sm90"} <= set(backends.available_backends())


def test_candidates_are_cached_until_the_registry_changes():
    """``candidates`` caches its list per device and kind (a dispatch cost of every call) but sees a
    backend registered or removed at once, and hands out copies of the cached list."""
    before = [b.name for b in backends.candidates("cpu", "w4a4")]
    got = backends.candidates("cpu", "w4a4")
    got.clear()  # a caller's edit does not reach the cache
    assert [b.name for b in backends.candidates("cpu", "w4a4")] == before
    backend = _CountingBackend()
    backends.register_backend(backend, priority=100)
    try:
        assert [b.name for b in backends.candidates(torch.device("cpu"), "w4a4")] == ["counting", *before]
        assert "counting" not in [b.name for b in backends.candidates("cpu", "w4a16")]
    finally:
        backends._ENTRIES.pop(backend.name)
    assert [b.name for b in backends.candidates("cpu", "w4a4")] == before


_LAZY_SOURCE = '''
from svdq_linear import nvfp4
from svdq_linear.backends import Backend

class LazyProbe(Backend):
    name = "lazy_probe"
    calls = 0

    def run_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        LazyProbe.calls += 1
        return nvfp4.w4a4_linear(x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias).to(x.dtype)

def make_backend():
    return LazyProbe()
'''


def test_a_compiled_first_call_loads_a_lazy_backend_outside_the_trace(tmp_path, monkeypatch):
    # A model compiled before any eager call: the lazy backend's import (and the registry lock) must not
    # be traced; fullgraph=True turns such a graph break into an error.
    (tmp_path / "svdq_lazy_probe.py").write_text(_LAZY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    backends.register_lazy("lazy_probe", 100, "svdq_lazy_probe", lambda d: d.type == "cpu")
    try:
        torch._dynamo.reset()
        m = _module()
        x = torch.randn(5, m.in_features)
        assert backends._ENTRIES["lazy_probe"].backend is None
        y = torch.compile(m, fullgraph=True)(x)
        probe = backends._ENTRIES["lazy_probe"].backend
        assert probe is not None and type(probe).calls == 1  # loaded, and it served the compiled call
        ref = nvfp4.w4a4_linear(x, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias)
        torch.testing.assert_close(y, ref.to(x.dtype), rtol=0, atol=0)
    finally:
        backends._ENTRIES.pop("lazy_probe")
        torch._dynamo.reset()


def test_a_model_compiled_before_any_eager_call_prepares_its_layers_eagerly_once(standing):
    # Compiled first, the layers' preparation must not be traced into the graph (it would repack the
    # weights on every call): it runs eagerly at trace time, with its stand-ins, for every block at once,
    # so repeated blocks share one graph.
    import gc

    from torch._dynamo.utils import counters

    gc.collect()
    torch._dynamo.reset()
    counters.clear()
    try:
        blocks = torch.nn.ModuleList(
            torch.nn.Sequential(_module(64, 64), torch.nn.SiLU(), _module(64, 64)) for _ in range(4))
        layers = [b[i] for b in blocks for i in (0, 2)]
        canonical = [m.qweight.clone() for m in layers]
        for b in blocks:
            b.compile(fullgraph=True)
        x = torch.randn(5, 64)
        for call in range(3):
            y = x
            for b in blocks:
                y = b(y)
            if call == 0:
                prepares = standing.prepares
        assert standing.prepares == prepares >= len(layers)  # nothing prepared again after the first call
        assert standing.calls == 3 * len(layers)  # the compiled graphs call the backend's op
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # one graph for the 4 blocks
        for m, q in zip(layers, canonical):
            assert m._parameters["qweight"].numel() == 0  # stood in: prepared eagerly, not in the graph
            assert torch.equal(m.qweight, q)  # and rebuilt bit for bit on a read
        want = x
        for b in blocks:
            a, c = b[0], b[2]
            h = nvfp4.w4a4_linear(want, a.qweight, a.wscales, a.smooth, a.proj_down, a.proj_up, a.wcscale, a.bias)
            h = torch.nn.functional.silu(h)
            want = nvfp4.w4a4_linear(h, c.qweight, c.wscales, c.smooth, c.proj_down, c.proj_up, c.wcscale, c.bias)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


def test_prepare_before_trace_leaves_fused_parts_and_other_devices_alone(standing):
    from svdq_linear.fuse import _share_packed_weight, concat_w4a4

    parts = [_module(64, 16) for _ in range(3)]
    for p in parts[1:]:
        p.smooth.copy_(parts[0].smooth)  # one smoothing factor: fusable
    fused = concat_w4a4(parts)
    _share_packed_weight(fused, parts)  # what fuse_qkv_projections does: the parts hold rows of the fused
    lone = _module(64, 48)
    meta = SVDQW4A4Linear(64, 48, rank=8, device="meta")
    backends.prepare_before_trace("cpu", None, "torch.float32")
    assert fused._dispatch_cache and lone._dispatch_cache  # prepared, as their first calls would
    assert not any(p._dispatch_cache for p in parts)  # the fused layer serves their rows
    assert not meta._dispatch_cache


def test_a_copy_of_a_prepared_fused_layer_holds_its_weight_once(standing):
    """A deepcopy (or pickle) of a model with fused q/k/v: the copy's parts are views of its fused layer's rows again
    (a deepcopy cloned each view: the parts' packed weights held a second time), and when the copy's fused layer is
    prepared, its parts free those views as the original's do."""
    from svdq_linear.fuse import _share_packed_weight, concat_w4a4

    parts = [_module(64, 16) for _ in range(3)]
    for p in parts[1:]:
        p.smooth.copy_(parts[0].smooth)
    want = [p.qweight.clone() for p in parts]
    fused = concat_w4a4(parts)
    _share_packed_weight(fused, parts)
    model = torch.nn.ModuleDict({"q": parts[0], "k": parts[1], "v": parts[2], "qkv": fused})
    x = torch.randn(3, 64)
    y = fused(x)
    assert fused._parameters["qweight"].numel() == 0 and parts[0]._parameters["qweight"].numel() == 0
    for twin in (copy.deepcopy(model), copy.deepcopy(model.qkv)):  # alone: parts copied for nothing, harmless
        got = twin["qkv"] if isinstance(twin, torch.nn.ModuleDict) else twin
        assert torch.equal(got(x), y)  # prepared: stands in
        assert got._parameters["qweight"].numel() == 0
        if isinstance(twin, torch.nn.ModuleDict):
            for name, w in zip("qkv", want):
                assert twin[name]._parameters["qweight"].numel() == 0, "a copied part kept its own rows"
                assert torch.equal(twin[name].qweight, w)  # rebuilt on demand, bit for bit
    for p, w in zip(parts, want):
        assert torch.equal(p.qweight, w)


def test_a_compiled_model_moved_or_reloaded_keeps_its_graph(standing):
    # .to() and load_state_dict drop the prepared state; a layer that had one is prepared again at once,
    # so the compiled graph (which reads the prepared state) keeps matching instead of recompiling after
    # every move until fullgraph's recompile limit fails the call.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        model = torch.nn.Sequential(_module(), torch.nn.GELU(), _module(48, 32))
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        x = torch.randn(3, 64)
        y = compiled(x)
        sd = model.state_dict()
        for i in range(10):
            model.to("cpu") if i % 2 else model.load_state_dict(sd)
            assert torch.equal(compiled(x), y)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


def test_a_traced_call_prepares_for_its_own_input_dtype(standing):
    # The backend prepared at trace time is the one that serves the traced call's dtype: the standing
    # backend declines fp16 calls, so an fp16 call of an fp32 layer is the reference's (no stand-in).
    torch._dynamo.reset()
    try:
        m = _module()
        x = torch.randn(3, 64).half()
        y = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
        assert m._parameters["qweight"].numel() > 0 and standing.calls == 0
        ref = nvfp4.w4a4_linear(x, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias)
        torch.testing.assert_close(y, ref.to(x.dtype), rtol=0, atol=0)
        # prepared eagerly for fp32 (stood in), then traced with fp16, which another backend serves: the
        # trace cannot bring the canonical tensors back, so it says what to do instead of reading them
        m2 = _module()
        m2(torch.randn(3, 64))
        assert m2._parameters["qweight"].numel() == 0
        with pytest.raises(Exception, match="once eagerly with such inputs"):
            torch.compile(m2, fullgraph=True, backend="aot_eager")(x)
    finally:
        torch._dynamo.reset()


def test_a_backend_registered_after_a_compile_recompiles_the_graph():
    torch._dynamo.reset()
    m = _module()
    x = torch.randn(3, 64)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    compiled(x)
    backend = _CountingBackend()
    backends.register_backend(backend, priority=100)
    try:
        compiled(x)
        assert backend.calls == 1  # the graph was traced again and takes the new backend
    finally:
        backends._ENTRIES.pop(backend.name)
        torch._dynamo.reset()


def test_a_dropped_layer_is_freed_without_the_garbage_collector():
    import gc
    import weakref

    gc.disable()
    try:
        m = _module()
        ref = weakref.ref(m)
        del m
        assert ref() is None  # no reference cycle: it leaves backends.LIVE_LAYERS at once
    finally:
        gc.enable()


def test_a_pipeline_compiled_before_its_first_call_matches_eager(standing):
    # What a user does: quantize (or load), fuse q/k/v, compile the repeated blocks, generate. The
    # layers prepare at trace time (stand-ins included), each block class compiles once, and the
    # image is the eager one.
    import numpy as np
    from torch._dynamo.utils import counters

    from svdq_linear.convert.tiny import TINY_CALL_KWARGS, build_tiny_pipeline

    def generate(p):
        p.set_progress_bar_config(disable=True)
        return p("a cat", generator=torch.Generator().manual_seed(0), output_type="np",
                 **TINY_CALL_KWARGS["flux"]).images[0]

    pipe = build_tiny_pipeline("flux")
    svdq_linear.quantize_pipeline(pipe, rank=8, calib=False, progress=False)
    pipe.transformer.fuse_qkv_projections()
    fresh = copy.deepcopy(pipe.transformer)  # no prepared state: compiled before any call
    eager = generate(pipe)
    pipe.transformer = fresh
    layers = [m for m in fresh.modules() if isinstance(m, SVDQW4A4Linear)]
    torch._dynamo.reset()
    counters.clear()
    try:
        fresh.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        assert np.array_equal(generate(pipe), eager)
        served = [m for m in layers if m._dispatch_cache]
        assert served and all(m._parameters["qweight"].numel() == 0 for m in served)  # prepared eagerly
        parts = [m for m in layers if not m._dispatch_cache]
        assert all(m._parameters["qweight"].numel() == 0 for m in parts)  # fused parts: views dropped too
        # one graph per block class, and one more for the single blocks: diffusers hands the first one
        # its input with other strides; no recompile per block for the layers' prepared states
        assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


def test_repeated_blocks_with_an_unprepared_layer_share_one_graph():
    # A layer whose backend prepares nothing (the weight-only product, on every backend) used to cache
    # a tuple of constants (its tensors' addresses, None), which dynamo guarded by value: every block
    # recompiled, until fullgraph's recompile limit failed the call (or, without fullgraph, the rest
    # ran eagerly). Compiled after an eager call, as the Flux benchmark does.
    from torch._dynamo.utils import counters

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mod = NVFP4W4A16Linear.from_linear(torch.nn.Linear(64, 64))
            self.lin = _module(64, 64)

        def forward(self, x):
            return self.lin(self.mod(torch.nn.functional.silu(x))) + x

    torch._dynamo.reset()
    counters.clear()
    try:
        blocks = torch.nn.ModuleList(Block() for _ in range(12))
        x = torch.randn(4, 64)
        want = x
        for b in blocks:
            want = b(want)
        for b in blocks:
            b.compile(fullgraph=True, backend="aot_eager")
        for _ in range(2):
            y = x
            for b in blocks:
                y = b(y)
            assert torch.equal(y, want)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


def test_getenv_reads_what_os_environ_holds(monkeypatch):
    """The hot path's environment reader (``svdq_linear._env.getenv``) sees every change made through
    ``os.environ`` at once, as ``os.environ.get`` does."""
    import os

    from svdq_linear._env import getenv

    name = "SVDQ_LINEAR_TEST_GETENV"
    monkeypatch.delenv(name, raising=False)
    assert getenv(name) is None and getenv(name, "d") == "d"
    monkeypatch.setenv(name, "fast")
    assert getenv(name) == os.environ.get(name) == "fast"
    os.environ[name] = "ünï"  # non-ASCII survives the encoding round trip
    assert getenv(name) == "ünï"
    del os.environ[name]
    assert getenv(name) is None
    monkeypatch.setenv("SVDQ_LINEAR_MODE", "exact")
    m = SVDQW4A4Linear(32, 16, rank=4)
    assert m.mode == "exact" and m.kind == "w4a4"
    monkeypatch.setenv("SVDQ_LINEAR_MODE", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        m.mode


def test_switch_reads_on_off_and_refuses_the_rest(monkeypatch):
    """``_env.switch``, every on/off setting's reader: the words for on and off in any case and spacing, the
    caller's default where unset, empty or "auto", and an error naming the setting and its value otherwise."""
    from svdq_linear._env import switch

    name = "SVDQ_LINEAR_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert switch(name) is None
    for value, want in [("1", True), (" TRUE ", True), ("yes", True), ("On", True), ("0", False), ("false", False),
                        ("NO", False), (" off", False), ("", None), ("auto", None), (" Auto ", None)]:
        monkeypatch.setenv(name, value)
        assert switch(name) is want, value
    for value in ("2", "enable", "o", "-1", "1,0"):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name}='{value}'"):
            switch(name)


def test_sm90_routing_switches_read_words_and_refuse_typos(monkeypatch):
    """The sm90 backend's per-call on/off routes read their setting through ``_env.switch``: "true" routes as "1",
    "off" as "0", and a typo is an error naming the setting (before, anything but "0" / "1" silently meant the
    default)."""
    from svdq_linear.backends import sm90

    x1, x4 = torch.empty(1, 64), torch.empty(4, 64)
    routes = [(sm90.ENV_SMALL_M_MMA, lambda: sm90._route_small_m_mma("exact", x4, 64)),
              (sm90.ENV_EXACT_ONE_LAUNCH, lambda: sm90._route_exact_one_launch(x1, 64)),
              (sm90.ENV_FAST_ONE_LAUNCH, lambda: sm90._route_fast_one_launch(x4, 64))]
    for name, route in routes:
        got = {}
        for value in ("1", "true", "0", "off"):
            monkeypatch.setenv(name, value)
            got[value] = route()
        assert got["true"] == got["1"] and got["off"] == got["0"], (name, got)
        monkeypatch.setenv(name, "ture")
        with pytest.raises(ValueError, match=f"{name}='ture'"):
            route()
        monkeypatch.delenv(name)
    monkeypatch.setenv(sm90.ENV_FAST_ONE_LAUNCH, "yes")  # on: every call of 1-64 tokens, the CPU's included
    assert sm90._route_fast_one_launch(x4, 64) is True


def test_a_malformed_small_m_limit_is_named_at_import():
    """``SVDQ_SM90_SMALL_M`` (read when the sm90 backend is imported) takes a whole number of tokens; another value
    was int()'s bare "invalid literal" error, naming no setting. A number sets every kind's limit."""
    import os

    code = "from svdq_linear.backends import sm90; print(sorted(sm90.SMALL_M.values()))"
    for value, ok in (("abc", False), ("-3", False), ("16", True)):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "SVDQ_SM90_SMALL_M": value})
        if ok:
            assert r.returncode == 0 and r.stdout.split() == ["[16,", "16]"], r.stdout + r.stderr
        else:
            assert r.returncode != 0 and f"SVDQ_SM90_SMALL_M='{value}'" in r.stderr, r.stderr[-500:]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_does_not_reach_the_backends_own_ops(dtype):
    """Under autocast the op's body ran the reference's fp32 matmuls in 16 bits: in fp16 the FP4 product overflows
    before its ``* wcscale`` (Inf / NaN). The ops now turn autocast off for their bodies, and the layers take
    autocast as ``nn.Linear`` does: an fp32 input is cast to the region's dtype, and the output is what the layer
    gives that 16-bit input without autocast, in that dtype. The fused inputs (``forward_cat_gelu``,
    ``forward_ada_norm``) are cast the same way."""
    torch.manual_seed(0)
    m, w16 = _module(), NVFP4W4A16Linear.from_linear(torch.nn.Linear(64, 48))
    x = torch.randn(5, 64) * 4
    with torch.no_grad():
        want, want16 = m(x.to(dtype)), w16(x.to(dtype))
        with torch.autocast("cpu", dtype=dtype):
            got, got16 = m(x), w16(x)
            assert torch.nn.Linear(64, 48)(x).dtype == dtype  # what a drop-in replacement matches
    assert got.dtype == got16.dtype == dtype and torch.isfinite(got).all() and torch.isfinite(got16).all()
    assert torch.equal(got, want) and torch.equal(got16, want16)
    xa, xb = x[:, :32].reshape(1, 5, 32), x[:, 32:].reshape(1, 5, 32)
    shift, scale = torch.randn(1, 64), torch.randn(1, 64)
    with torch.no_grad():
        want_cat = m.forward_cat_gelu(xa.to(dtype), xb.to(dtype))
        want_norm = m.forward_ada_norm(x.reshape(1, 5, 64).to(dtype), shift.to(dtype), scale.to(dtype), 1e-6)
        with torch.autocast("cpu", dtype=dtype):
            got_cat = m.forward_cat_gelu(xa, xb)
            got_norm = m.forward_ada_norm(x.reshape(1, 5, 64), shift, scale, 1e-6)
    assert got_cat.dtype == got_norm.dtype == dtype
    assert torch.equal(got_cat, want_cat) and torch.equal(got_norm, want_norm)


def test_written_inputs_are_built_with_autocast_off(monkeypatch):
    """The written adaLN norm (``forward_ada_norm``'s default path and its wrapped-call path) is computed outside the
    ops. CUDA autocast runs ``layer_norm`` in fp32, which handed the kernels an fp32 input and returned fp32. That
    policy is emulated here on the CPU: the layer's steps after its input cast run with autocast off, so the
    result is the same bits, in the region's dtype, as without autocast."""
    layer_norm = torch.nn.functional.layer_norm

    def cuda_policy(x, *args, **kwargs):
        if torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return layer_norm(x.float(), *args, **kwargs)
        return layer_norm(x, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "layer_norm", cuda_policy)
    torch.manual_seed(0)
    m = _module().bfloat16()
    x, shift, scale = torch.randn(1, 5, 64).bfloat16(), torch.randn(1, 64).bfloat16(), torch.randn(1, 64).bfloat16()
    with torch.no_grad():
        want = m.forward_ada_norm(x, shift, scale, 1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = m.forward_ada_norm(x, shift, scale, 1e-6)
        h = m.register_forward_hook(lambda *a: None)  # the wrapped path writes the norm and calls the layer
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got_wrapped = m.forward_ada_norm(x, shift, scale, 1e-6)
        h.remove()
    assert got.dtype == got_wrapped.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(got_wrapped, want)


class _DerivedBackend(_CountingBackend):
    """Prepares ``1 / smooth`` and reads only that (as sm90 prepares ``proj_down / smooth``): a prepared state that
    an edit of ``smooth`` the seam does not see leaves stale."""

    name = "derived"

    def prepare(self, module, device):
        self.prepares += 1
        return _Prepared(1.0 / module.smooth)

    def run_w4a4(self, x, qweight, wscales, smooth, proj_down, proj_up, wcscale, bias, extra):
        self.calls += 1
        return nvfp4.w4a4_linear(x, qweight, wscales, 1.0 / extra[0], proj_down, proj_up, wcscale, bias).to(x.dtype)


@pytest.fixture
def derived():
    yield from _registered(_DerivedBackend())


def test_reset_prepared_after_edits_the_seam_cannot_see(derived):
    """An edit through ``.data`` (no version bump) leaves an eager layer's prepared state stale, and any edit leaves
    a compiled graph's: ``svdq_linear.reset_prepared`` makes them new (a compiled graph retraces once)."""
    torch.manual_seed(1)
    m = _module()
    x = torch.randn(3, 64)
    reference = backends.get_backend("reference")

    def oracle():
        return reference.linear(m, x, None)

    with torch.no_grad():
        assert torch.equal(m(x), oracle()) and derived.prepares == 1
        m.smooth.data.mul_(2)  # PyTorch does not count it as an edit
        assert not torch.equal(m(x), oracle()), "the stale state the reset is for"
        assert svdq_linear.reset_prepared(m) == 1 and derived.prepares == 2
        assert torch.equal(m(x), oracle())
        compiled = torch.compile(m, fullgraph=True)
        torch.testing.assert_close(compiled(x), oracle(), rtol=0, atol=0)
        m.smooth.mul_(2)  # an edit an eager call would see; the compiled graph reads the prepared state
        assert not torch.equal(compiled(x), oracle())
        svdq_linear.reset_prepared(m)
        torch.testing.assert_close(compiled(x), oracle(), rtol=0, atol=0)
    assert svdq_linear.reset_prepared(m, reprepare=False) == 1 and not m._dispatch_cache
    assert svdq_linear.reset_prepared(m) == 0, "nothing prepared: nothing to reset"


def test_a_zero_dimensional_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"last dimension 64, got shape \(\)"):
        _module()(torch.tensor(1.0))


def test_a_layers_own_preference_wins_over_the_environment(counting, monkeypatch):
    """``set_backend`` on a layer beats ``SVDQ_LINEAR_BACKEND``; without one the variable applies (each was tested
    alone, never both at once)."""
    monkeypatch.setenv(backends.ENV_BACKEND, "reference")
    m = _module().set_backend("counting")
    assert m.backend_for(torch.randn(1, 64)) == "counting"
    m.set_backend(None)
    assert m.backend_for(torch.randn(1, 64)) == "reference"


class _ExactOnlyBackend(_CountingBackend):
    """Covers both modes on the CPU but declines a layer in the fast mode (as sm90 declines fast-mode layers whose
    widths its FP8 GEMM does not take): what it declines depends on the layer's mode, not on the layer alone."""

    name = "exact_only"
    kinds = frozenset({"w4a4", "w4a4_fast"})

    def declines(self, module, device):
        return "no fast-mode kernel for this layer" if module.kind == "w4a4_fast" else None


@pytest.fixture
def exact_only():
    yield from _registered(_ExactOnlyBackend())


def test_a_mode_switch_asks_the_backend_again(exact_only):
    """A layer's decline is cached per backend, device and kind: switching the layer's mode asks again, in both
    directions (an answer cached for the layer alone served the fast mode on a backend that had declined it, or
    kept the exact mode off a backend that takes it)."""
    x = torch.randn(2, 64)
    m = _module().set_mode("exact")
    assert m.backend_for(x) == "exact_only"
    m.set_mode("fast")
    assert m.backend_for(x) == "reference"
    m2 = _module().set_mode("fast")
    assert m2.backend_for(x) == "reference"
    m2.set_mode("exact")
    assert m2.backend_for(x) == "exact_only"
    with torch.no_grad():
        ref = nvfp4.w4a4_linear(x, m2.qweight, m2.wscales, m2.smooth, m2.proj_down, m2.proj_up, m2.wcscale, m2.bias)
        assert torch.equal(m2(x), ref) and exact_only.calls == 1


def test_one_tensor_replaced_is_a_new_weight_not_an_offloader(counting):
    """A single tensor put in anew (accelerate's ``set_module_tensor_to_device`` for one name, a LoRA merge) rebuilds
    the prepared state once and keeps it cached; only every tensor at a new address between two calls marks the
    layer as moved per call (which rebuilds the state at every call from then on)."""
    m = _module()
    x = torch.randn(2, 64)
    m(x)
    with torch.no_grad():
        m._set("proj_up", m.proj_up * 2)
    want = nvfp4.w4a4_linear(x, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias)
    for _ in range(3):
        assert torch.equal(m(x), want)
    assert counting.prepares == 2, f"prepared {counting.prepares} times for one replaced tensor"
    assert not backends.weights_are_offloaded(m) and m._dispatch_cache


def test_auto_mode_is_exact_where_no_gpu_kernel_serves_the_fast_mode(monkeypatch):
    """``"auto"`` (the default) resolves to the fast mode only where a backend other than the reference serves it:
    not on this CPU; with such a backend registered (after the answer was cached), fast, unless the layer prefers a
    backend that has no fast mode (the reference); with it removed, exact again."""
    monkeypatch.delenv("SVDQ_LINEAR_MODE", raising=False)  # conftest pins "exact" for the suite
    monkeypatch.setattr(backends, "_NATIVE_FAST", {})
    m = _module()
    assert m.mode == "auto" and m.kind == "w4a4"
    backend = _ExactOnlyBackend()
    backends.register_backend(backend, priority=100)
    try:
        assert m.kind == "w4a4_fast", "the cached answer missed a backend registered after it"
        assert m.set_backend("reference").kind == "w4a4"
        assert m.set_backend("exact_only").kind == "w4a4_fast"
    finally:
        backends._ENTRIES.pop(backend.name)
    assert m.set_backend(None).kind == "w4a4"


def test_a_compiled_auto_mode_layer_is_not_retraced_by_a_load_for_another_device(monkeypatch):
    """The auto mode's answer is read inside compiled graphs; its cache's registry snapshot must not become a guard
    there: a lazy backend for another device loading (or failing to) retraced every compiled layer twice."""
    from torch._dynamo.utils import counters

    monkeypatch.delenv("SVDQ_LINEAR_MODE", raising=False)
    torch._dynamo.reset()
    backends.register_lazy("elsewhere", 5, "svdq_linear_no_such_module", lambda d: d.type == "cuda")
    try:
        m = _module()
        x = torch.randn(2, 64)
        f = torch.compile(lambda t: m(t), backend="eager", fullgraph=True)
        want = f(x)
        graphs = counters["stats"]["unique_graphs"]
        with pytest.warns(UserWarning):
            backends._load(backends._ENTRIES["elsewhere"])  # fails: its module does not exist
        for _ in range(2):
            assert torch.equal(f(x), want)
        assert counters["stats"]["unique_graphs"] == graphs, "a load for another device retraced the graph"
    finally:
        backends._ENTRIES.pop("elsewhere")
        torch._dynamo.reset()


def test_prepare_before_trace_prepares_only_the_traced_device(standing):
    """A trace on one device prepares that device's layers only (a pipeline spread over devices compiles a block
    per device): a trace of the meta device leaves a CPU layer unprepared, a trace of the CPU prepares it."""
    lone = _module()
    backends.prepare_before_trace("meta", None, "torch.float32")
    assert not lone._dispatch_cache and standing.prepares == 0
    backends.prepare_before_trace("cpu", None, "torch.float32")
    assert lone._dispatch_cache and standing.prepares == 1
