"""``svdq-precompile --arch sm_90a`` compiles the sm90 kernels with no GPU (Triton's and, with
quack-kernels, the quack GEMMs of both modes); their SASS holds Hopper's wgmma (HGMMA, QGMMA for FP8)
and no local memory (spills); the FP8 GEMM's low-rank branch is bf16 wgmma into the same kernel."""

import importlib.util
import json
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_sm90_kernels_compile_to_hgmma_without_spills(tmp_path):
    env_code = "import os; os.environ.pop('TRITON_INTERPRET', None); from svdq_linear.precompile import main; "
    r = subprocess.run([sys.executable, "-c", env_code + f"raise SystemExit(main(['--arch', 'sm_90a', '--out', "
                        f"{str(tmp_path)!r}, '--keep-sass', '--quick']))"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "report-sm_90a.json").read_text())
    gemms = [k for k in report if k["kernel"].startswith("w4_gemm")]
    assert gemms and any(k["kernel"].startswith("quantize_act") for k in report)
    for k in gemms:
        assert k["hgmma"] > 0, f"{k['kernel']}: no HGMMA in its SASS"
        assert "HGMMA" in (tmp_path / "sass-sm_90a" / f"{k['kernel']}.sass").read_text()
    for k in report:
        assert k["local_memory"] == 0 and k["stack_bytes"] == 0, f"{k['kernel']} spills: {k}"
    assert any((tmp_path / "triton-cache").rglob("*.cubin")), "nothing was written to the Triton cache"
    assert any(k["kernel"].startswith("quantize_act_fp8") for k in report)
    assert any(k["kernel"].startswith("quantize_act_fp8_rows") and k["constants"]["GELU_B"]
               and k["constants"]["NA"] > 0 for k in report)  # the two-source pass
    from svdq_linear.backends.sm90 import kernels

    if kernels.gdc_wait is not None:  # SVDQ_SM90_PDL=1's pair: lora_act, then each mode's pass as its dependent
        pdl = {k["kernel"]: k for k in report if "_pdl_" in k["kernel"]}
        assert {n.split("_pdl_")[0] for n in pdl} >= {"lora_act", "quantize_act", "quantize_act_fp8_rows",
                                                       "lora_scale"}, sorted(pdl)
        assert all(k["grid_waits"] >= 1 for k in pdl.values()), {n: k["grid_waits"] for n, k in pdl.items()}
        assert all(k["constants"].get("PDL", k["constants"].get("AFTER_LORA", True)) for k in pdl.values())
    small = {k["kernel"]: k for k in report if k["kernel"].startswith("small_m")}
    # --quick: W4A16 at 1 token (adaLN), the exact mode at 1 and 64 tokens (canonical weights; quack's blob at 1)
    assert {"small_m_w4a16_m1_3072x18432_bfloat16", "small_m_exact_m1_3072x3072_bfloat16",
            "small_m_exact_m64_3072x3072_bfloat16"} <= set(small), sorted(small)
    for name, k in small.items():  # the dot (from 3 tokens) runs on wgmma; the multiply-adds must not spill either
        c = k["constants"]
        assert (k["hgmma"] > 0) == c["USE_DOT"] == (c["BLOCK_M"] > 2), f"{name}: {k['hgmma']} HGMMA, {c}"
    # what the runtime specializes, not what a list assumed: one token is the constant M = 1 (Triton's
    # rule for integers equal to 1), and a layer without a low-rank branch would take RC = 16
    one = small["small_m_w4a16_m1_3072x18432_bfloat16"]["constants"]
    assert one["M"] == 1 and one["WORDS"] and one["CHAIN"] and one["HAS_LORA"] is False and one["RC"] == 16, one
    quack = [k for k in report if k["kernel"].startswith("quack")]
    if quack:  # quack-kernels installed (the kernels extra): its GEMMs go into its disk cache
        for k in quack:
            assert k["ok"], k
            wgmma = "hgmma" if k["kernel"].startswith("quack_w4a16") else "qgmma"
            assert k[wgmma] > 0, f"{k['kernel']}: no {wgmma.upper()} in its SASS"
        assert any(k["kernel"].startswith("quack_w4a8") for k in quack)
        # the low-rank MMA joins the FP8 accumulator as bf16 wgmmas (R / 16 = 2 of them at rank 32)
        fast_lr = [k for k in quack if k["kernel"].startswith("quack_w4a8") and k["kernel"].endswith("_r32")]
        assert fast_lr and all(k["hgmma"] >= 2 and k["qgmma"] > 0 for k in fast_lr), fast_lr
        assert any((tmp_path / "quack-cache").rglob("*.o")), "nothing was written to quack's cache"


