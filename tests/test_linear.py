"""SVDQW4A4Linear: the contract from its own buffers, dtypes, state_dict, bad input, compile, backends."""

import copy

import oracle
import pytest
import torch
from safetensors.torch import load_file, save_file

import svdq_linear
from svdq_linear import NVFP4W4A16Linear, SVDQW4A4Linear, backends
from svdq_linear.linear import FIXED_DTYPES


def _module(k=128, n=96, rank=16, bias=True, dtype=torch.float32, calibrate=True):
    lin = torch.nn.Linear(k, n, bias=bias, dtype=dtype)
    act_max = (torch.randn(64, k) * torch.exp(torch.randn(k))).abs().amax(0) if calibrate else None
    return SVDQW4A4Linear.from_linear(lin, rank=rank, act_max=act_max), lin


def _contract_float64(m: SVDQW4A4Linear, x: torch.Tensor) -> torch.Tensor:
    """The formula in float64 from the module's tensors, decoded and encoded by the tests' own oracle."""
    return oracle.w4a4_linear(m, x)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rank", [0, 16])
def test_forward_matches_float64_contract(bias, rank):
    m, _ = _module(rank=rank, bias=bias)
    x = torch.randn(3, 5, m.in_features) * 4
    y = m(x)
    assert y.shape == (3, 5, m.out_features) and y.dtype == torch.float32
    assert _rel(y, _contract_float64(m, x)) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_dtypes_return_input_dtype(dtype):
    m, lin = _module()
    m = m.to(dtype)
    x = torch.randn(7, m.in_features, dtype=dtype)
    y = m(x)
    assert y.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the output's own rounding
    assert _rel(y, _contract_float64(m, x)) < tol
    assert _rel(y, lin(x.float()).detach()) < 0.2  # still the layer it replaced


def test_to_dtype_casts_only_float_buffers():
    m, _ = _module()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    for convert in (lambda t: t.to(torch.bfloat16), lambda t: t.half(), lambda t: t.float()):
        m = convert(m)
        sd = m.state_dict()
        assert sd["qweight"].dtype == torch.uint8 and torch.equal(sd["qweight"], before["qweight"])
        assert sd["wscales"].dtype == torch.float8_e4m3fn
        assert torch.equal(sd["wscales"].view(torch.uint8), before["wscales"].view(torch.uint8))
        assert sd["smooth"].dtype == torch.float32 and torch.equal(sd["smooth"], before["smooth"])
        assert sd["wcscale"].dtype == torch.float32 and torch.equal(sd["wcscale"], before["wcscale"])
    assert m.to(torch.float16).proj_down.dtype == torch.float16
    assert m.bias.dtype == torch.float16


def test_safetensors_round_trip(tmp_path):
    m, _ = _module()
    save_file(m.state_dict(), tmp_path / "layer.safetensors")
    fresh = SVDQW4A4Linear(m.in_features, m.out_features, rank=m.rank)
    fresh.load_state_dict(load_file(tmp_path / "layer.safetensors"), strict=True)
    x = torch.randn(4, m.in_features)
    assert torch.equal(fresh(x), m(x))
    for key, value in m.state_dict().items():
        assert torch.equal(fresh.state_dict()[key].view(torch.uint8), value.view(torch.uint8)), key


def test_load_on_meta_with_assign_keeps_file_tensors():
    m, _ = _module(dtype=torch.bfloat16)
    meta = SVDQW4A4Linear(m.in_features, m.out_features, rank=m.rank, device="meta")
    meta.load_state_dict(m.state_dict(), strict=True, assign=True)
    assert meta.proj_down.dtype == torch.bfloat16 and meta.qweight.device.type == "cpu"
    x = torch.randn(2, m.in_features, dtype=torch.bfloat16)
    assert torch.equal(meta(x), m(x))


