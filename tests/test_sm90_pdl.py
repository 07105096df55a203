"""Programmatic dependent launch (PDL) of ``lora_act`` and the activation pass (``SVDQ_SM90_PDL=1``).

``kernels.lora_act(pdl=True)`` waits for x's writer, then lets the next grid start; the pass launched right after
it (``quantize_act_after_lora``, ``quantize_act_fp8(lora_pdl=True)``) reads x without waiting, beside it, and
ends after it. CPU: the builds compiled for sm_90a here (the real compiler) put the grid-dependency instructions
where that order needs them, and a CPU device refuses PDL by name. GPU: the pair writes the bits of the plain
launches, eager, in CUDA graphs and right after a grid that lets it start early; the module routes to it and
stays within the contract.
"""

import types

import pytest
import torch

_SASS = """
import json, sys
sys.path.insert(0, sys.argv[2])
from sass_loops import compile_sm90, instructions
from svdq_linear.backends.sm90 import kernels

def first(ops, key):
    return min((i for i, t in enumerate(ops) if key in t), default=-1)

def summary(fn, sig, cx, name, not_div, warps=4):
    ops = [t for _, t in instructions(compile_sm90(fn, sig, cx, sys.argv[1] + "/" + name + ".cubin", not_div,
                                                   num_warps=warps))]
    return dict(wait=[i for i, t in enumerate(ops) if "ACQBULK" in t],
                launch=[i for i, t in enumerate(ops) if "PREEXIT" in t],
                first_load=first(ops, "LDG"), loads=[i for i, t in enumerate(ops) if "LDG" in t],
                stores=[i for i, t in enumerate(ops) if "STG" in t])

out = {}
sig = dict(x_ptr="*bf16", pd_ptr="*bf16", out_ptr="*fp32", M="i32", K="i32", R="i32", stride_xm="i32",
           K_SPLIT="i32", xb_ptr="*bf16", KA="i32", stride_bm="i32")
for pdl in (False, True):
    cx = dict(BLOCK_M=64, BLOCK_K=128, BLOCK_R=32, NUM_STAGES=3, DOT_F32=False, HAS_B=False, GELU_B=False,
              RNE_BITS=False, PDL=pdl)
    out["lora%d" % pdl] = summary(kernels._lora_act_kernel, sig, cx, "lora%d" % pdl, ("M",))
sig = dict(x_ptr="*bf16", smooth_ptr="*fp32", xq_ptr="*bf16", codes_ptr="*u8", scales_ptr="*u8", M="i32",
           K="i32", stride_xm="i32", stride_xk="i32", xb_ptr="*bf16", KA="i32", stride_bm="i32",
           lora_ptr="*fp32", la_ptr="*bf16", R="i32")
for late in (False, True):
    cx = dict(BLOCK_M=8, BLOCK_K=256, WRITE_XQ=True, WRITE_CODES=False, AFTER_LORA=late, BLOCK_R=32, NSPLIT=4)
    out["exact%d" % late] = summary(kernels._quantize_act_kernel, sig, cx, "exact%d" % late, ("M", "stride_xk"))
sig = dict(xa_ptr="*bf16", xb_ptr="*bf16", inv_ptr="*fp32", a8_ptr="*fp8e4nv", sa_ptr="*fp32",
           lora_ptr="*fp32", la_ptr="*bf16", M="i32", KA="i32", KB="i32", R="i32", stride_am="i32",
           stride_bm="i32")
rows, _, _, warps = kernels.fp8_rows_config(3072)
(ca, na), (cb, nb) = kernels._src_chunks(0), kernels._src_chunks(3072)
for late in (False, True):
    cx = dict(ROWS=rows, CA=ca, NA=na, CB=cb, NB=nb, BLOCK_R=32, HAS_LORA=not late, GELU_B=False, HW_CVT=True,
              CANON_NAN=True, GEMM_ORDER=True, NSPLIT=4, RNE_BITS=False, AFTER_LORA=late)
    out["fp8%d" % late] = summary(kernels._quantize_act_fp8_rows_kernel, sig, cx, "fp8%d" % late, ("M",), warps)
sig = dict(lora_ptr="*fp32", sa_ptr="*fp32", la_ptr="*bf16", M="i32", R="i32")
out["scale"] = summary(kernels._lora_scale_kernel, sig, dict(BLOCK_M=32, BLOCK_R=32, NSPLIT=4), "scale", ("M",))
print(json.dumps(out))
"""


