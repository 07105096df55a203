"""``svdq-precompile``: compile the library's GPU kernels on a machine without a GPU.

    svdq-precompile --arch sm_90a [--out DIR] [--keep-sass] [--quick] [--python X.Y]

``sm_90a``: the Triton kernels the sm90 backend launches for the Flux.1 and SD3.5 layers are
compiled for compute capability 9.0 into ``DIR/triton-cache`` by running the backend's own host code
on CPU stand-ins of those layers (``_sm90_calls``: bf16, fp16 and fp32 activations, rank 32 and none;
``--quick`` a bf16 subset) with every launch turned into a compile through Triton's own binder
(``compile_launches``): the cache then holds the very specializations a GPU process looks up (point
``TRITON_CACHE_DIR`` there on the GPU machine; the cache is specific to the Triton version that wrote
it). ``--keep-sass`` also writes each kernel's SASS; a JSON report lists registers, spills,
shared memory and the SASS counts that matter (HGMMA, local-memory LDL/STL).
With quack-kernels installed, the quack GEMMs (the exact mode's NVFP4 W4A16 decode for M >= 128, the
fast mode's FP8 decode for every M) are compiled per Flux/SD3.5 shape into ``DIR/quack-cache`` (point
``QUACK_CACHE_DIR`` there; quack's cache key includes the Python minor version and the cutlass and
tvm-ffi versions: ``--python 3.12`` also files the objects for a GPU machine running Python 3.12,
whose cutlass and tvm-ffi must match this machine's).
``sm_100a`` / ``sm_103a``: the Blackwell kernels (``svdq_linear.backends.sm100``), when present.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

# Flux.1 and SD3.5 (M tokens at 1024^2 with 512 text tokens, K, N), the adaLN GEMVs at batch 1-4.
SHAPES = [(4608, 3072, 3072), (4608, 3072, 12288), (4608, 12288, 3072), (4608, 15360, 3072),
          (512, 3072, 3072), (4352, 3840, 3072), (4352, 3840, 15360), (4352, 15360, 3840),
          (1, 3072, 18432), (4, 3072, 9216), (64, 3072, 3072)]


def _nvidia_bin(tool: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    return str(path) if path.exists() else tool


def _sass_stats(cubin: bytes, work: Path, name: str, keep_sass: bool) -> dict:
    tool = _nvidia_bin("cuobjdump")
    if not Path(tool).exists() and shutil.which(tool) is None:
        return {"sass": None, "note": "no cuobjdump in this Triton's CUDA backend or on PATH"}
    cub = work / f"{name}.cubin"
    cub.write_bytes(cubin)
    sass = subprocess.run([tool, "--dump-sass", str(cub)], capture_output=True, text=True,
                          check=True).stdout
    res = subprocess.run([tool, "--dump-resource-usage", str(cub)], capture_output=True,
                         text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    stats = {
        "registers": int(regs.group(1)) if regs else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "hgmma": len(re.findall(r"\bHGMMA\.", sass)),
        "qgmma": len(re.findall(r"\bQGMMA\.", sass)),
        "local_memory": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        "grid_waits": len(re.findall(r"\bACQBULK\b", sass)),  # griddepcontrol.wait (programmatic dependent launch)
        # of those, the ones laid out before the first cp.async (LDGSTS): what a kernel waits for before it copies
        "grid_waits_before_cp_async": len(re.findall(r"\bACQBULK\b", sass.split("LDGSTS")[0])),
        "global_loads": len(re.findall(r"\bLDG\.", sass)),
        # cp.async copies laid out after the last tensor-core MMA: the epilogue's own (quack's vector loads)
        "cp_async_after_mma": len(re.findall(r"\bLDGSTS\b", re.split(r"\b[HQ]GMMA\.", sass)[-1])),
    }
    if keep_sass:
        (work / f"{name}.sass").write_text(sass)
        stats["sass"] = str(work / f"{name}.sass")
    cub.unlink()
    return stats


class _CompileOnlyDriver:
    """What Triton's ``JITFunction.run`` asks the active driver for, answered for a GPU that is not here."""

    def __init__(self, target):
        self._target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self._target


def _jit_function(fn):
    """The ``JITFunction`` under an autotune / heuristics wrapper (or ``fn`` itself)."""
    while not hasattr(fn, "device_caches") and hasattr(fn, "fn"):
        fn = fn.fn
    return fn


