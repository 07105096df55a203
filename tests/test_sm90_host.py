"""Host-side pieces of the sm90 backend that need no GPU: the quack weight repack, the tile table."""

import json

import pytest
import torch

quack_gemm = pytest.importorskip("svdq_linear.backends.sm90.quack_gemm",
                                 reason="quack-kernels (the [kernels] extra) is not installed")


@pytest.mark.parametrize("n,k", [(128, 128), (256, 512), (384, 3072)])
def test_repack_equals_quacks_and_inverts(n, k):
    from quack.gemm_w4 import prepare_w4_weight

    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    sf = torch.randint(0, 0x7F, (n, k // 16), dtype=torch.uint8).view(torch.float8_e4m3fn)
    blob_ref, sf_ref = prepare_w4_weight(q, sf, "nvfp4")
    blob, strip = quack_gemm.repack_weight(q), quack_gemm.repack_scales(sf)
    assert blob.shape == blob_ref.shape and torch.equal(blob, blob_ref), "weight bytes differ from quack's repack"
    assert torch.equal(strip, sf_ref.view(torch.uint8).reshape(strip.shape)), "scale bytes differ from quack's"
    assert torch.equal(quack_gemm.unpack_weight(blob), q)
    assert torch.equal(quack_gemm.unpack_scales(strip).view(torch.uint8), sf.view(torch.uint8))


def test_tile_table_is_well_formed():
    from svdq_linear.backends.sm90 import tuning

    raw = json.loads(tuning._TABLE.read_text())
    assert set(map(int, raw["configs"])) == set(tuning.M_BUCKETS)
    for m in (1, 7, 64, 500, 4096, 10000):
        cfg = tuning.pick(m, 3072, 3072)
        assert cfg.block_m >= 16 and cfg.block_m <= max(16, 1 << (m - 1).bit_length())
        assert cfg.split_k >= 1 and 3072 % cfg.block_k == 0