def test_extra_repr_names_shape_rank_and_backend():
    m, _ = _module(k=64, n=32, rank=8)
    assert "in_features=64, out_features=32, rank=8, bias=True, backend=reference" in repr(m)


def test_flux_size_layer_takes_what_its_tensors_say():
    # A 3072 x 3072 layer at rank 32 in bf16, the low-rank branch and per-channel factors included.
    n = k = 3072
    r = 32
    m = SVDQW4A4Linear(k, n, rank=r, device="meta", dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in m.state_dict().values())
    codes, scales, smooth, wcscale = n * k // 2, n * k // 16, 4 * k, 4 * n
    branch, bias = 2 * (k + n) * r, 2 * n
    assert held == codes + scales + smooth + wcscale + branch + bias
    ratio = (2 * n * k + 2 * n) / held  # against the bf16 nn.Linear it replaces
    assert ratio == pytest.approx(3.29, abs=0.01), ratio


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_only_matches_float64_contract(dtype):
    lin = torch.nn.Linear(96, 160, dtype=dtype)
    m = NVFP4W4A16Linear.from_linear(lin)
    assert m.qweight.dtype == torch.uint8 and m.wcscale.dtype == torch.float32 and m.bias.dtype == dtype
    x = torch.randn(2, 3, 96, dtype=dtype)
    expected = oracle.w4a16_linear(m, x)
    y = m(x)
    assert y.dtype == dtype and y.shape == (2, 3, 160)
    assert _rel(y, expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert _rel(y, lin(x).detach()) < 0.15
    assert "backend=reference" in repr(m)


def test_weight_only_state_dict_round_trip_and_checks(tmp_path):
    m = NVFP4W4A16Linear.from_linear(torch.nn.Linear(64, 32, bias=False))
    save_file(m.state_dict(), tmp_path / "w.safetensors")
    fresh = NVFP4W4A16Linear(64, 32, bias=False)
    fresh.load_state_dict(load_file(tmp_path / "w.safetensors"))
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), m(x))
    bad = m.state_dict()
    bad["wscales"] = torch.zeros(32, 2, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"wscales: expected shape \[32, 4\] for NVFP4W4A16Linear"):
        fresh.load_state_dict(bad)


# ---- bad input ------------------------------------------------------------------------------------


def test_wrong_last_dim_is_rejected():
    m, _ = _module(k=64, n=32, rank=8)
    with pytest.raises(ValueError, match="last dimension 64"):
        m(torch.randn(2, 48))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn])
def test_unsupported_input_dtype_is_rejected(dtype):
    m, _ = _module(k=64, n=32, rank=8)
    with pytest.raises(TypeError, match=str(dtype)):
        m(torch.zeros(2, 64).to(dtype))


def test_in_features_not_multiple_of_16_is_rejected():
    with pytest.raises(ValueError, match="multiple of 16, got 3000"):
        SVDQW4A4Linear(3000, 64)
    with pytest.raises(ValueError, match="in_features % 16 == 0, got 40"):
        SVDQW4A4Linear.from_linear(torch.nn.Linear(40, 8), rank=4)


def test_from_linear_rejects_non_linear():
    with pytest.raises(TypeError, match="nn.Linear"):
        SVDQW4A4Linear.from_linear(torch.nn.Conv2d(3, 3, 1))


