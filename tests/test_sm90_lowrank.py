"""The low-rank MMA in quack's accumulator (``quack_lowrank``): its host logic on the CPU, its kernels
compiled for sm_90a on the CPU (bf16 wgmma beside the main loop's, no local memory), and (GPU) the
outputs of both modes against the contract, which ``test_conformance`` and ``test_sm90_fast`` check."""

import json
import subprocess
import sys

import pytest


def test_copy_split_covers_every_tile_exactly():
    lr = pytest.importorskip("svdq_linear.backends.sm90.quack_lowrank")
    for nthreads in (128, 256):
        for rows in (16, 32, 64, 128, 192, 256):
            for r in range(16, 257, 16):
                if r // 8 > nthreads:
                    continue
                per_row, rows_per_pass = lr.copy_split(rows, r, nthreads)
                assert per_row * 8 == r, (rows, r)
                assert per_row * rows_per_pass <= nthreads
                assert rows % rows_per_pass == 0, (rows, r, rows_per_pass)
                # no idle half: doubling the rows a pass would overrun the threads or stop dividing the tile
                assert 2 * rows_per_pass * per_row > nthreads or rows % (2 * rows_per_pass)
    with pytest.raises(ValueError):
        lr.copy_split(256, 40, 256)  # not a multiple of 16
    with pytest.raises(ValueError):
        lr.copy_split(100, 32, 256)  # not a multiple of 8


def test_packed_runs_give_every_group_its_window():
    """``pack_runs``' two words read back (``run_window``, the kernel's arithmetic) each 64-row group's window
    for any table of at most four runs; longer tables, windows past 15 and 1023 groups are refused."""
    lr = pytest.importorskip("svdq_linear.backends.sm90.quack_lowrank")
    import random

    rng = random.Random(0)
    for _ in range(300):
        runs = rng.randint(1, lr.MAX_RUNS)
        lengths = [rng.randint(1, 40) for _ in range(runs)]
        windows = [rng.randint(0, 15) for _ in range(runs)]
        for i in range(1, runs):  # neighbouring runs differ (else they are one run)
            while windows[i] == windows[i - 1]:
                windows[i] = rng.randint(0, 15)
        table = [w for w, n in zip(windows, lengths) for _ in range(n)][:1022]
        lb, lw = lr.pack_runs(table)
        assert 0 <= lb < 2**31 and 0 <= lw < 2**31  # Int32 kernel parameters
        assert [lr.run_window(lb, lw, g) for g in range(len(table))] == table, (lengths, windows)
    assert lr.pack_runs([0, 1, 2, 3, 0]) is None  # five runs
    assert lr.pack_runs([0, 16]) is None and lr.pack_runs([-1]) is None  # windows outside 0..15
    assert lr.pack_runs([0] * 1023) is None and lr.pack_runs([0] * 1022) is not None
    assert lr.pack_runs([]) is None
    # fused q/k/v of 3072 rows a part, and a single block's q, k, v and mlp (3072 x 3 + 12288)
    qkv = [0] * 48 + [1] * 48 + [2] * 48
    single = [0] * 48 + [1] * 48 + [2] * 48 + [3] * 192
    for t in (qkv, single):
        words = lr.pack_runs(t)
        assert [lr.run_window(*words, g) for g in range(len(t))] == t


