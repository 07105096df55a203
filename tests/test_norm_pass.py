"""The activation pass fused into the adaLN norm (``sm90.norm_pass``): on the CPU under Triton's interpreter,
on a GPU compiled (the same tests and thresholds: the kernel's row sums run in another order than PyTorch's, so
an element may round the other way now and then; a compiled kernel that contracts the modulation's two roundings
into one fma, as it did before ``norm_pass._round_kept``, moves a bf16 unit in about a quarter of the values and
fails them). The oracle is PyTorch: ``nvfp4.ada_norm`` (``F.layer_norm`` and the modulation in the
input's dtype), then the contract's reference quantizers (``nvfp4.quantize_nvfp4``, ``nvfp4.fast_act``) and a
float64 ``lora_act``."""

from __future__ import annotations

import pytest
import torch

from svdq_linear import nvfp4
from svdq_linear.backends.sm90 import norm_pass
from test_sm90_fast import _logical_k


def _case(m_per, batch, k, r, dtype, device="cpu", seed=0, mean=0.0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(batch, m_per, k, generator=g, device=device) * 3 + mean).to(dtype)
    x[..., 5] *= 40  # an outlier channel, as Flux's residual stream has
    shift = (torch.randn(batch, k, generator=g, device=device) * 0.5).to(dtype)
    scale = (torch.randn(batch, k, generator=g, device=device) * 0.5).to(dtype)
    smooth = (torch.rand(k, generator=g, device=device) * 4 + 0.25).float()
    pds = (torch.randn(k, r, generator=g, device=device) / k ** 0.5).bfloat16() if r else None
    return x, shift, scale, smooth, pds


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _blocks_agree(got: torch.Tensor, want: torch.Tensor, k: int) -> float:
    """The fraction of NVFP4 blocks (rows of 16) whose values are the same bits."""
    same = (got == want) | (got.isnan() & want.isnan())
    same = same.view(-1, k // 16, 16)
    return same.all(-1).float().mean().item()


# the split form at three splits (None: auto_split), and the pair form (its lora_act's split is its own)
FORMS = [("split", 1), ("split", 3), ("split", None), ("pair", None), ("rows", None)]


@pytest.mark.parametrize("form,split", FORMS)
@pytest.mark.parametrize("m_per,batch,k,r,dtype,mean", [(40, 1, 256, 16, torch.bfloat16, 0.0),
                                                        (17, 2, 384, 32, torch.bfloat16, 50.0),
                                                        (24, 2, 128, 0, torch.float16, 0.0)])
def test_exact_pass_on_the_norm_is_the_pass_on_the_written_input(m_per, batch, k, r, dtype, mean, form, split):
    x, shift, scale, smooth, pds = _case(m_per, batch, k, r, dtype, device=DEV, mean=mean)
    inp = nvfp4.ada_norm(x, shift, scale, 1e-6).reshape(-1, k)
    xq, lora = norm_pass.ada_norm_exact(x.reshape(-1, k), shift, scale, 1e-6, 1.0 / smooth, pds, tokens=m_per,
                                        out_dtype=torch.float32, split=split, form=form)
    packed, sc = nvfp4.quantize_nvfp4(nvfp4.smooth_input(inp, smooth))
    want = nvfp4.dequantize_nvfp4(packed, sc)
    # an element of the kernel's input may be the neighbour of PyTorch's (another order of the row sums)
    assert _blocks_agree(xq, want, k) >= 0.97
    err = (xq - want).abs().max().item()
    assert err <= 0.25 * want.abs().max().item()
    if r:
        ref = inp.to(torch.bfloat16).double() @ pds.double()
        torch.testing.assert_close(lora.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    else:
        assert lora is None


@pytest.mark.parametrize("form,split", FORMS)
@pytest.mark.parametrize("m_per,batch,k,r,gemm_order", [(40, 1, 256, 16, True), (9, 3, 384, 32, False)])
def test_fast_pass_on_the_norm_is_the_pass_on_the_written_input(m_per, batch, k, r, gemm_order, form, split):
    x, shift, scale, smooth, pds = _case(m_per, batch, k, r, torch.bfloat16, device=DEV, seed=1)
    inp = nvfp4.ada_norm(x, shift, scale, 1e-6).reshape(-1, k)
    a8, sa, la = norm_pass.ada_norm_fast(x.reshape(-1, k), shift, scale, 1e-6, 1.0 / smooth, pds, tokens=m_per,
                                         gemm_order=gemm_order, split=split, form=form)
    a8_ref, sa_ref = nvfp4.fast_act(nvfp4.smooth_input(inp, smooth))
    if gemm_order:  # position p of each 128-column tile holds logical column _logical_k(p)
        perm = torch.tensor([t * 128 + _logical_k(p) for t in range(k // 128) for p in range(128)], device=DEV)
        a8_ref = a8_ref[:, perm]
    # a row whose largest value moved by a rounding takes another sa, and every code of the row moves with it: the
    # codes are compared on the rows of the same sa (most rows)
    row_same = sa == sa_ref
    assert row_same.float().mean().item() >= 0.95
    same = (a8.view(torch.uint8) == a8_ref.view(torch.uint8))[row_same].float().mean().item()
    assert same >= 0.97, same
    # the row max of a rounding-neighbour input: one bf16 unit (2 ** -7 of it at most) and sa's own fp32 rounding
    torch.testing.assert_close(sa, sa_ref, rtol=2 ** -7 + 2 ** -20, atol=0)
    got = a8.float() * sa[:, None]
    assert (got - a8_ref.float() * sa_ref[:, None]).abs().max() <= 0.07 * (a8_ref.float() * sa_ref[:, None]).abs().max()
    ref = (inp.to(torch.bfloat16).double() @ pds.double()) / sa_ref[:, None].double()
    torch.testing.assert_close(la.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_apply_tiles_give_the_same_bits(monkeypatch):
    """``SVDQ_SM90_ADA_NORM_TILE`` picks the apply launch's rows x warps (``tuning.ada_norm_tile``); every tile it
    accepts writes the same ``xq`` / ``a8`` / ``sa`` bits (``lora_act``: its fp32 sums in another order), and a tile
    outside the list is refused by name rather than replaced by the default."""
    from svdq_linear.backends.sm90 import tuning

    x, shift, scale, smooth, pds = _case(70, 2, 512, 96, torch.bfloat16, device=DEV, seed=4)
    x2, inv = x.reshape(-1, 512), 1.0 / smooth
    got = {}
    for tile in tuning.ADA_NORM_TILES:
        monkeypatch.setenv(tuning.ENV_ADA_NORM_TILE, f"{tile[0]}x{tile[1]}")
        block_m, warps = tuning.ada_norm_tile()
        assert (block_m, warps) == tile
        kw = dict(tokens=70, block_m=block_m, num_warps=warps)
        ex = norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, **kw)
        fa = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, **kw)
        got[tile] = ex + fa
    first = got[tuning.ADA_NORM_TILES[0]]
    for tile, (xq, lora, a8, sa, la) in got.items():
        assert torch.equal(xq, first[0]) and torch.equal(a8.view(torch.uint8), first[2].view(torch.uint8)), tile
        assert torch.equal(sa, first[3]), tile
        torch.testing.assert_close(lora.float(), first[1].float(), rtol=2 ** -7, atol=1e-3)
        torch.testing.assert_close(la.float(), first[4].float(), rtol=2 ** -7, atol=1e-3)
    monkeypatch.delenv(tuning.ENV_ADA_NORM_TILE)
    assert tuning.ada_norm_tile() == (32, 4)
    for bad in ("64", "128x4", "32xfour", "64x4x3"):
        monkeypatch.setenv(tuning.ENV_ADA_NORM_TILE, bad)
        with pytest.raises(ValueError, match=tuning.ENV_ADA_NORM_TILE):
            tuning.ada_norm_tile()


@pytest.mark.parametrize("r", [96, 0])
def test_pair_form_writes_the_split_forms_bits(monkeypatch, r):
    """``form="pair"`` (the statistics, then ``lora_act`` and the pass in small tiles: ``_ada_lora_kernel``,
    ``_ada_pass_kernel``) writes the split form's ``xq``, ``a8`` (both k orders) and ``sa`` bits; its ``lora_act``
    sums in another order (64-row blocks over four K ranges, 64-column steps at this R), and its pass tiles
    straddle the batch elements (70 tokens in 8-row tiles). ``SVDQ_SM90_ADA_NORM_FORM`` names the form the backend
    takes (``tuning.ada_norm_form``), a value outside the list refused by name; ``pdl`` asks for the pair's PDL
    launch, refused with the split form and off a GPU of capability 9.0 or later."""
    from svdq_linear.backends.sm90 import tuning

    x, shift, scale, smooth, pds = _case(70, 2, 512, r, torch.bfloat16, device=DEV, seed=6, mean=3.0)
    x2, inv = x.reshape(-1, 512), 1.0 / smooth
    pds = pds if r else None
    for order in (True, False):
        want = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, tokens=70, split=3, gemm_order=order)
        got = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, tokens=70, form="pair", gemm_order=order)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
        if r:
            torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2 ** -7, atol=1e-3)
            assert not torch.equal(got[2], torch.zeros_like(got[2]))
        else:
            assert got[2] is None
    want = norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, tokens=70, split=3)
    got = norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, tokens=70, form="pair")
    assert torch.equal(got[0], want[0])
    if r:
        torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2 ** -7, atol=1e-3)
        # against an oracle of its own: lora_act of the written input (float64)
        ref = nvfp4.ada_norm(x, shift, scale, 1e-6).reshape(-1, 512).double() @ pds.double()
        torch.testing.assert_close(got[1].double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    with pytest.raises(ValueError, match="form must be one of"):
        norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, tokens=70, form="pairs")
    with pytest.raises(ValueError, match="form='pair'"):
        norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, tokens=70, pdl=True)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="programmatic dependent launch"):
            norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, tokens=70, form="pair", pdl=True)
    elif torch.cuda.get_device_capability()[0] >= 9:  # the PDL pair, eager: the same bits as one after the other
        pair = dict(tokens=70, form="pair", pdl=True)
        for a, b in zip(norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, **pair), got):
            assert (a is None and b is None) or torch.equal(a, b)
        want = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, tokens=70, form="pair")
        for a, b in zip(norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, **pair), want):
            assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    monkeypatch.delenv(tuning.ENV_ADA_NORM_FORM, raising=False)
    assert tuning.ada_norm_form() == "pair"
    monkeypatch.setenv(tuning.ENV_ADA_NORM_FORM, "Split")
    assert tuning.ada_norm_form() == "split"
    monkeypatch.setenv(tuning.ENV_ADA_NORM_FORM, "tiles")
    with pytest.raises(ValueError, match=tuning.ENV_ADA_NORM_FORM):
        tuning.ada_norm_form()