def test_a_linear_subclass_with_its_own_forward_is_refused_not_stripped():
    """A subclass of nn.Linear with its own forward (a LoRA wrapper, another quantizer's layer) was quantized and its
    forward dropped: the quantized layer computed something else (a probe measured 1.12 relative error). Both
    siblings and quantize_linears refuse it by name; a subclass that keeps nn.Linear's forward is taken."""
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Plain(torch.nn.Linear):
        pass

    for build in (lambda lin: SVDQW4A4Linear.from_linear(lin, rank=8), NVFP4W4A16Linear.from_linear):
        with pytest.raises(TypeError, match="Doubled subclasses nn.Linear with its own forward"):
            build(Doubled(64, 32))
        assert build(Plain(64, 32)).out_features == 32
    with pytest.raises(TypeError, match="^1: Doubled subclasses nn.Linear with its own forward"):
        svdq_linear.quantize_linears(torch.nn.Sequential(Plain(64, 64), Doubled(64, 32)), w4a4=["0", "1"], rank=8)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("qweight", torch.zeros(32, 16, dtype=torch.uint8), r"layer.qweight: expected shape \[32, 32\]"),
        ("qweight", torch.zeros(32, 32, dtype=torch.int8), "layer.qweight: expected dtype torch.uint8"),
        ("wscales", torch.zeros(32, 4), "layer.wscales: expected dtype torch.float8_e4m3fn"),
        ("proj_down", torch.zeros(64, 4), r"layer.proj_down: expected shape \[64, 8\]"),
        ("proj_up", torch.zeros(32, 8, dtype=torch.int64), "layer.proj_up: expected a float16"),
        ("wcscale", torch.zeros(31), r"layer.wcscale: expected shape \[32\]"),
    ],
)
def test_bad_state_dict_names_the_tensor(key, value, match):
    m, _ = _module(k=64, n=32, rank=8)
    parent = torch.nn.Module()
    parent.layer = m
    sd = parent.state_dict()
    sd[f"layer.{key}"] = value
    with pytest.raises(ValueError, match=match):
        parent.load_state_dict(sd)


@pytest.mark.parametrize("key, edit, match", [
    ("wcscale", lambda t: t.to(torch.bfloat16), "layer.wcscale: expected dtype torch.float32, got torch.bfloat16"),
    ("smooth", lambda t: t.half(), "layer.smooth: expected dtype torch.float32, got torch.float16"),
    ("smooth", lambda t: t.index_fill(0, torch.tensor([2, 9]), 0.0),
     r"layer.smooth: expected finite positive smoothing factors, got 2 zero \(first at index 2: 0.0\)"),
    ("smooth", lambda t: -t, r"layer.smooth: .* got 64 negative \(first at index 0: -"),
    ("smooth", lambda t: t.index_fill(0, torch.tensor([4]), float("nan")).index_fill(0, torch.tensor([6]), float("inf")),
     r"layer.smooth: .* got 1 NaN, 1 Inf \(first at index 4: nan\)"),
    ("wcscale", lambda t: t.index_fill(0, torch.tensor([7]), 0.0),
     r"layer.wcscale: expected finite positive per-row weight scales, got 1 zero \(first at index 7: 0.0\)"),
    ("wcscale", lambda t: t.index_fill(0, torch.tensor([1, 2]), -1.0).index_fill(0, torch.tensor([30]), float("nan")),
     r"layer.wcscale: .* got 2 negative, 1 NaN \(first at index 1: -1.0\)"),
    ("wcscale", lambda t: t.index_fill(0, torch.tensor([31]), float("inf")), r"layer.wcscale: .* got 1 Inf"),
    ("wscales", lambda t: t.view(torch.uint8).index_fill(1, torch.tensor([3]), 0x7F).view(torch.float8_e4m3fn),
     r"layer.wscales: expected finite E4M3 block scales, got 32 NaN scale bytes \(0x7F/0xFF; "
     r"first at \[row, block\] = \[0, 3\]\)"),
    ("wscales", lambda t: t.view(torch.uint8).index_fill(0, torch.tensor([5]), 0xFF).view(torch.float8_e4m3fn),
     r"layer.wscales: .* got 4 NaN scale bytes \(0x7F/0xFF; first at \[row, block\] = \[5, 0\]\)"),
    # the low-rank branch and the bias had loaded with NaN or Inf (a probe's find): every output they touch was
    ("proj_up", lambda t: t.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("inf"))),
     r"layer.proj_up: expected finite values, got 1 NaN or Inf \(first at index \[0, 0\]\)"),
    ("proj_down", lambda t: t.index_put((torch.tensor([9]), torch.tensor([2])), torch.tensor(float("nan"))),
     r"layer.proj_down: expected finite values, got 1 NaN or Inf \(first at index \[9, 2\]\)"),
    ("bias", lambda t: t.index_fill(0, torch.tensor([3, 4]), float("nan")),
     r"layer.bias: expected finite values, got 2 NaN or Inf \(first at index \[3\]\)"),
])
def test_values_that_would_poison_the_output_are_refused(key, edit, match):
    m, _ = _module(k=64, n=32, rank=8)
    parent = torch.nn.Module()
    parent.layer = m
    sd = parent.state_dict()
    sd[f"layer.{key}"] = edit(sd[f"layer.{key}"])
    fresh = copy.deepcopy(parent)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(sd)
    with pytest.raises(ValueError, match=match):  # the meta + assign path loaders take
        meta = torch.nn.Module()
        meta.layer = SVDQW4A4Linear(64, 32, rank=8, device="meta")
        meta.load_state_dict(sd, assign=True)


