"""``quack_launch``: the warm launch (plan and weight views kept per layer) hands quack's runtime what
its epilogue frontend's own path hands it.

CPU: in a subprocess set up for compiling without a GPU (``quack_precompile._setup``), both quack
GEMMs (fast and exact, low-rank in the accumulator) are called twice; ``run_gemm_epi_plan`` is
replaced by a recorder in the frontend and in ``quack_launch``. The first call goes through the
frontend (compile, plan); the second must take the warm path with the same plan object, weight views
over the same bytes with the same shapes and strides, and this call's activations, output and
epilogue operands. A call with a different token count (once), a non-contiguous operand or a weight
that is not the registered prepared one goes through the frontend.
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
from svdq_linear.backends.sm90 import quack_fast, quack_gemm, quack_launch, quack_lowrank

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
    words = quack_lowrank.register_runs(seg)  # as the preparation does: two int kernel parameters, no table
    calls.clear()
    a1, la1 = act(4096), torch.zeros(4096, r, dtype=torch.bfloat16)
    run(4096, a1, la1)
    a2, la2 = act(4096), torch.ones(4096, r, dtype=torch.bfloat16)
    y2 = run(4096, a2, la2)
    run(4096, a2, torch.ones(4096, 2 * r, dtype=torch.bfloat16)[:, :r])  # la not contiguous: the frontend
    plans = len(quack_launch._PLANS)
    run(300, act(300), torch.zeros(300, r, dtype=torch.bfloat16))  # another token count: the frontend first
    run(300, act(300), torch.zeros(300, r, dtype=torch.bfloat16))  # then warm
    new_plans = len(quack_launch._PLANS) - plans
    copy = (quack_fast if mode == "fast" else quack_gemm).weight([t.clone() for t in w.tensors()])
    unregistered = copy.warm is None
    w_saved, w = w, copy  # the lambdas read w: two calls through a weight that is not the prepared one
    run(4096, a2, la2)
    run(4096, a2, la2)
    w = w_saved
    (w1, p1, A1, B1, D1, C1, e1), (w2, p2, A2, B2, D2, C2, e2) = calls[:2]
    out[mode] = {
        "where": [c[0] for c in calls],
        "same_plan": p1 is p2,
        "same_views": views(A1) == views(A2),
        "b_is_call": B2 is a2 and B1 is a1,
        "d_is_out": D2 is y2 and C2 is None,
        "epi_keys": sorted(e1) == sorted(e2),
        "la_is_call": e2["la"] is la2,
        "words": [e2.get("lb"), e2.get("lw")] == list(words) and "ls" not in e2,
        "tiles": sorted(w.warm),
        "new_plans": new_plans,
        "unregistered": unregistered,
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
        assert got["where"] == ["frontend", "warm", "frontend", "frontend", "warm", "frontend", "frontend"], (mode, got)
        assert got["same_plan"] and got["same_views"] and got["b_is_call"] and got["d_is_out"], (mode, got)
        assert got["epi_keys"] and got["la_is_call"] and got["words"], (mode, got)
        assert got["new_plans"] == 1 and got["unregistered"], (mode, got)
        assert got["tiles"] and all(isinstance(t, int) for t in got["tiles"]), (mode, got)  # views per tile


def test_preparation_traced_into_a_graph_compiles():
    """A preparation that torch.compile traces (a layer not prepared before the trace) builds its weight
    object without the launch registry, which dynamo cannot trace."""
    pytest.importorskip("quack")
    import torch

    from svdq_linear.backends.sm90 import quack_gemm, quack_launch

    # (the fast mode's preparation checks an invariant on the data, which a full graph cannot hold)
    q = torch.randint(0, 256, (128, 128), dtype=torch.uint8)
    s = torch.ones(128, 16).to(torch.float8_e4m3fn)
    torch._dynamo.reset()
    f = torch.compile(lambda q, s, wc: quack_gemm.prepare(q, s, wc, None).blob.float().sum(), fullgraph=True)
    want = quack_gemm.prepare(q, s, torch.ones(128), None)
    assert f(q, s, torch.ones(128)) == want.blob.float().sum()
    assert quack_launch._WEIGHTS.get(id(want.blob)) is want  # eager preparations still register
    torch._dynamo.reset()


_WORDS = r"""
import json, sys
from pathlib import Path
from svdq_linear.backends.sm90 import quack_precompile as qp
qp._setup(Path(sys.argv[1]), Path(sys.argv[2]), 132)
import torch
import quack.gemm_runtime.host as host
from svdq_linear.backends.sm90 import quack_fast, quack_gemm, quack_lowrank

got = []
def launch(plan, A, B, D, C, epi_args, *a, **k):  # quack's runtime launch: what the kernel would receive
    fields = epi_args._asdict()
    got.append({"plan": id(plan), "words": [int(fields[f]) for f in ("lb", "lw")],
                "table": fields.get("ls") is not None})
host.launch_gemm = launch
n, k, r, m = 256, 512, 32, 4096
q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
s = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
tables = [torch.tensor(t, dtype=torch.int32) for t in ([0, 0, 0, 0], [0, 1, 2, 2], [0, 0, 1, 1])]
words = [list(quack_lowrank.register_runs(t)) for t in tables]
up, la = torch.zeros(n, r, dtype=torch.bfloat16), torch.zeros(m, 3 * r, dtype=torch.bfloat16)
out = {}
for mode in ("exact", "fast"):
    got.clear()
    if mode == "exact":
        ws = [quack_gemm.prepare(q, s, torch.ones(n), None) for _ in tables]
        run = lambda w, t: quack_gemm.gemm(torch.zeros(m, k, dtype=torch.bfloat16), w, lr_acc=(up, la, t))
    else:
        ws = [quack_fast.prepare(q, s, torch.ones(n), None) for _ in tables]
        run = lambda w, t: quack_fast.gemm(torch.zeros(m, k).to(torch.float8_e4m3fn), torch.ones(m), w,
                                           lr_acc=(up, la, t))
    for _ in range(2):  # the frontend's path, then the warm one
        for w, t in zip(ws, tables):
            run(w, t)
    out[mode] = list(got)
print(json.dumps({"words": words, "launches": out}))
"""


def test_layers_of_one_shape_share_a_plan_and_each_passes_its_own_words(tmp_path):
    """Three layers of one shape with different segment tables: every launch (quack's runtime call, frontend and
    warm paths) shares the one plan and hands the kernel that layer's own words, not the first layer's; the
    table is not passed."""
    pytest.importorskip("quack")
    r = subprocess.run([sys.executable, "-c", _WORDS, str(tmp_path / "cache"), str(tmp_path / "dump")],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert len({tuple(w) for w in res["words"]}) == 3
    for mode, launches in res["launches"].items():
        assert len(launches) == 6 and len({g["plan"] for g in launches}) == 1, (mode, launches)
        assert [g["words"] for g in launches] == res["words"] * 2, (mode, launches)
        assert not any(g["table"] for g in launches), (mode, launches)