@contextlib.contextmanager
def compile_launches(target):
    """Inside, every ``kernel[grid](...)`` of a Triton JIT function compiles what Triton's runtime would
    compile for those very arguments and launches nothing: Triton's own binder turns them into the
    signature, constants and alignment attributes (integers equal to 1 become constants, multiples of
    16 and 16-byte aligned pointers get divisibility attributes), so the cache entry written is the one
    a GPU process looks up for the same call. Yields the list of ``(kernel name, CompiledKernel)``.

    Each kernel compiles with per-device caches of its own while inside (a kernel that already ran on a
    GPU in this process keeps its real ones), and Triton's launch path, active driver and those caches
    are put back on the way out, an exception included."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import KernelInterface

    compiled: list = []
    own_caches: dict = {}  # JITFunction -> the per-device caches it had before

    def getitem(fn, grid):
        def launch(*args, **kwargs):
            jit = _jit_function(fn)
            if jit not in own_caches:
                own_caches[jit] = jit.device_caches
                jit.device_caches = defaultdict(jit.device_caches.default_factory)
            kernel = fn.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append((getattr(jit, "__name__", type(jit).__name__), kernel))

        return launch

    # the active driver: DriverConfig._active (Triton 3.5+) or .active (3.4), read without creating one
    state = vars(driver)
    slot = "_active" if "_active" in state else "active"
    saved_getitem, saved_active = KernelInterface.__getitem__, state.get(slot)
    KernelInterface.__getitem__ = getitem
    driver.set_active(_CompileOnlyDriver(target))
    try:
        yield compiled
    finally:
        KernelInterface.__getitem__ = saved_getitem
        setattr(driver, slot, saved_active)
        for jit, caches in own_caches.items():
            jit.device_caches = caches


def _sm90_calls(quick: bool):
    """``(tag, call)``: the sm90 backend's own entry points on CPU stand-ins of the Flux.1 and SD3.5 layers
    (zeros of the real shapes and dtypes, with bias; rank 32, the converter's default, and 0), so that
    each Triton launch they make is the one a GPU process makes for that layer: the exact mode above 64
    tokens (activation pass, and the Triton W4 GEMM that serves it without quack-kernels), the small-M
    kernel (the exact mode on canonical weights and, from 9 tokens, on quack's blob, whose fewer tokens
    run ``small_m_mma`` on a GPU; W4A16 for the adaLN modulation at batch 1-32), the fast mode's
    activation pass and ``lora_act``, their two-source forms (``fuse_gelu_inputs``), the passes that normalize as
    they load (``forward_ada_norm``, Flux blocks after ``fuse_qkv_projections``), and the PDL pair of both
    modes (what calls captured into a CUDA graph take, or every call with ``SVDQ_SM90_PDL=1``: ``lora_act`` and
    the pass, where ``lora_act`` runs on Triton). quack's GEMMs
    are compiled by ``precompile_sm90_quack``. Not covered (compiled on first use, seconds each): other ranks
    (their low-rank tile widths), other token counts where Triton specializes differently (1, multiples of
    16, others), other widths.
    Routing that depends on the device (``x.is_cuda``) is the CPU's here: such variants are left out
    rather than compiled for nothing."""
    import torch

    from .backends import sm90
    from .backends.sm90 import kernels, tuning
    from .linear import SVDQW4A4Linear

    be = sm90.Sm90Backend()
    dtypes = [torch.bfloat16] if quick else [torch.bfloat16, torch.float16, torch.float32]
    big = [s for s in SHAPES if s[0] > sm90.SMALL_M["w4a4"]]
    small = [(1, 3072, 3072), (64, 3072, 3072)] if quick else [
        (m, k, n) for m in (1, 2, 4, 16, 32, 48, 64) for k, n in ((3072, 3072), (3072, 12288), (12288, 3072))]
    repacked = [(16, 3072, 3072)] if quick else [s for s in small if s[0] > tuning.MMA_MAX_M]
    adaln = [(1, 3072, 18432)] if quick else [  # Flux.1 (double, single), SD3.5 large and medium
        (m, k, n) for m in (1, 2, 4, 16, 32) for k, n in ((3072, 18432), (3072, 9216), (2432, 14592), (1536, 9216))]
    fast = [(4608, 3072), (1, 3072)] if quick else [(m, k) for m in (1, 16, 512, 4608)
                                                     for k in (2432, 3072, 3840, 10240, 12288, 15360)]
    # the fast mode reading a GELU'd input from its parts (fuse_gelu_inputs): Flux single blocks' proj_out
    # (attention 3072 + MLP 12288), the feed-forwards' down projections of Flux.1 and SD3.5 large / medium
    gelu_in = [(4608, 3072, 12288)] if quick else [(m, ka, kb) for m in (512, 4608)
                                                   for ka, kb in ((3072, 12288), (0, 12288), (0, 9728), (0, 6144))]

    def layer(m, k, n, dt, r=32):
        return dict(x=torch.zeros(m, k, dtype=dt), qweight=torch.zeros(n, k // 2, dtype=torch.uint8),
                    wscales=torch.zeros(n, k // 16, dtype=torch.float8_e4m3fn), smooth=torch.ones(k),
                    proj_down=torch.zeros(k, r, dtype=dt), proj_up=torch.zeros(n, r, dtype=dt),
                    wcscale=torch.ones(n), bias=torch.zeros(n, dtype=dt))

    def exact(t, extra):
        return lambda: be.run_w4a4(t["x"], t["qweight"], t["wscales"], t["smooth"], t["proj_down"], t["proj_up"],
                                   t["wcscale"], t["bias"], extra)

    for dt in dtypes:
        name = str(dt).removeprefix("torch.")
        for m, k, n in big + small:
            # canonical weights, with the prepared 1 / smooth (sm90._exact_inv) as every prepared layer has it
            yield f"exact_m{m}_{k}x{n}_{name}", exact(layer(m, k, n, dt), [torch.ones(k)])
            if not quick and (k, n) == (3072, 3072):  # a layer without a low-rank branch
                yield f"exact_r0_m{m}_{k}x{n}_{name}", exact(layer(m, k, n, dt, r=0), [torch.ones(k)])
        if sm90._quack_module() is not None and dt == torch.bfloat16:  # the small-M kernel on quack's blob
            for m, k, n in repacked:
                t = layer(m, k, n, dt)
                prepared = be.prepare(SVDQW4A4Linear(k, n, rank=32, dtype=dt), torch.device("cpu"))
                t["qweight"] = torch.empty(0, dtype=torch.uint8)  # replaced by the blob, as on the GPU
                yield f"exact_quack_m{m}_{k}x{n}", exact(t, prepared.tensors())
            t2 = layer(128, 3072, 3072, dt)  # the pass that quack's GEMM reads (bf16 activations)
            yield f"exact_quack_pass_{name}", lambda t2=t2: kernels.quantize_act(
                t2["x"], t2["smooth"], out_dtype=torch.bfloat16, inv_smooth=t2["smooth"])
        for m, k, n in adaln if dt != torch.float32 else []:  # W4A16 takes 16-bit activations only
            t = layer(m, k, n, dt)
            yield f"w4a16_m{m}_{k}x{n}_{name}", (lambda t=t: be.run_w4a16(t["x"], t["qweight"], t["wscales"],
                                                                           t["wcscale"], t["bias"], []))
        for m, k in fast:
            x, inv = torch.zeros(m, k, dtype=dt), torch.ones(k)
            pds = torch.zeros(k, 32, dtype=torch.bfloat16)

            def fast_pass(x=x, inv=inv, pds=pds):
                # without a low-rank branch, and where small_m_mma serves the call (lora_act on cuBLAS)
                kernels.quantize_act_fp8(x, inv, inv_smooth=inv, gemm_order=True)
                # quack's FP8 GEMM with the low-rank MMA in its accumulator: lora_act, then the pass that
                # divides it by the token scale
                kernels.quantize_act_fp8(x, inv, lora=be._lora_act(x, pds), inv_smooth=inv, gemm_order=True)

            yield f"fast_m{m}_{k}_{name}", fast_pass
            if dt != torch.float32 and k <= kernels.ROW_MAX_K and tuning.lora_act_plan(m, k, 32) is not None:
                yield f"pdl_m{m}_{k}_{name}", lambda x=x, inv=inv, pds=pds: _pdl_pair(kernels, tuning, x, inv, pds)
        for m, ka, kb in gelu_in if dt != torch.float32 else []:  # 16-bit inputs only
            xa = torch.zeros(m, ka, dtype=dt) if ka else None
            xb, inv = torch.zeros(m, kb, dtype=dt), torch.ones(ka + kb)
            pds = torch.zeros(ka + kb, 32, dtype=torch.bfloat16)

            def gelu_pass(xa=xa, xb=xb, inv=inv, pds=pds):
                kernels.quantize_act_fp8_cat(xa, xb, inv, gemm_order=True)  # no low-rank branch
                kernels.quantize_act_fp8_cat(xa, xb, inv, lora=be._lora_act_cat(xa, xb, pds), gemm_order=True)
                kernels.quantize_act_cat(xa, xb, inv, inv_smooth=inv)  # the exact mode's (lora_act: the same launch)

            yield f"fast_gelu_in_m{m}_{ka}+{kb}_{name}", gelu_pass
        # the passes that normalize as they load (forward_ada_norm: Flux blocks' fused q/k/v, a single block's
        # q/k/v + MLP, the feed-forwards' first linears), both modes, bf16 (quack's GEMMs), the prepared
        # proj_down / smooth's widths (a window of 32 a part: 32, 96, 128)
        from .backends.sm90 import norm_pass

        for m, r in ([(4608, 128)] if quick else [(m, r) for m in (4096, 4608) for r in (32, 96, 128)]):
            if dt != torch.bfloat16:
                break
            x, mod, inv = torch.zeros(m, 3072, dtype=dt), torch.zeros(3, 3072, dtype=dt), torch.ones(3072)
            pds = torch.zeros(3072, r, dtype=torch.bfloat16)

            def norm_in(x=x, mod=mod, inv=inv, pds=pds):
                norm_pass.ada_norm_exact(x, mod[:1], mod[1:2], 1e-6, inv, pds, out_dtype=torch.bfloat16)
                norm_pass.ada_norm_fast(x, mod[:1], mod[1:2], 1e-6, inv, pds)
                _norm_forms(kernels, norm_pass, x, mod, inv, pds)

            yield f"norm_in_m{m}_r{r}", norm_in


def _norm_forms(kernels, norm_pass, x, mod, inv, pds) -> None:
    """The norm pass's pair form (the backend's default form) and rows form in both modes: their launches one
    after the other (an eager call) and as the PDL pairs a captured graph launches (the device check is the
    target's, as ``_pdl_pair``'s; not where this Triton has no grid dependency control)."""
    import torch

    real = kernels.pdl_supported
    kernels.pdl_supported = lambda device=None: True  # compiling for sm_90a, which has it
    try:
        for form, pdl in itertools.product(("pair", "rows"), (False, True) if kernels.gdc_wait is not None
                                           else (False,)):
            norm_pass.ada_norm_exact(x, mod[:1], mod[1:2], 1e-6, inv, pds, out_dtype=torch.bfloat16, form=form,
                                     pdl=pdl)
            norm_pass.ada_norm_fast(x, mod[:1], mod[1:2], 1e-6, inv, pds, form=form, pdl=pdl)
    finally:
        kernels.pdl_supported = real


def _pdl_pair(kernels, tuning, x, inv, pds) -> None:
    """The PDL pair's launches for one layer (its ``lora_act`` plan): ``lora_act`` as the first grid of the
    pair, then the exact mode's pass and the fast mode's as its programmatic dependents. The pair's device
    check (``kernels.pdl_supported``: a GPU of capability 9.0 or later) is the target's here; a Triton without
    grid dependency control has no pair to compile."""
    import torch

    if kernels.gdc_wait is None:
        return
    plan = tuning.lora_act_plan(x.shape[0], x.shape[1], pds.shape[1])
    real = kernels.pdl_supported
    kernels.pdl_supported = lambda device=None: True  # compiling for sm_90a, which has it
    try:
        part = kernels.lora_act(x, pds, torch.float32, block_m=plan.block_m, split=plan.split,
                                num_warps=plan.num_warps, num_stages=plan.num_stages, pdl=True)
        kernels.quantize_act_after_lora(x, inv, part, inv_smooth=inv)
        kernels.quantize_act_fp8(x, inv, lora=part, inv_smooth=inv, gemm_order=True, lora_pdl=True)
    finally:
        kernels.pdl_supported = real


def precompile_sm90(out_dir: Path, keep_sass: bool = False, quick: bool = False) -> list[dict]:
    """Compile the sm90 Triton kernels for sm_90a into ``out_dir`` (``compile_launches`` over
    ``_sm90_calls``); one report record per distinct kernel, named by its kernel and first layer."""
    os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the CPU interpreter
    os.environ["TRITON_CACHE_DIR"] = str(out_dir / "triton-cache")
    from triton.backends.compiler import GPUTarget

    from .backends.sm90 import kernels, small_m

    if kernels._INTERPRET or small_m._INTERPRET:
        raise RuntimeError("svdq-precompile needs the real Triton compiler: run it in a process started "
                           "without TRITON_INTERPRET=1 (the sm90 kernels were imported for the interpreter)")
    sass_dir = out_dir / "sass-sm_90a"
    sass_dir.mkdir(parents=True, exist_ok=True)
    records, seen, labels = [], set(), set()
    with compile_launches(GPUTarget("cuda", 90, 32)) as compiled:
        for tag, call in _sm90_calls(quick):
            before = len(compiled)
            call()
            for fn_name, ck in compiled[before:]:
                if ck.hash in seen:
                    continue
                seen.add(ck.hash)
                base = f"{fn_name.strip('_').removesuffix('_kernel')}_{tag}"
                # another specialization of the same kernel for this layer: _2, _3, ...
                label = next(x for x in itertools.chain([base], (f"{base}_{i}" for i in itertools.count(2)))
                             if x not in labels)
                labels.add(label)
                records.append({"kernel": label, "arch": "sm_90a", "shared_bytes": ck.metadata.shared,
                                "constants": _constants(ck),
                                **_sass_stats(ck.asm["cubin"], sass_dir, label, keep_sass)})
    return records


def _constants(ck) -> dict:
    """The compiled kernel's constexpr arguments by name (JSON-friendly), for the report."""
    src = getattr(ck, "src", None)
    fn, consts = getattr(src, "fn", None), getattr(src, "constants", {}) or {}
    names = getattr(fn, "arg_names", [])
    out = {}
    for key, v in consts.items():
        idx = key[0] if isinstance(key, tuple) else key
        name = names[idx] if isinstance(idx, int) and idx < len(names) else str(key)
        out[name] = v if isinstance(v, (int, float, bool, str)) or v is None else str(v)
    return out


