"""Compile the sm90 backend's quack-kernels GEMMs (exact and fast mode) with no GPU, into quack's disk cache.

    python -m svdq_linear.backends.sm90.quack_precompile --cache DIR --dump DIR [--quick] [--sms 132]
        [--python X.Y]

Run by ``svdq-precompile --arch sm_90a`` in a child process: the environment has to be set before
cutlass is imported. The CuTe DSL compiles for ``sm_90a`` without a driver; the two host queries quack
makes while planning a launch (the SM count for its persistent grid, the shared memory per SM) are
answered from the target's tables. quack keys its cache by the Python minor version, the cutlass and
tvm-ffi versions and its own sources (one folder per key under ``DIR``); point ``QUACK_CACHE_DIR`` on
the GPU machine at ``DIR``. The compiled objects are native code behind tvm-ffi's C ABI, not
CPython's, so ``--python X.Y`` also files them under the key the GPU machine's interpreter computes
(``python_fingerprint``), for a GPU machine whose Python differs from this one; its cutlass and
tvm-ffi versions must still be these.

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


def python_fingerprint(python: str) -> str:
    """quack's cache-folder name (``quack.cache.jit._compute_source_fingerprint``) as an interpreter of
    version ``python`` ("3.12") with this machine's quack, cutlass and tvm-ffi computes it. Refuses
    (RuntimeError) when, for this interpreter, it is not what quack computes: quack changed its key,
    and a cache filed under a guessed one would never be found."""
    import hashlib

    import cutlass
    import quack
    import quack.cache as state
    import tvm_ffi
    from quack.cache import jit

    def digest(py: str) -> str:
        h = hashlib.sha256()
        h.update(f"py{py}".encode())
        h.update(f"cutlass={cutlass.__version__}".encode())
        h.update(f"tvm_ffi={tvm_ffi.__version__}".encode())
        jit._hash_source_dir(h, Path(quack.__file__).resolve().parent)
        for extra in state.EXTRA_SOURCE_DIRS:
            jit._hash_source_dir(h, Path(extra).resolve())
        return h.hexdigest()

    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if digest(here) != jit._compute_source_fingerprint():
        raise RuntimeError("quack's cache key is not the one svdq-linear reproduces (quack-kernels changed its "
                           "fingerprint): compile on a machine with the GPU machine's Python instead")
    return digest(python)


def file_for_python(cache: Path, python: str) -> tuple[Path, int]:
    """Copy the compiled objects of this interpreter's cache folder under ``cache`` into the folder an
    interpreter of version ``python`` looks in; returns (that folder, objects copied)."""
    import shutil

    from quack.cache import jit

    src = cache / jit._compute_source_fingerprint()
    dst = cache / python_fingerprint(python)
    dst.mkdir(parents=True, exist_ok=True)
    n = 0
    for obj in sorted(src.glob("*.o")):
        if dst != src:
            tmp = dst / (obj.name + ".partial")
            shutil.copyfile(obj, tmp)
            os.replace(tmp, dst / obj.name)  # whole objects only: quack loads any .o it finds
        n += 1
    return dst, n


def variants(shapes, quick: bool, rank: int = 32):
    """(label, compile thunk) per GEMM specialisation the backend launches for ``shapes`` (the low-rank
    MMA in the accumulator at ``rank``, the converter's default; without a low-rank branch unless
    ``quick``)."""
    import torch

    from . import LOWRANK_MAX_WINDOW, QUACK_MIN_M, fast_layout, quack_fast, quack_gemm, quack_lowrank

    assert rank % 16 == 0 and rank <= LOWRANK_MAX_WINDOW
    out = []
    for m, k, n in shapes:
        qweight = torch.zeros(n, k // 2, dtype=torch.uint8)
        wscales = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
        ones = torch.ones(n)
        lr = (torch.zeros(n, rank, dtype=torch.bfloat16), torch.zeros(m, rank, dtype=torch.bfloat16),
              torch.zeros(n // 64, dtype=torch.int32))  # what prepare passes for a dense branch
        quack_lowrank.register_runs(lr[2])  # and registers: the launch passes the table's runs as two words
        for with_lowrank in ((True,) if quick else (True, False)):
            lr_acc = lr if with_lowrank else None
            tag = f"{m}x{k}x{n}{f'_r{rank}' if with_lowrank else ''}"
            if m >= QUACK_MIN_M:
                # this shape's tensors bound now: the thunks run after the loop
                def exact(lr_acc=lr_acc, m=m, k=k, qweight=qweight, wscales=wscales, ones=ones):
                    w = quack_gemm.prepare(qweight, wscales, ones, None)
                    quack_gemm.gemm(torch.zeros(m, k, dtype=torch.bfloat16), w, launch=False, lr_acc=lr_acc)
                out.append((f"quack_w4a16_{tag}", exact))
            if n % 64 == 0 and k % fast_layout.TILE_K == 0:
                def fast(lr_acc=lr_acc, m=m, k=k, qweight=qweight, wscales=wscales, ones=ones):
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
    p.add_argument("--python", default=None, help="also file the cache for this Python (X.Y) of the GPU machine")
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
    if args.python:
        try:
            folder, n = file_for_python(Path(args.cache), args.python)
            rec = {"kernel": f"python{args.python}-quack-cache", "ok": True, "objects": n, "folder": str(folder)}
        except Exception as e:
            rec = {"kernel": f"python{args.python}-quack-cache", "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