def test_quack_cache_is_filed_for_the_gpu_machines_python(tmp_path, monkeypatch):
    """quack keys its disk cache by the Python minor version: ``--python X.Y`` copies the compiled
    objects into the folder that interpreter computes. The key is rebuilt by our code, so it must equal
    quack's own for this interpreter (else it refuses), and differ for another."""
    pytest.importorskip("quack.cache.jit")
    import quack.cache as state
    from quack.cache import jit

    from svdq_linear.backends.sm90 import quack_precompile as qp

    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert qp.python_fingerprint(here) == jit._compute_source_fingerprint()
    other = qp.python_fingerprint("3.99")
    assert other != jit._compute_source_fingerprint() and len(other) == 64
    monkeypatch.setattr(state, "CACHE_DIR", str(tmp_path))
    src = tmp_path / jit._compute_source_fingerprint()
    src.mkdir()
    (src / "a.o").write_bytes(b"object a")
    (src / "b.o").write_bytes(b"object b")
    (src / "b.lock").write_bytes(b"")
    folder, n = qp.file_for_python(tmp_path, "3.99")
    assert folder == tmp_path / other and n == 2
    assert sorted(p.name for p in folder.iterdir()) == ["a.o", "b.o"]
    assert (folder / "b.o").read_bytes() == b"object b"
    # a quack whose key this code no longer reproduces: refuse rather than file objects nobody finds
    monkeypatch.setattr(jit, "_compute_source_fingerprint", lambda: "0" * 64)
    with pytest.raises(RuntimeError, match="cache key"):
        qp.python_fingerprint("3.12")


def test_quack_variants_compile_each_shape_with_its_own_weight(monkeypatch):
    """``quack_precompile.variants`` returns thunks that run after its loop over shapes: each must prepare the
    weight of its own shape (N x K), not the last shape's (a late-bound closure compiled the full list's
    K != 3072 shapes against a 3072-wide weight and failed on them)."""
    pytest.importorskip("quack")
    from svdq_linear.backends.sm90 import quack_fast, quack_gemm, quack_lowrank
    from svdq_linear.backends.sm90 import quack_precompile as qp

    seen = []

    def prepare(qweight, wscales, ones, bias):
        return (qweight.shape[0], qweight.shape[1] * 2, wscales.shape, ones.shape)

    words = []

    def gemm(a, *args, **kwargs):
        w = args[-1] if len(args) == 2 else args[0]
        seen.append((tuple(a.shape), w))
        words.append(quack_lowrank.runs_for(kwargs["lr_acc"][2]))

    for mod in (quack_gemm, quack_fast):
        monkeypatch.setattr(mod, "prepare", prepare)
        monkeypatch.setattr(mod, "gemm", gemm)
    shapes = [(4096, 3072, 9216), (4096, 12288, 3072), (4096, 3072, 12288)]
    for _, thunk in qp.variants(shapes, quick=True):
        thunk()
    assert len(seen) == 2 * len(shapes)
    for (m, k), (n, wk, sc, cs) in seen:
        assert (m, k) in {(s[0], s[1]) for s in shapes}
        assert wk == k and sc == (n, k // 16) and cs == (n,), (m, k, n, wk)
    assert {(a[1], w[0]) for a, w in seen} == {(k, n) for _, k, n in shapes}
    # the segment table registered as the backend's preparation registers it: the kernel a layer launches takes
    # the table's runs as two words, so that is the one to compile
    assert words == [quack_lowrank.pack_runs([0])] * len(seen)


def test_precompile_refuses_a_malformed_python_version(capsys):
    from svdq_linear.precompile import main

    with pytest.raises(SystemExit):
        main(["--arch", "sm_90a", "--python", "312"])
    assert "--python" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--arch", "sm_100a", "--quick"], "--quick and --python apply to --arch sm_90a, not sm_100a"),
    (["--arch", "sm_90a", "--out", ""], "--out: expected a folder, got ''"),
    (["--arch", "sm_90a", "--out", "{file}"], "--out {file}: File exists"),
    (["--arch", "sm_100a", "--python", "3.12"], "--quick and --python apply to --arch sm_90a, not sm_100a"),
    (["--arch", "sm_90a", "--python", "3.12.1"], "--python takes a version like 3.12, got '3.12.1'"),
])
def test_precompile_refuses_bad_arguments_in_one_line(args, says, tmp_path, capsys):
    """An existing file as --out gave a traceback, --out "" compiled into the current folder, and --quick / --python
    were ignored for sm_100a."""
    from svdq_linear.precompile import main

    (tmp_path / "f").write_text("")
    fill = lambda a: a.replace("{file}", str(tmp_path / "f"))
    with pytest.raises(SystemExit) as e:
        main([fill(a) for a in args])
    assert e.value.code == 2 and fill(says) in capsys.readouterr().err