def precompile_sm90_quack(out_dir: Path, keep_sass: bool = False, quick: bool = False,
                          python: str | None = None) -> list[dict]:
    """Compile the quack-kernels GEMMs (exact W4A16 decode, fast FP8 decode) into ``DIR/quack-cache``
    (``QUACK_CACHE_DIR`` on the GPU machine), in a child process; [] where quack is not installed.
    ``python`` ("3.12"): also file them for that interpreter (``quack_precompile.file_for_python``)."""
    try:
        import quack  # noqa: F401
    except ImportError:
        return []
    dump = out_dir / "quack-dump"
    proc = subprocess.run(
        [sys.executable, "-m", "svdq_linear.backends.sm90.quack_precompile", "--cache", str(out_dir / "quack-cache"),
         "--dump", str(dump)] + (["--quick"] if quick else []) + (["--python", python] if python else []),
        capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    records = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            cubin = rec.pop("cubin", None)
            if cubin:
                rec.update(_sass_stats(Path(cubin).read_bytes(), out_dir / "sass-sm_90a", rec["kernel"], keep_sass))
            records.append({"arch": "sm_90a", **rec})
    if proc.returncode != 0:
        records.append({"kernel": "quack", "arch": "sm_90a", "ok": False, "error": proc.stderr[-2000:]})
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="svdq-precompile", description=__doc__.splitlines()[0])
    p.add_argument("--arch", required=True, choices=["sm_90a", "sm_100a", "sm_103a"])
    p.add_argument("--out", default="svdq-precompiled", help="output folder (default: %(default)s)")
    p.add_argument("--keep-sass", action="store_true", help="write each kernel's SASS")
    p.add_argument("--quick", action="store_true", help="a representative subset (CI)")
    p.add_argument("--python", default=None, metavar="X.Y",
                   help="sm_90a: also file quack's cache for the GPU machine's Python X.Y (quack keys by it)")
    args = p.parse_args(argv)
    if args.python and not re.fullmatch(r"3\.\d+", args.python):
        p.error(f"--python takes a version like 3.12, got {args.python!r}")
    if args.arch != "sm_90a" and (args.quick or args.python):
        p.error(f"--quick and --python apply to --arch sm_90a, not {args.arch}")
    if not args.out.strip():
        p.error("--out: expected a folder, got ''")
    out_dir = Path(args.out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {args.out}: {e.strerror or e}")
    if args.arch == "sm_90a":
        records = precompile_sm90(out_dir, args.keep_sass, args.quick)
        records += precompile_sm90_quack(out_dir, args.keep_sass, args.quick, args.python)
    else:
        try:
            from .backends.sm100.precompile import precompile_sm100
        except ImportError as e:
            print(f"svdq-precompile: the sm100 kernels are not available here ({e})", file=sys.stderr)
            return 2
        records = precompile_sm100(args.arch, out_dir, args.keep_sass)
    (out_dir / f"report-{args.arch}.json").write_text(json.dumps(records, indent=1))
    for r in records:
        print(" ".join(f"{k}={v}" for k, v in r.items() if k != "sass"))
    failed = [r for r in records if r.get("ok") is False]
    print(f"{len(records) - len(failed)} kernels compiled for {args.arch} into {out_dir}")
    if failed:
        print(f"svdq-precompile: {len(failed)} kernels failed to compile (report-{args.arch}.json holds their "
              f"errors)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