def test_pdl_builds_wait_and_release_where_the_order_needs_it(tmp_path):
    """SASS (sm_90a, compiled here): ``griddepcontrol.wait`` is ``ACQBULK``, ``launch_dependents`` ``PREEXIT``.
    - ``lora_act``: waits before its first load (x is the previous grid's output), then releases the next grid;
    - the passes (``AFTER_LORA``): release first and load x with no wait before; the exact pass stores its tile,
      waits, then loads the partials and stores ``la``; the FP8 pass waits once, after its last store and load;
    - ``_lora_scale_kernel`` waits before any load;
    - the plain builds hold neither instruction."""
    from sass_loops import run_script

    res = run_script(_SASS, tmp_path, timeout=900)
    for plain in ("lora0", "exact0", "fp80"):
        assert res[plain]["wait"] == [] and res[plain]["launch"] == [], plain
    lora = res["lora1"]
    assert len(lora["wait"]) == 1 and len(lora["launch"]) == 1
    assert lora["wait"][0] < lora["launch"][0] < lora["first_load"]
    for name in ("exact1", "fp81"):
        v = res[name]
        assert len(v["launch"]) == 1 and len(v["wait"]) == 1, (name, v["launch"], v["wait"])
        assert v["launch"][0] < v["first_load"] < v["wait"][0], (name, "x must be read with no wait before it")
    ex, fp = res["exact1"], res["fp81"]
    # the exact pass: its xq tile goes out before the wait; after it, the NSPLIT partials' loads and la's store
    assert min(ex["stores"]) < ex["wait"][0], ex["stores"]
    assert sum(i > ex["wait"][0] for i in ex["loads"]) >= 4, ("the 4 partials are loaded after the wait", ex)
    assert max(ex["stores"]) > ex["wait"][0], "la is stored after the wait"
    # the FP8 pass: every store (a8, sa) before its one wait, and nothing loaded after it
    assert max(fp["stores"]) < fp["wait"][0] and max(fp["loads"]) < fp["wait"][0], fp
    sc = res["scale"]
    assert len(sc["wait"]) == 1 and sc["wait"][0] < sc["first_load"], sc


def test_pdl_is_refused_where_it_cannot_run(monkeypatch):
    """On a CPU device the PDL entry points refuse by name rather than launch without the order they rely on; where
    PDL is there they refuse what would put a launch between the pair (a copy of a strided x, ``inv_smooth`` made
    on the spot) or reach the two-pass kernel."""
    from svdq_linear.backends.sm90 import kernels

    assert not kernels.pdl_supported(torch.device("cpu")) and not kernels.pdl_supported(None)
    x = torch.randn(64, 256)
    pds = torch.randn(256, 16).bfloat16()
    with pytest.raises(ValueError, match="programmatic dependent launch"):
        kernels.lora_act(x, pds, pdl=True)
    with pytest.raises(ValueError, match="programmatic dependent launch"):
        kernels.quantize_act_after_lora(x, torch.ones(256), torch.zeros(64, 16))
    inv = torch.ones(256)
    with pytest.raises(ValueError, match="programmatic dependent launch"):
        kernels.quantize_act_fp8(x, torch.ones(256), lora=torch.zeros(64, 16), inv_smooth=inv, lora_pdl=True)
    with pytest.raises(ValueError, match="float32"):
        kernels.quantize_act_after_lora(x, torch.ones(256), torch.zeros(64, 16, dtype=torch.bfloat16))

    monkeypatch.setattr(kernels, "pdl_supported", lambda device=None: True)  # past the device check
    xt = torch.randn(256, 64).T  # stride 64 along K
    with pytest.raises(ValueError, match="unit stride"):
        kernels.lora_act(xt, pds, pdl=True)
    with pytest.raises(ValueError, match="unit stride"):
        kernels.lora_act(None, pds, xb=xt, pdl=True)
    lora = torch.zeros(64, 16)
    for bad in (dict(x=xt, inv_smooth=inv), dict(x=x, inv_smooth=None), dict(x=x, inv_smooth=inv, one_pass=False)):
        with pytest.raises(ValueError, match="lora_pdl needs"):
            kernels.quantize_act_fp8(bad.pop("x"), torch.ones(256), lora=lora, lora_pdl=True, **bad)
    with pytest.raises(ValueError, match="lora_pdl needs"):
        kernels.quantize_act_fp8(torch.randn(64, kernels.ROW_MAX_K + 128), torch.ones(kernels.ROW_MAX_K + 128),
                                 lora=lora, inv_smooth=torch.ones(kernels.ROW_MAX_K + 128), lora_pdl=True)
    with pytest.raises(ValueError, match="lora_pdl needs"):
        kernels.quantize_act_fp8_cat(None, xt, inv, lora=lora, lora_pdl=True)