def test_kernels_that_failed_to_compile_make_the_exit_status_1(tmp_path, capsys, monkeypatch):
    """A run whose report holds a kernel with ``ok: False`` (a quack shape that failed in its child process) exits 1
    and says how many failed, after writing the whole report; a run without one exits 0. The compiles are stubbed:
    the exit status is the promise here."""
    from svdq_linear import precompile

    records = [{"kernel": "w4_gemm_a", "arch": "sm_90a"}, {"kernel": "quack_w4a8_b", "arch": "sm_90a", "ok": True}]
    monkeypatch.setattr(precompile, "precompile_sm90", lambda out, keep, quick: list(records))
    failed = [{"kernel": "quack_w4a16_c", "arch": "sm_90a", "ok": False, "error": "boom"}]
    for quack, rc in (([], 0), (failed, 1)):
        monkeypatch.setattr(precompile, "precompile_sm90_quack", lambda out, keep, quick, py, q=quack: list(q))
        out = tmp_path / f"rc{rc}"
        assert precompile.main(["--arch", "sm_90a", "--out", str(out), "--quick"]) == rc
        report = json.loads((out / "report-sm_90a.json").read_text())
        assert [r["kernel"] for r in report] == [r["kernel"] for r in records + quack]
        err = capsys.readouterr().err
        assert ("1 kernels failed to compile" in err) == (rc == 1), err


def test_quack_variants_start_at_the_backends_token_threshold():
    """quack's W4A16 GEMM serves the exact mode from ``QUACK_MIN_M`` tokens (``sm90.QUACK_MIN_M``), so the precompile
    builds it for a shape of exactly that many tokens and not one fewer; the fast mode's FP8 GEMM at every M."""
    pytest.importorskip("quack")
    from svdq_linear.backends.sm90 import QUACK_MIN_M
    from svdq_linear.backends.sm90 import quack_precompile as qp

    labels = [label for label, _ in qp.variants([(QUACK_MIN_M, 3072, 3072), (QUACK_MIN_M - 1, 3072, 3072)], True)]
    assert labels == [f"quack_w4a16_{QUACK_MIN_M}x3072x3072_r32", f"quack_w4a8_{QUACK_MIN_M}x3072x3072_r32",
                      f"quack_w4a8_{QUACK_MIN_M - 1}x3072x3072_r32"], labels


_LAUNCHES = """
import json, os
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = __import__("sys").argv[1]
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import KernelInterface
from svdq_linear.precompile import compile_launches

@triton.jit
def scale(x_ptr, n, stride, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i * stride, tl.load(x_ptr + i * stride, mask=i < n) * 2, mask=i < n)

from triton.runtime.driver import driver
getitem, before = KernelInterface.__getitem__, dict(vars(driver))
try:  # an exception inside puts Triton back too
    with compile_launches(GPUTarget("cuda", 90, 32)):
        scale[(1,)](torch.zeros(64), 1, 32, BLOCK=3)  # BLOCK not a power of two: Triton refuses to compile it
    raised = False
except Exception:
    raised = True
after_error = raised and KernelInterface.__getitem__ is getitem and dict(vars(driver)) == before and len(scale.device_caches) == 0
with compile_launches(GPUTarget("cuda", 90, 32)) as compiled:
    scale[(1,)](torch.zeros(64), 1, 32, BLOCK=16)   # n == 1: Triton makes it a constant
    scale[(1,)](torch.zeros(64), 7, 32, BLOCK=16)   # n == 7: an argument
    scale[(1,)](torch.zeros(64), 7, 32, BLOCK=16)   # the same key again: the kernel it has
names = scale.arg_names
consts = [sorted(names[k[0]] for k in ck.src.constants) for _, ck in compiled]
print(json.dumps(dict(n=len(compiled), hashes=len({ck.hash for _, ck in compiled}), consts=consts,
                      cubin=all(len(ck.asm["cubin"]) > 0 for _, ck in compiled),
                      restored=KernelInterface.__getitem__ is getitem and dict(vars(driver)) == before,
                      after_error=after_error, caches=len(scale.device_caches))))
"""


