"""``quack_launch``: the warm launch (plan and weight views kept per layer) hands quack's runtime what
its epilogue frontend's own path hands it.

CPU: in a subprocess set up for compiling without a GPU (``quack_precompile._setup``), both quack
GEMMs (fast and exact, low-rank in the accumulator) are called twice; ``run_gemm_epi_plan`` is
replaced by a recorder in the frontend and in ``quack_launch``. The first call goes through the
frontend (compile, plan); the second must take the warm path with the same plan object, weight views
over the same bytes with the same shapes and strides, and this call's activations, output and
epilogue operands. A call with a different token count or a non-contiguous operand goes back to the
frontend.
"""

import json
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, sys
from pathlib import Path
from svdq_linear.backends.sm90 import quack_precompile as qp
qp._setup(Path(sys.argv[1]), Path(sys.argv[2]), 132)
import torch
import quack.epilogue.frontend as fe
from svdq_linear.backends.sm90 import quack_fast, quack_gemm, quack_launch

calls = []
def recorder(where):
    def rec(plan, A, B, D, C, epi, **kw):
        calls.append((where, plan, A, B, D, C, dict(epi)))
    return rec
fe.run_gemm_epi_plan = recorder("frontend")
quack_launch.run_gemm_epi_plan = recorder("warm")

def views(bundle):
    return [(tuple(t.shape), tuple(t.stride()), t.data_ptr()) for t in (bundle.blob, bundle.sf) if t is not None]

n, k, r = 256, 512, 32
q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
s = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
out = {}
for mode in ("fast", "exact"):
    if mode == "fast":
        w = quack_fast.prepare(q, s, torch.ones(n), None)
        run = lambda m, a, la: quack_fast.gemm(a, torch.ones(m), w, lr_acc=(up, la, seg))
        act = lambda m: torch.zeros(m, k).to(torch.float8_e4m3fn)
    else:
        w = quack_gemm.prepare(q, s, torch.ones(n), None)
        run = lambda m, a, la: quack_gemm.gemm(a, w, lr_acc=(up, la, seg))
        act = lambda m: torch.zeros(m, k, dtype=torch.bfloat16)
    up, seg = torch.zeros(n, r, dtype=torch.bfloat16), torch.zeros(n // 64, dtype=torch.int32)
    calls.clear()
    a1, la1 = act(4096), torch.zeros(4096, r, dtype=torch.bfloat16)
    run(4096, a1, la1)
    a2, la2 = act(4096), torch.ones(4096, r, dtype=torch.bfloat16)
    y2 = run(4096, a2, la2)
    run(4096, a2, torch.ones(4096, 2 * r, dtype=torch.bfloat16)[:, :r])  # la not contiguous: the frontend
    run(300, act(300), torch.zeros(300, r, dtype=torch.bfloat16))  # another token count: the frontend first
    (w1, p1, A1, B1, D1, C1, e1), (w2, p2, A2, B2, D2, C2, e2) = calls[:2]
    out[mode] = {
        "where": [c[0] for c in calls],
        "same_plan": p1 is p2,
        "same_views": views(A1) == views(A2),
        "b_is_call": B2 is a2 and B1 is a1,
        "d_is_out": D2 is y2 and C2 is None,
        "epi_keys": sorted(e1) == sorted(e2),
        "la_is_call": e2["la"] is la2,
        "warm_entries": len(w.warm),
    }
print(json.dumps(out))
"""


def test_warm_launch_hands_quack_what_the_frontend_does(tmp_path):
    pytest.importorskip("quack")
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "cache"), str(tmp_path / "dump")],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for mode in ("fast", "exact"):
        got = res[mode]
        assert got["where"] == ["frontend", "warm", "frontend", "frontend"], (mode, got)
        assert got["same_plan"] and got["same_views"] and got["b_is_call"] and got["d_is_out"], (mode, got)
        assert got["epi_keys"] and got["la_is_call"], (mode, got)
        assert got["warm_entries"] == 2, (mode, got)  # 4096 and 300 tokens; the strided call is not kept
