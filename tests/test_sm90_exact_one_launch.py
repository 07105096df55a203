"""The exact mode's one-launch kernel for one or two tokens (``small_m_fast.linear_exact``): the producers'
NVFP4 activation codes and scales, integer dot products of the weight's and the activations' codes on quack's
blob, the fast kernel's split-K sum and epilogue. Against the contract (``nvfp4.w4a4_linear`` in float64, its
tolerance ``nvfp4.tolerance``); the ``prmt`` / ``dp4a`` text of the product run by a small PTX model; the
sm_90a build's SASS. On the CPU through Triton's interpreter (conftest); on a GPU compiled."""

import numpy as np
import pytest
import torch

from svdq_linear import nvfp4

pytest.importorskip("triton")
smf = pytest.importorskip("svdq_linear.backends.sm90.small_m_fast")
quack_gemm = pytest.importorskip("svdq_linear.backends.sm90.quack_gemm")
from test_sm90_small_m_fast import _layer as fast_layer, assert_words_zero_and_graphs_replay  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _layer(n, k, r, gen):
    """The fast kernel's test layer (zero and subnormal block scales, all 16 codes in either nibble, a zero row)
    with a block scale of 448 too."""
    q, ws, wc, smooth, pd, up = fast_layer(n, k, r, gen)
    ws[5, 3] = 448.0  # the largest
    return q, ws, wc, smooth, pd, up


def _run(x, q, ws, wc, smooth, pd, up, bias, out_dtype, **kw):
    """``linear_exact`` on what the exact mode's prepared state holds: quack's blob and strip, the bf16
    ``proj_down / smooth``."""
    r = pd.shape[1]
    to = dict(device=DEV)
    return smf.linear_exact(x.to(**to), smooth.to(**to), quack_gemm.repack_weight(q).to(**to),
                            quack_gemm.repack_scales(ws).to(**to), wc.to(**to),
                            None if bias is None else bias.to(**to),
                            (pd / smooth[:, None]).bfloat16().to(**to) if r else None, up.to(**to) if r else None,
                            out_dtype=out_dtype, **kw).cpu()


def _assert_contract(y, x, q, ws, wc, smooth, pd, up, bias, what):
    want = nvfp4.w4a4_linear(x, q, ws, smooth, pd, up.float(), wc, bias, torch.float64)
    bound = nvfp4.tolerance(x, q, ws, smooth, pd, up.float(), wc, bias, y.dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan), f"{what}: NaN where the contract has none, or none where it has"
    err = (y.double() - want).abs()[~nan]
    assert (err <= bound[~nan]).all(), f"{what}: {int((err > bound[~nan]).sum())} elements out of the contract's " \
                                       f"tolerance (worst {(err / bound[~nan]).max().item():.2f}x)"


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("r", [0, 16, 32])
@pytest.mark.parametrize("n,k,out_dtype", [(128, 256, torch.bfloat16), (64, 512, torch.float32)])
def test_exact_one_launch_meets_the_contract(m, r, n, k, out_dtype):
    gen = torch.Generator().manual_seed(100 * m + r + k)
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    bias = torch.randn(n, generator=gen) if r != 16 else None
    x = torch.randn(m, k, generator=gen).bfloat16() * 3
    x[0, 16:32] = 0  # an all-zero block
    x[-1, 40] = 900.0  # an outlier
    x[0, 70] = 1e-30  # a tiny value in a block of normal ones
    y = _run(x, q, ws, wc, smooth, pd, up, bias, out_dtype)
    assert y.dtype == out_dtype and y.shape == (m, n)
    _assert_contract(y, x, q, ws, wc, smooth, pd, up, bias, f"m={m} r={r} {n}x{k}")


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.float32])
def test_exact_one_launch_takes_fp16_and_fp32_inputs(x_dtype):
    """The backend routes any float input of 1-2 tokens here (it declines none for the exact mode): fp16 and
    fp32 tokens are read as they are and meet the contract in their own output dtype."""
    gen = torch.Generator().manual_seed(7 + x_dtype.itemsize)
    n, k, r = 64, 256, 16
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    x = (torch.randn(2, k, generator=gen) * 3).to(x_dtype)
    y = _run(x, q, ws, wc, smooth, pd, up, None, x_dtype)
    assert y.dtype == x_dtype
    _assert_contract(y, x, q, ws, wc, smooth, pd, up, None, f"{x_dtype} tokens")


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("ctas", [1, 5])
def test_workers_that_quantize_their_own_range_give_the_same_bits(m, ctas):
    """``self_acts``: each worker writes its k-range's activation codes itself (over ranges of 6 tiles and of 1,
    four tiles a pass: a partial last pass) instead of waiting for the producers'; the result has the same
    bits, and meets the contract."""
    gen = torch.Generator().manual_seed(60 + m + ctas)
    n, k, r = 128, 768, 16
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    x = torch.randn(m, k, generator=gen).bfloat16() * 2
    x[-1, 300] = float("inf") if m == 2 else 1.0  # a NaN block in the second token's
    kw = dict(ctas_per_sm=ctas, sms=8 if ctas == 1 else smf.SM_COUNT)
    want = _run(x, q, ws, wc, smooth, pd, up, None, torch.float32, **kw)
    got = _run(x, q, ws, wc, smooth, pd, up, None, torch.float32, self_acts=True, **kw)
    assert smf.plan(m, n, k, kw["sms"], ctas, False)[0] == (1 if ctas == 1 else 6)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(got.nan_to_num(), want.nan_to_num())
    _assert_contract(got, x, q, ws, wc, smooth, pd, up, None, f"self_acts m={m}")


