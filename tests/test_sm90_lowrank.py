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
        for rows in (16, 32, 64, 128, 256):
            for r in range(16, 257, 16):
                if r // 8 > nthreads:
                    continue
                per_row, rows_per_pass = lr.copy_split(rows, r, nthreads)
                assert per_row * 8 == r, (rows, r)
                assert per_row * rows_per_pass <= nthreads
                assert rows % rows_per_pass == 0, (rows, r, rows_per_pass)
                # no idle half: doubling the rows a pass would overrun the threads or the tile
                assert 2 * rows_per_pass * per_row > nthreads or 2 * rows_per_pass > rows
    with pytest.raises(ValueError):
        lr.copy_split(256, 40, 256)  # not a multiple of 16
    with pytest.raises(ValueError):
        lr.copy_split(96, 32, 256)  # not a power of two


def test_lowrank_in_acc_rank_rule_and_padding():
    pytest.importorskip("triton")
    import torch

    from svdq_linear.backends import sm90

    assert not sm90.lowrank_in_acc(0) and sm90.lowrank_in_acc(20) and sm90.lowrank_in_acc(sm90.LOWRANK_ACC_MAX_RANK)
    assert not sm90.lowrank_in_acc(sm90.LOWRANK_ACC_MAX_RANK + 1)
    t = torch.randn(5, 20)
    p = sm90._pad16(t)
    assert p.shape == (5, 32) and torch.equal(p[:, :20], t) and not p[:, 20:].any()
    assert sm90._pad16(p) is p


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
for mode, m, r in [("fast", 4096, 48), ("fast", 1, 48), ("exact", 300, 48), ("exact", 4096, 16)]:
    before = set(dump.glob("*.cubin"))
    lr = (torch.zeros(n, r, dtype=torch.bfloat16), torch.zeros(m, r, dtype=torch.bfloat16))
    if mode == "fast":
        w = quack_fast.prepare(q, s, torch.ones(n), None)
        quack_fast.gemm(torch.zeros(m, k).to(torch.float8_e4m3fn), torch.ones(m), w, launch=False, lr_acc=lr)
    else:
        w = quack_gemm.prepare(q, s, torch.ones(n), None)
        quack_gemm.gemm(torch.zeros(m, k, dtype=torch.bfloat16), w, launch=False, lr_acc=lr)
    new = sorted(set(dump.glob("*.cubin")) - before)
    stats = _sass_stats(new[0].read_bytes(), dump, f"{mode}_{m}_{r}", False) if new else None
    print(json.dumps({"mode": mode, "m": m, "r": r, "stats": stats}), flush=True)
"""


def test_lowrank_gemms_compile_for_sm90_with_bf16_wgmma(tmp_path):
    pytest.importorskip("quack")
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp_path / "cache"), str(tmp_path / "dump")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(recs) == 4
    for rec in recs:
        st = rec["stats"]
        assert st is not None, f"{rec}: no cubin"
        assert st["local_memory"] == 0 and st["stack_bytes"] == 0, rec
        if rec["mode"] == "fast":  # FP8 main loop, bf16 low-rank wgmmas
            assert st["qgmma"] > 0 and st["hgmma"] >= rec["r"] // 16, rec
        else:  # bf16 throughout: more HGMMA than the main loop's alone
            assert st["hgmma"] > 0, rec
