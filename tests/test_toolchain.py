"""The kernels extra (nvidia-cutlass-dsl) compiles CuTe DSL for Hopper and Blackwell on a CPU machine.

Backends build on this: no GPU or driver is needed to compile, so CI checks every target. This test
compiles a small kernel in a fresh process per target and reads the PTX the DSL keeps.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("cutlass", reason="the [kernels] extra (nvidia-cutlass-dsl) is not installed")

KERNEL = textwrap.dedent(
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    @cute.kernel
    def scale_kernel(x: cute.Tensor, y: cute.Tensor, s: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        y[i] = x[i] * s

    @cute.jit
    def scale(x: cute.Tensor, y: cute.Tensor, s: cutlass.Float32, stream):
        scale_kernel(x, y, s).launch(grid=[cute.size(x) // 128, 1, 1], block=[128, 1, 1], stream=stream)

    x = make_fake_compact_tensor(cutlass.Float32, (4096,))
    y = make_fake_compact_tensor(cutlass.Float32, (4096,))
    cute.compile(scale, x, y, cutlass.Float32(2.0), make_fake_stream())
    """
)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_cute_dsl_compiles_without_a_gpu(arch, tmp_path):
    env = {**os.environ, "CUTE_DSL_ARCH": arch, "CUTE_DSL_KEEP": "ptx,cubin",
           "CUTE_DSL_DUMP_DIR": str(tmp_path), "CUTE_DSL_CACHE_DIR": str(tmp_path / "cache")}
    script = tmp_path / "kernel.py"  # the DSL reads the kernel's source: it must live in a file
    script.write_text(KERNEL)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = [p for p in tmp_path.iterdir() if p.name.endswith(f".{arch}.ptx")]
    cubin = [p for p in tmp_path.iterdir() if p.name.endswith(f".{arch}.cubin")]
    assert ptx and cubin, sorted(p.name for p in tmp_path.iterdir())
    text = ptx[0].read_text()
    assert f".target {arch}" in text and "mul.f32" in text
