"""``decode_dense.decode_weight``: quack's repacked NVFP4 weight back to exact bf16 values (CPU under
Triton's interpreter; on a GPU where one is present), against the independent decoder in ``oracle``."""

from __future__ import annotations

import pytest
import torch

from oracle import decode_e2m1, decode_e4m3
from svdq_linear.backends.sm90 import quack_gemm
from svdq_linear.backends.sm90.decode_dense import decode_weight


def _oracle(qweight: torch.Tensor, wscales: torch.Tensor) -> torch.Tensor:
    """float64 [N, K]: element 2i in the low nibble of byte i, times its block's scale."""
    codes = torch.stack([qweight & 0xF, qweight >> 4], -1).reshape(qweight.shape[0], -1)
    return decode_e2m1(codes) * decode_e4m3(wscales).repeat_interleave(16, 1)


def _weight(n, k, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=g)
    s[s == 0x7F] = 0x38  # keep NaN scales for the test below
    s[s == 0xFF] = 0xB8
    return q.to(device), s.view(torch.float8_e4m3fn).to(device)


def _check(n, k, extra, tiles, device):
    q, s = _weight(n, k, device)
    blob, sf = quack_gemm.repack_weight(q), quack_gemm.repack_scales(s)
    out = torch.full((n, k + extra), float("nan"), dtype=torch.bfloat16, device=device)
    assert decode_weight(blob, sf, out, tiles=tiles) is out
    want = _oracle(q.cpu(), s.cpu())
    got = out[:, :k].double().cpu()
    # bit-exact: E2M1 x E4M3 has at most 6 significant bits and fits bf16's range; -0 codes keep their sign
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert bool(out[:, k:].isnan().all())  # columns past K untouched (the low-rank columns live there)


@pytest.mark.parametrize("n,k,extra,tiles", [(64, 64, 0, 1), (128, 384, 32, 4), (192, 256, 16, 3)])
def test_decode_weight_is_bit_exact_and_stays_in_its_columns(n, k, extra, tiles):
    _check(n, k, extra, tiles, "cpu")


def test_decode_weight_nan_scale_gives_nan_block():
    q, s = _weight(64, 128, "cpu")
    s = s.view(torch.uint8).clone()
    s[5, 3] = 0x7F
    s = s.view(torch.float8_e4m3fn)
    out = torch.empty(64, 128, dtype=torch.bfloat16)
    decode_weight(quack_gemm.repack_weight(q), quack_gemm.repack_scales(s), out)
    assert bool(out[5, 48:64].isnan().all())
    assert int(out.isnan().sum()) == 16


def test_decode_weight_rejects_bad_arguments():
    q, s = _weight(64, 128, "cpu")
    blob, sf = quack_gemm.repack_weight(q), quack_gemm.repack_scales(s)
    with pytest.raises(ValueError, match="out must be bf16"):
        decode_weight(blob, sf, torch.empty(64, 128, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be bf16"):
        decode_weight(blob, sf, torch.empty(64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be bf16"):
        decode_weight(blob, sf, torch.empty(128, 64, dtype=torch.bfloat16).T)
    with pytest.raises(ValueError, match="sf must be"):
        decode_weight(blob, sf[:, :1].contiguous(), torch.empty(64, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="blob must be uint8"):
        decode_weight(q, sf, torch.empty(64, 128, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_weight_is_bit_exact():
    _check(3072, 15360, 32, 4, "cuda")