@pytest.mark.parametrize("tokens,r", [(70, 96), (35, 32), (70, 0)])
def test_rows_form_writes_the_pair_forms_bits_where_the_statistics_agree(tokens, r):
    """``form="rows"`` (whole rows a program: the statistics and the pass from one read of x, then ``lora_act``
    adding its own partials) sums a row's statistics in another order than the other forms. On rows whose sums are
    exact in any order (small integers, 256 columns: one chunk of the statistics kernel, a power-of-two count) the
    statistics agree, and so must every output: ``xq``, ``a8`` in both k orders, ``sa``, and ``lora`` / ``la``
    (the same partial sums, added in the same split order). 35 tokens: two-row programs straddle the batch
    elements (the modulation gathered a value at a time)."""
    k = 256
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-8, 9, (2, tokens, k), generator=g).to(torch.bfloat16).to(DEV)
    x[..., 5] *= 40
    _, shift, scale, smooth, pds = _case(tokens, 2, k, r, torch.bfloat16, device=DEV, seed=12)
    x2, inv = x.reshape(-1, k), 1.0 / smooth
    kw = dict(tokens=tokens)
    for order in (True, False):
        want = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, form="pair", gemm_order=order, **kw)
        got = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, form="rows", gemm_order=order, **kw)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
        assert (got[2] is None and want[2] is None and not r) or torch.equal(got[2], want[2])
    want = norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, form="pair", **kw)
    got = norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, form="rows", **kw)
    assert torch.equal(got[0], want[0])
    assert (got[1] is None and want[1] is None and not r) or torch.equal(got[1], want[1])
    if r:  # and lora_act is there: against float64 of the written input
        ref = nvfp4.ada_norm(x, shift, scale, 1e-6).reshape(-1, k).double() @ pds.double()
        torch.testing.assert_close(got[1].double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    # rows past the registers' kernels.ROW_MAX_K columns take the pair form (norm_pass._form_for)
    assert norm_pass._form_for("rows", norm_pass.ROW_MAX_K) == "rows"
    assert norm_pass._form_for("rows", norm_pass.ROW_MAX_K + 16) == "pair"
    assert norm_pass._form_for("split", 10 ** 6) == "split"


@pytest.mark.parametrize("form", ["split", "pair", "rows"])
def test_lora_partials_add_in_split_order(form):
    """``lora_act``'s K ranges add in split order, a fixed order for any timing: with the modulated input exactly
    ``shift`` (``1 + scale = 0``) and one nonzero product in each of four 128-column ranges, 2**24, 1, -2**24 and 0,
    float32 gives (2**24 + 1) - 2**24 = 0 in that order and 1 in the reverse one. Both modes (``la = 0 / sa``)."""
    k, r = 512, 16
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(0)).bfloat16().to(DEV)
    scale = torch.full((1, k), -1.0, dtype=torch.bfloat16, device=DEV)
    shift = torch.zeros(1, k, dtype=torch.bfloat16, device=DEV)
    shift[0, [0, 128, 256]] = 1.0
    pds = torch.zeros(k, r, dtype=torch.bfloat16, device=DEV)
    pds[0], pds[128], pds[256] = 2.0 ** 24, 1.0, -2.0 ** 24
    kw = dict(form=form, split=4 if form == "split" else None)  # the pair form's own split: four ranges here
    inv = torch.ones(k, device=DEV)
    _, lora = norm_pass.ada_norm_exact(x, shift, scale, 1e-6, inv, pds, **kw)
    _, sa, la = norm_pass.ada_norm_fast(x, shift, scale, 1e-6, inv, pds, gemm_order=False, **kw)
    assert torch.equal(sa, torch.full_like(sa, 1 / 448))
    assert torch.equal(lora, torch.zeros_like(lora)) and torch.equal(la, torch.zeros_like(la))