@pytest.mark.parametrize("build", [lambda: _module()[0], lambda: NVFP4W4A16Linear.from_linear(torch.nn.Linear(64, 32))])
def test_fixed_dtype_tensors_keep_their_dtype_through_casts(build):
    m = build()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        held = {n: t.dtype for n, t in m.to(dtype).state_dict().items()}
        assert {n: d for n, d in held.items() if n in FIXED_DTYPES} == {n: FIXED_DTYPES[n] for n in held
                                                                       if n in FIXED_DTYPES}
        assert all(d == dtype for n, d in held.items() if n not in FIXED_DTYPES), held


def test_missing_key_is_reported():
    m, _ = _module(k=64, n=32, rank=8)
    sd = m.state_dict()
    del sd["wscales"]
    with pytest.raises(RuntimeError, match="wscales"):
        SVDQW4A4Linear(64, 32, rank=8).load_state_dict(sd)


def test_bias_in_state_dict_of_biasless_module_is_rejected():
    m, _ = _module(k=64, n=32, rank=8)
    with pytest.raises(ValueError, match="bias=False"):
        SVDQW4A4Linear(64, 32, rank=8, bias=False).load_state_dict(m.state_dict())


# ---- torch.compile and backends -------------------------------------------------------------------


def test_torch_compile_fullgraph_matches_eager():
    m, _ = _module(k=64, n=48, rank=8)
    seq = torch.nn.Sequential(m, torch.nn.GELU())
    compiled = torch.compile(seq, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3, 64)
    assert torch.equal(compiled(x), seq(x))


def test_fake_impl_gives_shapes_on_meta():
    meta = SVDQW4A4Linear(64, 48, rank=8, device="meta")
    y = meta(torch.empty(5, 2, 64, device="meta"))
    assert y.shape == (5, 2, 48) and y.device.type == "meta"


def test_public_api():
    assert svdq_linear.SVDQW4A4Linear is SVDQW4A4Linear
    assert "reference" in backends.available_backends()




def test_empty_batch():
    m, _ = _module(k=64, n=48, rank=8)
    assert m(torch.randn(0, 64)).shape == (0, 48)


