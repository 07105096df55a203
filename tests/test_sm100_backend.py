"""sm100 backend object: what it accepts and declines, what prepare builds (CPU), and the kernel
against the contract on a compute capability 10.x GPU (skipped elsewhere)."""

import pytest
import torch

from svdq_linear import SVDQW4A4Linear, nvfp4
from svdq_linear.backends.sm100 import Sm100Backend, host, make_backend


def _module(k=256, n=192, rank=32, bias=True, dtype=torch.bfloat16):
    return SVDQW4A4Linear.from_linear(torch.nn.Linear(k, n, bias=bias), rank=rank).to(dtype)


def _capability_10():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def test_importing_svdq_linear_does_not_import_cutlass():
    import subprocess
    import sys

    code = (
        "import sys, svdq_linear; before = set(sys.modules); import svdq_linear.backends.sm100; "
        "new = set(sys.modules) - before; "
        "print('cutlass' in sys.modules, any(m.split('.')[0] in ('cutlass', 'triton', 'quack') for m in new))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.split() == ["False", "False"], r.stdout + r.stderr


def test_make_backend_and_support_rules():
    b = make_backend()
    assert isinstance(b, Sm100Backend) and b.name == "sm100"
    assert not b.supports(torch.device("cpu"), "w4a4")
    assert not b.supports(torch.device("cpu"), "w4a16")
    if torch.cuda.is_available():
        assert b.supports(torch.device("cuda"), "w4a4") == _capability_10()


@pytest.mark.parametrize(
    "k,n,rank,match",
    [(272, 192, 32, "in_features % 32"), (256, 190, 32, "out_features % 8"), (256, 192, 24, "multiple of 16"),
     (512, 384, 256, "rank <= 128")],
)
def test_declines_layers_it_cannot_run(k, n, rank, match):
    assert match in Sm100Backend().declines(_module(k, n, rank))


def test_declines_a_fold_that_overflows_bfloat16():
    m = _module()
    m.wcscale[3] = 0.0
    assert "wcscale" in Sm100Backend().declines(m)
    m = _module()
    m.wcscale[3] = 1e-38
    m.proj_up.data[3, 0] = 1e3
    assert "overflows" in Sm100Backend().declines(m)


def test_accepts_an_aligned_layer_and_declines_fp32_calls():
    m = _module()
    b = Sm100Backend()
    assert b.declines(m) is None
    assert "float32" in b.declines_call(m, torch.randn(4, 256))
    assert "capability 10.x" in b.declines_call(m, torch.randn(4, 256, dtype=torch.bfloat16))


@pytest.mark.parametrize("bias", [True, False])
def test_prepare_repacks_scales_and_folds_proj_up_once(bias):
    m = _module(k=320, n=200, bias=bias)
    p = Sm100Backend().prepare(m)
    back = host.from_sf_atom_layout(p.wsf, m.out_features, m.in_features)
    assert torch.equal(back.view(torch.uint8), m.wscales.view(torch.uint8))
    n_pad = p.proj_up_folded.shape[0]
    assert n_pad % 256 == 0 and n_pad >= 200 and p.proj_up_folded.dtype == torch.bfloat16
    want = (m.proj_up.float() / m.wcscale[:, None]).to(torch.bfloat16)
    assert torch.equal(p.proj_up_folded[:200], want) and not p.proj_up_folded[200:].any()
    assert torch.equal(p.wcscale_pad[:200], m.wcscale) and not p.wcscale_pad[200:].any()
    if bias:
        assert torch.equal(p.bias_pad[:200], m.bias.float())
    assert not p.bias_pad[200:].any()
    assert torch.equal(p.smooth_recip, 1.0 / m.smooth)


def test_no_tokens_launch_nothing(monkeypatch):
    """Zero rows gave the persistent grid 0 clusters, a launch CUDA refuses (sm90 returns early; sm100 did not). The
    call returns an empty [0, N] output and launches nothing (checked on the CPU: the launch is the kernel's)."""
    mod = _module(k=256, n=192)
    b = Sm100Backend()

    def no_launch(*a, **k):
        raise AssertionError("launched a kernel for zero rows")

    monkeypatch.setattr(b, "_launch", no_launch)
    t = mod._parameters
    x = torch.empty(0, 256, dtype=torch.bfloat16)
    y = b.run_w4a4(x, t["qweight"], t["wscales"], mod.smooth, t["proj_down"], t["proj_up"], t["wcscale"], t["bias"],
                   b.extra_tensors(b.prepare(mod)))
    assert y.shape == (0, 192) and y.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not _capability_10(), reason="needs a compute capability 10.x GPU (B200/B300)")