@pytest.mark.parametrize("form", ["split", "pair", "rows"])
def test_partial_k_ranges_read_no_row_of_proj_down_past_k(form):
    """K = 400 (whole NVFP4 blocks, not whole 64- or 128-column steps): the last step of the last K range runs past
    K, and ``pds`` is a view whose next rows hold Inf; a read of them would make ``lora_act`` NaN (0 * Inf), and x
    is a view whose next values are NaN. Against float64 ``lora_act`` of PyTorch's norm."""
    k, r = 400, 32
    x, shift, scale, smooth, pds = _case(20, 2, k, r, torch.bfloat16, device=DEV, seed=7)
    big = torch.full((k + 128, r), float("inf"), dtype=torch.bfloat16, device=DEV)
    big[:k] = pds
    xbig = torch.full((40, k + 16), float("nan"), dtype=torch.bfloat16, device=DEV)
    xbig[:, :k] = x.reshape(-1, k)
    ref = nvfp4.ada_norm(x, shift, scale, 1e-6).reshape(-1, k).double() @ pds.double()
    kw = dict(tokens=20, form=form, split=3 if form == "split" else None)
    _, lora = norm_pass.ada_norm_exact(xbig[:, :k], shift, scale, 1e-6, 1.0 / smooth, big[:k], **kw)
    _, sa, la = norm_pass.ada_norm_fast(xbig[:, :k], shift, scale, 1e-6, 1.0 / smooth, big[:k], gemm_order=False,
                                        **kw)
    for got in (lora.double(), la.double() * sa[:, None].double()):
        assert got.isfinite().all()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("form", ["split", "pair", "rows"])
