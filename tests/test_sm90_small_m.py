"""The sm90 small-M kernel (``backends/sm90/small_m.py``): every weight layout and activation form
against the contract's formulas (float64 oracles from ``svdq_linear.nvfp4``), split-K reduction in
the kernel, its host rules and its errors. On the CPU through Triton's interpreter (conftest); on the
H200 compiled, against the same oracles."""

import subprocess

import pytest
import torch

from svdq_linear import nvfp4

pytest.importorskip("triton")
sm = pytest.importorskip("svdq_linear.backends.sm90.small_m")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, gen):
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    ws = (torch.rand(n, k // 16, generator=gen) * 0.9 + 0.01).to(torch.float8_e4m3fn)
    ws[0, 1] = 0  # a zero block scale
    return q, ws


def _lowrank(m, n, r, gen):
    up = torch.randn(n, r, generator=gen).bfloat16()
    lora = torch.randn(m, r, generator=gen).bfloat16()
    return up, lora, lora.double() @ up.double().T


def _close(y, ref, what):
    err = (y.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-5, f"{what}: relative error {err:.2e}"


def _w4a16_case(m, k, seed, **kw):
    """A canonical W4A16 layer (N 96, rank 20, bias) through ``sm.linear(**kw)`` against float64."""
    gen = torch.Generator().manual_seed(seed)
    n, r = 96, 20
    q, ws = _weight(n, k, gen)
    wc, bias = torch.rand(n, generator=gen) + 0.5, torch.randn(n, generator=gen).bfloat16()
    up, lora, lr = _lowrank(m, n, r, gen)
    x = torch.randn(m, k, generator=gen).bfloat16()
    ref = (x.double() @ nvfp4.dequantize_nvfp4(q, ws).double().T) * wc.double() + lr + bias.double()
    to = dict(device=DEV)
    y = sm.linear(x.to(**to), sm.CANONICAL, q.to(**to), ws.to(**to), wc.to(**to), n, act=sm.ACT_X,
                  out_dtype=torch.float32, bias=bias.to(**to), proj_up=up.to(**to), lora_act=lora.to(**to), **kw)
    _close(y, ref, f"W4A16 m={m} {kw}")


@pytest.mark.parametrize("m", [1, 5, 9, 33])
@pytest.mark.parametrize("split", [1, 3, None])
def test_w4a16_canonical_any_k(m, split):
    _w4a16_case(m, 208, m, split_k=split)  # K not a multiple of the k-step: the tail is masked


@pytest.mark.parametrize("m", [1, 9, 33])
def test_split_sum_adds_more_partials_than_it_loads_at_once(m):
    """18 splits of one 64-deep k-step each: more than the epilogue loads at once at one token (16 partials:
    the last chunk is partly masked; the dot's 9-64 rows load one at a time); every split's partial is added
    in order and the counters are left at zero."""
    assert sm.sum_chunk(64, 1, False) == 16 and sm.sum_chunk(64, 16, True) == 1
    _w4a16_case(m, 1152, 70 + m, split_k=18, block_k=64)
    assert int(sm._counters(torch.empty(0, device=DEV).device, 64).abs().sum()) == 0, "a counter was left nonzero"


@pytest.mark.parametrize("m,act,k_step", [(1, "x", 64), (1, "x", 128), (2, "x", 256), (1, "nvfp4", 128),
                                          (3, "x", 256), (4, "nvfp4", 128)])
def test_word_decode_is_the_byte_decode(m, act, k_step):
    """The multiply-add form's 32-bit word decode (each nibble made an E4M3 byte of value E2M1 x 2**-6,
    four at a time, the activations gathered in the word's order): every code of either sign, zero and
    subnormal block scales, split K, one to four tokens (a k-step decoded once for all of them); the
    same sums as the per-byte decode up to fp32 order, and the contract's value in float64."""
    gen = torch.Generator().manual_seed(20 + m + k_step)
    n, k = 64, 512
    q, ws = _weight(n, k, gen)
    codes = torch.arange(16, dtype=torch.uint8)
    q[0, :16] = codes | ((15 - codes) << 4)  # all 16 codes (both signs) in either nibble
    ws[1, 2] = torch.tensor(2.0**-9).to(torch.float8_e4m3fn)  # the smallest subnormal scale
    wc = torch.rand(n, generator=gen) + 0.5
    x = torch.randn(m, k, generator=gen).bfloat16() * 3
    x[0, 5] = 0
    smooth = torch.exp(torch.randn(k, generator=gen) * 0.3)
    to = dict(device=DEV)
    kw = dict(act=sm.ACT_X if act == "x" else sm.ACT_NVFP4, smooth=smooth.to(**to), out_dtype=torch.float32,
              split_k=2, block_k=k_step, fma=True)
    args = (x.to(**to), sm.CANONICAL, q.to(**to), ws.to(**to), wc.to(**to), n)
    y_w = sm.linear(*args, words=True, chain=True, **kw)  # each block's 16 products chained, k reduced at the end
    y_b = sm.linear(*args, words=False, **kw)
    y_c = sm.linear(*args, words=True, chain=False, **kw)  # per-word sums, a cross-thread sum every trip
    if m <= 2:  # each step's activations and scales one step ahead: the same sums in the same order
        assert torch.equal(sm.linear(*args, words=True, chain=False, prefetch=True, **kw).cpu(), y_c.cpu())
        assert torch.equal(sm.linear(*args, words=True, chain=True, prefetch=True, **kw).cpu(), y_w.cpu())
    if m > 1:  # each token's sums are its own: token 0 alone gives the same bits
        y_0 = sm.linear(x[:1].to(**to), *args[1:], words=True, chain=True, **kw)
        assert torch.equal(y_0.cpu(), y_w[:1].cpu())
    a = x.double() if act == "x" else nvfp4.dequantize_nvfp4(*nvfp4.quantize_nvfp4(nvfp4.smooth_input(x, smooth))).double()
    ref = (a @ nvfp4.dequantize_nvfp4(q, ws).double().T) * wc.double()
    _close(y_w, ref, f"words m={m} act={act} k_step={k_step}")
    for y, what in ((y_w, "block chain"), (y_c, "per-word sums")):
        _close(y, ref, f"words ({what}) m={m} act={act} k_step={k_step}")
        assert torch.allclose(y.cpu(), y_b.cpu(), rtol=1e-5, atol=1e-6 * ref.abs().max().item())


def test_word_decode_takes_what_it_can_read():
    gen = torch.Generator().manual_seed(3)
    q, ws = _weight(64, 208, gen)  # K not a multiple of the k-step
    x = torch.randn(1, 208, generator=gen).bfloat16()
    for out_dtype in (torch.float32, torch.bfloat16):  # (the interpreter casts 16-bit outputs outside)
        with pytest.raises(ValueError, match="word decode"):
            sm.linear(x.to(DEV), sm.CANONICAL, q.to(DEV), ws.to(DEV), torch.ones(64, device=DEV), 64, act=sm.ACT_X,
                      out_dtype=out_dtype, words=True)
    q2, ws2 = _weight(64, 256, gen)  # the repacked layout: the word decode's reason, not a tile's
    with pytest.raises(ValueError, match="word decode takes the canonical layout"):
        sm.linear(torch.randn(1, 256).bfloat16().to(DEV), sm.QUACK, q2.to(DEV), ws2.to(DEV), torch.ones(64, device=DEV),
                  64, act=sm.ACT_X, out_dtype=torch.float32, words=True)


_WORDS_SASS = """
import json, sys
sys.path.insert(0, sys.argv[2])
from sass_loops import compile_sm90, loop_with
from svdq_linear.backends.sm90 import small_m as sm

sig = dict(x_ptr="*bf16", smooth_ptr="*fp32", w_ptr="*u8", s_ptr="*u8", cs_ptr="*fp32", bias_ptr="*bf16",
           up_ptr="*bf16", lora_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32", M="i32", N="i32",
           K="i32", R="i32", stride_xm="i32", stride_lm="i32", stride_om="i32", stride_w="i32", stride_s="i32",
           k_per_split="i32", SPLIT_K="i32")
out = {}
# each decode at the backend's tile; the word decode at 1 and 2 tokens
for words, (block_n, block_k), bm in ((True, sm.WORDS_TILE[sm.ACT_X], 1), (False, (64, 64), 1),
                                      (True, sm.WORDS_TILE[sm.ACT_X], 2)):
    cx = dict(LAYOUT=sm.CANONICAL, ACT=sm.ACT_X, BLOCK_N=block_n, BLOCK_M=bm, BLOCK_K=block_k, RC=16, EVEN_K=True, NUM_STAGES=3,
              IS_SPLIT=True, HAS_BIAS=False, HAS_LORA=False, USE_DOT=False, DOT_F32=False, WORDS=words, ASM=words,
              PREFETCH=False, CHAIN=words and sm.WORDS_CHAIN, SC=sm.sum_chunk(block_n, bm, False))
    sass = compile_sm90(sm._small_m_kernel, sig, cx, sys.argv[1] + f"/k{words}{bm}.cubin", ("M", "R"))
    body = loop_with(sass, "LDGSTS")  # the pipelined main loop
    out[str(words) + ("" if bm == 1 else str(bm))] = dict(n=len(body), per_value=len(body) / (block_n * block_k / 128), values=block_n * block_k // 128,
                           unpack=sum("F2FP.F16.E4M3.UNPACK_B" in t for t in body),
                           shfl=sum("SHFL" in t for t in body), membar=sass.count("MEMBAR"),
                           exch=sass.count("ATOMG.E.EXCH"))
print(json.dumps(out))
"""


def test_word_decode_compiles_to_hardware_e4m3_converts_and_fewer_instructions(tmp_path):
    """Compiled for sm_90a here (no GPU; the real compiler, in a child process), each decode at the tile
    the backend runs it with on 4 warps: the word decode's main loop converts through
    ``F2FP.F16.E4M3.UNPACK_B`` (two E4M3 bytes an instruction), has no cross-thread shuffle (the block
    chain reduces across k after the loop) and issues at most 5.25 instructions per weight value a thread
    handles (5.0 with Triton 3.9 at 32 x 256; 4.6 at 64 x 128), at most 0.6x the per-byte decode's (about 10);
    a second token adds its multiply-adds, not a second decode."""
    from sass_loops import run_script

    res = run_script(_WORDS_SASS, tmp_path, timeout=600)
    words, byte = res["True"], res["False"]
    assert words["values"] // 2 <= words["unpack"] <= words["values"] // 2 + 4  # the values' and the block scales'
    assert words["shfl"] == 0, words
    # the split-K counter: one acq_rel add (a fence) a CTA; reset by a plain store, not a fenced exchange
    assert all(v["exch"] == 0 and v["membar"] == 1 for v in res.values()), res
    per_value, per_value_bytes = words["per_value"], byte["per_value"]
    assert per_value <= 5.25, per_value
    assert per_value <= 0.6 * per_value_bytes, (per_value, per_value_bytes)
    # two tokens: the codes decoded once (as many E4M3 converts as for one token), a second token adding
    # its multiply-adds and gather (6.6 a value with Triton 3.9), not a second decode
    two = res["True2"]
    assert two["unpack"] == words["unpack"] and two["shfl"] == 0, two
    assert two["per_value"] <= per_value + 2.0, (two["per_value"], per_value)


@pytest.mark.parametrize("m", [1, 8, 12, 64])
@pytest.mark.parametrize("layout", ["canonical", "quack"])
def test_exact_w4a4_both_layouts(m, layout):
    quack_gemm = pytest.importorskip("svdq_linear.backends.sm90.quack_gemm")
    gen = torch.Generator().manual_seed(10 + m)
    n, k = 128, 512
    q, ws = _weight(n, k, gen)
    wc = torch.rand(n, generator=gen) + 0.5
    smooth = torch.exp(torch.randn(k, generator=gen) * 0.3)
    x = torch.randn(m, k, generator=gen).bfloat16() * 3
    x[0, :16] = 0  # an all-zero block
    codes, scales = nvfp4.quantize_nvfp4(nvfp4.smooth_input(x, smooth))
    ref = (nvfp4.dequantize_nvfp4(codes, scales).double() @ nvfp4.dequantize_nvfp4(q, ws).double().T) * wc.double()
    w, s, lay = (q, ws, sm.CANONICAL) if layout == "canonical" else (
        quack_gemm.repack_weight(q), quack_gemm.repack_scales(ws), sm.QUACK)
    to = dict(device=DEV)
    if sm.use_fma(m, n, k):  # the kernel quantizes x / smooth itself
        a, act = x, sm.ACT_NVFP4
    else:  # the exact activations from quantize_act
        a, act = nvfp4.dequantize_nvfp4(codes, scales).bfloat16(), sm.ACT_X
    y = sm.linear(a.to(**to), lay, w.to(**to), s.to(**to), wc.to(**to), n, act=act, smooth=smooth.to(**to),
                  out_dtype=torch.float32, split_k=2)
    _close(y, ref, f"exact {layout} m={m}")


def test_in_kernel_quantization_keeps_nan_blocks():
    gen = torch.Generator().manual_seed(3)
    n, k = 64, 256
    q, ws = _weight(n, k, gen)
    x = torch.randn(2, k, generator=gen)
    x[1, 40] = float("inf")  # block 2 of token 1: NaN per the contract, so its whole output row is NaN
    y = sm.linear(x.to(DEV), sm.CANONICAL, q.to(DEV), ws.to(DEV), torch.ones(n, device=DEV), n, act=sm.ACT_NVFP4,
                  smooth=torch.ones(k, device=DEV), out_dtype=torch.float32).cpu()
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()


@pytest.mark.parametrize("m", [2, 16])
@pytest.mark.parametrize("block_k", [128, 256, 512])
def test_quack_layout_at_every_k_step(block_k, m):
    """The blob tiles are read a run of several 64-k tiles at a time and permuted in registers: every
    run length (K = 768 makes 512 fall back to 256) against the canonical formula."""
    quack_gemm = pytest.importorskip("svdq_linear.backends.sm90.quack_gemm")
    gen = torch.Generator().manual_seed(block_k + m)
    n, k = 128, 768
    q, ws = _weight(n, k, gen)
    wc = torch.rand(n, generator=gen) + 0.5
    x = (torch.randn(m, k, generator=gen) * 2).bfloat16()
    w, s = quack_gemm.repack_weight(q), quack_gemm.repack_scales(ws)
    ref = (x.double() @ nvfp4.dequantize_nvfp4(q, ws).double().T) * wc.double()
    assert sm.block_k_for(sm.QUACK, k, block_k) == min(block_k, 256)
    to = dict(device=DEV)
    y = sm.linear(x.to(**to), sm.QUACK, w.to(**to), s.to(**to), wc.to(**to), n, act=sm.ACT_X,
                  out_dtype=torch.float32, block_k=block_k, split_k=2)
    _close(y, ref, f"quack block_k={block_k} m={m}")


def test_split_k_reduction_is_ordered_and_leaves_its_counters_at_zero():
    gen = torch.Generator().manual_seed(5)
    n, k = 192, 1024
    q, ws = _weight(n, k, gen)
    x = torch.randn(3, k, generator=gen).bfloat16().to(DEV)
    args = (x, sm.CANONICAL, q.to(DEV), ws.to(DEV), torch.ones(n, device=DEV), n)
    one = sm.linear(*args, act=sm.ACT_X, out_dtype=torch.float32, split_k=1)
    many = [sm.linear(*args, act=sm.ACT_X, out_dtype=torch.float32, split_k=8) for _ in range(3)]
    assert all(torch.equal(many[0], y) for y in many[1:]), "the split-K sum depends on scheduling"
    assert torch.allclose(one, many[0], rtol=1e-5, atol=1e-4)
    assert int(sm._counters(torch.device(DEV), 3).abs().sum()) == 0, "a tile counter was not reset"


def test_split_rule_fills_the_gpu_and_bounds_the_partials():
    # 48 or 288 weight tiles of 64 rows: about CTAS_PER_SM CTAs per SM (K-steps rounded to equal
    # splits); never more splits than k-steps
    for n in (3072, 18432):
        ctas = (n // 64) * sm.split_for(2, n, 3072, 64, 64)
        assert 0.6 * sm.CTAS_PER_SM * sm.SM_COUNT <= ctas <= 1.2 * sm.CTAS_PER_SM * sm.SM_COUNT, (n, ctas)
    assert sm.split_for(2, 3072, 128, 64, 64) == 2
    # at 64 tokens the fp32 partials would outweigh the 4-bit weight: capped
    s = sm.split_for(64, 3072, 3072, 64, 128)
    assert 1 <= s and s * 64 * 8 <= 0.5 * 3072 * 0.5625


def test_bad_calls_name_the_problem():
    q, ws = _weight(64, 192, torch.Generator().manual_seed(0))
    one = torch.ones(64)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        sm.linear(torch.zeros(65, 192), sm.CANONICAL, q, ws, one, 64, act=sm.ACT_X, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="expected layout CANONICAL or QUACK"):  # 2 was the fast blob's
        sm.linear(torch.zeros(1, 256), 2, q, ws, one, 64, act=sm.ACT_X, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="in_features % 128"):
        sm.linear(torch.zeros(1, 192), sm.QUACK, q, ws, one, 64, act=sm.ACT_X, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="smooth"):
        sm.linear(torch.zeros(1, 192), sm.CANONICAL, q, ws, one, 64, act=sm.ACT_NVFP4, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="proj_up"):
        sm.linear(torch.zeros(1, 192), sm.CANONICAL, q, ws, one, 64, act=sm.ACT_X, out_dtype=torch.float32,
                  proj_up=torch.zeros(64, 4), lora_act=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="64-row group"):
        sm.linear(torch.zeros(1, 256), sm.QUACK, q, ws, one, 64, act=sm.ACT_X, out_dtype=torch.float32, block_n=128)


def test_backend_routes_each_kind_by_its_own_token_limit(monkeypatch):
    """``sm90.SMALL_M`` is per layer kind: W4A16 at 1 token goes to the small-M kernel and at 2 to the
    GEMM; exact W4A4 up to 64 tokens; both give the contract's result either way."""
    import svdq_linear.backends.sm90 as sm90
    from svdq_linear import NVFP4W4A16Linear, SVDQW4A4Linear, backends

    calls = []
    real = sm.linear
    monkeypatch.setattr(sm, "linear", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    monkeypatch.setattr(sm90, "SMALL_M", {"w4a4": 64, "w4a16": 1})
    gen = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(256, 128)
    backend = backends.get_backend("sm90")
    for module, m, small in [(NVFP4W4A16Linear.from_linear(lin), 1, True), (NVFP4W4A16Linear.from_linear(lin), 2, False),
                             (SVDQW4A4Linear.from_linear(lin, rank=16), 3, True),
                             (SVDQW4A4Linear.from_linear(lin, rank=16), 64, True)]:
        module = module.to(DEV)
        x = torch.randn(m, 256, generator=gen).to(DEV)
        calls.clear()
        y = backend.linear(module, x, backend.prepare(module, x.device))
        assert bool(calls) == small, f"{module.kind} at {m} tokens: small-M kernel {'not ' if small else ''}expected"
        ref = backends.get_backend("reference")
        want = ref.linear(module, x, ref.prepare(module, x.device))
        # bf16 operands of the low-rank product: the contract's allowance, ~1e-3 of the output here
        assert (y.float() - want.float()).abs().max() <= 1e-2 * want.abs().max(), f"{module.kind} at {m}"


def test_small_m_mma_routing_follows_the_measured_crossover(monkeypatch):
    """``tuning.use_small_m_mma`` (the H200's same-run crossover, docs/perf.md): the exact mode up to 8
    tokens at every shape, the fast mode up to 8 tokens only where K >= 2 N; ``SVDQ_SM90_SMALL_M_MMA``
    forces it on ("1", up to 64 tokens) or off ("0")."""
    import svdq_linear.backends.sm90 as sm90
    from svdq_linear.backends.sm90 import tuning

    monkeypatch.delenv(sm90.ENV_SMALL_M_MMA, raising=False)
    assert all(tuning.use_small_m_mma("exact", m, n, k) for m in (1, 8) for n, k in ((3072, 3072), (12288, 3072)))
    assert not tuning.use_small_m_mma("exact", 9, 3072, 3072)
    assert tuning.use_small_m_mma("fast", 1, 3072, 12288) and tuning.use_small_m_mma("fast", 8, 3072, 6144)
    assert not tuning.use_small_m_mma("fast", 1, 3072, 3072) and not tuning.use_small_m_mma("fast", 1, 12288, 3072)
    assert not tuning.use_small_m_mma("fast", 16, 3072, 12288)
    class _Cuda:  # shape and device of a CUDA input without a GPU
        def __init__(self, m, k=3072, cuda=True):
            self.shape, self.is_cuda = (m, k), cuda

    assert sm90._route_small_m_mma("exact", _Cuda(4), 3072) and not sm90._route_small_m_mma("exact", _Cuda(16), 3072)
    assert not sm90._route_small_m_mma("exact", _Cuda(4, cuda=False), 3072)  # the Triton interpreter's CPU calls
    assert not sm90._route_small_m_mma("exact", _Cuda(0), 3072)  # no tokens: the other paths' empty output
    monkeypatch.setenv(sm90.ENV_SMALL_M_MMA, "1")
    assert sm90._route_small_m_mma("fast", _Cuda(64), 3072) and not sm90._route_small_m_mma("fast", _Cuda(65), 3072)
    assert not sm90._route_small_m_mma("fast", _Cuda(8, cuda=False), 3072)
    assert not sm90._route_small_m_mma("fast", _Cuda(0), 3072)
    monkeypatch.setenv(sm90.ENV_SMALL_M_MMA, "0")
    assert not sm90._route_small_m_mma("exact", _Cuda(1), 3072)


def test_use_fma_takes_one_and_two_tokens_at_every_shape():
    """The H200 crossover with the block chain (docs/perf.md, tenth session): multiply-adds win at 1 and 2
    tokens on every weight measured, the dot from 3 tokens on."""
    for n, k in ((18432, 3072), (9216, 3072), (3072, 12288), (3072, 3072)):
        assert sm.use_fma(1, n, k) and sm.use_fma(2, n, k)
        assert not sm.use_fma(3, n, k) and not sm.use_fma(4, n, k)
    assert not sm.use_fma(16, 256, 256)


# ---- the warp-level tensor-core kernel (small_m_mma): host rules and SASS on the CPU, numerics on a GPU ----


def test_mma_split_divides_the_k_tiles_and_leaves_a_tile_to_prefetch():
    mma = pytest.importorskip("svdq_linear.backends.sm90.small_m_mma")
    for groups, k_tiles in [(48, 48), (288, 48), (48, 192), (48, 240), (1, 2), (192, 240)]:
        s = mma.split_for(groups, k_tiles)
        assert k_tiles % s == 0 and (s == 1 or k_tiles // s >= 2), (groups, k_tiles, s)
        assert groups * s <= max(groups, mma.CTAS_PER_SM * mma.SM_COUNT * 1.5), (groups, k_tiles, s)
    assert mma.split_for(48, 48) == 8  # 3072 x 3072: 384 CTAs (the largest divisor of 48 up to 4 x 132 / 48), 6 k-tiles a split


def _sm90a_sass(tmp_path, *args):
    """The SASS of ``python -m svdq_linear.backends.sm90.small_m_mma ARGS`` compiled for sm_90a here (no GPU)."""
    import os
    import sys

    pytest.importorskip("quack")
    from svdq_linear.backends.sm100.precompile import find_nvdisasm

    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not found")
    cubin = tmp_path / "k.cubin"
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "QUACK_ARCH": "90", "CUTE_DSL_KEEP": "cubin",
           "CUTE_DSL_DUMP_DIR": str(tmp_path), "CUTE_DSL_CACHE_DIR": str(tmp_path / "cache"),
           "CUTE_DSL_DISABLE_FILE_CACHING": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", "svdq_linear.backends.sm90.small_m_mma", *args, "--out", str(cubin)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("mode,n_tiles,depth,unroll", [("exact", 1, 2, False), ("exact", 8, 2, False), ("fast", 2, 2, False),
                                                       ("exact", 1, 4, False), ("fast", 1, 1, False), ("exact", 1, 3, True),
                                                       ("fast", 1, 2, True)])
def test_mma_kernel_compiles_for_sm90_with_an_hmma_per_k16_block_and_token_tile(tmp_path, mode, n_tiles, depth, unroll):
    """Compiled for sm_90a here (no GPU): exact, one ``HMMA.16816.F32.BF16`` per k16 block and 8 tokens,
    quack's ``prmt`` decode; fast, the E4M3 ``mma.sync`` as ptxas lowers it on Hopper (two f16
    ``HMMA.16816.F32`` per k32 block and 8 tokens) after the table decode; no local memory. The
    prefetch ring: ``depth`` k-tiles of code words loaded before the loop, one a tile in it (16-byte
    loads: one a k-tile in the exact blob, two in the fast one); unrolled, ``depth`` k-tiles a loop trip,
    each with its own slot (``depth`` times the MMAs and the loads in the loop)."""
    import re

    sass = _sm90a_sass(tmp_path, "--n-tiles", str(n_tiles), "--mode", mode, "--depth", str(depth),
                       *(["--unroll"] if unroll else []))
    trips = depth if unroll else 1  # k-tiles in the loop's body
    if mode == "exact":
        assert len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", sass)) == 4 * n_tiles * trips
        assert len(re.findall(r"\bPRMT\b", sass)) >= 40 * trips  # quack's decode: 11 a k16 block
    else:
        assert len(re.findall(r"\bHMMA\.16816\.F32\b(?!\.BF16)", sass)) == 8 * n_tiles * trips
        assert len(re.findall(r"\bF2FP\.SATFINITE\.E4M3\.F16\b", sass)) == 16 * trips  # the four tables
    runs = 1 if mode == "exact" else 2
    assert len(re.findall(r"\bLDG\.E\.128\b", sass)) == runs * (depth + trips)
    assert not re.search(r"\b(LDL|STL)\b", sass)


@pytest.mark.parametrize("mode,n_tiles", [("exact", 1), ("fast", 1), ("exact", 8)])
def test_fused_mma_kernel_compiles_with_its_low_rank_mma_counter_and_fenced_sum(tmp_path, mode, n_tiles):
    """``--fused`` for sm_90a here (no GPU): the main loop's MMAs plus the low-rank MMA (four bf16
    ``HMMA.16816`` a token tile: a window of up to 64 columns), one atomic add on the group's counter at
    GPU scope, the fence before it and after it (``MEMBAR`` at GPU scope; the acquire also invalidates
    L1: ``CCTL.IVALL``), strong (L2) loads of the partials, CTA barriers around the flag, no local memory."""
    import re

    sass = _sm90a_sass(tmp_path, "--n-tiles", str(n_tiles), "--mode", mode, "--fused")
    bf16 = len(re.findall(r"\bHMMA\.16816\.F32\.BF16\b", sass))
    if mode == "exact":
        assert bf16 == 4 * n_tiles + 4 * n_tiles  # main loop + low-rank window
    else:
        assert len(re.findall(r"\bHMMA\.16816\.F32\b(?!\.BF16)", sass)) == 8 * n_tiles and bf16 == 4 * n_tiles
    assert len(re.findall(r"\bATOMG\.E\.ADD\.STRONG\.GPU\b", sass)) == 1
    assert len(re.findall(r"\bMEMBAR\.ALL\.GPU\b", sass)) >= 2 and re.search(r"\bCCTL\.IVALL\b", sass)
    assert re.search(r"\bLDG\.E\.STRONG\.GPU\b", sass)
    assert len(re.findall(r"\bBAR\.SYNC", sass)) >= 2
    assert not re.search(r"\b(LDL|STL)\b", sass)


def test_fused_mma_kernel_binds_no_size_of_a_stand_in_to_the_layer_shape(tmp_path):
    """tvm-ffi binds each symbolic size of the compiled signature once a call: the counter buffer, the
    segments and the low-rank operands (dummies without a low-rank term) must have sizes of their own, or
    every call is refused. Read from the signature the wrapper reports (it checks the device first, so
    a CPU call shows it without a GPU); compiled for sm_90a in a subprocess (the DSL reads its target at
    import)."""
    import os
    import re
    import sys

    pytest.importorskip("quack")
    code = ("import torch\nfrom svdq_linear.backends.sm90 import small_m_mma as s\n"
            "fn = s.compile_kernel(1, 'exact', fused='bfloat16')\n"
            "try:\n    fn(*[torch.zeros(1, dtype=torch.int32)] * 15)\nexcept ValueError as e:\n    print(e)\n")
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "QUACK_ARCH": "90", "CUTE_DSL_CACHE_DIR": str(tmp_path),
           "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    sig = re.search(r"call_fused\((.*)\)`", r.stdout)
    if sig is None:
        pytest.skip("this tvm-ffi does not report the signature")
    shapes = dict(re.findall(r"(m\w+): Tensor\(\[([^\]]*)\]", sig.group(1)))
    layer = {d for name in ("mBlob", "mSf", "mX", "mPart", "mOut", "mCs", "mBias") for d in shapes[name].split(", ")}
    for name in ("mCnt", "mSeg", "mUp", "mLa", "mRs"):
        assert not set(shapes[name].split(", ")) & layer, f"{name} {shapes[name]} shares a size with the layer's tensors"
    assert not set(shapes["mCnt"].split(", ")) & set(shapes["mSeg"].split(", "))


def test_fused_mma_call_checks_its_operands():
    """The fused kernel's host side refuses what it cannot run before compiling anything: a bias that is
    not the prepared fp32 one, windows wider than 64 or not whole k16 blocks, mismatched lora', a split
    that does not divide the k-tiles, an output dtype it does not write."""
    mma = pytest.importorskip("svdq_linear.backends.sm90.small_m_mma")
    m, g, kt = 3, 2, 4  # 128 rows x 256 columns
    a = torch.zeros(m, 256, dtype=torch.bfloat16)
    blob = torch.zeros(g, kt, 128, 4, dtype=torch.int32)
    sf = torch.zeros(g, kt, 32, 2, dtype=torch.int32)
    cs, bias = torch.ones(128), torch.zeros(128)
    up, la, seg = torch.zeros(128, 32, dtype=torch.bfloat16), torch.zeros(m, 32, dtype=torch.bfloat16), torch.zeros(g, dtype=torch.int32)

    def run(**kw):
        args = dict(bias=bias, up_w=up, la=la, seg=seg, out_dtype=torch.bfloat16, split=2)
        args.update(kw)
        return mma._run_fused("exact", a, blob, sf, cs, None, args.pop("bias"), args.pop("up_w"), args.pop("la"),
                              args.pop("seg"), **args)

    with pytest.raises(ValueError, match="fp32 bias"):
        run(bias=bias.bfloat16())
    with pytest.raises(ValueError, match="16-64 columns"):
        run(up_w=torch.zeros(128, 80, dtype=torch.bfloat16), la=torch.zeros(m, 80, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="16-64 columns"):
        run(up_w=torch.zeros(128, 24, dtype=torch.bfloat16), la=torch.zeros(m, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="16-64 columns"):
        run(la=torch.zeros(m + 1, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        run(la=torch.zeros(m, 32))
    with pytest.raises(ValueError, match="does not divide"):
        run(split=3)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        run(out_dtype=torch.float32)


def _fused_case(mode, m, r, seed=0):
    """A 3072 x 3072 layer (a fused q/k/v's three 1024-row parts with R = 32 each where ``r == "3x32"``), its
    prepared sm90 state and x."""
    from test_conformance import random_w4a4

    from svdq_linear.backends.sm90 import Sm90Backend

    torch.manual_seed(seed)
    rank = 96 if r == "3x32" else r
    mod = random_w4a4(3072, 3072, rank, torch.bfloat16, "cuda")
    if r == "3x32":
        with torch.no_grad():
            mod.proj_up.mul_(torch.block_diag(*[torch.ones(1024, 32)] * 3).to(mod.proj_up))
    mod.set_mode(mode)
    x = torch.randn(m, 3072, device="cuda", dtype=torch.bfloat16) * 3
    prep = Sm90Backend().prepare(mod, torch.device("cuda"))
    return mod, x, prep


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("m", [1, 7, 9, 33, 64])
@pytest.mark.parametrize("r", [0, 32, "3x32"])
def test_gpu_fused_mma_kernel_meets_the_contract_and_resets_its_counters(mode, m, r, monkeypatch):
    """The fused kernel (one launch: low-rank MMA, ordered split-K sum, epilogue) against the contract
    (exact) or the fast formula, directly and through the module (``SVDQ_SM90_MMA_FUSED=1``); its
    counters are zero after each launch, a second call and a CUDA-graph replay give the same bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    mma = pytest.importorskip("svdq_linear.backends.sm90.small_m_mma")
    from test_conformance import _check, _expected_and_bound

    from svdq_linear import backends, nvfp4
    from svdq_linear.backends.sm90 import (ENV_EXACT_ONE_LAUNCH, ENV_FAST_ONE_LAUNCH, ENV_MMA_FUSED, ENV_SMALL_M_MMA,
                                           _mm_f32, kernels)
    from svdq_linear.backends.sm90.small_m import _counters

    # both modes read the weight quack's prepare repacked (exact: quack_gemm's blob; fast: quack_fast's)
    pytest.importorskip("quack")
    mod, x, prep = _fused_case(mode, m, r, seed=m)
    lr = (prep.proj_up_bf16, None, prep.lowrank_segments) if mod.rank else (None, None, None)
    if mode == "exact":
        qw = prep.quack
        la = x @ prep.proj_down_smoothed if mod.rank else None

        def run():
            xq = kernels.quantize_act(x, mod.smooth)[0]
            return mma.linear_fused(xq, qw.blob, qw.sf, qw.wc, qw.bias, lr[0], la, lr[2], out_dtype=torch.bfloat16)
        expected, bound = _expected_and_bound(mod, x)
    else:
        fw = prep.quack

        def run():
            if mod.rank:
                a8, sa, la = kernels.quantize_act_fp8(x, mod.smooth, lora=_mm_f32(x, prep.proj_down_smoothed),
                                                      gemm_order=True)
            else:
                (a8, sa), la = kernels.quantize_act_fp8(x, mod.smooth, gemm_order=True), None
            return mma.linear_fast_fused(a8, sa, fw, lr[0], la, lr[2], out_dtype=torch.bfloat16)
        from test_sm90_fast import _fast_bound

        args = [t.cpu() if t is not None else None for t in (mod.qweight, mod.wscales, mod.smooth, mod.proj_down,
                                                             mod.proj_up, mod.wcscale, mod.bias)]
        expected = nvfp4.w4a8_fast_linear(x.cpu(), *args, torch.float64)
        a8r, sar = nvfp4.fast_act(nvfp4.smooth_input(x.cpu(), mod.smooth.cpu()))
        bound = _fast_bound(mod, x, a8r, sar) + 2.0**-8 * expected.abs() + 1e-30
    y = run()
    _check(y, expected, bound, f"fused {mode} M={m} R={r}")
    torch.cuda.synchronize()
    assert int(_counters(x.device, 48).abs().sum()) == 0, "a counter was left nonzero"
    assert torch.equal(run(), y), "a second launch differs"
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
        with torch.cuda.graph(g, stream=s):
            yg = run()
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(2):  # each replay writes every output again (a stuck counter would skip the epilogue)
        yg.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, y), "a CUDA-graph replay differs"
    with torch.cuda.stream(s):
        # the warm-up launch on the graph's stream used that stream's eager counters (the captured launch has
        # words of its own, which the replays above exercised)
        assert int(_counters(x.device, 48).abs().sum()) == 0, "the warm-up launch left a counter nonzero"
    monkeypatch.setenv(ENV_SMALL_M_MMA, "1")
    monkeypatch.setenv(ENV_MMA_FUSED, "1")
    monkeypatch.setenv(ENV_FAST_ONE_LAUNCH, "0")  # 1-2 tokens would take the one-launch kernels
    monkeypatch.setenv(ENV_EXACT_ONE_LAUNCH, "0")
    assert backends.choose(mod, x).name == "sm90"
    calls = []
    real = mma._run_fused
    monkeypatch.setattr(mma, "_run_fused", lambda *a, **k: calls.append(1) or real(*a, **k))
    # the module's forward: its prepared state stands in for the canonical tensors, which routes the exact
    # mode to quack's blob (the layout small_m_mma reads)
    _check(mod(x), expected, bound, f"module fused {mode} M={m}")
    assert calls, "the module's forward did not take the fused kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 9, 33, 64])
def test_gpu_mma_kernel_meets_the_contract(m, monkeypatch):
    """The exact W4A4 layer through the tensor-core kernel (directly, and through the backend with
    ``SVDQ_SM90_SMALL_M_MMA=1``) against the contract in float64, within its tensor-core tolerance."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    mma = pytest.importorskip("svdq_linear.backends.sm90.small_m_mma")
    quack_gemm = pytest.importorskip("svdq_linear.backends.sm90.quack_gemm")
    from test_conformance import _check, _expected_and_bound, random_w4a4

    from svdq_linear import backends
    from svdq_linear.backends.sm90 import ENV_SMALL_M_MMA, kernels

    torch.manual_seed(m)
    mod = random_w4a4(3072, 3072, 32, torch.bfloat16, "cuda")
    x = torch.randn(m, 3072, device="cuda", dtype=torch.bfloat16) * 3
    pds = (mod.proj_down.float() / mod.smooth.float()[:, None]).bfloat16()
    y = mma.linear(kernels.quantize_act(x, mod.smooth)[0], quack_gemm.repack_weight(mod.qweight),
                   quack_gemm.repack_scales(mod.wscales), mod.wcscale.float(), mod.bias, mod.proj_up,
                   x @ pds, out_dtype=torch.bfloat16)
    expected, bound = _expected_and_bound(mod, x)
    _check(y, expected, bound, f"small_m_mma M={m}")
    monkeypatch.setenv(ENV_SMALL_M_MMA, "1")
    backend = backends.choose(mod, x)
    _check(backend.linear(mod, x, backend.prepare(mod, x.device)), expected, bound, f"backend M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gpu_mma_unrolled_loop_gives_the_same_bits(mode):
    """The k-loop unrolled by the prefetch depth (fixed ring slots, ``--mma-sweep``'s candidate) walks the
    same k-tiles in the same order as the default loop: the same partial sums, bit for bit."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    mma = pytest.importorskip("svdq_linear.backends.sm90.small_m_mma")
    quack_gemm = pytest.importorskip("svdq_linear.backends.sm90.quack_gemm")
    from test_conformance import random_w4a4

    from svdq_linear.backends.sm90 import kernels, quack_fast

    torch.manual_seed(3)
    mod = random_w4a4(3072, 3072, 32, torch.bfloat16, "cuda")
    x = torch.randn(5, 3072, device="cuda", dtype=torch.bfloat16)
    if mode == "exact":  # 48 k-tiles: split 4 gives 12 a split, a multiple of 2, 3 and 4
        xq = kernels.quantize_act(x, mod.smooth)[0]
        blob, sf = quack_gemm.repack_weight(mod.qweight), quack_gemm.repack_scales(mod.wscales)

        def run(split=4, **kw):
            return mma.linear(xq, blob, sf, mod.wcscale.float(), mod.bias, out_dtype=torch.float32, split=split, **kw)
    else:  # 24 k-tiles: split 2 gives 12
        fw = quack_fast.prepare(mod.qweight, mod.wscales, mod.wcscale, mod.bias)
        a8, sa = kernels.quantize_act_fp8(x, mod.smooth, gemm_order=True)

        def run(split=2, **kw):
            return mma.linear_fast(a8, sa, fw, mod.bias, out_dtype=torch.float32, split=split, **kw)
    want = run()
    for depth in (2, 3, 4):
        assert torch.equal(run(depth=depth, unroll=True), want), f"unrolled at depth {depth}"
    with pytest.raises(ValueError, match="multiple of depth"):  # 6 (exact) or 3 (fast) k-tiles a split
        run(depth=4 if mode == "exact" else 2, unroll=True, split=8)


@pytest.mark.parametrize("s,m", [(3, 16), (9, 5), (9, 16), (5, 40)])
def test_splitk_epilogue_sums_in_order_and_applies_both_scales(s, m):
    """``kernels.splitk_epilogue`` (the Triton GEMM's split-K and both small_m_mma modes): the partials'
    sum times the per-token and per-column factors, plus the low-rank product and the bias; more splits
    than it loads at once (4 at 16 token rows, the last chunk partly masked) and masked token rows."""
    from svdq_linear.backends.sm90 import kernels

    gen = torch.Generator().manual_seed(3 + s + m)
    n, r = 64, 16
    part = torch.randn(s, m, n, generator=gen)
    cs, rs, bias = torch.rand(n, generator=gen) + 0.5, torch.rand(m, generator=gen) + 0.5, torch.randn(n, generator=gen)
    up, lora, lr = _lowrank(m, n, r, gen)
    to = dict(device=DEV)
    out = torch.empty(m, n, **to)
    kernels.splitk_epilogue(part.to(**to), out, cs.to(**to), bias.to(**to), up.to(**to), lora.to(**to), rs.to(**to))
    ref = part.double().sum(0) * rs.double()[:, None] * cs.double() + lr + bias.double()
    _close(out, ref, "splitk_epilogue with a row scale")
    kernels.splitk_epilogue(part.to(**to), out, cs.to(**to))
    _close(out, part.double().sum(0) * cs.double(), "splitk_epilogue, factors only")


@pytest.mark.parametrize("split", [1, 3])
def test_triton_gemm_adds_the_low_rank_branch_with_or_without_split_k(split):
    """``kernels.w4_gemm`` with a low-rank branch, in one pass and split over K (the split's sum and the branch then
    come from ``splitk_epilogue``): a mutation dropping the branch from the split path passed every test, since the
    tile rule never splits a call with a branch above 64 tokens. Against the float64 formula."""
    from svdq_linear.backends.sm90 import kernels
    from svdq_linear.backends.sm90.tuning import GemmConfig

    gen = torch.Generator().manual_seed(11 + split)
    m, n, k, r = 24, 64, 384, 16
    q, ws = _weight(n, k, gen)
    wc, bias = torch.rand(n, generator=gen) + 0.5, torch.randn(n, generator=gen)
    a = torch.randn(m, k, generator=gen).bfloat16()
    up, lora, lr = _lowrank(m, n, r, gen)
    cfg = GemmConfig(block_n=64, block_m=16, block_k=128, split_k=split, num_warps=4, num_stages=1)
    to = dict(device=DEV)
    y = kernels.w4_gemm(a.to(**to), q.to(**to), ws.to(**to), wc.to(**to), bias.to(**to), up.to(**to), lora.to(**to),
                        torch.float32, cfg)
    w = nvfp4.dequantize_weight(q, ws, torch.ones(n)).double()
    ref = (a.double() @ w.T) * wc.double() + lr + bias.double()
    _close(y, ref, f"w4_gemm, split {split}")


def test_in_kernel_quantization_rounds_every_midpoint_to_even():
    """The kernel's own NVFP4 quantizer (``ACT_NVFP4``, one or two tokens) at every E2M1 midpoint and beside it,
    in blocks whose maximum 6 fixes the scale to 1: random inputs never land on one, and a mutation rounding 0.75
    down passed every test. Against the contract's codes through the float64 formula."""
    gen = torch.Generator().manual_seed(5)
    n, k = 64, 256
    q, ws = _weight(n, k, gen)
    mids = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0.7501])
    x = torch.stack([mids.repeat(k // 16), -mids.repeat(k // 16)])
    ref = (nvfp4.dequantize_nvfp4(*nvfp4.quantize_nvfp4(x)).double() @ nvfp4.dequantize_nvfp4(q, ws).double().T)
    y = sm.linear(x.to(DEV), sm.CANONICAL, q.to(DEV), ws.to(DEV), torch.ones(n, device=DEV), n, act=sm.ACT_NVFP4,
                  smooth=torch.ones(k, device=DEV), out_dtype=torch.float32, fma=True)
    _close(y, ref, "in-kernel quantization at the midpoints")