def test_producers_write_their_chunk_in_passes_of_whole_tiles(monkeypatch):
    """``act_tiles``: a producer's chunk in passes of up to 4 tiles, no more than the chunk holds (one at the
    Flux attention width). With two producers of three tiles each, a pass of 4 masks its last tile off; the
    activations written are the contract's all the same."""
    assert [smf.act_tiles(k) for k in (3072, 4096, 10240, 12288, 15360)] == [1, 1, 4, 4, 4]
    monkeypatch.setattr(smf, "PRODUCERS_MAX", 2)
    n, k = 64, 768
    assert smf.plan(1, n, k, 8, 1, False)[2:] == (2, 3 * 128) and smf.act_tiles(k) == 4
    gen = torch.Generator().manual_seed(9)
    q, ws, wc, smooth, pd, up = _layer(n, k, 16, gen)
    for m in (1, 2):
        x = torch.randn(m, k, generator=gen).bfloat16()
        y = _run(x, q, ws, wc, smooth, pd, up, None, torch.float32, ctas_per_sm=1, sms=8)
        _assert_contract(y, x, q, ws, wc, smooth, pd, up, None, f"two producers, m={m}")


def test_exact_one_launch_keeps_nan_blocks_to_their_token():
    """A NaN in token 0 and an Inf in token 1 make the contract's output NaN for that token; the other
    token of a call stays finite."""
    gen = torch.Generator().manual_seed(5)
    n, k, r = 64, 256, 16
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    for bad, row in ((float("nan"), 0), (float("inf"), 1)):
        x = torch.randn(2, k, generator=gen)
        x[row, 130] = bad
        y = _run(x, q, ws, wc, smooth, pd, up, None, torch.float32)
        assert torch.isnan(y[row]).all() and torch.isfinite(y[1 - row]).all(), bad
        _assert_contract(y, x, q, ws, wc, smooth, pd, up, None, f"{bad} in token {row}")