@pytest.mark.parametrize("m_rows", [1, 100, 300, 4352])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n,rank", [(3072, 3072, 32), (3840, 3072, 128), (320, 200, 16)])
def test_kernel_matches_the_contract(m_rows, dtype, k, n, rank):
    mod = _module(k, n, rank, dtype=dtype).cuda()
    b = Sm100Backend()
    assert b.declines(mod) is None
    x = torch.randn(m_rows, k, device="cuda", dtype=dtype)
    y = b.linear(mod, x, b.prepare(mod))
    args = (mod.qweight, mod.wscales, mod.smooth, mod.proj_down, mod.proj_up, mod.wcscale, mod.bias)
    ref = nvfp4.w4a4_linear(x, *args, accum_dtype=torch.float64)
    # the contract's tensor-core tolerance, which every backend is held to: fp32 summation order, the bf16
    # roundings of the low-rank operands (x, proj_down / smooth, lora_act, proj_up / wcscale), the output's
    tol = nvfp4.tolerance(x, *args, dtype)
    err = (y.double() - ref).abs()
    assert bool((err <= tol).all()), f"max error {err.max().item():.3g} at {divmod(int(err.argmax()), n)}"


@pytest.mark.parametrize("rank", [0, 8, 16, 24, 48, 128, 136, 256, 272])
def test_the_rank_note_says_what_the_backends_decline(rank):
    """``backends.rank_note`` (what svdq-convert and quantize_pipeline say before the work) agrees with what the
    Blackwell backend and sm90 decline for an aligned layer of that rank: a note exactly when one of them declines,
    naming the PyTorch reference as what runs there."""
    from svdq_linear.backends import rank_note
    from svdq_linear.backends.sm90 import make_backend as make_sm90

    m = _module(k=512, n=512, rank=rank)
    sm100_declines = Sm100Backend().declines(m) is not None
    sm90_declines = make_sm90().declines(m, torch.device("cpu")) is not None
    note = rank_note(rank)
    assert (note is not None) == (sm100_declines or sm90_declines), (note, sm100_declines, sm90_declines)
    if note is not None:
        assert f"rank {rank}" in note and "PyTorch reference" in note
        assert ("either GPU kernel" in note) == sm90_declines


def test_the_grid_is_sized_by_the_clusters_the_driver_keeps_resident(monkeypatch):
    """The persistent grid took SMs / cluster size clusters; where fewer 2-CTA clusters fit at once (GPC
    fragmentation, MPS), the rest ran as a second wave. It now takes the driver's count of active clusters
    (CUTLASS's persistent examples do the same), and the SM count where the driver cannot say."""
    import contextlib

    import cutlass.utils

    from svdq_linear.backends import sm100

    class Props:
        multi_processor_count = 148

    asked = []

    class Info:
        def __init__(self, device_id=0):
            asked.append(device_id)

        def get_max_active_clusters(self, cluster_size):
            if cluster_size == 4:
                raise RuntimeError("driver too old")
            return 70

    current = []

    @contextlib.contextmanager
    def on(device):  # the query must run with the layer's device current (its context)
        current.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", on)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(cutlass.utils, "HardwareInfo", Info)
    monkeypatch.setattr(sm100, "_RESIDENT", {})
    dev = torch.device("cuda", 1)
    assert sm100.resident_ctas(dev, 2) == 140 and asked == [1] and current == [dev]
    assert sm100.resident_ctas(dev, 2) == 140 and asked == [1], "cached"
    assert sm100.resident_ctas(dev, 1) == 70
    assert sm100.resident_ctas(dev, 4) == 148, "the SM count where the query fails"


def test_lora_act_is_one_bf16_product_of_x_within_the_contract(monkeypatch):
    """``lora_act`` had been ``(x / smooth) @ proj_down`` in float32 from a written float32 ``xs`` ([M, K] fp32
    out and back in, and an fp32 GEMM: several times the NVFP4 GEMM's time on a B200). It is now
    ``x.bf16 @ (proj_down / smooth)`` (bf16, prepared once), within the contract's low-rank roundings, and the
    activation pass no longer writes ``xs``."""
    from svdq_linear.backends.sm100 import quantize

    torch.manual_seed(0)
    mod = _module(k=256, n=192, rank=32)
    b = Sm100Backend()
    p = b.prepare(mod)
    want = (mod.proj_down.float() / mod.smooth.float()[:, None]).to(torch.bfloat16)
    assert p.proj_down_smoothed.dtype == torch.bfloat16 and torch.equal(p.proj_down_smoothed, want)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(64, 256) * 3).to(dtype)
        got = b.lora_act(x, p).double()
        xs = nvfp4.smooth_input(x, mod.smooth).double()
        exact = xs @ mod.proj_down.double()
        bound = 3 * 2**-8 * (xs.abs() @ mod.proj_down.double().abs())  # x, proj_down / smooth, the output
        assert got.shape == (64, 32) and bool(((got - exact).abs() <= bound).all())

    asked = {}
    real = quantize.quantize_act

    def spy(x, smooth_recip, want_xs=False):
        asked["want_xs"] = want_xs
        return real(x, smooth_recip, want_xs)

    monkeypatch.setattr(quantize, "quantize_act", spy)
    monkeypatch.setattr(b, "_launch", lambda *a, **k: None)
    monkeypatch.setattr(host, "choose_config", lambda *a, **k: None)
    t = mod._parameters
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    b.run_w4a4(x, t["qweight"], t["wscales"], mod.smooth, t["proj_down"], t["proj_up"], t["wcscale"], t["bias"],
               b.extra_tensors(p))
    assert asked == {"want_xs": False}