def test_rows_of_one_batch_element_read_one_modulation_row(form):
    """Where every program's rows lie in one batch element (the tokens a multiple of its rows) the statistics' walk
    (fast mode) and the pair form's ``lora_act`` read one row of ``shift`` / ``scale`` for the whole tile
    (``UNIFORM``); elsewhere, and in the pass tiles, a row each. 128 rows as two batch elements of 64 tokens (the
    statistics' 4 rows and ``lora_act``'s 64 uniform) and as 64 elements of 2 tokens whose modulation rows repeat
    the two (neither uniform) are the same input, so every output is the same bits."""
    k, r = 256, 32
    x, shift, scale, smooth, pds = _case(64, 2, k, r, torch.bfloat16, device=DEV, seed=8, mean=2.0)
    x2, inv = x.reshape(-1, k), 1.0 / smooth
    outs = []
    for tokens in (64, 2):
        kw = dict(tokens=tokens, form=form)
        sh, sc = (t.repeat_interleave(64 // tokens, 0) for t in (shift, scale))
        outs.append(norm_pass.ada_norm_exact(x2, sh, sc, 1e-6, inv, pds, **kw)
                    + norm_pass.ada_norm_fast(x2, sh, sc, 1e-6, inv, pds, **kw))
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


class _Launches:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records the launch's keyword arguments."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *a, **kw: self.log.append((self.name, kw))


def test_launch_options_reach_the_kernels(monkeypatch):
    """What the forms launch, kernel by kernel (stand-ins record it): ``pdl=True`` launches the pair form's
    ``lora_act`` and pass with PDL (its compiled wait and trigger, and the launch option), never the statistics, and
    neither without a ``lora_act`` (R = 0: the pass has no grid before it to wait for); the rows form's ``lora_act``
    as the PDL dependent of its pass; the tile reaches the split form's apply launch in both modes."""
    log = []
    for name in ("_ada_stats_kernel", "_ada_apply_kernel", "_ada_lora_kernel", "_ada_pass_kernel", "_ada_rows_kernel"):
        monkeypatch.setattr(norm_pass, name, _Launches(name, log))
    monkeypatch.setattr(norm_pass, "_check_pdl", lambda device, what: None)  # (a GPU's check)
    x, shift, scale, smooth, pds = _case(16, 1, 256, 16, torch.bfloat16)
    for fn in (norm_pass.ada_norm_exact, norm_pass.ada_norm_fast):
        for r_pds, pdl in ((pds, True), (pds, False), (None, True)):
            log.clear()
            fn(x.reshape(-1, 256), shift, scale, 1e-6, 1.0 / smooth, r_pds, form="pair", pdl=pdl)
            want = [("_ada_stats_kernel", False)] + ([("_ada_lora_kernel", pdl)] if r_pds is not None else [])
            want.append(("_ada_pass_kernel", pdl and r_pds is not None))
            assert [(n, kw.get("PDL", False)) for n, kw in log] == want, (fn.__name__, pdl, log)
            assert [kw.get("launch_pdl", False) for _, kw in log] == [p for _, p in want]
            # the rows form: the pass from whole rows, releasing lora_act (a PDL dependent) with pdl; lora_act adds
            # its own partials (FINISH) and waits for the pass's statistics
            log.clear()
            fn(x.reshape(-1, 256), shift, scale, 1e-6, 1.0 / smooth, r_pds, form="rows", pdl=pdl)
            lora = r_pds is not None
            assert [(n, kw.get("RELEASE", kw.get("PDL"))) for n, kw in log] == [("_ada_rows_kernel", pdl and lora)] + (
                [("_ada_lora_kernel", pdl)] if lora else []), (fn.__name__, pdl, log)
            assert [kw.get("launch_pdl", False) for _, kw in log] == [False] + ([pdl] if lora else [])
            assert all(kw["FINISH"] and kw["FAST"] == (fn is norm_pass.ada_norm_fast) for n, kw in log
                       if n == "_ada_lora_kernel")
        log.clear()
        fn(x.reshape(-1, 256), shift, scale, 1e-6, 1.0 / smooth, pds, num_warps=8, block_m=64)
        assert [(n, kw["num_warps"], kw["BLOCK_M"]) for n, kw in log if n == "_ada_apply_kernel"] == [
            ("_ada_apply_kernel", 8, 64)]


def _stand_in_gemms(monkeypatch, sm90):
    """Both modes' GEMMs after the norm pass stood in by zeros of 8 columns (the quack fast module's, the exact
    ``Sm90Backend._exact_gemm``): what a backend test of the pass's launches needs of them."""

    class FakeQuackFast:
        weight = staticmethod(lambda ex: ex)
        gemm = staticmethod(lambda a8, sa, fw, out_dtype, lr_acc: torch.zeros(a8.shape[0], 8, dtype=out_dtype))

    monkeypatch.setattr(sm90, "_quack_fast_module", lambda: FakeQuackFast)
    monkeypatch.setattr(sm90.Sm90Backend, "_exact_gemm", lambda self, xq, lora, *a: torch.zeros(xq.shape[0], 8))


@pytest.mark.parametrize("fast", [False, True])
def test_backend_takes_the_form_tile_and_pdl_the_settings_name(monkeypatch, fast):
    """``Sm90Backend.run_w4a4_ada_norm`` hands the norm pass ``SVDQ_SM90_ADA_NORM_TILE``'s rows and warps,
    ``SVDQ_SM90_ADA_NORM_FORM``'s form, and PDL where the pair form meets a call that takes PDL pairs (``_pdl``);
    the pass and the GEMMs are stand-ins recording what they receive."""
    from svdq_linear.backends import sm90

    got = []

    def fake_pass(*a, **kw):
        got.append(kw)
        m, r = a[0].shape[0], a[5].shape[1]
        z = torch.zeros(m, r, dtype=torch.bfloat16)
        return (a[0], torch.ones(m), z) if fast else (a[0], z)

    monkeypatch.setattr(norm_pass, "ada_norm_fast" if fast else "ada_norm_exact", fake_pass)

    _stand_in_gemms(monkeypatch, sm90)
    be = sm90.Sm90Backend()
    m, k, r = 32, 128, 16
    x, shift, scale = torch.zeros(m, k, dtype=torch.bfloat16), torch.zeros(1, k, dtype=torch.bfloat16), None
    scale = torch.zeros(1, k, dtype=torch.bfloat16)
    pd = torch.zeros(k, r)
    ex = [torch.zeros(k, r, dtype=torch.bfloat16)] + [torch.zeros(1, 8)] * 6 + [torch.ones(k)]  # 7 + inv_smooth
    for tile, form, pdl_ok in (("64x8", "pair", True), ("32x8", "split", True), ("16x4", "pair", False),
                               ("32x4", "rows", True), ("32x4", "rows", False)):
        monkeypatch.setenv("SVDQ_SM90_ADA_NORM_TILE", tile)
        monkeypatch.setenv("SVDQ_SM90_ADA_NORM_FORM", form)
        monkeypatch.setattr(sm90, "_pdl", lambda x, kernels, auto=True, _ok=pdl_ok: _ok)
        got.clear()
        be.run_w4a4_ada_norm(x, shift, scale, 1e-6, m, None, None, None, pd, None, None, None, ex, fast)
        rows, warps = (int(v) for v in tile.split("x"))
        want = dict(block_m=rows, num_warps=warps, form=form, pdl=form != "split" and pdl_ok)
        assert len(got) == 1 and {key: got[0][key] for key in want} == want, (tile, form, got)


@pytest.mark.parametrize("config, nsplit", [("32,2,4,1", 2), ("16,8,2,2", 4), ("128,1,8,2", 1)])
def test_pair_form_lora_config_changes_only_the_summation_order(monkeypatch, config, nsplit):
    """``SVDQ_SM90_ADA_PAIR_LORA`` (``tuning.ada_pair_lora``) sets the pair form's ``lora_act`` launch: other block
    rows (tokens not a multiple of them: 70 in 32- and 128-row blocks, the gathered modulation), splits, warps and
    stages write the same ``xq`` / ``a8`` / ``sa`` bits and ``lora_act`` within float32 summation order of the
    default's, and the launch takes the rows, split, warps and stages the setting names (recorded: K = 1024 in
    128-column steps at R = 48 keeps at most four K ranges of two steps); malformed values are refused by name."""
    from svdq_linear.backends.sm90 import tuning

    x, shift, scale, smooth, pds = _case(70, 2, 1024, 48, torch.bfloat16, device=DEV, seed=8, mean=2.0)
    x2, inv = x.reshape(-1, 1024), 1.0 / smooth
    monkeypatch.delenv(tuning.ENV_ADA_PAIR_LORA, raising=False)
    assert tuning.ada_pair_lora() == tuning.LORA_ACT_CONFIG
    want_x = norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, tokens=70, form="pair")
    want_f = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, tokens=70, form="pair")
    monkeypatch.setenv(tuning.ENV_ADA_PAIR_LORA, config)
    bm, split, warps, stages = (int(v) for v in config.split(","))
    assert tuning.ada_pair_lora() == (bm, split, warps, stages)
    grids = []
    real = norm_pass._ada_lora_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                grids.append((grid, kw["BLOCK_M"], kw["num_warps"], kw["NUM_STAGES"]))
                return real[grid](*a, **kw)
            return launch

    monkeypatch.setattr(norm_pass, "_ada_lora_kernel", Spy())
    got_x = norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, tokens=70, form="pair")
    got_f = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, tokens=70, form="pair")
    assert grids == [((-(-140 // bm), nsplit), bm, warps, stages)] * 2, grids
    assert torch.equal(got_x[0], want_x[0])
    assert torch.equal(got_f[0].view(torch.uint8), want_f[0].view(torch.uint8)) and torch.equal(got_f[1], want_f[1])
    for g, w in ((got_x[1], want_x[1]), (got_f[2], want_f[2])):
        torch.testing.assert_close(g.float(), w.float(), rtol=2 ** -7, atol=1e-3)
    for bad in ("64,4,4", "48,4,4,3", "64,0,4,3", "64,4,3,3", "a,b,c,d"):
        monkeypatch.setenv(tuning.ENV_ADA_PAIR_LORA, bad)
        with pytest.raises(ValueError, match=tuning.ENV_ADA_PAIR_LORA):
            tuning.ada_pair_lora()


def _refusing(exc: Exception):
    """A stand-in for a Triton kernel: every launch (``kernel[grid](...)``) raises ``exc``."""
    class Launch:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                raise exc
            return launch
    return Launch()


def _out_of_resources():
    """Triton's refusal of a launch past the GPU's shared memory (``128,1,8,3`` at R = 48 raised it on the H100)."""
    from triton.runtime.errors import OutOfResources

    return OutOfResources(294912, 232448, "shared memory")


def test_pair_lora_setting_past_shared_memory_is_named(monkeypatch):
    """A ``SVDQ_SM90_ADA_PAIR_LORA`` launch that Triton refuses for want of resources (its ``OutOfResources``, as
    ``128,1,8,3`` at R = 48 raised on the H100) is a ValueError naming the setting, its value and the launch, chained
    from Triton's error (``kernels.setting_launch``); with the setting unset (the default config) Triton's error
    passes unchanged, and other errors pass through unchanged (stand-in launches)."""
    from triton.runtime.errors import OutOfResources

    from svdq_linear.backends.sm90 import tuning

    x, shift, scale, smooth, pds = _case(8, 1, 256, 16, torch.bfloat16, device=DEV, seed=9)
    x2, inv = x.reshape(-1, 256), 1.0 / smooth
    monkeypatch.setenv(tuning.ENV_ADA_PAIR_LORA, "128,1,8,3")
    oor = _out_of_resources()
    monkeypatch.setattr(norm_pass, "_ada_lora_kernel", _refusing(oor))
    with pytest.raises(ValueError, match=f"{tuning.ENV_ADA_PAIR_LORA}='128,1,8,3': .*block_m=128, stages=3.*R = 16"
                       ) as info:
        norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, tokens=8, form="pair")
    assert info.value.__cause__ is oor
    monkeypatch.delenv(tuning.ENV_ADA_PAIR_LORA)
    with pytest.raises(OutOfResources) as info:
        norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, tokens=8, form="pair")
    assert info.value is oor, "unset: Triton's own error"
    monkeypatch.setenv(tuning.ENV_ADA_PAIR_LORA, "128,1,8,3")
    monkeypatch.setattr(norm_pass, "_ada_lora_kernel", _refusing(RuntimeError("something else")))
    with pytest.raises(RuntimeError, match="something else"):
        norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, tokens=8, form="pair")


def test_rows_tile_setting_changes_no_bits_and_is_named(monkeypatch):
    """``SVDQ_SM90_ADA_ROWS_TILE`` sets the rows form's first launch (``tuning.ada_rows_tile``): every listed tile
    writes the same bits as the form's own (1 and 4 rows a program at 70 tokens straddle the batch elements where 2
    do not); a value outside the list is refused by name, and a tile Triton refuses for want of resources names the
    setting (``kernels.setting_launch``), its own tile Triton's error unchanged."""
    from triton.runtime.errors import OutOfResources

    from svdq_linear.backends.sm90 import tuning

    x, shift, scale, smooth, pds = _case(70, 2, 384, 32, torch.bfloat16, device=DEV, seed=13, mean=1.0)
    x2, inv = x.reshape(-1, 384), 1.0 / smooth
    kw = dict(tokens=70, form="rows")
    monkeypatch.delenv(tuning.ENV_ADA_ROWS_TILE, raising=False)
    assert tuning.ada_rows_tile() is None
    want_x = norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, **kw)
    want_f = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, **kw)
    for tile in ("1x4", "4X8"):
        monkeypatch.setenv(tuning.ENV_ADA_ROWS_TILE, tile)
        assert tuning.ada_rows_tile() == tuple(int(p) for p in tile.lower().split("x"))
        got_x = norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, **kw)
        got_f = norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got_x, want_x))
        assert torch.equal(got_f[0].view(torch.uint8), want_f[0].view(torch.uint8))
        assert torch.equal(got_f[1], want_f[1]) and torch.equal(got_f[2], want_f[2])
    for bad in ("3x8", "2", "rows"):
        monkeypatch.setenv(tuning.ENV_ADA_ROWS_TILE, bad)
        with pytest.raises(ValueError, match=f"{tuning.ENV_ADA_ROWS_TILE}='{bad}': expected one of"):
            norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, inv, pds, **kw)
    oor = _out_of_resources()
    monkeypatch.setattr(norm_pass, "_ada_rows_kernel", _refusing(oor))
    monkeypatch.setenv(tuning.ENV_ADA_ROWS_TILE, "4x8")
    with pytest.raises(ValueError, match=f"{tuning.ENV_ADA_ROWS_TILE}='4x8': the rows form's pass at 4 x 8"):
        norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, **kw)
    monkeypatch.delenv(tuning.ENV_ADA_ROWS_TILE)
    with pytest.raises(OutOfResources):
        norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, inv, pds, **kw)


