"""``svdq-precompile``: compile the library's GPU kernels on a machine without a GPU.

    svdq-precompile --arch sm_90a [--out DIR] [--keep-sass] [--quick] [--python X.Y]

``sm_90a``: every Triton kernel variant the sm90 backend launches for the Flux.1 and SD3.5 shapes
(the activation pass per input dtype, the W4 GEMM per tile configuration of ``configs.json`` with and
without bias / low-rank, bf16 and fp16) is compiled for compute capability 9.0 into
``DIR/triton-cache`` (point ``TRITON_CACHE_DIR`` there on the GPU machine: the runtime finds the
same specialisations there instead of compiling; the cache is specific to the Triton version that
wrote it). ``--keep-sass`` also writes each kernel's SASS; a JSON report lists registers, spills,
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
import json
import os
import re
import subprocess
import sys
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
    cub = work / f"{name}.cubin"
    cub.write_bytes(cubin)
    sass = subprocess.run([_nvidia_bin("cuobjdump"), "--dump-sass", str(cub)], capture_output=True, text=True,
                          check=True).stdout
    res = subprocess.run([_nvidia_bin("cuobjdump"), "--dump-resource-usage", str(cub)], capture_output=True,
                         text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    stats = {
        "registers": int(regs.group(1)) if regs else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "hgmma": len(re.findall(r"\bHGMMA\.", sass)),
        "qgmma": len(re.findall(r"\bQGMMA\.", sass)),
        "local_memory": len(re.findall(r"\b(?:LDL|STL)\b", sass)),
    }
    if keep_sass:
        (work / f"{name}.sass").write_text(sass)
        stats["sass"] = str(work / f"{name}.sass")
    cub.unlink()
    return stats


def _variants_sm90(quick: bool):
    """(kernel, signature, constexprs, options, label) for each specialisation the backend launches."""
    from .backends.sm90 import kernels, tuning

    k_ptr = {torch_name: f"*{t}" for torch_name, t in (("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"))}
    out = []
    for xdt in (["bf16"] if quick else ["bf16", "fp16", "fp32"]):
        sig = dict(x_ptr=k_ptr[xdt], smooth_ptr="*fp32", xq_ptr="*bf16" if xdt == "fp32" else k_ptr[xdt],
                   codes_ptr="*u8", scales_ptr="*u8", M="i32", K="i32", stride_xm="i32", stride_xk="i32")
        cx = dict(BLOCK_M=8, BLOCK_K=256, WRITE_XQ=True, WRITE_CODES=False)
        out.append((kernels._quantize_act_kernel, sig, cx, dict(num_warps=4), f"quantize_act_{xdt}"))
        # with lora_act / sa for the low-rank MMA in the accumulator, at the converter's default rank 32
        sig = dict(x_ptr=k_ptr[xdt], smooth_ptr="*fp32", a8_ptr="*u8", sa_ptr="*fp32", lora_ptr="*fp32",
                   pds_ptr="*fp32", la_ptr="*bf16", M="i32", K="i32", R="i32", stride_xm="i32", stride_xk="i32")
        out.append((kernels._quantize_act_fp8_kernel, sig,
                    dict(BLOCK_M=4, BLOCK_K=512, BLOCK_R=32, HAS_LORA=True, FUSE_LORA=False, DOT_F32=False,
                         GEMM_ORDER=True, NSPLIT=1), dict(num_warps=4),
                    f"quantize_act_fp8_{xdt}"))
        # the one-pass kernel (the default; the fast GEMM's k order, as the backend writes it), at the row widths of Flux.1 and SD3.5 inputs
        for k in ((3072,) if quick else (2432, 3072, 3840, 10240, 12288, 15360)):
            rows, c, nch, warps = kernels.fp8_rows_config(k)
            sig1 = dict(x_ptr=k_ptr[xdt], inv_ptr="*fp32", a8_ptr="*fp8e4nv", sa_ptr="*fp32", lora_ptr="*fp32",
                        la_ptr="*bf16", M="i32", K="i32", R="i32", stride_xm="i32")
            # lora_act's partial sums from kernels.lora_act (tuning.LORA_ACT_CONFIG's split) from 128 tokens,
            # one cuBLAS result below
            lora_split = tuning.lora_act_plan(4096, k, 32).split
            for nsplit in ((lora_split,) if quick else (lora_split, 1)):
                out.append((kernels._quantize_act_fp8_rows_kernel, sig1,
                            dict(ROWS=rows, C=c, NCH=nch, BLOCK_R=32, HAS_LORA=True, HW_CVT=True, CANON_NAN=True,
                                 GEMM_ORDER=True, NSPLIT=nsplit),
                            dict(num_warps=warps), f"quantize_act_fp8_rows_k{k}_{xdt}_lora{nsplit}"))
        sig = dict(sig, pds_ptr="*bf16")  # lora_act computed in the pass (proj_down_smoothed=)
        out.append((kernels._quantize_act_fp8_kernel, sig,
                    dict(BLOCK_M=16, BLOCK_K=128, BLOCK_R=32, HAS_LORA=False, FUSE_LORA=True, DOT_F32=False, GEMM_ORDER=True,
                         NSPLIT=1),
                    dict(num_warps=4), f"quantize_act_fp8_lora_{xdt}"))
        # kernels.lora_act as the fast mode runs it (tuning.LORA_ACT_CONFIG), rank 32
        bm, _, warps, stages = tuning.LORA_ACT_CONFIG
        sig = dict(x_ptr=k_ptr[xdt], pd_ptr="*bf16", out_ptr="*fp32", M="i32", K="i32", R="i32", stride_xm="i32",
                   K_SPLIT="i32")
        out.append((kernels._lora_act_kernel, sig,
                    dict(BLOCK_M=bm, BLOCK_K=128, BLOCK_R=32, NUM_STAGES=stages, DOT_F32=False),
                    dict(num_warps=warps), f"lora_act_{xdt}"))
    out += _variants_small_m(quick)
    seen = set()
    for m, k, n in (SHAPES[:2] + SHAPES[-3:] if quick else SHAPES):
        cfg = tuning.pick(m, n, k)
        for dt in (["bf16"] if quick else ["bf16", "fp16"]):
            for has_lora in (True, False):
                key = (cfg, dt, has_lora, k % cfg.block_k == 0)
                if key in seen:
                    continue
                seen.add(key)
                sig = dict(a_ptr=f"*{dt}", w_ptr="*u8", ws_ptr="*u8", wc_ptr="*fp32", bias_ptr=f"*{dt}",
                           up_ptr=f"*{dt}", lora_ptr="*bf16", out_ptr=f"*{dt}", part_ptr="*fp32", M="i32", N="i32",
                           K="i32", R="i32", stride_am="i32", stride_om="i32", k_per_split="i32")
                split = tuning.split_for(cfg, m, n, k) if cfg.split_k == 0 else cfg.split_k
                cx = dict(BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_R=32,
                          GROUP_N=cfg.group_n, SPLIT_K=split, EVEN_K=True, HAS_BIAS=True, HAS_LORA=has_lora,
                          DOT_F32=False)
                label = (f"w4_gemm_{dt}_{cfg.block_n}x{cfg.block_m}x{cfg.block_k}_s{split}"
                         f"_w{cfg.num_warps}{'_lora' if has_lora else ''}")
                out.append((kernels._w4_gemm_kernel, sig, cx,
                            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), label))
    return out


def _variants_small_m(quick: bool):
    """The small-M kernel (``backends/sm90/small_m.py``) as the backend launches it: W4A16 on the
    canonical layout, the exact mode quantizing in the kernel (canonical and quack layouts) or reading
    ``xq``; multiply-adds where ``small_m.use_fma``, a dot elsewhere."""
    from .backends.sm90 import small_m as sm

    out = []
    cases = [  # (layout, act, x dtype, block_m, use_dot, label)
        (sm.CANONICAL, sm.ACT_X, "bf16", 1, False, "w4a16_m1"),
        (sm.QUACK, sm.ACT_NVFP4, "bf16", 1, False, "exact_quack_m1"),
        (sm.QUACK, sm.ACT_X, "bf16", 64, True, "exact_quack_xq_m64"),
    ]
    if not quick:
        cases += [
            (sm.CANONICAL, sm.ACT_X, "bf16", 2, False, "w4a16_m2"),
            (sm.CANONICAL, sm.ACT_X, "fp16", 1, False, "w4a16_fp16_m1"),
            (sm.CANONICAL, sm.ACT_X, "bf16", 16, True, "w4a16_m16"),
            (sm.CANONICAL, sm.ACT_X, "bf16", 32, True, "w4a16_m32"),
            (sm.CANONICAL, sm.ACT_NVFP4, "bf16", 2, False, "exact_m2"),
        ]
    for layout, act, xdt, bm, dot, label in cases:
        for split, lora in ((2, True), (1, False)):
            sig = dict(x_ptr=f"*{xdt}", smooth_ptr="*fp32", w_ptr="*u8", s_ptr="*u8", cs_ptr="*fp32", bias_ptr="*bf16",
                       up_ptr="*bf16", lora_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32", M="i32",
                       N="i32", K="i32", R="i32", stride_xm="i32", stride_lm="i32", stride_om="i32", stride_w="i32",
                       stride_s="i32", k_per_split="i32", SPLIT_K="i32")
            words = layout == sm.CANONICAL and not dot  # the word decode at its tile (Flux widths divide it)
            bn, bk = sm.WORDS_TILE[act] if words else (64, 128 if dot else 64)
            cx = dict(LAYOUT=layout, ACT=act, BLOCK_N=bn, BLOCK_M=bm, BLOCK_K=bk,
                      RC=32, EVEN_K=True, NUM_STAGES=3, IS_SPLIT=split > 1, HAS_BIAS=True, HAS_LORA=lora, USE_DOT=dot,
                      DOT_F32=False, WORDS=words, ASM=words, PREFETCH=False, CHAIN=words and sm.WORDS_CHAIN)
            out.append((sm._small_m_kernel, sig, cx, dict(num_warps=4),
                        f"small_m_{label}_s{split}{'_lora' if lora else ''}"))
    return out


def precompile_sm90(out_dir: Path, keep_sass: bool = False, quick: bool = False) -> list[dict]:
    """Compile the sm90 Triton kernels for sm_90a into ``out_dir``; one report record per kernel."""
    os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the CPU interpreter
    os.environ["TRITON_CACHE_DIR"] = str(out_dir / "triton-cache")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    sass_dir = out_dir / "sass-sm_90a"
    sass_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for fn, sig, cx, opts, label in _variants_sm90(quick):
        full = {name: ("constexpr" if name in cx else sig[name]) for name in fn.arg_names}
        # What the runtime specialises: pointers and the integer sizes/strides are 16-divisible.
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                 if name not in cx and name not in ("R", "M")}
        ck = triton.compile(ASTSource(fn, full, constexprs=cx, attrs=attrs), target=target, options=opts)
        rec = {"kernel": label, "arch": "sm_90a", "shared_bytes": ck.metadata.shared,
               **_sass_stats(ck.asm["cubin"], sass_dir, label, keep_sass)}
        records.append(rec)
    return records


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
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
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
    print(f"{len(records)} kernels compiled for {args.arch} into {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