def test_compile_launches_compiles_what_triton_keys_and_puts_triton_back(tmp_path):
    """``precompile.compile_launches`` (no GPU): a launch inside it compiles a cubin for sm_90a through
    Triton's own binder, so an integer argument equal to 1 becomes a constant as it does at run time
    and a repeated launch reuses its kernel; afterwards (an exception inside included) Triton's launch
    path and active driver are its own again and the kernel keeps no binder for the stand-in target."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "launches.py"  # Triton reads a kernel's source from its file
    script.write_text(_LAUNCHES)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["n"] == 3 and res["hashes"] == 2 and res["cubin"], res
    assert "n" in res["consts"][0] and "n" not in res["consts"][1] and "BLOCK" in res["consts"][1], res
    assert res["restored"] and res["after_error"] and res["caches"] == 0, res


_FIDELITY = """
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
os.environ["SVDQ_SM90_QUACK"] = "0"  # the Triton GEMM above 64 tokens: what --quick's canonical layers run
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
sys.path.insert(0, sys.argv[2])
import torch
from triton.backends.compiler import GPUTarget
from svdq_linear import NVFP4W4A16Linear
from svdq_linear.backends.sm90 import Sm90Backend
from svdq_linear.precompile import _sm90_calls, compile_launches
from test_conformance import random_w4a4

target = GPUTarget("cuda", 90, 32)
with compile_launches(target) as stand_ins:
    for tag, call in _sm90_calls(True):
        if not tag.startswith(("exact_quack", "fast")) or tag.startswith("fast_gelu_in"):
            call()  # the canonical exact and W4A16 layers; the fast mode's two-source pass
be = Sm90Backend()
real = {}
with torch.no_grad(), compile_launches(target) as compiled:
    for m in (4608, 512, 64, 1):  # real modules: random weights, rank 32, bias, bf16
        mod = random_w4a4(3072, 3072, 32, torch.bfloat16, "cpu")
        be.linear(mod, torch.randn(m, 3072, dtype=torch.bfloat16), be.prepare(mod, torch.device("cpu")))
        real[f"exact m{m}"] = [ck.hash for _, ck in compiled]
        compiled.clear()
    ada = NVFP4W4A16Linear.from_linear(torch.nn.Linear(3072, 18432, dtype=torch.bfloat16))
    be.linear(ada, torch.randn(1, 3072, dtype=torch.bfloat16), None)
    real["w4a16 m1"] = [ck.hash for _, ck in compiled]
    compiled.clear()
    import svdq_linear.backends.sm90 as sm90
    quack_fast = sm90._quack_fast_module()
    if quack_fast is not None:  # a Flux single block's proj_out reading its GELU'd input (quack's GEMM stubbed)
        mod = random_w4a4(15360, 3072, 32, torch.bfloat16, "cpu").set_mode("fast")
        prepared = be.prepare(mod, torch.device("cpu"))

        class StubGemm:
            weight = staticmethod(quack_fast.weight)
            gemm = staticmethod(lambda a8, sa, fw, lowrank=None, out_dtype=None, lr_acc=None: a8.new_zeros(0))

        sm90._quack_fast_module = lambda: StubGemm
        xa, xb = torch.randn(4608, 3072, dtype=torch.bfloat16), torch.randn(4608, 12288, dtype=torch.bfloat16)
        be.linear_cat_gelu(mod, xa, xb, prepared, "w4a4_fast")
        real["fast gelu_in m4608"] = [ck.hash for _, ck in compiled]