@pytest.mark.parametrize("fast", [False, True])
def test_apply_tile_setting_past_the_gpus_resources_is_named(monkeypatch, fast):
    """A split-form apply launch at ``SVDQ_SM90_ADA_NORM_TILE``'s tile that Triton refuses for want of resources is a
    ValueError naming the setting, its value and the tile, chained from Triton's error: through the backend
    (``run_w4a4_ada_norm``, which hands the norm pass the setting's tile; the GEMMs stand-ins) and called directly at
    that tile. With the setting unset, or a direct call at a tile of its own, Triton's error passes unchanged.
    Stand-in apply launches; the statistics launch runs."""
    from triton.runtime.errors import OutOfResources

    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import tuning

    oor = _out_of_resources()
    monkeypatch.setattr(norm_pass, "_ada_apply_kernel", _refusing(oor))

    _stand_in_gemms(monkeypatch, sm90)
    be = sm90.Sm90Backend()
    m, k, r = 32, 128, 16
    x, shift, scale, smooth, pds = _case(m, 1, k, r, torch.bfloat16, seed=10)
    x2, inv = x.reshape(-1, k), 1.0 / smooth
    ex = [pds] + [torch.zeros(1, 8)] * 6 + [inv]  # the 7 tensors of the accumulator form + inv_smooth
    monkeypatch.setenv(tuning.ENV_ADA_NORM_FORM, "split")
    monkeypatch.setenv(tuning.ENV_ADA_NORM_TILE, "64x8")

    def backend_call():
        be.run_w4a4_ada_norm(x2, shift, scale, 1e-6, m, None, None, None, torch.zeros(k, r), None, None, None, ex, fast)

    def direct_call(block_m, warps):
        fn = norm_pass.ada_norm_fast if fast else norm_pass.ada_norm_exact
        fn(x2, shift, scale, 1e-6, inv, pds, block_m=block_m, num_warps=warps)

    for call in (backend_call, lambda: direct_call(64, 8)):
        with pytest.raises(ValueError, match=f"{tuning.ENV_ADA_NORM_TILE}='64x8': .*apply launch at 64 x 8.*R = {r}"
                           ) as info:
            call()
        assert info.value.__cause__ is oor
    with pytest.raises(OutOfResources) as info:
        direct_call(32, 4)
    assert info.value is oor, "a direct call at its own tile: Triton's own error"
    monkeypatch.delenv(tuning.ENV_ADA_NORM_TILE)
    for call in (backend_call, lambda: direct_call(32, 4)):
        with pytest.raises(OutOfResources) as info:
            call()
        assert info.value is oor, "unset: Triton's own error"


