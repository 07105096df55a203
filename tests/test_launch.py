"""``backends/sm90/launch.FastLaunch``: the cache key of a Triton launch and its arguments.

On the CPU: the key holds what Triton specializes a kernel on (tensor dtype and 16-byte alignment,
integer equality to 1, divisibility by 16 and 32-bit range, constexprs, launch options), arguments
come out in signature order with tensors as addresses, and the interpreter goes through Triton's
JIT. On a GPU: two launches with the same key get the same compiled kernel from Triton's own cache,
and a cached launch writes what the JIT launch writes."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from svdq_linear.backends.sm90.launch import FastLaunch, spec_of  # noqa: E402


@triton.jit
def _scale_rows(x_ptr, y_ptr, n, stride, f, BLOCK: tl.constexpr, NEG: tl.constexpr = False):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride + cols, mask=cols < n, other=0.0) * f
    if NEG:
        v = -v
    tl.store(y_ptr + row * stride + cols, v, mask=cols < n)


def test_spec_holds_what_triton_specializes_on():
    t = torch.zeros(64, dtype=torch.bfloat16)
    assert spec_of(t) == (torch.bfloat16, True)
    assert spec_of(t[1:]) == (torch.bfloat16, False)  # 2 bytes off: not 16-byte aligned
    assert spec_of(t[8:]) == (torch.bfloat16, True)
    assert spec_of(t.float()) != spec_of(t)
    assert spec_of(1) != spec_of(17) != spec_of(32) != spec_of(33)
    assert spec_of(1) == ("int", True, False, True) and spec_of(48) == ("int", False, True, True)
    assert spec_of(1 << 31) == ("int", False, True, False)  # past int32: Triton types it i64
    assert spec_of(True) != spec_of(1) and spec_of(None) is None and spec_of(0.5) == "float"


def test_key_orders_arguments_and_separates_what_differs():
    launch = FastLaunch(_scale_rows)
    x, y = torch.zeros(4, 64), torch.zeros(4, 64)
    key, full = launch.key((x, y, 64, 64, 2.0), dict(BLOCK=64, num_warps=4), device=0)
    assert full == [x.data_ptr(), y.data_ptr(), 64, 64, 2.0, 64, False]  # the default NEG filled in
    same, _ = launch.key((x, y, 64, 64, 3.0), dict(BLOCK=64, num_warps=4), device=0)
    assert same == key  # a float's value is not specialized on
    for args, kw in (((x, y, 63, 64, 2.0), dict(BLOCK=64, num_warps=4)),  # n no longer divisible by 16
                     ((x, y, 1, 64, 2.0), dict(BLOCK=64, num_warps=4)),  # n == 1
                     ((x[:, 1:], y, 64, 64, 2.0), dict(BLOCK=64, num_warps=4)),  # x misaligned
                     ((x.bfloat16(), y, 64, 64, 2.0), dict(BLOCK=64, num_warps=4)),  # another dtype
                     ((x, y, 64, 64, 2.0), dict(BLOCK=64, NEG=True, num_warps=4)),  # a constexpr
                     ((x, y, 64, 64, 2.0), dict(BLOCK=64, num_warps=8))):  # a launch option
        assert launch.key(args, kw, device=0)[0] != key, (args[2:], kw)
    assert launch.key((x, y, 64, 64, 2.0), dict(BLOCK=64, num_warps=4), device=1)[0] != key
    with pytest.raises(TypeError, match="'BLOCK' missing"):
        launch.key((x, y, 64, 64, 2.0), {}, device=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cached_launch_is_the_kernel_triton_picks():
    launch = FastLaunch(_scale_rows)
    base = torch.randn(8, 80, device="cuda")
    cases = [(base, 80, 80), (base, 64, 80), (base[:, 1:], 63, 80), (base[:, 16:], 64, 80), (base, 1, 80),
             (base.reshape(10, 64), 64, 64), (base.reshape(10, 64), 48, 64)]
    for rep in range(2):  # the second round hits the cache for every case
        for x, n, stride in cases:
            rows = x.shape[0]
            y_fast = torch.full_like(base, float("nan")).reshape(-1)[: rows * stride].reshape(rows, stride)
            y_jit = y_fast.clone()
            kw = dict(BLOCK=128, num_warps=4)
            launch((rows,), x, y_fast, n, stride, 1.5, **kw)
            ck = _scale_rows[(rows,)](x, y_jit, n, stride, 1.5, **kw)
            key, _ = launch.key((x, y_fast, n, stride, 1.5), kw)
            assert launch.cache[key][1] == ck.function, (n, stride, rep)  # Triton's own pick, same kernel
            torch.cuda.synchronize()
            assert torch.equal(y_fast[:, :n], y_jit[:, :n]) and torch.equal(y_fast[:, :n], x[:, :n] * 1.5)
    assert len(launch.cache) >= 4