def test_fused_layers_free_their_views_when_the_fused_weight_stands_in():
    """After ``fuse_qkv_projections`` the q/k/v layers hold row views of the fused packed weight. When a
    GPU backend frees the fused module's canonical tensors (its kernel layout stands in for them), the
    views would keep that storage alive: a second copy of the weight. The layers free them too and
    rebuild their rows, bit for bit, whenever they are read (state_dict, an attribute, a forward)."""
    import io

    from svdq_linear.fuse import _share_packed_weight, concat_w4a4

    torch.manual_seed(0)
    parts = [SVDQW4A4Linear.from_linear(torch.nn.Linear(64, n), rank=4, act_max=torch.rand(64) + 1) for n in (32, 48, 32)]
    for p in parts[1:]:
        p.smooth.copy_(parts[0].smooth)
    x = torch.randn(3, 64)
    want = {i: p(x) for i, p in enumerate(parts)}
    saved = {i: {k: v.clone() for k, v in p.state_dict().items()} for i, p in enumerate(parts)}
    fused = concat_w4a4(parts)
    _share_packed_weight(fused, parts)
    base = fused.qweight.data_ptr()
    assert parts[1].qweight.data_ptr() == base + 32 * 32  # a view of rows 32..79 (32 bytes a row)

    canon = {name: getattr(fused, name).clone() for name in ("qweight", "wscales")}
    fused._stand_in({name: (lambda name=name: canon[name].clone()) for name in canon})  # as backends.resolve does
    for m in [fused, *parts]:
        assert all(m._parameters[name].numel() == 0 for name in canon), "a layer still holds the fused storage"
    for i, p in enumerate(parts):  # the checkpoint, bit for bit, without keeping the rows
        sd = p.state_dict()
        assert all(torch.equal(sd[k].view(torch.uint8) if sd[k].dtype == torch.float8_e4m3fn else sd[k],
                               saved[i][k].view(torch.uint8) if saved[i][k].dtype == torch.float8_e4m3fn else saved[i][k])
                   for k in saved[i]), f"part {i}: state_dict changed"
        assert p._parameters["qweight"].numel() == 0
    buf = io.BytesIO()
    torch.save(fused, buf)  # the weak references stay behind (a pickle of weakrefs would fail)
    copy.deepcopy(fused)
    for i, p in enumerate(parts):  # a forward rebuilds the rows (a copy of them: the fused canonical is gone)
        torch.testing.assert_close(p(x), want[i], rtol=0, atol=0)
        assert torch.equal(p.qweight, saved[i]["qweight"])  # (the freed address may be reused: not compared)
    fused._restore()  # the fused canonical back: a second stand-in frees the layers' rows again
    fused._stand_in({name: (lambda name=name: canon[name].clone()) for name in canon})
    assert all(p._parameters["qweight"].numel() == 0 for p in parts)
    fused._restore()
    assert parts[2].qweight.data_ptr() == fused.qweight.data_ptr() + 80 * 32  # views again
    # a tensor of the layer's own (a load with assign=True) is not a view: the fused stand-in leaves it
    own = {k: v.clone() for k, v in saved[0].items()}
    own["qweight"] = torch.randint(0, 256, own["qweight"].shape, dtype=torch.uint8)
    parts[0].load_state_dict(own, assign=True)
    fused._stand_in({name: (lambda name=name: canon[name].clone()) for name in canon})
    assert torch.equal(parts[0].qweight, own["qweight"]), "the layer's own codes were replaced"
    assert parts[1]._parameters["qweight"].numel() == 0


def test_unfusing_gives_the_layers_their_rows_back():
    """``unfuse_qkv_projections`` deletes the fused module: the q/k/v layers first take their rows back
    (nothing of theirs keeps the fused module and its prepared state alive), bit for bit."""
    import types

    from svdq_linear.fuse import _fuse_projections, _unfuse_projections

    torch.manual_seed(0)
    attn = torch.nn.Module()
    act_max = torch.rand(64) + 1
    for name in ("to_q", "to_k", "to_v"):
        setattr(attn, name, SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=4, act_max=act_max))
        getattr(attn, name).smooth.copy_(attn.to_q.smooth)  # one input, one smoothing factor (as converted)
    codes = {name: getattr(attn, name).qweight.clone() for name in ("to_q", "to_k", "to_v")}
    types.MethodType(_fuse_projections, attn)()
    fused = attn.to_qkv
    canon = fused.qweight.clone()
    fused._stand_in({"qweight": lambda: canon.clone()})
    assert attn.to_k._parameters["qweight"].numel() == 0
    types.MethodType(_unfuse_projections, attn)()
    assert not hasattr(attn, "to_qkv") and not attn.fused_projections
    for name, c in codes.items():
        layer = getattr(attn, name)
        assert not layer._stood_in and torch.equal(layer._parameters["qweight"], c)