def test_norm_pass_is_on_unless_the_setting_says_0(monkeypatch):
    """``SVDQ_SM90_ADA_NORM``: unset or on ("1", "On") normalizes as it loads, off ("0", "off") writes the norm's
    output, anything else is an error naming the setting; ``Sm90Backend._reads_ada_norm`` follows it on a call that
    meets every other condition (a prepared fast layer at ``ADA_NORM_MIN_M`` tokens; stand-in prepared state)."""
    from types import SimpleNamespace

    from svdq_linear.backends import sm90
    from svdq_linear.backends.sm90 import tuning

    monkeypatch.delenv(tuning.ENV_ADA_NORM, raising=False)
    assert tuning.ada_norm_enabled()
    monkeypatch.setenv(tuning.ENV_ADA_NORM, "1")
    assert tuning.ada_norm_enabled()
    monkeypatch.setenv(tuning.ENV_ADA_NORM, " 0 ")
    assert not tuning.ada_norm_enabled()
    monkeypatch.setenv(tuning.ENV_ADA_NORM, "off")
    assert not tuning.ada_norm_enabled()
    monkeypatch.setenv(tuning.ENV_ADA_NORM, "On")
    assert tuning.ada_norm_enabled()
    monkeypatch.setenv(tuning.ENV_ADA_NORM, "2")
    with pytest.raises(ValueError, match=tuning.ENV_ADA_NORM):
        tuning.ada_norm_enabled()

    FastWeight = type("FastWeight", (), {})
    be = sm90.Sm90Backend()
    be.interpret = False
    m, k = tuning.ADA_NORM_MIN_M, 256
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    row = torch.zeros(1, k, dtype=torch.bfloat16)
    prepared = SimpleNamespace(quack=FastWeight(), lowrank_segments=None)
    module = SimpleNamespace(rank=0)
    for value, want in ((None, True), ("1", True), ("0", False)):
        if value is None:
            monkeypatch.delenv(tuning.ENV_ADA_NORM, raising=False)
        else:
            monkeypatch.setenv(tuning.ENV_ADA_NORM, value)
        assert be._reads_ada_norm(module, x, row, row, prepared, True) is want, value
    monkeypatch.delenv(tuning.ENV_ADA_NORM, raising=False)
    assert not be._reads_ada_norm(module, x[: m - 1], row, row, prepared, True)  # below ADA_NORM_MIN_M


