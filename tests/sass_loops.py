"""What the SASS tests share: a Triton kernel compiled for sm_90a here (no GPU needed: the real compiler) and its
loops read from ``cuobjdump``. Imported by the tests' child processes (``sys.path`` gets this folder)."""

from __future__ import annotations

import collections
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from svdq_linear.precompile import _nvidia_bin


def compile_sm90(fn, sig: dict, cx: dict, cubin: str, not_divisible: tuple = (), num_warps: int = 4) -> str:
    """The SASS text of ``fn`` (a ``triton.jit`` kernel) with constexprs ``cx`` (those left out at their defaults)
    and the other arguments typed by ``sig``; every non-constexpr argument but ``not_divisible`` is declared a
    multiple of 16, as Triton specializes them at a launch. The cubin is kept at ``cubin``."""
    cx = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **cx}
    full = {a: ("constexpr" if a in cx else sig[a]) for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a not in cx and a not in not_divisible}
    ck = triton.compile(ASTSource(fn, full, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                        options=dict(num_warps=num_warps))
    with open(cubin, "wb") as f:
        f.write(ck.asm["cubin"])
    return subprocess.run([_nvidia_bin("cuobjdump"), "--dump-sass", cubin], capture_output=True, text=True,
                          check=True).stdout


def instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, text)`` of every instruction."""
    return [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def loop_bodies(sass: str) -> list[list[str]]:
    """The instructions between each backward branch's target and the branch, in address order."""
    ins = instructions(sass)
    loops = [(lo, addr) for addr, t in ins if (b := re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", t))
             and (lo := int(b.group(1), 16)) < addr]
    return [[t for a, t in ins if lo <= a <= hi] for lo, hi in loops]


def loop_with(sass: str, key: str, longest: bool = True) -> list[str]:
    """The loop whose body holds an instruction containing ``key``: the longest such loop, or (``longest``
    False) the first one."""
    bodies = [b for b in loop_bodies(sass) if any(key in t for t in b)]
    assert bodies, f"no loop holds {key} in the SASS"
    return max(bodies, key=len) if longest else bodies[0]


def opcodes(lines) -> collections.Counter:
    """Opcode counts (the predicate stripped) of SASS instruction texts."""
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in lines)


def run_script(script: str, tmp_path, timeout: int = 900) -> dict:
    """Runs a SASS test's ``script`` in a child process (``argv``: ``tmp_path`` for its cubins, then this
    folder), without the Triton interpreter, and returns the JSON object its last line prints. Skips where
    this Triton's CUDA backend has no ``cuobjdump``."""
    import json
    import os
    import sys

    import pytest

    if not os.path.exists(_nvidia_bin("cuobjdump")):
        pytest.skip("no cuobjdump in this Triton's CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path), os.path.dirname(os.path.abspath(__file__))],
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
