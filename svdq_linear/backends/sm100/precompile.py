"""Compile every sm100 configuration the library uses, with no GPU, and read back what ptxas made.

``precompile_sm100(arch, out_dir, keep_sass)`` compiles ``host.LIBRARY_CONFIGS`` for ``sm_100a`` or
``sm_103a`` (each in a fresh process, two at a time), and returns one record per kernel: the
configuration, registers, stack frame, the SASS instruction counts CI asserts on (2-CTA block-scaled
MMAs ``UTCOMMA``, low-rank MMAs ``UTCHMMA``, TMA loads ``UTMALDG``, TMA stores ``UTMASTG``, local
memory ``LDL``/``STL``) and the path of the SASS when kept.

Registers come from the cubin's ``EIATTR_REGCOUNT``; SASS from ``nvdisasm`` (``$PATH``, Triton's
bundled copy, or pip ``nvidia-cuda-nvdisasm``).

    python -m svdq_linear.backends.sm100.precompile --arch sm_100a [--out DIR] [--keep-sass]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .host import LIBRARY_CONFIGS, KernelConfig

ARCHES = ("sm_100a", "sm_103a")
SASS_COUNTS = {
    "UTCOMMA": r"\bUTCOMMA\b[.\w]*",
    "UTCOMMA.2CTA": r"\bUTCOMMA\.2CTA\b[.\w]*",
    "UTCHMMA": r"\bUTCHMMA\b[.\w]*",
    "UTCCP": r"\bUTCCP\b[.\w]*",
    "UTMALDG": r"\bUTMALDG\b[.\w]*",
    "UTMASTG": r"\bUTMASTG\b[.\w]*",
    "LDL": r"\bLDL\b[.\w]*",
    "STL": r"\bSTL\b[.\w]*",
}


def find_nvdisasm() -> str | None:
    env = os.environ.get("SVDQ_NVDISASM")
    if env:
        return env
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    try:
        import nvidia.cuda_nvdisasm as m  # pip nvidia-cuda-nvdisasm

        for cand in Path(list(m.__path__)[0]).rglob("nvdisasm"):
            return str(cand)
    except ImportError:
        pass
    return None


def cubin_resources(path: Path) -> dict:
    """``{"registers", "frame_bytes"}`` of the (single) kernel of a cubin, read from its ELF
    ``.nv.info`` attributes (EIATTR_REGCOUNT 0x2f, EIATTR_FRAME_SIZE 0x11/0x12)."""
    d = path.read_bytes()
    shoff = struct.unpack_from("<Q", d, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    stro = secs[shstrndx][4]

    def name(n):
        return d[stro + n : d.index(b"\0", stro + n)].decode()

    regs, frame = [], []
    for sh_name, _typ, _flags, _addr, off, size, *_ in secs:
        if not name(sh_name).startswith(".nv.info"):
            continue
        p = off
        while p < off + size:
            fmt, attr = d[p], d[p + 1]
            if fmt == 4:  # EIFMT_SVAL: u16 size + payload
                sz = struct.unpack_from("<H", d, p + 2)[0]
                val = d[p + 4 : p + 4 + sz]
                p += 4 + sz
            else:
                val = None
                p += 2 if fmt == 1 else 4
            if val is not None and len(val) == 8:
                _sym, v = struct.unpack("<II", val)
                if attr == 0x2F:
                    regs.append(v)
                elif attr in (0x11, 0x12):
                    frame.append(v)
    return {"registers": max(regs) if regs else None, "frame_bytes": max(frame) if frame else 0}


def accumulate_flags(ptx: str) -> dict:
    """How each ``tcgen05.mma`` sets enable-input-d (ACCUMULATE), in program order: ``"true"`` for a
    constant ``mov.pred %p, -1``, ``"runtime"`` for a computed predicate. Keys ``"block_scaled"`` and
    ``"low_rank"`` (kind::f16)."""
    defs = {}
    for m in re.finditer(r"mov\.pred\s+(%p\d+),\s*(-?\d+);", ptx):
        defs[m.group(1)] = "true" if m.group(2) in ("-1", "1") else "false"
    out = {"block_scaled": [], "low_rank": []}
    for m in re.finditer(r"tcgen05\.mma\.[^\n]*?kind::(\w+)[^\n]*,\s*(%p\d+);", ptx):
        kind = "block_scaled" if m.group(1).startswith("mxf4") else "low_rank"
        out[kind].append(defs.get(m.group(2), "runtime"))
    return out


def tma_load_masks(ptx: str) -> list[str]:
    """The CTA mask of every TMA load into shared memory, in program order: ``"self"`` for a load without
    multicast (it lands in the issuing CTA, or in the pair's shared barrier under ``cta_group::2``), the mask's
    value for a multicast load whose mask is a compile-time constant (``mov.b16 %rs, 3``: both CTAs of a pair),
    ``"runtime"`` for one computed at run time (e.g. ``1 << cta_rank``: the issuing CTA alone)."""
    defs = {m.group(1): m.group(2) for m in re.finditer(r"mov\.b16\s+(%rs\d+),\s*(\d+);", ptx)}
    out = []
    for m in re.finditer(r"cp\.async\.bulk\.tensor\.[^\n]*?shared::(?:cta|cluster)\.global[^\n]*", ptx):
        line = m.group(0)
        if ".multicast::cluster" not in line:
            out.append("self")
            continue
        mask = re.search(r"\],\s*(%rs\d+),", line)
        out.append(defs.get(mask.group(1), "runtime") if mask else "runtime")
    return out


def sass_counts(sass: str) -> dict:
    return {k: len(re.findall(p, sass)) for k, p in SASS_COUNTS.items()}


def _compile_in_subprocess(args: list[str], dump: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    arch = args[args.index("--arch") + 1]
    env = {
        **os.environ,
        "CUTE_DSL_ARCH": arch,
        "CUTE_DSL_KEEP": "ptx,cubin",
        "CUTE_DSL_DUMP_DIR": str(dump),
        "CUTE_DSL_CACHE_DIR": str(dump / "cache"),
        "CUTE_DSL_DISABLE_FILE_CACHING": "1",
        "PYTHONWARNINGS": "ignore",
    }
    return subprocess.run(
        [sys.executable, "-m", "svdq_linear.backends.sm100.precompile", *args],
        env=env, capture_output=True, text=True, timeout=timeout,
    )


def _record(name: str, config: dict, arch: str, dump: Path, out_dir: Path, keep_sass: bool, nvdisasm, r) -> dict:
    rec = {"name": name, "arch": arch, "config": config, "ok": r.returncode == 0}
    if r.returncode != 0:
        rec["error"] = (r.stderr or r.stdout)[-4000:]
        return rec
    cubins = sorted(dump.glob(f"*.{arch}.cubin"))
    if not cubins:
        rec.update(ok=False, error=f"no .{arch}.cubin written in {dump}")
        return rec
    cubin = out_dir / f"{name}.{arch}.cubin"
    shutil.copyfile(cubins[0], cubin)
    rec.update(cubin_resources(cubin))
    rec["cubin"] = str(cubin)
    ptxs = sorted(dump.glob(f"*.{arch}.ptx"))
    if ptxs:
        ptx = ptxs[0].read_text()
        rec["accumulate_flags"] = accumulate_flags(ptx)
        rec["tma_load_masks"] = tma_load_masks(ptx)
    if nvdisasm:
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
        rec["sass_counts"] = sass_counts(sass)
        rec["spills"] = rec["sass_counts"]["LDL"] + rec["sass_counts"]["STL"]
        if keep_sass:
            p = out_dir / f"{name}.{arch}.sass"
            p.write_text(sass)
            rec["sass"] = str(p)
    return rec


def _one_config(cfg: KernelConfig, arch: str, out_dir: Path, keep_sass: bool, nvdisasm) -> dict:
    with tempfile.TemporaryDirectory(prefix="svdq-sm100-") as tmp:
        dump = Path(tmp)
        r = _compile_in_subprocess(["--_one", json.dumps(dataclasses.asdict(cfg)), "--arch", arch], dump)
        return _record(cfg.name, dataclasses.asdict(cfg), arch, dump, out_dir, keep_sass, nvdisasm, r)


def precompile_sm100(arch: str, out_dir: Path, keep_sass: bool = False, configs=None, jobs: int | None = None) -> list[dict]:
    """Compile ``configs`` (default: every library configuration) for ``arch``; one record each."""
    if arch not in ARCHES:
        raise ValueError(f"expected arch in {ARCHES}, got {arch!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nvdisasm = find_nvdisasm()
    configs = LIBRARY_CONFIGS if configs is None else configs
    jobs = jobs or max(1, min(len(configs), os.cpu_count() or 1))
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda c: _one_config(c, arch, out_dir, keep_sass, nvdisasm), configs))


def precompile_baselines(arch: str, out_dir: Path, keep_sass: bool = False) -> list[dict]:
    """quack's ``GemmSm100`` (block-scaled NVFP4, 2-CTA 256x128, bf16 out) compiled the same way, as
    the no-low-rank reference for registers, and CUTLASS's block-scaled example when
    ``$SVDQ_CUTLASS_BLOCKSCALED_EXAMPLE`` names its file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    nvdisasm = find_nvdisasm()
    recs = []
    with tempfile.TemporaryDirectory(prefix="svdq-sm100-base-") as tmp:
        dump = Path(tmp)
        r = _compile_in_subprocess(["--_quack", "--arch", arch], dump)
        recs.append(_record("quack_GemmSm100_nvfp4_256x128_2cta", {}, arch, dump, out_dir, keep_sass, nvdisasm, r))
    example = os.environ.get("SVDQ_CUTLASS_BLOCKSCALED_EXAMPLE")
    if example:
        with tempfile.TemporaryDirectory(prefix="svdq-sm100-base-") as tmp:
            dump = Path(tmp)
            r = _compile_in_subprocess(["--_cutlass_example", example, "--arch", arch], dump)
            recs.append(_record("cutlass_example_nvfp4_256x128_2cta", {}, arch, dump, out_dir, keep_sass, nvdisasm, r))
    return recs


def _compile_one_here(cfg_json: str, arch: str) -> None:
    from .kernel import compile_kernel

    compile_kernel(KernelConfig(**json.loads(cfg_json)), arch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_100a", choices=ARCHES)
    ap.add_argument("--out", type=Path, default=Path("svdq-precompile-out"))
    ap.add_argument("--keep-sass", action="store_true")
    ap.add_argument("--baselines", action="store_true", help="also compile quack's GemmSm100")
    ap.add_argument("--_one", help=argparse.SUPPRESS)
    ap.add_argument("--_quack", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_cutlass_example", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._one:
        _compile_one_here(a._one, a.arch)
        return 0
    if a._cutlass_example:
        from ._baselines import compile_cutlass_example

        compile_cutlass_example(a.arch, a._cutlass_example)
        return 0
    if a._quack:
        from ._baselines import compile_quack_nvfp4

        compile_quack_nvfp4(a.arch)
        return 0
    recs = precompile_sm100(a.arch, a.out, a.keep_sass)
    if a.baselines:
        recs += precompile_baselines(a.arch, a.out, a.keep_sass)
    (a.out / f"precompile-{a.arch}.json").write_text(json.dumps(recs, indent=1))
    print(f"{'kernel':60} {'regs':>5} {'spill':>5} {'UTCOMMA.2CTA':>12} {'UTCOMMA':>8} {'UTCHMMA':>8} {'UTMALDG':>8}")
    bad = 0
    for r in recs:
        if not r["ok"]:
            bad += 1
            print(f"{r['name']:60} FAILED\n{r['error']}")
            continue
        c = r.get("sass_counts", {})
        print(f"{r['name']:60} {r['registers']:>5} {r.get('spills', '?'):>5} {c.get('UTCOMMA.2CTA', '?'):>12} "
              f"{c.get('UTCOMMA', '?'):>8} {c.get('UTCHMMA', '?'):>8} {c.get('UTMALDG', '?'):>8}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