def test_backend_switch_reads_the_environment_per_call(monkeypatch):
    """``SVDQ_SM90_PDL``, read per call: unset, empty or "auto" takes the pair for a call captured into a CUDA graph
    only, "1" for every call, "0" for none, and only for a CUDA tensor on a device that has PDL; another value is an
    error naming the variable. ``kernels.pdl_supported`` asks a device's capability once."""
    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels

    monkeypatch.setattr(kernels, "pdl_supported", lambda device=None: device.type == "cuda")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    x = torch.empty(2, 2)
    gpu_x = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # no GPU needed: a stand-in
    for env in (None, "", "auto", "0", "1"):
        if env is None:
            monkeypatch.delenv(sm90.ENV_PDL, raising=False)
        else:
            monkeypatch.setenv(sm90.ENV_PDL, env)
        for capturing[0] in (False, True):
            want = env == "1" or (env != "0" and capturing[0])
            assert sm90._pdl(gpu_x, kernels) == want, (env, capturing[0])
            assert not sm90._pdl(x, kernels)  # a CPU tensor
    capturing[0] = True  # auto=False: the caller has another setting asked for (SVDQ_SM90_LORA_STREAM=1)
    for env, want in ((None, False), ("auto", False), ("1", True), ("0", False)):
        if env is None:
            monkeypatch.delenv(sm90.ENV_PDL, raising=False)
        else:
            monkeypatch.setenv(sm90.ENV_PDL, env)
        assert sm90._pdl(gpu_x, kernels, auto=False) == want, env
    monkeypatch.setattr(kernels, "pdl_supported", lambda device=None: False)  # a device without PDL
    for env in ("1", "auto"):
        monkeypatch.setenv(sm90.ENV_PDL, env)
        assert not sm90._pdl(gpu_x, kernels)
    monkeypatch.setenv(sm90.ENV_PDL, "maybe")
    with pytest.raises(ValueError, match="SVDQ_SM90_PDL=.maybe.: expected 1/true/yes/on, 0/false/no/off, or auto"):
        sm90._pdl(gpu_x, kernels)
    monkeypatch.undo()

    asked = []
    monkeypatch.setattr(kernels, "_INTERPRET", False)
    monkeypatch.setattr(kernels, "gdc_wait", object())
    monkeypatch.setattr(kernels, "_PDL_DEVICES", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: asked.append(d) or (9, 0))
    assert kernels.pdl_supported(torch.device("cuda", 1)) and kernels.pdl_supported(torch.device("cuda", 1))
    assert asked == [1]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert not kernels.pdl_supported(torch.device("cuda", 2))  # an Ampere card: no PDL


# ---- GPU ---------------------------------------------------------------------------------------------