covered = {ck.hash for _, ck in stand_ins}
print(json.dumps({k: [h in covered for h in v] for k, v in real.items()}))
"""


def test_precompiled_stand_ins_compile_what_real_modules_launch(tmp_path):
    """The stand-ins of ``--quick`` (zeros of a layer's shapes) against real modules (random weights) of
    the same layers going through the sm90 backend, both under ``compile_launches`` (no GPU): every
    kernel a real module's call compiles is one the stand-ins compiled (the same cache key), so a
    stand-in that drifted from what a module holds (a dtype, a stride, a rank) fails here."""
    import os
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "fidelity.py"
    script.write_text(_FIDELITY)
    tests_dir = str(Path(__file__).resolve().parent)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "cache"), tests_dir], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(res) - {"fast gelu_in m4608"} == {"exact m4608", "exact m512", "exact m64", "exact m1", "w4a16 m1"}, res
    if importlib.util.find_spec("quack") is not None:  # the fast mode's layer (quack prepares its weight)
        assert len(res["fast gelu_in m4608"]) == 2, res  # its lora_act and activation pass
    for layer, hits in res.items():
        assert hits and all(hits), f"{layer}: kernels the stand-ins did not compile: {hits}"


_NORM_PTX = """
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
import torch
from triton.backends.compiler import GPUTarget
from svdq_linear.backends.sm90 import kernels, norm_pass
from svdq_linear.precompile import _norm_forms, compile_launches

out = {}
with compile_launches(GPUTarget("cuda", 90, 32)) as compiled:
    for dt in (torch.bfloat16, torch.float16):
        x, mod, inv = torch.zeros(256, 512, dtype=dt), torch.zeros(3, 512, dtype=dt), torch.ones(512)
        pds = torch.zeros(512, 32, dtype=torch.bfloat16)
        norm_pass.ada_norm_exact(x, mod[:1], mod[1:2], 1e-6, inv, pds, tokens=256, out_dtype=dt, split=2)
        norm_pass.ada_norm_fast(x, mod[:1], mod[1:2], 1e-6, inv, pds, tokens=256, split=2)
        _norm_forms(kernels, norm_pass, x, mod, inv, pds)  # the pair and rows forms as svdq-precompile compiles them
for i, (name, ck) in enumerate(compiled):
    ptx = ck.asm["ptx"]
    out[f"{name}_{i}"] = {op: ptx.find(op) for op in ("fma.rn.bf16", "fma.rn.f16", "fma.rn.ftz.f16",
                                                      "griddepcontrol.wait", "griddepcontrol.launch_dependents",
                                                      "st.global") if op in ptx}
print(json.dumps(out))
"""


def test_norm_pass_modulation_keeps_both_roundings_when_compiled(tmp_path):
    """Compiled for sm_90a (no GPU), the norm pass's kernels hold no 16-bit fma: the eager code rounds
    ``normed * (1 + scale)`` to the input's dtype before adding ``shift``, and LLVM had contracted the two into one
    ``fma.rn.bf16x2`` (one rounding), a bf16 unit off in about a quarter of the values on the H100, which the
    interpreter's tests cannot see (``norm_pass._round_kept``)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "norm_ptx.py"
    script.write_text(_NORM_PTX)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "cache")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    names = {k.rsplit("_", 1)[0] for k in res}
    assert names == {"_ada_stats_kernel", "_ada_apply_kernel", "_ada_lora_kernel", "_ada_pass_kernel",
                     "_ada_rows_kernel"}, res
    assert len(res) == 48, res
    assert not [op for ops in res.values() for op in ops if op.startswith("fma")], res
    # the pair and rows forms (svdq-precompile's _norm_forms compiles both modes, launched plainly and with PDL): in the
    # pair lora_act waits for the statistics before it lets the pass start, and the pass lets the GEMM start first,
    # stores its tile, and only then waits for lora_act's partials (its last k-tile); the rows form's pass lets its
    # lora_act start and never waits (the grid before it is a plain launch's), its lora_act waits for the pass's
    # statistics and then lets the GEMM start; launched plainly none holds a wait, nor do the split form and the
    # statistics launch
    gdc = {"_ada_lora_kernel": ["griddepcontrol.wait", "griddepcontrol.launch_dependents"],
           "_ada_pass_kernel": ["griddepcontrol.launch_dependents", "st.global", "griddepcontrol.wait"],
           "_ada_rows_kernel": ["griddepcontrol.launch_dependents"]}
    seen = {}
    for k, ops in res.items():
        name = k.rsplit("_", 1)[0]
        keep = [op for op in ops if op.startswith("griddep") or (name == "_ada_pass_kernel" and op == "st.global")]
        pdl = any(op.startswith("griddep") for op in keep)
        assert sorted(keep, key=ops.get) == (gdc[name] if pdl else [op for op in keep if op == "st.global"]), (k, ops)
        if name in gdc:
            seen[name, pdl] = seen.get((name, pdl), 0) + 1
        else:
            assert not pdl, (k, ops)
    # both modes at both dtypes, plain and PDL (lora_act: the pair's and the rows form's)
    assert seen == {("_ada_lora_kernel", False): 8, ("_ada_lora_kernel", True): 8, ("_ada_pass_kernel", False): 4,
                    ("_ada_pass_kernel", True): 4, ("_ada_rows_kernel", False): 4, ("_ada_rows_kernel", True): 4}, res
