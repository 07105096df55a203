"""sm100 activation quantization (Triton): bit-exact to the contract on the CPU (Triton's interpreter),
writing the scales straight into the tcgen05 scale-factor atom layout; compiles for sm_100a/sm_103a
with IEEE division only."""

import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import torch
    from svdq_linear import nvfp4
    from svdq_linear.backends.sm100 import host
    from svdq_linear.backends.sm100.quantize import quantize_act

    torch.manual_seed({seed})
    m, k = {m}, {k}
    x = (torch.randn(m, k) * 3).to(torch.{dtype})
    # the contract's special blocks: all-zero, subnormal scale, NaN, Inf, E2M1 ties, saturation, -0.0
    x[0, :16] = 0
    x[1 % m, 16:32] = 1e-5
    x[2 % m, 5] = float("nan")
    x[3 % m, 40 % k] = float("inf")
    x[4 % m, 32:48] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -0.75, -5, -6, 0, -0.0, 1, -1])
    x[5 % m, 50] = 30000
    x[6 % m, 16:32] = -0.0
    smooth = torch.rand(k) + 0.5
    # outputs poisoned: every byte, the scale atoms' padding included, must be written by the kernel
    empty = torch.empty
    torch.empty = lambda *a, **kw: empty(*a, **kw).fill_(0xAB if kw.get("dtype") == torch.uint8 else float("nan"))
    codes, sf, xs = quantize_act(x, 1.0 / smooth, want_xs=True, block_m={block_m}, block_k={block_k})
    torch.empty = empty
    xs_ref = nvfp4.smooth_input(x, smooth)
    assert torch.allclose(xs, xs_ref, rtol=0, atol=0, equal_nan=True), "xs differs"
    ref_codes, ref_scales = nvfp4.quantize_nvfp4(xs_ref)
    bad = (codes != ref_codes).nonzero()[:5].tolist()
    assert not bad, f"codes differ at {{bad}}"
    ref_sf = host.to_sf_atom_layout(ref_scales).view(torch.uint8)
    assert sf.shape == ref_sf.shape, (sf.shape, ref_sf.shape)
    bad = (sf != ref_sf).nonzero().flatten()[:5].tolist()
    assert not bad, f"scale bytes differ at atom offsets {{bad}}"
    print("OK")
    """
)


@pytest.mark.parametrize("m,k,dtype,block_m,block_k", [(140, 160, "bfloat16", 8, 64), (7, 96, "float16", 4, 256),
                                                       (130, 64, "float32", 32, 128), (33, 544, "bfloat16", 2, 256)])
def test_quantize_act_is_bit_exact_to_the_contract(m, k, dtype, block_m, block_k, tmp_path):
    """Tiles (``block_m`` x ``block_k``) that do not divide M or K: the last programs' rows and columns past the
    tensor write no codes, and zero scales into the atoms' padding (the outputs start poisoned)."""
    script = tmp_path / "check.py"
    script.write_text(CHECK.format(seed=m, m=m, k=k, dtype=dtype, block_m=block_m, block_k=block_k))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-3000:]


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_quantize_act_compiles_with_ieee_division_only(arch, tmp_path):
    # A fresh process without TRITON_INTERPRET (the CPU suite's conftest sets it): the real compiler.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; from svdq_linear.backends.sm100.quantize import compile_for; "
            f"open(sys.argv[1], 'w').write(compile_for({arch!r}).asm['ptx'])")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "q.ptx")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = (tmp_path / "q.ptx").read_text()
    assert f".target {arch}" in ptx
    divs = set(re.findall(r"\b(div\.[a-z]+\.f32|rcp\.[a-z.]+f32)", ptx))
    assert divs == {"div.rn.f32"}, f"expected only IEEE div.rn.f32, got {divs}"
    assert "st.global" in ptx and "ld.local" not in ptx and "st.local" not in ptx
    assert "fma.rn.f32" not in ptx, "a multiply was contracted into an FMA: the contract rounds each one"


def test_e2m1_code_by_arithmetic_matches_the_oracle_on_a_dense_sweep(tmp_path):
    """The pass's E2M1 code (a magic-constant rounding, then the rounded value's bits) against the oracle's
    nearest-even encoder: every midpoint and its float32 neighbours, a dense grid over [-8, 8], the signs of zero,
    float32 subnormals, saturation and Inf (NaN blocks are zeroed by the kernel before it: the bit-exact test above
    holds them). The interpreter runs the same arithmetic as the GPU: no FMA, IEEE adds, subnormals kept."""
    script = tmp_path / "sweep.py"
    script.write_text(textwrap.dedent(
        """
        import sys
        import torch, triton, triton.language as tl
        sys.path.insert(0, {tests!r})
        import oracle
        from svdq_linear.backends.sm100.quantize import _e2m1_code_by_rounding

        @triton.jit
        def k(q_ptr, c_ptr, N, B: tl.constexpr):
            i = tl.program_id(0) * B + tl.arange(0, B)
            tl.store(c_ptr + i, _e2m1_code_by_rounding(tl.load(q_ptr + i, mask=i < N, other=0.0)), mask=i < N)

        base = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 1e-30, 7.0,
                             1e30, 1e-40, 6.5, 7.5])
        near = torch.cat([base, torch.nextafter(base, torch.full_like(base, 1e38)), torch.nextafter(base, 0 * base)])
        q = torch.cat([near, -near, torch.linspace(-8, 8, 20001),
                       torch.tensor([0.0, -0.0, float("inf"), -float("inf")])]).float()
        got = torch.empty(q.numel(), dtype=torch.int32)
        k[(triton.cdiv(q.numel(), 1024),)](q, got, q.numel(), B=1024)
        want = [oracle.encode_e2m1(v) for v in q.tolist()]
        bad = [(v, g, w) for v, g, w in zip(q.tolist(), got.tolist(), want) if g != w]
        assert not bad, bad[:5]
        print("OK")
        """).format(tests=os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-3000:]


@pytest.mark.parametrize("block_m, block_k, needle", [(16, 32, "block_k a power of two >= 64"),
                                                      (16, 192, "block_k a power of two >= 64"),
                                                      (12, 256, "block_m a power of two")])
def test_tiles_the_kernel_cannot_take_are_refused_by_name(block_m, block_k, needle):
    """Tiles whose scale words or ranges Triton cannot build are refused before a launch, naming the argument (192
    columns passed the old multiple-of-64 check and failed inside Triton's ``arange``)."""
    import torch

    from svdq_linear.backends.sm100.quantize import quantize_act

    with pytest.raises(ValueError, match=needle):
        quantize_act(torch.randn(4, 256, dtype=torch.bfloat16), torch.ones(256), block_m=block_m, block_k=block_k)
