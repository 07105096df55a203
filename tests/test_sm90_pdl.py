"""Programmatic dependent launch (PDL) of ``lora_act`` and the activation pass (``SVDQ_SM90_PDL=1``).

``kernels.lora_act(pdl=True)`` waits for x's writer, then lets the next grid start; the pass launched right after
it (``quantize_act_after_lora``, ``quantize_act_fp8(lora_pdl=True)``) reads x without waiting, beside it, and
ends after it. CPU: the builds compiled for sm_90a here (the real compiler) put the grid-dependency instructions
where that order needs them, and the interpreter refuses PDL by name. GPU: the pair writes the bits of the plain
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
    cx = dict(BLOCK_M=8, BLOCK_K=256, WRITE_XQ=True, WRITE_CODES=False, LORA_LATE=late, BLOCK_R=32, NSPLIT=4)
    out["exact%d" % late] = summary(kernels._quantize_act_kernel, sig, cx, "exact%d" % late, ("M", "stride_xk"))
sig = dict(xa_ptr="*bf16", xb_ptr="*bf16", inv_ptr="*fp32", a8_ptr="*fp8e4nv", sa_ptr="*fp32",
           lora_ptr="*fp32", la_ptr="*bf16", M="i32", KA="i32", KB="i32", R="i32", stride_am="i32",
           stride_bm="i32")
rows, _, _, warps = kernels.fp8_rows_config(3072)
(ca, na), (cb, nb) = kernels._src_chunks(0), kernels._src_chunks(3072)
for late in (False, True):
    cx = dict(ROWS=rows, CA=ca, NA=na, CB=cb, NB=nb, BLOCK_R=32, HAS_LORA=not late, GELU_B=False, HW_CVT=True,
              CANON_NAN=True, GEMM_ORDER=True, NSPLIT=4, RNE_BITS=False, LORA_LATE=late)
    out["fp8%d" % late] = summary(kernels._quantize_act_fp8_rows_kernel, sig, cx, "fp8%d" % late, ("M",), warps)
sig = dict(lora_ptr="*fp32", sa_ptr="*fp32", la_ptr="*bf16", M="i32", R="i32")
out["scale"] = summary(kernels._lora_scale_kernel, sig, dict(BLOCK_M=32, BLOCK_R=32, NSPLIT=4), "scale", ("M",))
print(json.dumps(out))
"""


def test_pdl_builds_wait_and_release_where_the_order_needs_it(tmp_path):
    """SASS (sm_90a, compiled here): ``griddepcontrol.wait`` is ``ACQBULK``, ``launch_dependents`` ``PREEXIT``.
    - ``lora_act``: waits before its first load (x is the previous grid's output), then releases the next grid;
    - the passes (``LORA_LATE``): release first and load x with no wait before; the exact pass waits after its
      tile's stores and before the partials' loads; the FP8 pass waits once, after its last store;
    - ``_lora_scale_kernel`` waits before any load;
    - the plain builds hold neither instruction."""
    from sass_loops import run_script

    res = run_script(_SASS, tmp_path, timeout=900)
    for plain in ("lora0", "exact0", "fp80"):
        assert res[plain]["wait"] == [] and res[plain]["launch"] == [], plain
    lora = res["lora1"]
    assert len(lora["wait"]) == 1 and len(lora["launch"]) == 1
    assert lora["wait"][0] < lora["launch"][0] < lora["first_load"]
    for late in ("exact1", "fp81"):
        v = res[late]
        assert len(v["launch"]) == 1 and len(v["wait"]) == 1, late
        assert v["launch"][0] < v["first_load"] < v["wait"][0], late  # x is read with no wait before it
        assert v["stores"] and min(v["stores"]) < v["wait"][0], late  # its own output goes out first
    ex = res["exact1"]
    assert any(i > ex["wait"][0] for i in ex["loads"])  # the partials, loaded after the wait
    assert not any(i > res["fp81"]["wait"][0] for i in res["fp81"]["loads"])  # nothing read after its wait
    sc = res["scale"]
    assert len(sc["wait"]) == 1 and sc["wait"][0] < sc["first_load"]


def test_pdl_is_refused_where_it_cannot_run():
    """On the CPU (and under the interpreter) the PDL entry points refuse by name rather than launch without
    the order they rely on."""
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


def test_backend_switch_reads_the_environment_per_call(monkeypatch):
    """``SVDQ_SM90_PDL``: only "1" turns it on, read per call, and only for a CUDA tensor on a device that has
    PDL; ``kernels.pdl_supported`` asks a device's capability once."""
    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels

    monkeypatch.setattr(kernels, "pdl_supported", lambda device=None: device.type == "cuda")
    x = torch.empty(2, 2)
    gpu_x = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))  # no GPU needed: a stand-in
    for env in (None, "0", "", "yes"):
        if env is None:
            monkeypatch.delenv(sm90.ENV_PDL, raising=False)
        else:
            monkeypatch.setenv(sm90.ENV_PDL, env)
        assert not sm90._pdl(x, kernels) and not sm90._pdl(gpu_x, kernels)
    monkeypatch.setenv(sm90.ENV_PDL, "1")
    assert not sm90._pdl(x, kernels)  # a CPU tensor
    assert sm90._pdl(gpu_x, kernels)
    monkeypatch.setenv(sm90.ENV_PDL, "0")
    assert not sm90._pdl(gpu_x, kernels)  # read per call
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