def test_norm_pass_refuses_bad_operands():
    x, shift, scale, smooth, pds = _case(8, 2, 128, 16, torch.bfloat16, device=DEV)
    x2 = x.reshape(-1, 128)
    with pytest.raises(ValueError, match="whole batch elements"):
        norm_pass.ada_norm_exact(x2, shift, scale, 1e-6, 1.0 / smooth, pds, tokens=5)
    with pytest.raises(ValueError, match="shift must be"):
        norm_pass.ada_norm_exact(x2, shift[:1], scale, 1e-6, 1.0 / smooth, pds, tokens=8)
    with pytest.raises(ValueError, match="scale must be"):
        norm_pass.ada_norm_fast(x2, shift, scale.half(), 1e-6, 1.0 / smooth, pds, tokens=8)
    with pytest.raises(ValueError, match="inv_smooth"):
        norm_pass.ada_norm_fast(x2, shift, scale, 1e-6, smooth.double(), pds, tokens=8)
    with pytest.raises(ValueError, match="K % 16"):
        norm_pass.ada_norm_exact(x2[:, :120], shift[:, :120], scale[:, :120], 1e-6, 1.0 / smooth[:120], tokens=8)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["split", "pair", "rows"])
@pytest.mark.parametrize("fast", [False, True])
def test_gpu_norm_pass_at_a_flux_width(fast, form):
    """Every form at Flux's width against PyTorch's norm and the contract's quantizers; the pair and rows forms
    launched with PDL, eagerly (the forward test below captures them)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    kw = dict(form=form, pdl=form != "split")
    k = 3072
    x, shift, scale, smooth, pds = _case(1000, 2, k, 32, torch.bfloat16, device="cuda", seed=3, mean=5.0)
    inp = nvfp4.ada_norm(x, shift, scale, 1e-6).reshape(-1, k)
    xs = nvfp4.smooth_input(inp, smooth)
    if fast:
        a8, sa, la = norm_pass.ada_norm_fast(x.reshape(-1, k), shift, scale, 1e-6, 1.0 / smooth, pds, tokens=1000,
                                             gemm_order=False, **kw)
        a8_ref, sa_ref = nvfp4.fast_act(xs)
        assert (sa == sa_ref).float().mean().item() >= 0.95
        assert (a8.view(torch.uint8) == a8_ref.view(torch.uint8)).float().mean().item() >= 0.95
        # a row's largest value one bf16 unit off (at most 2 ** -7 of it) and sa's own fp32 division rounding
        torch.testing.assert_close(sa, sa_ref, rtol=2 ** -7 + 2 ** -20, atol=0)
        ref = (inp.double() @ pds.double()) / sa_ref[:, None].double()
        torch.testing.assert_close(la.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    else:
        xq, lora = norm_pass.ada_norm_exact(x.reshape(-1, k), shift, scale, 1e-6, 1.0 / smooth, pds, tokens=1000,
                                            **kw)
        packed, sc = nvfp4.quantize_nvfp4(xs)
        want = nvfp4.dequantize_nvfp4(packed, sc, torch.bfloat16)
        assert _blocks_agree(xq, want, k) >= 0.97 and (xq == want).float().mean().item() >= 0.99
        assert (xq.float() - want.float()).abs().max().item() <= 0.25 * want.float().abs().max().item()
        ref = inp.double() @ pds.double()
        torch.testing.assert_close(lora.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["split", "pair", "rows"])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gpu_forward_ada_norm_normalizes_as_it_loads(mode, form, monkeypatch):
    """``SVDQW4A4Linear.forward_ada_norm`` on an sm90 GPU from ``tuning.ADA_NORM_MIN_M`` tokens takes the norm pass
    (counted) in the form ``SVDQ_SM90_ADA_NORM_FORM`` names and gives the layer's output on the written input within
    bf16 roundings, eager and replayed from a CUDA graph (the pair and rows forms' PDL launch); under
    ``SVDQ_SM90_ADA_NORM=0`` it writes the input (the same bits as the plain call); unset is on."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    pytest.importorskip("quack")
    from svdq_linear import SVDQW4A4Linear

    k, n = 3072, 1024
    torch.manual_seed(4)
    layer = SVDQW4A4Linear.from_linear(torch.nn.Linear(k, n).cuda(), rank=32).bfloat16().set_mode(mode)
    x, shift, scale, _, _ = _case(1152, 2, k, 0, torch.bfloat16, device="cuda", seed=5)
    monkeypatch.delenv("SVDQ_SM90_ADA_NORM", raising=False)  # on by default
    monkeypatch.setenv("SVDQ_SM90_ADA_NORM_FORM", form)
    calls = []
    real = {f: getattr(norm_pass, f) for f in ("ada_norm_exact", "ada_norm_fast")}
    for f, fn in real.items():
        monkeypatch.setattr(norm_pass, f, lambda *a, _fn=fn, _f=f, **kw: calls.append((_f, kw["form"], kw["pdl"]))
                            or _fn(*a, **kw))
    name = "ada_norm_fast" if mode == "fast" else "ada_norm_exact"
    with torch.no_grad():
        want = layer(nvfp4.ada_norm(x, shift, scale, 1e-6))
        got = layer.forward_ada_norm(x, shift, scale, 1e-6)
        assert calls == [(name, form, False)]
        layer.forward_ada_norm(x, shift, scale, 1e-6)  # warm, then captured: the pair form's PDL launch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = layer.forward_ada_norm(x, shift, scale, 1e-6)
        graph.replay()
        torch.cuda.synchronize()
        assert calls[-1] == (name, form, form != "split")
        assert torch.equal(replayed, got)
        err = (got.float() - want.float()).abs()
        assert err.max().item() <= 0.05 * want.float().abs().max().item()
        assert err.mean().item() <= 1e-3 * want.float().abs().mean().item() + 1e-6
        monkeypatch.setenv("SVDQ_SM90_ADA_NORM", "0")
        n_calls = len(calls)
        assert torch.equal(layer.forward_ada_norm(x, shift, scale, 1e-6), want) and len(calls) == n_calls
        with pytest.raises(ValueError, match="shift must be"):
            layer.forward_ada_norm(x, shift[:1], scale, 1e-6)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_forward_ada_norm_is_the_layer_on_the_written_input_on_the_reference(mode):
    from svdq_linear import SVDQW4A4Linear

    torch.manual_seed(2)
    layer = SVDQW4A4Linear.from_linear(torch.nn.Linear(128, 64), rank=8).bfloat16().set_mode(mode)
    x, shift, scale, _, _ = _case(6, 2, 128, 0, torch.bfloat16)
    with torch.no_grad():
        want = layer(nvfp4.ada_norm(x, shift, scale, 1e-6))
        assert torch.equal(layer.forward_ada_norm(x, shift, scale, 1e-6), want)
    with pytest.raises(ValueError, match=r"expected x \[B, S, 128\]"):
        layer.forward_ada_norm(x[0], shift, scale, 1e-6)
    with pytest.raises(ValueError, match="scale must be"):
        layer.forward_ada_norm(x, shift, scale.float(), 1e-6)


@pytest.mark.parametrize("fast", [False, True])
def test_ada_norm_op_passes_opcheck(fast):
    """The op every backend's ``forward_ada_norm`` goes through when traced: its fake and registration (the
    reference backend's run: the input written, then the layer)."""
    from svdq_linear import SVDQW4A4Linear, backends

    torch.manual_seed(3)
    m = SVDQW4A4Linear.from_linear(torch.nn.Linear(128, 48), rank=8).bfloat16()
    x, shift, scale, _, _ = _case(5, 2, 128, 0, torch.bfloat16)
    args = (x.reshape(-1, 128), shift, scale, 1e-6, 5, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up,
            m.wcscale, m.bias, [], fast, "reference")
    y = backends.w4a4_ada_norm_linear(*args)
    assert y.shape == (10, 48)
    m.set_mode("fast" if fast else "exact")
    with torch.no_grad():
        assert torch.equal(y, m(nvfp4.ada_norm(x, shift, scale, 1e-6)).reshape(10, 48))
    torch.library.opcheck(backends.w4a4_ada_norm_linear, args,
                          test_utils=("test_autograd_registration", "test_faketensor"))
