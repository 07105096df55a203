"""Reference kernels compiled the same way as ours, for register/SASS comparison (no launch)."""

from __future__ import annotations


def compile_quack_nvfp4(arch: str) -> None:
    """quack's GemmSm100, block-scaled NVFP4 (E2M1 x E2M1, E4M3 scales, vector 16), 2-CTA 256x128,
    bf16 output, default epilogue, compiled with fake tensors for ``arch`` (CUTE_DSL_ARCH)."""
    import os

    import cutlass
    from quack.gemm import _compile_gemm
    from quack.rounding import RoundingMode

    os.environ.setdefault("CUTE_DSL_ARCH", arch)
    fn = getattr(_compile_gemm, "__wrapped__", _compile_gemm)
    fn(
        cutlass.Float4E2M1FN, cutlass.Float4E2M1FN, cutlass.BFloat16, None,
        "k", "k", "n", None,
        (256, 128), (2, 1, 1),
        False, True, False,
        None, None, 0,
        0, 0, False, None,
        False, False, False, False, False,
        (10, 0 if arch == "sm_100a" else 3),
        RoundingMode.RN, 0, 6,
        sf_dtype=cutlass.Float8E4M3FN, sf_vec_size=16,
    )


def compile_cutlass_example(arch: str, path: str) -> None:
    """CUTLASS's ``dense_blockscaled_gemm_persistent.py`` (NVFP4, E4M3 scales, vector 16, 2-CTA
    256x128, bf16 out), loaded from ``path`` (the example is not packaged; point
    ``$SVDQ_CUTLASS_BLOCKSCALED_EXAMPLE`` at a checkout's copy)."""
    import importlib.util

    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    spec = importlib.util.spec_from_file_location("cutlass_blockscaled_example", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    gemm = ex.Sm100BlockScaledPersistentDenseGemmKernel(16, (256, 128), (2, 1))
    ex.scaled_mm(
        gemm, cutlass.Float4E2M1FN, cutlass.Float4E2M1FN, cutlass.BFloat16, cutlass.Float8E4M3FN,
        "k", "k", "n", 74, make_fake_stream(), options=f"--gpu-arch {arch}",
    )