def _gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a GPU of capability 9.0 or later")
    from svdq_linear.backends.sm90 import kernels

    if not kernels.pdl_supported(torch.device("cuda")):
        pytest.skip("this Triton has no grid dependency control")
    return kernels


def _inputs(m, k, r, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    x[m // 2, 5] = float("nan")  # a NaN block (its row's la is NaN either way)
    smooth = torch.rand(k, device="cuda", generator=g) + 0.5
    pds = (torch.randn(k, r, device="cuda", generator=g) / k**0.5).bfloat16()
    return x, smooth, pds


def _spy_pair(monkeypatch, kernels, calls: list) -> None:
    """Record into ``calls`` each call of ``quantize_act_after_lora`` and of ``lora_act`` (with its ``pdl``)."""
    after, lora_act = kernels.quantize_act_after_lora, kernels.lora_act
    monkeypatch.setattr(kernels, "quantize_act_after_lora",
                        lambda *a, **kw: calls.append("quantize_act_after_lora") or after(*a, **kw))
    monkeypatch.setattr(kernels, "lora_act",
                        lambda *a, **kw: calls.append(f"lora_act pdl={kw.get('pdl', False)}") or lora_act(*a, **kw))


def _plain_call(m, x, mode, monkeypatch):
    """``m`` in ``mode``, the backend chosen for ``x``, its prepared state, and its eager output on ``x`` with
    ``SVDQ_SM90_PDL`` unset (the plain launches)."""
    from svdq_linear import backends
    from svdq_linear.backends import sm90

    if mode == "fast":
        m.set_mode("fast")
    backend = backends.choose(m, x)
    prepared = backend.prepare(m, x.device)
    monkeypatch.delenv(sm90.ENV_PDL, raising=False)
    return backend, prepared, backend.linear(m, x, prepared)


def _same(a, b):
    """The same bits (any dtype)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,r,split", [(4096, 3072, 96, 4), (1000, 3072, 32, 4), (300, 15360, 32, 2),
                                         (4608, 3072, 128, 1)])
def test_gpu_exact_pair_writes_the_plain_bits(m, k, r, split):
    """``lora_act(pdl=True)`` then ``quantize_act_after_lora``: ``xq`` is ``quantize_act``'s bytes and ``la`` the
    plain ``lora_act`` partials added in split order in fp32, rounded once to bf16 (and within a bf16 rounding
    plus an fp32 sum's error of the float64 product)."""
    kernels = _gpu()
    x, smooth, pds = _inputs(m, k, r, m + k + r)
    part = kernels.lora_act(x, pds, torch.float32, block_m=64, split=split, pdl=True)
    xq, la = kernels.quantize_act_after_lora(x, smooth, part)
    plain = kernels.lora_act(x, pds, torch.float32, block_m=64, split=split)
    want_la = plain if plain.dim() == 2 else plain[0].clone()
    if plain.dim() == 3:
        for s in range(1, plain.shape[0]):
            want_la += plain[s]
    torch.cuda.synchronize()
    assert _same(xq, kernels.quantize_act(x, smooth)[0]), "xq differs from quantize_act's"
    assert _same(la, want_la.bfloat16()), "la differs from the plain partials' sum in split order"
    ref = x.bfloat16().double() @ pds.double()
    ok = ref.isfinite()
    bound = 2.0**-8 * ref.abs() + k * 2.0**-23 * (x.bfloat16().double().abs() @ pds.double().abs()) + 1e-30
    assert ((la.double() - ref).abs() <= bound)[ok].all(), "la is off the float64 product"
    assert la[m // 2].isnan().all(), "the NaN row's la"


@pytest.mark.gpu
@pytest.mark.parametrize("m,ka,kb,r", [(4096, 0, 3072, 96), (4608, 3072, 12288, 32), (500, 0, 3072, 32)])
def test_gpu_fp8_pair_writes_the_plain_bits(m, ka, kb, r):
    """``lora_act(pdl=True)`` then the FP8 pass with ``lora_pdl=True``: ``a8``, ``sa`` and ``la`` bit for bit the
    plain pair's, for one source and for ``cat([xa, gelu(xb)])`` (a single block's ``proj_out``)."""
    kernels = _gpu()
    x, smooth, pds = _inputs(m, ka + kb, r, m + kb + r)
    inv = 1.0 / smooth
    if ka:
        xa, xb = x[:, :ka].contiguous(), x[:, ka:].contiguous()
        got = kernels.quantize_act_fp8_cat(xa, xb, inv, lora=kernels.lora_act(xa, pds, xb=xb, gelu_b=True, split=4,
                                                                              block_m=64, pdl=True),
                                           gemm_order=True, lora_pdl=True)
        want = kernels.quantize_act_fp8_cat(xa, xb, inv, lora=kernels.lora_act(xa, pds, xb=xb, gelu_b=True, split=4,
                                                                               block_m=64),
                                            gemm_order=True)
    else:
        got = kernels.quantize_act_fp8(x, smooth, lora=kernels.lora_act(x, pds, split=4, block_m=64, pdl=True),
                                       inv_smooth=inv, gemm_order=True, lora_pdl=True)
        want = kernels.quantize_act_fp8(x, smooth, lora=kernels.lora_act(x, pds, split=4, block_m=64),
                                        inv_smooth=inv, gemm_order=True)
    torch.cuda.synchronize()
    for g, w, name in zip(got, want, ("a8", "sa", "la")):
        assert _same(g, w), f"{name} differs from the plain pair's"


def _late_writer():
    """A Triton kernel that copies ``src`` to ``dst`` late: it waits for the grid before it, releases the next grid
    at once, spins, then writes, the order a GEMM that releases before its epilogue has. Launched with PDL, the
    next grid starts while ``dst`` still holds its old values."""
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def late_copy(src, dst, n, spins, BLOCK: tl.constexpr):
        gdc_wait()
        gdc_launch_dependents()
        acc = tl.zeros([BLOCK], tl.float32)
        for _ in range(spins):
            acc = acc * 0.5 + 1.0  # stays below 2: never stored, but the compiler cannot know
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(src + offs, mask=offs < n)
        tl.store(dst + offs, tl.where(acc > 1e30, acc.to(v.dtype), v), mask=offs < n)

    def copy(src, dst, spins=20000):
        late_copy[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), spins, BLOCK=1024, launch_pdl=True)
    return copy


@pytest.mark.gpu
def test_gpu_pairs_after_a_grid_that_releases_early_and_in_graphs():
    """Each pair reads an x written by the grid right before it, which released the pair at its start and wrote x
    only after spinning: only ``lora_act``'s wait keeps the pair (and the pass, which reads x without one) from
    reading the previous iteration's x. Exact and FP8 pairs, three rounds each, eager and replayed from a CUDA
    graph with new inputs, give the plain launches' bits."""
    kernels = _gpu()
    late_copy = _late_writer()
    m, k, r = 4096, 3072, 32
    srcs = [_inputs(m, k, r, 7 + i)[0] for i in range(3)]
    _, smooth, pds = _inputs(m, k, r, 7)
    inv = 1.0 / smooth
    xbuf = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)

    def plain(src):
        p = kernels.lora_act(src, pds, split=4, block_m=64)
        la = (((p[0] + p[1]) + p[2]) + p[3]).bfloat16()
        fp8 = kernels.quantize_act_fp8(src, smooth, lora=kernels.lora_act(src, pds, split=4, block_m=64),
                                       inv_smooth=inv, gemm_order=True)
        return [kernels.quantize_act(src, smooth)[0], la, *fp8]

    def chain(srcs):
        outs = []
        for src in srcs:
            late_copy(src, xbuf)
            outs += kernels.quantize_act_after_lora(xbuf, smooth, kernels.lora_act(xbuf, pds, split=4, block_m=64,
                                                                                   pdl=True))
            late_copy(src, xbuf)  # the same values again, written late once more, for the FP8 pair
            outs += kernels.quantize_act_fp8(xbuf, smooth, lora=kernels.lora_act(xbuf, pds, split=4, block_m=64,
                                                                                 pdl=True),
                                             inv_smooth=inv, gemm_order=True, lora_pdl=True)
            xbuf.zero_()  # (a plain launch: the next writer waits for it)
        return outs

    names = ("xq", "la", "a8", "sa", "la8")
    want = [t for src in srcs for t in plain(src)]
    got = chain(srcs)
    torch.cuda.synchronize()
    for i, (g, w) in enumerate(zip(got, want)):
        assert _same(g, w), f"round {i // 5}: {names[i % 5]} differs from the plain launches'"
    static = [src.clone() for src in srcs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(static)
    for seed in (11, 12):
        new = [_inputs(m, k, r, seed + 10 * i)[0] for i in range(3)]
        for st, nw in zip(static, new):
            st.copy_(nw)
        graph.replay()
        want = [t for src in new for t in plain(src)]
        torch.cuda.synchronize()
        for i, (g, w) in enumerate(zip(outs, want)):
            assert _same(g, w), f"replay {seed}, round {i // 5}: {names[i % 5]} differs from the plain launches'"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("tokens,r,n", [(128, 32, 3072), (1000, 64, 3072), (4096, 96, 3072), (4608, 128, 21504)])
def test_gpu_module_takes_the_pdl_pair(mode, tokens, r, n, monkeypatch):
    """``SVDQ_SM90_PDL=1`` through ``SVDQW4A4Linear``: the calls above small M take the pair (the fast mode where
    its low-rank branch joins the accumulator: a rank up to 64, or block-diagonal). Exact: within the
    contract's tolerance (its ``lora_act`` is now Triton's, another fp32 order than cuBLAS's). Fast: the bits of
    the same module without it (the same Triton ``lora_act`` and ``la`` arithmetic). The last shape is a Flux single
    block's fused input, where bench_lowrank first showed the GEMM's math warps reading ``la`` before the pass had
    written it (quack_lowrank now waits before that prefetch)."""
    _gpu()
    pytest.importorskip("quack")
    from test_conformance import _check, _expected_and_bound, random_w4a4

    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels

    calls = []

    class Spy:  # a jit kernel is launched by subscript
        def __init__(self, name, orig):
            self.name, self.orig = name, orig

        def __getitem__(self, grid):
            calls.append(self.name)
            return self.orig[grid]

    _spy_pair(monkeypatch, kernels, calls)
    monkeypatch.setattr(kernels, "_lora_scale_kernel", Spy("_lora_scale_kernel", kernels._lora_scale_kernel))
    torch.manual_seed(tokens + r)
    k = 3072
    m = random_w4a4(k, n, r, torch.bfloat16, "cuda")
    parts = {96: (n // 3,) * 3, 128: (3072, 3072, 3072, 12288)}.get(r)
    if parts:  # fused q/k/v or a single block's input: block-diagonal proj_up (the accumulator's windows)
        with torch.no_grad():
            m.proj_up.mul_(torch.block_diag(*[torch.ones(h, 32) for h in parts]).to(m.proj_up))
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) * 3
    backend, prepared, plain = _plain_call(m, x, mode, monkeypatch)
    assert calls == ([] if mode == "exact" else ["lora_act pdl=False"]), calls  # exact: cuBLAS's lora_act
    calls.clear()
    monkeypatch.setenv(sm90.ENV_PDL, "1")
    y = backend.linear(m, x, prepared)
    torch.cuda.synchronize()
    assert calls == ["lora_act pdl=True", "quantize_act_after_lora" if mode == "exact" else "_lora_scale_kernel"], calls
    if mode == "fast":
        assert _same(y, plain), "the fast mode's output moved with the PDL pair"
    else:
        _check(y, *_expected_and_bound(m, x), f"sm90 exact with PDL M={tokens} R={r}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gpu_strided_input_keeps_the_plain_launches(mode, monkeypatch):
    """``SVDQ_SM90_PDL=1`` with an input of non-unit stride along K (a transposed view): the pair would need a copy
    of x between its two grids, so the backend keeps the plain launches (no PDL ``lora_act``, no dependent pass)
    and the output is what the contiguous input gives without the switch: the same bits in the fast mode (the
    same Triton ``lora_act``), within the contract's tolerance in the exact mode (cuBLAS may sum a transposed x in
    another order)."""
    _gpu()
    pytest.importorskip("quack")
    from test_conformance import _check, _expected_and_bound, random_w4a4

    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels

    calls = []
    _spy_pair(monkeypatch, kernels, calls)
    torch.manual_seed(7)
    k, n, tokens = 3072, 3072, 1000
    m = random_w4a4(k, n, 32, torch.bfloat16, "cuda")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) * 3
    xt = torch.empty(k, tokens, device="cuda", dtype=torch.bfloat16).t()
    xt.copy_(x)
    assert xt.stride(1) != 1
    backend, prepared, plain = _plain_call(m, x, mode, monkeypatch)
    calls.clear()
    monkeypatch.setenv(sm90.ENV_PDL, "1")
    y = backend.linear(m, xt, prepared)
    torch.cuda.synchronize()
    assert "quantize_act_after_lora" not in calls and "lora_act pdl=True" not in calls, calls
    if mode == "fast":
        assert _same(y, plain), "a strided input moved the fast mode's output"
    else:
        _check(y, *_expected_and_bound(m, x), "sm90 exact, strided input, PDL switch on")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gpu_captured_calls_take_the_pdl_pair_by_default(mode, monkeypatch):
    """With ``SVDQ_SM90_PDL`` unset, an eager call keeps the plain launches and a call captured into a CUDA graph
    takes the pair; "0" keeps a captured call plain. The graph, replayed on new input, gives what an eager call
    gives on it: the same bits in the fast mode (the same Triton ``lora_act`` and ``la`` arithmetic), within the
    contract's tolerance in the exact mode (Triton's ``lora_act`` partials against cuBLAS's product)."""
    _gpu()
    pytest.importorskip("quack")
    from test_conformance import _check, _expected_and_bound, random_w4a4

    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels

    calls = []
    _spy_pair(monkeypatch, kernels, calls)
    monkeypatch.delenv(sm90.ENV_PDL, raising=False)
    torch.manual_seed(11)
    k, n, tokens = 3072, 3072, 1000
    m = random_w4a4(k, n, 32, torch.bfloat16, "cuda")
    if mode == "fast":
        m.set_mode("fast")
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) * 3
    with torch.no_grad():
        eager = m(x)
        assert "lora_act pdl=True" not in calls and "quantize_act_after_lora" not in calls, calls

        def captured(env):
            if env is None:
                monkeypatch.delenv(sm90.ENV_PDL, raising=False)
            else:
                monkeypatch.setenv(sm90.ENV_PDL, env)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                m(x)  # warm-up outside the capture (eager: plain)
            torch.cuda.current_stream().wait_stream(s)
            calls.clear()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = m(x)
            return g, y, list(calls)

        g, y, seen = captured(None)
        want = ["lora_act pdl=True"] + (["quantize_act_after_lora"] if mode == "exact" else [])
        assert [c for c in seen if c in want] == want, seen
        _, _, seen_off = captured("0")
        assert "lora_act pdl=True" not in seen_off and "quantize_act_after_lora" not in seen_off, seen_off
        monkeypatch.delenv(sm90.ENV_PDL, raising=False)
        x2 = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) * 3
        x.copy_(x2)
        g.replay()
        torch.cuda.synchronize()
        if mode == "fast":
            assert _same(y, m(x2)), "the captured pair's output differs from an eager call's"
        else:
            _check(y, *_expected_and_bound(m, x2), "sm90 exact, captured with the PDL pair by default")
        assert not _same(y, eager), "the replay did not compute on the new input"