def _same(a, b):
    return torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a.view(torch.int16 if a.dtype.itemsize == 2
                                                                                  else torch.int32),
                       b.view(torch.uint8) if b.dtype.itemsize == 1 else b.view(torch.int16 if b.dtype.itemsize == 2
                                                                                  else torch.int32))


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
    assert _same(xq, kernels.quantize_act(x, smooth)[0])
    assert _same(la, want_la.bfloat16())
    ref = x.bfloat16().double() @ pds.double()
    ok = ref.isfinite()
    bound = 2.0**-8 * ref.abs() + k * 2.0**-23 * (x.bfloat16().double().abs() @ pds.double().abs()) + 1e-30
    assert ((la.double() - ref).abs() <= bound)[ok].all()
    assert la[m // 2].isnan().all()


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
        assert _same(g, w), name


@pytest.mark.gpu
def test_gpu_pairs_after_a_grid_that_releases_early_and_in_graphs():
    """Each pair reads the output of the pass right before it: that pass lets the next grid start at its own
    start, so only ``lora_act``'s wait keeps the second pair from reading a half-written x. Three chained pairs,
    eager and replayed from a CUDA graph with new inputs, give the plain launches' bits."""
    kernels = _gpu()
    m, k, r = 4096, 3072, 32
    x0, smooth, pds = _inputs(m, k, r, 7)

    def chain(x, pdl):
        outs = []
        inv = 1.0 / smooth
        for _ in range(3):
            if pdl:
                xq, la = kernels.quantize_act_after_lora(x, smooth, kernels.lora_act(x, pds, split=4, block_m=64,
                                                                                     pdl=True))
                # the FP8 pair reads the exact pass's output: that pass released this grid at its start
                fp8 = kernels.quantize_act_fp8(xq, smooth, lora=kernels.lora_act(xq, pds, split=4, block_m=64,
                                                                                 pdl=True),
                                               inv_smooth=inv, gemm_order=True, lora_pdl=True)
            else:
                xq = kernels.quantize_act(x, smooth)[0]
                p = kernels.lora_act(x, pds, split=4, block_m=64)
                la = (((p[0] + p[1]) + p[2]) + p[3]).bfloat16()
                fp8 = kernels.quantize_act_fp8(xq, smooth, lora=kernels.lora_act(xq, pds, split=4, block_m=64),
                                               inv_smooth=inv, gemm_order=True)
            outs += [xq, la, *fp8]
            x = xq  # the next exact pair reads it right after the FP8 pair's last grid
        return outs

    want = chain(x0, False)
    got = chain(x0, True)
    torch.cuda.synchronize()
    for i, (g, w) in enumerate(zip(got, want)):
        assert _same(g, w), i
    static_x = x0.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(static_x, True)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(static_x, True)
    for seed in (11, 12):
        x1 = _inputs(m, k, r, seed)[0]
        static_x.copy_(x1)
        graph.replay()
        want = chain(x1, False)
        torch.cuda.synchronize()
        for i, (g, w) in enumerate(zip(outs, want)):
            assert _same(g, w), (seed, i)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("tokens,r,n", [(128, 32, 3072), (1000, 64, 3072), (4096, 96, 3072), (4608, 128, 21504)])
def test_gpu_module_takes_the_pdl_pair(mode, tokens, r, n, monkeypatch):
    """``SVDQ_SM90_PDL=1`` through ``SVDQW4A4Linear``: the calls above small M take the pair (the fast mode where
    its low-rank branch joins the accumulator: a rank up to 64, or block-diagonal). Exact: within the
    contract's tolerance (its ``lora_act`` is now Triton's, another fp32 order than cuBLAS's). Fast: the bits of
    the same module without it (the same Triton ``lora_act`` and ``la`` arithmetic). The last shape is a Flux single
    block's fused input: its GEMM's first tiles start while the pass still runs, and read ``la`` only after the
    wait (quack_lowrank: this caught the prefetch that read it before)."""
    _gpu()
    pytest.importorskip("quack")
    from test_conformance import _check, _expected_and_bound, random_w4a4

    from svdq_linear import backends
    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import kernels

    calls = []
    for name in ("quantize_act_after_lora", "_lora_scale_kernel"):
        orig = getattr(kernels, name)
        if name.startswith("_"):
            class Spy:  # a jit kernel is launched by subscript
                def __getitem__(self, grid, orig=orig):
                    calls.append(name)
                    return orig[grid]
            monkeypatch.setattr(kernels, name, Spy())
        else:
            monkeypatch.setattr(kernels, name, lambda *a, _o=orig, _n=name, **kw: calls.append(_n) or _o(*a, **kw))
    torch.manual_seed(tokens + r)
    k = 3072
    m = random_w4a4(k, n, r, torch.bfloat16, "cuda")
    parts = {96: (n // 3,) * 3, 128: (3072, 3072, 3072, 12288)}.get(r)
    if parts:  # fused q/k/v or a single block's input: block-diagonal proj_up (the accumulator's windows)
        with torch.no_grad():
            m.proj_up.mul_(torch.block_diag(*[torch.ones(h, 32) for h in parts]).to(m.proj_up))
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16) * 3
    if mode == "fast":
        m.set_mode("fast")
    backend = backends.choose(m, x)
    prepared = backend.prepare(m, x.device)
    monkeypatch.delenv(sm90.ENV_PDL, raising=False)
    plain = backend.linear(m, x, prepared)
    assert not calls
    monkeypatch.setenv(sm90.ENV_PDL, "1")
    y = backend.linear(m, x, prepared)
    torch.cuda.synchronize()
    assert calls == (["quantize_act_after_lora"] if mode == "exact" else ["_lora_scale_kernel"])
    if mode == "fast":
        assert _same(y, plain)
    else:
        _check(y, *_expected_and_bound(m, x), f"sm90 exact with PDL M={tokens} R={r}")
