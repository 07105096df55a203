"""Compile the sm90 backend's quack-kernels GEMMs (exact and fast mode) with no GPU, into quack's disk cache.

    python -m svdq_linear.backends.sm90.quack_precompile --cache DIR --dump DIR [--quick] [--sms 132]

Run by ``svdq-precompile --arch sm_90a`` in a child process: the environment has to be set before
cutlass is imported. The CuTe DSL compiles for ``sm_90a`` without a driver; the two host queries quack
makes while planning a launch (the SM count for its persistent grid, the shared memory per SM) are
answered from the target's tables. quack keys its cache by the Python minor version, the cutlass and
tvm-ffi versions and its own sources, so run this with the interpreter and packages of the GPU
machine, and point ``QUACK_CACHE_DIR`` there at ``DIR``.

Prints one JSON record per kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _setup(cache: Path, dump: Path, sms: int) -> None:
    os.environ.update(QUACK_ARCH="90", CUTE_DSL_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="",
                      QUACK_CACHE_DIR=str(cache), CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(dump))
    import quack.cute_dsl_utils as dsl_utils
    import quack.gemm_runtime.host as host
    from quack.cache.async_compile import _install_gpu_blind_device_attrs, _pin_dsl_arch

    _pin_dsl_arch("sm_90a")
    _install_gpu_blind_device_attrs()
    host.get_max_active_clusters = dsl_utils.get_max_active_clusters = lambda *a, **k: sms


def variants(shapes, quick: bool, rank: int = 32):
    """(label, compile thunk) per GEMM specialisation the backend launches for ``shapes`` (the low-rank
    MMA in the accumulator at ``rank``, the converter's default; without a low-rank branch unless
    ``quick``)."""
    import torch

    from . import LOWRANK_MAX_WINDOW, QUACK_MIN_M, fast_layout, quack_fast, quack_gemm

    assert rank % 16 == 0 and rank <= LOWRANK_MAX_WINDOW
    out = []
    for m, k, n in shapes:
        qweight = torch.zeros(n, k // 2, dtype=torch.uint8)
        wscales = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
        ones = torch.ones(n)
        lr = (torch.zeros(n, rank, dtype=torch.bfloat16), torch.zeros(m, rank, dtype=torch.bfloat16),
              torch.zeros(n // 64, dtype=torch.int32))  # what prepare passes for a dense branch
        for with_lowrank in ((True,) if quick else (True, False)):
            lr_acc = lr if with_lowrank else None
            tag = f"{m}x{k}x{n}{f'_r{rank}' if with_lowrank else ''}"
            if m >= QUACK_MIN_M:
                def exact(lr_acc=lr_acc, m=m, k=k, n=n):
                    w = quack_gemm.prepare(qweight, wscales, ones, None)
                    quack_gemm.gemm(torch.zeros(m, k, dtype=torch.bfloat16), w, launch=False, lr_acc=lr_acc)
                out.append((f"quack_w4a16_{tag}", exact))
            if n % 64 == 0 and k % fast_layout.TILE_K == 0:
                def fast(lr_acc=lr_acc, m=m, k=k, n=n):
                    w = quack_fast.prepare(qweight, wscales, ones, None)
                    a8 = torch.zeros(m, k).to(torch.float8_e4m3fn)
                    quack_fast.gemm(a8, torch.ones(m), w, launch=False, lr_acc=lr_acc)
                out.append((f"quack_w4a8_{tag}", fast))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--dump", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sms", type=int, default=132)
    args = p.parse_args(argv)
    dump = Path(args.dump)
    dump.mkdir(parents=True, exist_ok=True)
    _setup(Path(args.cache), dump, args.sms)
    from ...precompile import SHAPES

    shapes = [(4608, 3072, 3072), (64, 3072, 3072)] if args.quick else SHAPES
    for label, thunk in variants(shapes, args.quick):
        before = set(dump.glob("*.cubin"))
        try:
            thunk()
            new = sorted(set(dump.glob("*.cubin")) - before)
            rec = {"kernel": label, "ok": True, "cubin": str(new[0]) if new else None}
        except Exception as e:  # report and go on: one shape must not hide the others
            rec = {"kernel": label, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