def test_device_guard_makes_the_inputs_gpu_current(monkeypatch):
    """Triton and CuTe DSL kernels launch on the current CUDA device: a call whose input sits on another GPU
    runs under ``torch.cuda.device(that index)``; on the current GPU, off CUDA and under torch.compile it
    changes nothing."""
    from types import SimpleNamespace

    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: entered.append(index) or torch.no_grad())
    on = {i: SimpleNamespace(device=torch.device("cuda", i)) for i in (0, 1)}
    with backends.device_guard(on[1]):
        pass
    with backends.device_guard(on[0]), backends.device_guard(torch.zeros(1)):
        pass
    assert entered == [1]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with backends.device_guard(on[1]):
        pass
    assert entered == [1]


@pytest.mark.parametrize("cat_gelu", [False, True])
def test_forward_runs_its_backend_under_the_device_guard(cat_gelu, monkeypatch):
    """Both entry points (``forward``, ``forward_cat_gelu``) resolve and run the backend inside the guard of
    their input."""
    guarded, ran = [], []
    real_linear = backends.Backend.linear

    class Guard:
        def __init__(self, x):
            self.x = x

        def __enter__(self):
            guarded.append(self.x.shape)

        def __exit__(self, *exc):
            guarded.append(None)

    monkeypatch.setattr(backends, "device_guard", Guard)
    monkeypatch.setattr(backends.Backend, "linear",
                        lambda self, *a, **kw: ran.append(len(guarded)) or real_linear(self, *a, **kw))
    mod = SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=8)
    x = torch.randn(3, 64)
    y = mod.forward_cat_gelu(x[:, :32], x[:, 32:]) if cat_gelu else mod(x)
    assert y.shape == (3, 32)
    assert guarded == [(3, 32 if cat_gelu else 64), None] and ran == [1], (guarded, ran)