def test_exact_one_launch_leaves_its_sync_words_at_zero():
    gen = torch.Generator().manual_seed(6)
    n, k, r = 128, 512, 8
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    x = torch.randn(1, k, generator=gen)
    first = _run(x, q, ws, wc, smooth, pd, up, None, torch.float32)
    sync = smf._sync(torch.device(DEV), n // 64)
    assert int(sync.abs().sum()) == 0, "ticket, counts or group counters left set"
    assert torch.equal(_run(x, q, ws, wc, smooth, pd, up, None, torch.float32), first)  # and a second call agrees


def test_exact_one_launch_refuses_what_it_cannot_read():
    n, k = 64, 256
    x = torch.zeros(1, k)
    blob = torch.zeros(n // 64, k // 64, 128, 16, dtype=torch.uint8)
    strip = torch.zeros(n // 64, k // 64, 32, 4, 2, dtype=torch.uint8)
    ones = torch.ones(k)
    cs = torch.ones(n)
    with pytest.raises(ValueError, match="1 to 2 tokens"):
        smf.linear_exact(torch.zeros(3, k), ones, blob, strip, cs)
    with pytest.raises(ValueError, match="quack's nvfp4 blob"):  # the fast blob is not the exact mode's
        smf.linear_exact(x, ones, torch.zeros(n // 64, k // 128, 128, 32, dtype=torch.uint8),
                         torch.zeros(n // 64, k // 128, 512, dtype=torch.uint8), cs)
    with pytest.raises(ValueError, match="smooth must be a contiguous float32"):
        smf.linear_exact(x, ones.half(), blob, strip, cs)
    with pytest.raises(ValueError, match="K % 128"):
        smf.linear_exact(torch.zeros(1, 192), torch.ones(192), torch.zeros(1, 3, 128, 16, dtype=torch.uint8),
                         torch.zeros(1, 3, 32, 4, 2, dtype=torch.uint8), cs)
    with pytest.raises(ValueError, match="come together"):
        smf.linear_exact(x, ones, blob, strip, cs, proj_down=torch.zeros(k, 8, dtype=torch.bfloat16))


# ---- the product's PTX, run by a model of the instructions it uses ------------------------------------------

def _prmt(a, b, c):
    """PTX ``prmt.b32`` (no mode): result byte i from selector nibble i of c's low 16 bits; its low 3 bits pick
    a byte of (b:a), its bit 3 replicates that byte's sign bit instead of copying it."""
    src = ((b & 0xFFFFFFFF) << 32) | (a & 0xFFFFFFFF)
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _dp4a(a, b, c):
    """PTX ``dp4a.s32.s32``: c + the sum of the four signed byte products."""
    s = c
    for i in range(4):
        x, y = (a >> (8 * i)) & 0xFF, (b >> (8 * i)) & 0xFF
        s += (x - 256 if x > 127 else x) * (y - 256 if y > 127 else y)
    return ((s + 2**31) % 2**32) - 2**31


def _imm(tok, regs):
    tok = tok.strip()
    return regs[tok] if tok in regs else int(tok, 0)


def _run_ptx(text, inputs):
    """Executes the asm block's ``prmt`` / ``xor`` / ``dp4a`` lines on Python ints; ``$i`` are the operands."""
    regs = dict(inputs)
    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *src = [t.strip() for t in rest.split(",")]
        v = [_imm(t, regs) for t in src]
        if op == "prmt.b32":
            regs[d] = _prmt(*v)
        elif op == "xor.b32":
            regs[d] = (v[0] ^ v[1]) & 0xFFFFFFFF
        elif op == "dp4a.s32.s32":
            regs[d] = _dp4a(*v)
        else:
            raise AssertionError(f"the model does not know {op}")
    return regs


def test_product_ptx_gives_the_signed_code_products():
    """For every weight code pair and random activation codes, the asm's two outputs are row r's and row
    r + 8's sums of (E2M1 value x 2) x (activation code value x 2) over the word's four k: bytes 0 and 2 of
    the blob word (low nibble first) are row r's, bytes 1 and 3 row r + 8's (``quack_gemm``'s layout)."""
    text = smf._IDP_ASM.value
    e2m1x2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12])
    rng = np.random.default_rng(0)
    words = [int(w) for w in rng.integers(0, 2**32, 2000, dtype=np.uint64)]
    words += [sum(c << (4 * i) for i in range(8)) for c in range(16)]  # every code in every nibble
    for w in words:
        acts = [int(e2m1x2[c]) for c in rng.integers(0, 16, 4)]
        aw = sum((a & 0xFF) << (8 * i) for i, a in enumerate(acts))
        an = sum((-a & 0xFF) << (8 * i) for i, a in enumerate(acts))
        regs = _run_ptx(text, {"$2": w, "$3": aw, "$4": an, "$5": 0x03020100, "$6": 0x0C080604})
        nib = [(w >> (4 * i)) & 0xF for i in range(8)]
        want_r = sum(int(e2m1x2[nib[j]]) * acts[i] for i, j in enumerate((0, 1, 4, 5)))
        want_q = sum(int(e2m1x2[nib[j]]) * acts[i] for i, j in enumerate((2, 3, 6, 7)))
        assert (regs["$0"], regs["$1"]) == (want_r, want_q), hex(w)


def test_product_table_is_the_kernel_operand():
    """The table registers the kernel hands the asm ($5, $6) are the E2M1 magnitudes times 2, non-negative
    bytes (what the sign-replicate lookups of negative codes rely on to read 0)."""
    src = open(smf.__file__).read()
    assert "0x03020100" in src and "0x0C080604" in src
    table = [(0x03020100 >> (8 * i)) & 0xFF for i in range(4)] + [(0x0C080604 >> (8 * i)) & 0xFF for i in range(4)]
    assert table == [0, 1, 2, 3, 4, 6, 8, 12]


# ---- the sm_90a build --------------------------------------------------------------------------------------

_SASS = r"""
import json, re, sys
sys.path.insert(0, sys.argv[2])
from sass_loops import compile_sm90, instructions, loop_with, opcodes
from svdq_linear.backends.sm90 import small_m_fast as smf

sig = dict(x_ptr="*bf16", inv_ptr="*fp32", blob_ptr="*u8", strip_ptr="*u8", cs_ptr="*fp32", bias_ptr="*fp32",
           pd_ptr="*bf16", up_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", lpart_ptr="*fp32", a8_ptr="*i32",
           sync_ptr="*i32", trace_ptr="*i64", M="i32", N="i32", K="i32", R="i32", stride_xm="i32", stride_pd="i32",
           stride_om="i32", tiles_per_split="i32", S="i32", P="i32", k_per_prod="i32")
out = {}
for label, bm, self_acts in (("1", 1, False), ("2", 2, False), ("1s", 1, True)):
    cx = dict(BM=bm, RB=32, RC=32, **smf.chunks(bm, 32), HAS_BIAS=True, HAS_LORA=True, ASM=True, NUM_STAGES=3,
              DOT=False, POLL=0, TRACE=False, DELAY=0, EXACT=True, SELF_ACTS=self_acts)
    sass = compile_sm90(smf._fast_small_m_kernel, sig, cx, sys.argv[1] + f"/e{label}.cubin",
                        ("M", "R", "S", "P", "tiles_per_split"))
    body = loop_with(sass, "IDP.4A")  # the worker's k-loop
    ops, whole = opcodes(body), opcodes(t for _, t in instructions(sass))
    out[label] = dict(per_value=len(body) / 64, idp=ops["IDP.4A.S8.S8"], prmt=ops["PRMT"], ffma=ops["FFMA"],
                      i2f=ops["I2FP.F32.S32"], shfl=sum(v for o, v in ops.items() if "SHFL" in o),
                      local=sum(v for o, v in whole.items() if o.startswith(("LDL", "STL"))),
                      prefetch=whole["CCTL.E.PF2"], body=len(body),
                      byte_loads=sum(1 for t in body if re.match(r"(@!?P\w+\s+)?LDG\.E\.U8", t)))
print(json.dumps(out))
"""


def test_exact_one_launch_compiles_to_integer_dot_products(tmp_path):
    """Compiled for sm_90a here (no GPU; the real compiler, in a child process). Per k-tile a thread takes 8
    blob words (64 weight values): 6 ``PRMT`` a word (two gathers, four lookups) and 4 ``IDP.4A`` a word a
    token; a block's four words are one thread's and add as integers, then one convert and one FFMA a block
    and row a token (4 a k-tile at one token), nothing across threads in the loop, no local
    memory, no byte loads (the strip comes as words, through the loop's pipeline); the weight lines are prefetched
    into L2 before the wait. Triton 3.9: 205 instructions a k-tile at one token (3.2 a weight value, against the
    fast mode's multiply-adds' 5.1; 249 with the lookup table as an immediate, which ptxas copied in before each
    lookup, the strip as bytes, and a convert and FFMA a word)."""
    from sass_loops import run_script

    out = run_script(_SASS, tmp_path)
    for bm, st in ((1, out["1"]), (2, out["2"])):
        assert st["idp"] == 32 * bm and st["prmt"] == 48, (bm, st)  # the words are decoded once for both tokens
        assert st["i2f"] == 4 * bm and st["ffma"] == 4 * bm, (bm, st)  # a block's four words added as integers
        assert st["shfl"] == 0 and st["local"] == 0 and st["prefetch"] >= 2 and st["byte_loads"] == 0, (bm, st)
    assert out["1"]["per_value"] <= 3.3, out["1"]  # 197 a k-tile with Triton 3.9 (3.08), 209 with the GPUs' 3.6 (3.27)
    assert out["1s"]["body"] <= out["1"]["body"] + 4 and out["1s"]["local"] == 0, out  # the same loop
    assert out["2"]["per_value"] <= out["1"]["per_value"] + 1.5, out


# ---- through the backend -----------------------------------------------------------------------------------

@pytest.mark.parametrize("m,with_bias", [(1, True), (2, True), (1, False)])
def test_backend_takes_the_exact_one_launch_kernel_when_asked(m, with_bias, monkeypatch):
    """``SVDQ_SM90_EXACT_ONE_LAUNCH=1``: an exact call of 1-2 tokens on quack's blob (the prepared state with
    the canonical weight replaced) runs ``linear_exact`` with the prepared fp32 ``wcscale`` and bias and the
    first R columns of the padded ``proj_down / smooth``, and meets the contract; with "0" it does not."""
    from svdq_linear.backends import sm90

    gen = torch.Generator().manual_seed(50 + m)
    n, k, r = 128, 256, 8
    q, ws, wc, smooth, pd, up = _layer(n, k, r, gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    qw = quack_gemm.prepare(q.to(DEV), ws.to(DEV), wc.to(DEV), None if bias is None else bias.to(DEV))
    pds = torch.nn.functional.pad((pd / smooth[:, None]).bfloat16(), (0, 8)).to(DEV)  # padded as the accumulator's
    extra = sm90.Sm90Prepared(pds, up.to(DEV), qw, None).tensors()
    x = (torch.randn(m, k, generator=gen) * 2).bfloat16()
    calls = []
    real = smf.linear_exact
    monkeypatch.setattr(smf, "linear_exact", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    args = (x.to(DEV), torch.empty(0, dtype=torch.uint8, device=DEV), torch.empty(0, device=DEV), smooth.to(DEV),
            pd.to(DEV), up.to(DEV), wc.to(DEV), None if bias is None else bias.to(DEV), extra)
    monkeypatch.setenv(sm90.ENV_EXACT_ONE_LAUNCH, "1")
    y = sm90.Sm90Backend().run_w4a4(*args)
    assert calls and calls[0][6].shape == (k, r), "not the kernel"
    assert calls[0][5] is None if bias is None else calls[0][5].dtype == torch.float32  # the prepared fp32 bias
    assert y.dtype == x.dtype and y.shape == (m, n)
    want = nvfp4.w4a4_linear(x, q, ws, smooth, pd, up.float(), wc, bias, torch.float64)
    bound = nvfp4.tolerance(x, q, ws, smooth, pd, up.float(), wc, bias, torch.bfloat16)
    assert ((y.cpu().double() - want).abs() <= bound).all()
    monkeypatch.setenv(sm90.ENV_EXACT_ONE_LAUNCH, "0")
    calls.clear()
    monkeypatch.setattr(sm90, "_route_small_m_mma", lambda *a: False)  # (small_m_mma is a CUDA kernel)
    sm90.Sm90Backend().run_w4a4(*args)
    assert not calls, "the setting '0' turns the exact one launch off"


@pytest.mark.parametrize("m,k,n,ctas", [(1, 3072, 3072, 0), (2, 3072, 12288, 0), (1, 12288, 3072, 4),
                                        (2, 15360, 3072, 4), (3, 3072, 3072, None), (0, 3072, 3072, None)])
def test_exact_one_launch_route_follows_the_measured_table(m, k, n, ctas, monkeypatch):
    """By default a GPU's exact calls of 1-2 tokens take the one launch, splitting for four CTAs an SM where
    K >= 4 N (the table in ``tuning.exact_one_launch_ctas``) and for what residency fits elsewhere; CPU calls
    (the interpreter) do not unless the setting is "1"; "0" turns it off on a GPU."""
    from types import SimpleNamespace

    from svdq_linear.backends import sm90

    gpu, cpu = (SimpleNamespace(shape=(m, k), is_cuda=c) for c in (True, False))  # what the route reads
    monkeypatch.delenv(sm90.ENV_EXACT_ONE_LAUNCH, raising=False)
    assert sm90._route_exact_one_launch(gpu, n) == ctas
    assert sm90._route_exact_one_launch(cpu, n) is None
    monkeypatch.setenv(sm90.ENV_EXACT_ONE_LAUNCH, "0")
    assert sm90._route_exact_one_launch(gpu, n) is None
    monkeypatch.setenv(sm90.ENV_EXACT_ONE_LAUNCH, "1")
    assert sm90._route_exact_one_launch(cpu, n) == ctas


@pytest.mark.parametrize("m,k,n,stages", [(1, 3072, 3072, 2), (1, 3072, 12288, 2), (1, 12288, 3072, 3),
                                          (1, 15360, 3072, 3), (2, 12288, 3072, 2), (2, 3072, 3072, 2)])
def test_exact_one_launch_stages_follow_the_measured_table(m, k, n, stages):
    """Three k-tiles in flight only at one token of a narrow weight (K >= 4 N), two elsewhere
    (``tuning.exact_one_launch_stages``; the GPU route test below runs both builds against the contract)."""
    from svdq_linear.backends.sm90 import tuning

    assert tuning.exact_one_launch_stages(m, n, k) == stages


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k,n,r", [(3072, 3072, 32), (12288, 3072, 32), (3072, 12288, 0)])
def test_gpu_module_routes_exact_calls_to_one_launch(m, k, n, r, monkeypatch):
    """By default on a GPU, Flux-size layers: the module's exact 1-2 token calls take the kernel (the module's
    prepared state holds quack's blob in place of the canonical weight), meet the contract, leave the sync
    words at zero, give the same bits with ``self_acts``, and replay in a CUDA graph with the same bits."""
    pytest.importorskip("quack")
    from test_conformance import random_w4a4

    from svdq_linear.backends import sm90

    monkeypatch.delenv(sm90.ENV_EXACT_ONE_LAUNCH, raising=False)
    torch.manual_seed(m + k + r)
    mod = random_w4a4(k, n, r, torch.bfloat16, "cuda").set_mode("exact")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    # the canonical tensors, read before the forward: reading them once the prepared state stands in for them
    # rebuilds them and drops that state (the graph capture below would prepare it again, which syncs)
    args = [t.cpu() if t is not None else None for t in
            (mod.qweight, mod.wscales, mod.smooth, mod.proj_down, mod.proj_up, mod.wcscale, mod.bias)]
    calls = []
    run = smf.linear_exact
    monkeypatch.setattr(smf, "linear_exact", lambda *a, **kw: calls.append((a, kw)) or run(*a, **kw))
    y = mod(x)
    assert calls, "the call did not take the exact one-launch kernel"
    assert calls[0][1]["ctas_per_sm"] == (4 if k >= 4 * n else None)
    assert calls[0][1]["num_stages"] == (3 if m == 1 and k >= 4 * n else 2)
    want = nvfp4.w4a4_linear(x.cpu(), *args, torch.float64)
    bound = nvfp4.tolerance(x.cpu(), *args, torch.bfloat16)
    assert ((y.double().cpu() - want).abs() <= bound).all()
    a, kw = calls[0]  # self_acts is a build of its own, which residency may fit another split: fix the split
    assert torch.equal(run(*a, **{**kw, "ctas_per_sm": 4, "self_acts": True}), run(*a, **{**kw, "ctas_per_sm": 4}))
    assert_words_zero_and_graphs_replay(lambda: mod(x), y)