@pytest.mark.parametrize("cap, arch", [((10, 0), "sm_100a"), ((10, 3), "sm_103a"), ((9, 0), None), ((12, 0), None),
                                       ((11, 0), None), ((8, 9), None)])
def test_arch_of_is_compute_capability_10_only(cap, arch, monkeypatch):
    """Only datacenter Blackwell (10.0: B200, 10.3: B300) takes the tcgen05 kernel: consumer Blackwell (12.x) and
    Hopper have no tcgen05, and a check for ``major >= 10`` would have launched it there."""
    from svdq_linear.backends import sm100

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    assert sm100.arch_of(torch.device("cuda", 0)) == arch, cap
    assert sm100.Sm100Backend().supports(torch.device("cuda", 0), "w4a4") == (arch is not None)
    assert sm100.arch_of(torch.device("cpu")) is None


def test_on_a_blackwell_device_calls_decline_only_what_the_kernel_cannot_read(monkeypatch):
    """With the device check passed (``arch_of`` stubbed: no GPU here), a call is declined for an fp32 input or one
    whose rows are not contiguous along K (TMA reads unit-stride rows), and taken in bf16 and fp16, the kernel's two
    output dtypes."""
    from svdq_linear.backends import sm100

    monkeypatch.setattr(sm100, "arch_of", lambda device: "sm_100a")
    b, m = sm100.Sm100Backend(), _module()
    for dtype in (torch.bfloat16, torch.float16):
        assert b.declines_call(m, torch.randn(5, 256).to(dtype)) is None, dtype
        strided = torch.randn(256, 5).to(dtype).t()  # [5, 256], stride 1 along M
        assert "unit stride" in (b.declines_call(m, strided) or ""), dtype
    assert "float32" in (b.declines_call(m, torch.randn(5, 256)) or "")


def test_a_fold_beyond_float16_but_within_bfloat16_is_taken():
    """``proj_up / wcscale`` is held in bf16 for both output dtypes, so a fold beyond float16's 65504 (here 1e5,
    common where wcscale is small) runs on the kernel; only one beyond bf16's range is declined."""
    from svdq_linear.backends.sm100 import Sm100Backend

    for dtype in (torch.bfloat16, torch.float16):
        m = _module(dtype=dtype)
        m.wcscale[3] = 1e-3
        m.proj_up.data[3, 0] = 100.0
        assert Sm100Backend().declines(m) is None, dtype
        m.wcscale[3] = 1e-37
        assert "overflows" in Sm100Backend().declines(m), dtype


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prepare_keeps_the_bias_in_float32_exactly(dtype):
    """The epilogue adds ``bias_pad`` in float32: the layer's bias bit for bit (an fp16 or fp32 bias through bf16
    would lose mantissa bits), zeros past N."""
    from svdq_linear.backends.sm100 import Sm100Backend

    m = _module(n=200, dtype=dtype)
    m.bias.data.copy_((torch.randn(200) * 3).to(dtype))
    p = Sm100Backend().prepare(m)
    assert torch.equal(p.bias_pad[:200], m.bias.float()), (p.bias_pad[:200] - m.bias.float()).abs().max()
    assert not p.bias_pad[200:].any()


@pytest.mark.parametrize("m_rows, dtype", [(8, torch.bfloat16), (128, torch.float16), (300, torch.bfloat16),
                                           (129, torch.float16)])
def test_a_call_launches_the_tile_of_its_token_count_and_dtype(m_rows, dtype, monkeypatch):
    """``run_w4a4`` hands the launch the config of its own call (the launch itself is stubbed: no GPU): one 1-CTA
    tile up to 128 tokens, 2-CTA above (the design's rule, by hand; N = 192 is 128 wide), the input's dtype as the
    output's, the layer's rank, and M, N, K in that order."""
    from svdq_linear.backends.sm100 import Sm100Backend, quantize

    mod = _module(k=256, n=192, rank=32, dtype=dtype)
    b = Sm100Backend()
    seen = {}
    monkeypatch.setattr(quantize, "quantize_act", lambda x, recip, want_xs=False: (None, None, None))
    monkeypatch.setattr(b, "_launch", lambda cfg, arch, *args: seen.update(cfg=cfg, mnk=args[-3:], out=args[6]))
    t = mod._parameters
    x = torch.randn(m_rows, 256).to(dtype)
    y = b.run_w4a4(x, t["qweight"], t["wscales"], t["smooth"], t["proj_down"], t["proj_up"], t["wcscale"], t["bias"],
                   b.extra_tensors(b.prepare(mod)))
    cfg = seen["cfg"]
    want_tile = (128, 128) if m_rows <= 128 else (256, 128)
    assert (cfg.mma_tile_m, cfg.mma_tile_n) == want_tile, (m_rows, cfg.name)
    assert cfg.out_dtype == str(dtype).removeprefix("torch.") and cfg.rank == 32, cfg.name
    assert seen["mnk"] == (m_rows, 192, 256) and seen["out"] is y and y.shape == (m_rows, 192) and y.dtype == dtype