def test_launch_takes_a_registered_tables_words_and_any_other_table_as_it_is(monkeypatch):
    lr = pytest.importorskip("svdq_linear.backends.sm90.quack_lowrank")
    import gc

    import torch

    up, la = torch.zeros(256, 32, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    seg = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    assert lr.lowrank_args((up, la, seg)) == {"lu": up, "la": la, "ls": seg}  # not registered: the table
    words = lr.register_runs(seg)
    assert words == lr.pack_runs([0, 0, 1, 1])
    args = lr.lowrank_args((up, la, seg))
    assert "ls" not in args and (args["lb"], args["lw"]) == words and args["lu"] is up and args["la"] is la
    assert "ls" in lr.lowrank_args((up, la, seg.clone()))  # the registry knows the very tensor only
    assert lr.lowrank_args((up, la)) == {"lu": up, "la": la}  # one window: nothing to pass
    monkeypatch.setenv(lr.ENV_RUNS, "0")
    assert lr.lowrank_args((up, la, seg))["ls"] is seg
    monkeypatch.delenv(lr.ENV_RUNS)
    assert lr.register_runs(torch.arange(8, dtype=torch.int32)) is None  # eight runs: not registered
    key = id(seg)
    del seg, args
    gc.collect()
    assert key not in lr._RUNS  # the entry goes with its table


def _fused(k, widths, full=False):
    """``fuse.concat_w4a4`` of rank-32 parts ``k -> n`` for ``n`` in ``widths`` that share one smoothing factor (as
    the parts of a fused linear do), each with a random ``proj_up`` (``full``: also ``proj_down`` and a bias)."""
    import torch

    from svdq_linear import SVDQW4A4Linear
    from svdq_linear.fuse import concat_w4a4

    smooth = torch.rand(k) + 0.5
    parts = []
    for n in widths:
        p = SVDQW4A4Linear(k, n, rank=32)
        with torch.no_grad():
            p.proj_up.normal_()
            p.smooth.copy_(smooth)
            if full:
                p.proj_down.normal_()
                p.bias = torch.nn.Parameter(torch.randn(n))
        parts.append(p)
    return concat_w4a4(parts)


def _block_diagonal(rows_ranks, seed=0):
    """A fused linear's proj_up: segment i has rows_ranks[i][0] rows using its own rows_ranks[i][1] columns."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n, r = sum(a for a, _ in rows_ranks), sum(b for _, b in rows_ranks)
    up = torch.zeros(n, r)
    i = c = 0
    for a, b in rows_ranks:
        up[i:i + a, c:c + b] = torch.randn(a, b, generator=g)
        i, c = i + a, c + b
    return up


def test_plan_puts_each_weight_tile_in_one_window():
    pytest.importorskip("triton")
    import torch

    from svdq_linear.backends import sm90

    def plan(up):
        p = sm90.plan_lowrank(up)
        return None if p is None else (p[0], p[1].tolist())

    dense = torch.randn(256, 32)
    assert plan(dense) == (32, [0, 0, 0, 0])
    assert plan(torch.randn(256, 20)) == (32, [0] * 4)  # padded to a whole window
    assert plan(torch.randn(256, 64)) == (64, [0] * 4)
    assert plan(torch.randn(256, 80)) is None  # wider than LOWRANK_MAX_WINDOW: the tile path
    assert plan(torch.zeros(256, 32)) == (16, [0] * 4)
    # fused q/k/v of rank 32 (R = 96): each segment reads its own 32 columns
    assert plan(_block_diagonal([(128, 32)] * 3)) == (32, [0, 0, 1, 1, 2, 2])
    # a single block's q, k, v, mlp at rank 8: two segments share each 16-wide window
    assert plan(_block_diagonal([(128, 8)] * 3 + [(256, 8)])) == (16, [0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    # segments of 64 rows inside one 128-row tile: the tile's window must hold both
    assert plan(_block_diagonal([(64, 32), (64, 32)])) == (64, [0, 0])
    assert plan(_block_diagonal([(64, 48), (64, 48)])) is None
    # an unused half of a tile takes its partner's window
    up = _block_diagonal([(128, 32), (128, 32)])
    up[192:] = 0
    assert plan(up) == (32, [0, 0, 1, 1])


def test_prepared_windows_give_the_dense_low_rank_product():
    """What the kernel sums, W columns a row from its segment's window, equals lora_act @ (proj_up /
    c)^T: the dropped columns are zero."""
    pytest.importorskip("svdq_linear.backends.sm90.quack_fast")
    import torch

    from svdq_linear import SVDQW4A4Linear
    from svdq_linear.backends.sm90 import Sm90Backend

    n, k = 384, 256
    up = _block_diagonal([(128, 16), (128, 16), (128, 16)], seed=3)
    m = SVDQW4A4Linear(k, n, rank=48)
    with torch.no_grad():
        m.proj_up.copy_(up)
        m.proj_down.copy_(torch.randn(k, 48) / k**0.5)
        m.smooth.copy_(torch.rand(k) + 0.5)
        m.wcscale.copy_(torch.rand(n) + 0.5)
    m.set_mode("fast")
    prep = Sm90Backend().prepare(m, torch.device("cpu"))
    w = prep.proj_up_bf16.shape[1]
    assert w == 16 and prep.lowrank_segments.tolist() == [0, 0, 1, 1, 2, 2]
    x = torch.randn(5, k)
    la = x @ prep.proj_down_smoothed.float()  # [M, S * W]
    rows = torch.arange(n)
    cols = (prep.lowrank_segments.long()[rows // 64] * w)[:, None] + torch.arange(w)
    got = torch.einsum("nw,mnw->mn", prep.proj_up_bf16.float(), la[:, cols])
    upc = up / prep.quack.cs.reshape(-1, 1)
    want = (x / m.smooth) @ m.proj_down @ upc.T
    bound = ((x / m.smooth).abs() @ m.proj_down.abs() @ upc.abs().T) * 2**-6  # bf16 operands: 3 roundings
    assert ((got - want).abs() <= bound).all(), f"max err/bound {((got - want).abs() / bound).max():.3g}"
    assert Sm90Backend().extra_tensors(prep)[2] is prep.lowrank_segments  # the op's third low-rank tensor


@pytest.mark.parametrize("widths", [(128, 128, 128), (128, 128, 128, 256)])
def test_fused_linears_take_the_accumulator_path_one_window_a_part(widths):
    """``fuse.concat_w4a4`` (what ``fuse_qkv_projections`` builds) stacks the parts' branches along R
    with a block-diagonal proj_up: the fused layer keeps each part's rank per tile, not their sum."""
    pytest.importorskip("svdq_linear.backends.sm90.quack_fast")
    import torch

    from svdq_linear.backends.sm90 import Sm90Backend

    fused = _fused(256, widths).set_mode("fast")
    assert fused.rank == 32 * len(widths)
    prep = Sm90Backend().prepare(fused, torch.device("cpu"))
    want = [i for i, n in enumerate(widths) for _ in range(n // 64)]
    assert prep.proj_up_bf16.shape[1] == 32 and prep.lowrank_segments.tolist() == want
    assert prep.proj_down_smoothed.shape == (256, 32 * len(widths))
    # the preparation registers the table's runs: the quack launch passes them as two words
    from svdq_linear.backends.sm90 import quack_lowrank

    assert quack_lowrank.runs_for(prep.lowrank_segments) == quack_lowrank.pack_runs(want)


_COMPILE = r"""
import json, sys
from pathlib import Path
from svdq_linear.backends.sm90 import quack_precompile as qp
cache, dump = Path(sys.argv[1]), Path(sys.argv[2])
dump.mkdir(parents=True, exist_ok=True)
qp._setup(cache, dump, 132)
import torch
from svdq_linear.backends.sm90 import quack_fast, quack_gemm
from svdq_linear.precompile import _sass_stats
n, k = 256, 512
q = torch.zeros(n, k // 2, dtype=torch.uint8)
s = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
import os
from svdq_linear.backends.sm90 import quack_lowrank
cases = [("fast", 4096, 48, "table"), ("fast", 1, 48, "table"), ("exact", 300, 48, "table"),
         ("exact", 4096, 16, "table"), ("exact", 4096, 16, "words"), ("fast", 4096, 48, "words"),
         ("exact", 4096, 16, "at_epilogue"), ("exact", 4096, 16, "no_lowrank"), ("fast", 4096, 16, "no_lowrank")]
import re

def waits_before_reads(sass):
    # after the last tensor-core MMA (the epilogue): the cp.async wait and a barrier come before the first
    # shared-memory load that executes (the never-taken "@!PT LDS" lines are padding)
    tail = re.split(r"\b[HQ]GMMA\.", sass)[-1]
    lds = [m.start() for m in re.finditer(r"^(?!.*@!PT).*\bLDS\b", tail, re.M)]
    dep, bar = tail.find("DEPBAR.LE SB0"), tail.find("BAR.SYNC")
    return bool(lds) and 0 <= dep < lds[0] and 0 <= bar < lds[0]

for mode, m, r, form in cases:
    before = {p: p.stat().st_mtime_ns for p in dump.glob("*.cubin")}  # (a variant may rewrite a name)
    # three windows of r (a fused q/k/v): la is 3 r wide, the MMA r
    lr = (torch.zeros(n, r, dtype=torch.bfloat16), torch.zeros(m, 3 * r, dtype=torch.bfloat16),
          torch.tensor([0, 1, 2, 2], dtype=torch.int32))
    if form == "words":
        quack_lowrank.register_runs(lr[2])
    os.environ[quack_lowrank.ENV_PREFETCH] = "0" if form == "at_epilogue" else "1"
    if form == "no_lowrank":
        lr = None
    if mode == "fast":
        w = quack_fast.prepare(q, s, torch.ones(n), None)
        quack_fast.gemm(torch.zeros(m, k).to(torch.float8_e4m3fn), torch.ones(m), w, launch=False, lr_acc=lr)
    else:
        w = quack_gemm.prepare(q, s, torch.ones(n), None)
        quack_gemm.gemm(torch.zeros(m, k, dtype=torch.bfloat16), w, launch=False, lr_acc=lr)
    new = sorted(p for p in dump.glob("*.cubin") if before.get(p) != p.stat().st_mtime_ns)
    stats = _sass_stats(new[0].read_bytes(), dump, f"{mode}_{m}_{r}_{form}", True) if new else None
    if stats is not None and stats.get("sass"):
        stats["waits_before_reads"] = waits_before_reads(Path(stats.pop("sass")).read_text())
    print(json.dumps({"mode": mode, "m": m, "r": r, "form": form, "stats": stats}), flush=True)
"""


def test_lowrank_gemms_compile_for_sm90_with_bf16_wgmma(tmp_path):
    pytest.importorskip("quack")
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path / "cache"), str(tmp_path / "dump")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(recs) == 9
    by = {(rec["mode"], rec["m"], rec["form"]): rec["stats"] for rec in recs}
    for mode in ("exact", "fast"):
        # no low-rank MMA (whose wait covered the vectors' copies): the epilogue waits for them itself, and the
        # copies still lie at the tile's start
        st = by[(mode, 4096, "no_lowrank")]
        assert st["waits_before_reads"] and st["cp_async_after_mma"] == 0, (mode, st)
    for mode in ("exact", "fast"):
        # the segment table's window: one global load at every tile's start, none from the packed words
        assert by[(mode, 4096, "words")]["global_loads"] < by[(mode, 4096, "table")]["global_loads"], by
    # the per-row vectors: copied at the tile's start (beside the low-rank operands), not after the last MMA
    assert by[("exact", 4096, "table")]["cp_async_after_mma"] == 0, by
    assert by[("exact", 4096, "at_epilogue")]["cp_async_after_mma"] > 0, by
    for rec in recs:
        st = rec["stats"]
        assert st is not None, f"{rec}: no cubin"
        if rec["form"] == "no_lowrank":
            continue
        assert st["local_memory"] == 0 and st["stack_bytes"] == 0, rec
        # quack's producer waits for the grid before (PDL) before its first load, and so do the math warps before
        # they prefetch la (the activation pass's output) with cp.async at each tile's start: two waits are laid
        # out before the first LDGSTS (the producer's code comes first)
        assert st["grid_waits_before_cp_async"] >= 2, rec
        if rec["mode"] == "fast":  # FP8 main loop, bf16 low-rank wgmmas
            assert st["qgmma"] > 0 and st["hgmma"] >= rec["r"] // 16, rec
        else:  # bf16 throughout: more HGMMA than the main loop's alone
            assert st["hgmma"] > 0, rec


def test_plan_lowrank_plans_in_the_eager_preparation_that_runs_at_trace_time(monkeypatch):
    # Traced, the plan declines (no data-dependent choice in a graph); the preparation that
    # backends.prepare_before_trace runs eagerly at trace time plans as an eager call does.
    pytest.importorskip("triton")
    import torch

    from svdq_linear import backends
    from svdq_linear.backends import sm90

    up = torch.randn(256, 32)
    assert sm90.plan_lowrank(up) is not None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert sm90.plan_lowrank(up) is None
    monkeypatch.setattr(backends, "_EAGER_IN_TRACE", True)
    assert sm90.plan_lowrank(up) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_gpu_low_rank_window_from_words_and_vectors_at_the_tile_start_give_the_old_bits(mode, monkeypatch):
    """On an sm90 GPU: a single block's fused input (four parts, four runs of the segment table, 4 x 32 low-rank
    columns) through the kernel's window arithmetic on the packed words and the prefetched epilogue vectors gives
    the bits of the table's load and the vectors loaded at the epilogue (``SVDQ_SM90_LR_RUNS=0``,
    ``SVDQ_SM90_EPI_PREFETCH=0``), at a token count of whole tiles and one that is not."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm90 GPU")
    lr = pytest.importorskip("svdq_linear.backends.sm90.quack_lowrank")
    from svdq_linear.backends.sm90 import Sm90Backend

    torch.manual_seed(11)
    k = 512
    fused = _fused(k, (256, 256, 256, 1024), full=True).set_mode(mode).cuda().bfloat16()
    prep = Sm90Backend().prepare(fused, torch.device("cuda"))
    assert lr.runs_for(prep.lowrank_segments) is not None  # the words path is the one taken
    for tokens in (4096, 1000):
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        new = fused(x)
        monkeypatch.setenv(lr.ENV_RUNS, "0")
        monkeypatch.setenv(lr.ENV_PREFETCH, "0")
        old = fused(x)
        monkeypatch.delenv(lr.ENV_RUNS)
        monkeypatch.delenv(lr.ENV_PREFETCH)
        assert torch.equal(new, old), (tokens, (new.float() - old.float()).abs().max().item())
        assert new.abs().amax() > 0