@pytest.mark.parametrize("entry", ["exact", "fast", "cat_gelu", "ada_norm", "w4a16"])
def test_backward_through_a_4bit_layer_names_the_problem(entry):
    """An input that requires grad builds a graph through the op; its backward failed with torch's "no autograd
    formula was registered". It now says the layers are for inference and what to do. The 16-bit layers around them
    keep their gradients."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    if entry == "w4a16":
        m = NVFP4W4A16Linear.from_linear(lin)
    else:
        m = SVDQW4A4Linear.from_linear(lin, rank=8, act_max=torch.rand(64) + 1)
        m.set_mode("fast" if entry == "fast" else "exact")
    head = torch.nn.Linear(32, 4)
    x = torch.randn(2, 3, 64, requires_grad=True)
    if entry == "cat_gelu":
        y = m.forward_cat_gelu(x[..., :32], x[..., 32:])
    elif entry == "ada_norm":
        y = m.forward_ada_norm(x, torch.zeros(2, 64), torch.zeros(2, 64), 1e-6)
    else:
        y = m(x)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=r"4-bit layers are for inference: svdq_linear::\w+ has no gradient.*"
                                           r"torch.no_grad\(\)"):
        head(y).sum().backward()
    head(y.detach()).sum().backward()
    assert head.weight.grad is not None and torch.isfinite(head.weight.grad).all()


def test_a_compiled_model_runs_in_grad_mode_and_its_backward_names_the_problem():
    """Under grad mode with a 16-bit layer upstream, torch.compile traces the backward too: a backward that raised
    while traced made the compile fail, where the eager forward ran. The traced backward now holds an op that raises
    when it runs."""
    torch.manual_seed(0)
    q = SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=8, act_max=torch.rand(64) + 1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), q)
    x = torch.randn(4, 64)
    want = model(x)
    y = torch.compile(model, fullgraph=True)(x)
    assert y.requires_grad and torch.equal(y.detach(), want.detach())
    with pytest.raises(RuntimeError, match=r"4-bit layers are for inference: svdq_linear::w4a4_linear has no gradient"):
        y.sum().backward()


def test_a_tensor_left_on_meta_is_named_at_the_call():
    """A ``load_state_dict(strict=False, assign=True)`` into a meta-built layer that misses a tensor left it on meta,
    and the call returned garbage: torch multiplies a CPU tensor by a meta one without complaint."""
    full = SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=8, act_max=torch.rand(64) + 1)
    sd = full.state_dict()
    del sd["smooth"]
    m = SVDQW4A4Linear(64, 32, rank=8, device="meta")
    m.load_state_dict(sd, strict=False, assign=True)
    with pytest.raises(RuntimeError, match=r"the input is on cpu, but smooth on meta \(never loaded"):
        m(torch.randn(2, 64))
    m.load_state_dict({"smooth": full.smooth.clone()}, strict=False, assign=True)
    x = torch.randn(2, 64)
    assert torch.equal(m(x), full(x))


def test_a_float64_cast_is_refused_and_leaves_the_layer_as_it_was():
    """``.double()`` made the 16-bit tensors float64, which the constructor, ``from_linear`` and ``load_state_dict``
    refuse: the layer could not load its own state_dict."""
    m = SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=8, act_max=torch.rand(64) + 1)
    x = torch.randn(2, 64)
    y = m(x)
    for cast in (lambda t: t.double(), lambda t: t.to(torch.float64), lambda t: torch.nn.Sequential(t).double()):
        with pytest.raises(TypeError, match=r"takes float16/bfloat16/float32, not \['torch.float64'\]"):
            cast(m)
        assert m.proj_down.dtype == torch.float32 and torch.equal(m(x), y)
    m.half()
    assert m.proj_up.dtype == torch.float16 and m.wcscale.dtype == torch.float32


def test_a_bad_mode_is_refused_on_any_model_and_a_bad_backend_variable_does_not_break_printing(monkeypatch):
    """``set_mode(model, "bogus")`` returned 0 on a model without W4A4 layers; a bad ``$SVDQ_LINEAR_BACKEND`` made
    ``print(model)`` raise (the repr works out the backend), while the call names the problem."""
    with pytest.raises(ValueError, match="expected a mode in"):
        svdq_linear.set_mode(torch.nn.Linear(4, 4), "bogus")
    m = SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=8)
    monkeypatch.setenv("SVDQ_LINEAR_BACKEND", "nonesuch")
    assert "backend=? (" in repr(m)
    with pytest.raises((ValueError, KeyError), match="nonesuch"):
        m(torch.randn(2, 64))


def test_construction_errors_name_the_problem():
    for rank in (None, 8.0, True, -1):
        with pytest.raises(ValueError, match=f"expected an integer rank >= 0, got {rank!r}"):
            SVDQW4A4Linear(64, 32, rank=rank)
    meta = torch.nn.Linear(64, 32, device="meta")
    for build in (lambda: SVDQW4A4Linear.from_linear(meta, rank=8), lambda: NVFP4W4A16Linear.from_linear(meta)):
        with pytest.raises(ValueError, match=r"weight is on meta \(never loaded\)"):
            build()


def test_torch_export_of_a_layer_not_yet_called_gives_no_warning():
    """torch.export traces with fake parameters: the eager preparation ahead of the trace failed on them and warned
    that preparing had failed, though the exported program was right."""
    import warnings

    m = torch.nn.Sequential(SVDQW4A4Linear.from_linear(torch.nn.Linear(64, 32), rank=8)).eval()
    x = torch.randn(4, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = torch.export.export(m, (x,))
    assert not [w for w in caught if "svdq-linear" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(program.module()(x), m(x))
