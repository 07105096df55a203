"""On the GPU machine: does a quack cache written by ``svdq-precompile`` on a CPU machine spare the JIT?

    svdq-precompile --arch sm_90a --quick --python 3.12 --out .devcarry/precompiled     # CPU machine
    python benchmarks/check_precompiled.py --cache .devcarry/precompiled/quack-cache    # GPU machine
    python benchmarks/check_precompiled.py --triton-cache DIR/triton-cache              # same Triton as DIR's

``--triton-cache``: the Triton kernels instead (a cache is specific to the Triton version that wrote it,
so DIR comes from ``svdq-precompile --quick`` run with this machine's Triton). Each layer that ``--quick``
covers runs once through the module (exact mode on canonical weights, the W4A16 adaLN GEMV), and a new
cache entry holding a cubin is a miss (the runtime compiled a kernel). Entries without one are Triton's
host-side launchers (C code built with the host compiler per kernel signature, once per machine and
signature, ~0.3 s): reported, not counted as a kernel JIT.

Copies the cache to a scratch folder (quack writes lock files beside its objects), points
``QUACK_CACHE_DIR`` there, then runs the module forwards whose GEMMs ``--quick`` compiled (4608 x
3072 x 3072, rank 32, exact and fast mode, bf16) and reports, per call, the time of the first call
and whether quack added an object to its cache folder (a miss: it compiled) or not (a hit). The
output of each call is checked against the reference backend's first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def triton_main(cache: str) -> int:
    scratch = Path(tempfile.mkdtemp()) / "triton-cache"
    shutil.copytree(cache, scratch)
    os.environ["TRITON_CACHE_DIR"] = str(scratch)
    os.environ["SVDQ_SM90_QUACK"] = "0"  # the Triton GEMM serves the exact mode above 64 tokens
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_conformance import random_w4a4

    from svdq_linear import NVFP4W4A16Linear

    entries = lambda: {d.name for d in scratch.iterdir()}  # noqa: E731
    print(f"{len(entries())} entries in the precompiled Triton cache")
    ok = True
    exact = lambda: random_w4a4(3072, 3072, 32, torch.bfloat16, "cuda").set_mode("exact")  # noqa: E731
    cases = [(f"exact {m}x3072x3072", m, exact, {}) for m in (4608, 512, 64, 1)]
    cases.append(("w4a16 1x3072x18432", 1, lambda: NVFP4W4A16Linear.from_linear(
        torch.nn.Linear(3072, 18432, device="cuda", dtype=torch.bfloat16)), {}))
    cases.append(("exact 4608x3072x3072, SVDQ_SM90_PDL=1 (the pair)", 4608, exact, {"SVDQ_SM90_PDL": "1"}))
    with torch.no_grad():
        for label, m, make, env in cases:
            mod = make()
            x = torch.randn(m, 3072, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            before = entries()
            os.environ.update(env)
            t0 = time.perf_counter()
            mod(x)
            torch.cuda.synchronize()
            for key in env:
                os.environ.pop(key)
            first = time.perf_counter() - t0
            new = entries() - before
            kernels_built = [d for d in new if any((scratch / d).glob("*.cubin"))]
            ok &= not kernels_built
            print(f"{label}: first call {first * 1e3:.0f} ms, "
                  + (f"MISS ({len(kernels_built)} kernels compiled: "
                     f"{sorted(p.stem for d in kernels_built for p in (scratch / d).glob('*.cubin'))})"
                     if kernels_built else "HIT (no kernel compiled)")
                  + (f"; {len(new) - len(kernels_built)} host launchers built" if len(new) > len(kernels_built) else ""))
    print("every Triton kernel came from the precompiled cache" if ok else "Triton compiled on this machine")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser()
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--cache", help="the quack-cache folder svdq-precompile wrote")
    g.add_argument("--triton-cache", help="the triton-cache folder svdq-precompile wrote (this machine's Triton)")
    args = p.parse_args()
    if args.triton_cache:
        return triton_main(args.triton_cache)
    scratch = Path(tempfile.mkdtemp()) / "quack-cache"
    shutil.copytree(args.cache, scratch)
    os.environ["QUACK_CACHE_DIR"] = str(scratch)
    import torch
    from quack.cache import jit

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_conformance import random_w4a4

    from svdq_linear import nvfp4

    folder = scratch / jit._compute_source_fingerprint()
    print(f"python {sys.version.split()[0]}; quack's folder for this interpreter: {folder.name[:16]}... "
          f"{'present' if folder.is_dir() else 'ABSENT'} with {len(list(folder.glob('*.o')))} objects; "
          f"folders in the cache: {sorted(d.name[:16] for d in scratch.iterdir() if d.is_dir())}")
    ok = True
    for mode in ("exact", "fast"):
        torch.manual_seed(0)
        mod = random_w4a4(3072, 3072, 32, torch.bfloat16, "cuda")
        mod.set_mode(mode)
        x = torch.randn(4608, 3072, device="cuda", dtype=torch.bfloat16)
        before = set(folder.glob("*.o")) if folder.is_dir() else set()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = mod(x)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        after = set(folder.glob("*.o")) if folder.is_dir() else set()
        t0 = time.perf_counter()
        mod(x)
        torch.cuda.synchronize()
        second = time.perf_counter() - t0
        args = [t.cpu() if t is not None else None for t in (mod.qweight, mod.wscales, mod.smooth, mod.proj_down,
                                                                mod.proj_up, mod.wcscale, mod.bias)]
        formula = nvfp4.w4a4_linear if mode == "exact" else nvfp4.w4a8_fast_linear
        ref = formula(x[:64].cpu(), *args, torch.float64)
        err = ((y[:64].cpu().double() - ref).norm() / ref.norm()).item()
        hit = not (after - before)
        ok &= hit and err < 1e-2
        print(f"{mode}: first call {first:.2f} s, second {second * 1e3:.1f} ms, "
              f"{'HIT (no new object)' if hit else f'MISS ({len(after - before)} new objects)'}; "
              f"relative error of 64 rows against the {mode} formula: {err:.2e}")
    print("every quack GEMM came from the precompiled cache, with correct outputs" if ok
          else "quack compiled on this machine, or an output is wrong")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
