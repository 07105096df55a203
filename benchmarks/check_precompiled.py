"""On the GPU machine: does a quack cache written by ``svdq-precompile`` on a CPU machine spare the JIT?

    svdq-precompile --arch sm_90a --quick --python 3.12 --out .devcarry/precompiled     # CPU machine
    python benchmarks/check_precompiled.py --cache .devcarry/precompiled/quack-cache    # GPU machine

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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True, help="the quack-cache folder svdq-precompile wrote")
    args = p.parse_args()
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
