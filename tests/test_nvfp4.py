"""The NVFP4 format: E2M1 codes, E4M3 block scales, packing; bit-exact where the format defines bits."""

import math

import pytest
import torch

from svdq_linear import nvfp4

MAGS = nvfp4.E2M1_MAGNITUDES


def _e2m1_from_bits(code: int) -> float:
    """OCP MX E2M1: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return sign * mag


def _e4m3_values() -> list[float]:
    """All finite non-negative float8_e4m3fn values, by code (bias 7, no Inf, 0x7F is NaN)."""
    vals = []
    for code in range(0x7F):
        exp, man = code >> 3, code & 0x7
        vals.append(man / 8 * 2.0**-6 if exp == 0 else 2.0 ** (exp - 7) * (1 + man / 8))
    return vals


def _nearest_even(x: float, grid: list[float]) -> int:
    """Index of the grid value nearest to x; on a tie the even index (even code)."""
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - x), i % 2))
    return best


def test_e2m1_table_matches_bit_layout():
    values = nvfp4.e2m1_values().tolist()
    for code in range(16):
        assert values[code] == _e2m1_from_bits(code), f"code {code:#x}"


@pytest.mark.parametrize(
    "x, code",
    [
        (0.25, 0x0), (0.75, 0x2), (1.25, 0x2), (1.75, 0x4), (2.5, 0x4), (3.5, 0x6), (5.0, 0x6),
        (-0.25, 0x8), (-0.75, 0xA), (-1.25, 0xA), (-1.75, 0xC), (-2.5, 0xC), (-3.5, 0xE), (-5.0, 0xE),
        (0.2500001, 0x1), (0.7499999, 0x1), (1.2500001, 0x3), (4.9999, 0x6), (5.0001, 0x7),
        (6.0, 0x7), (7.0, 0x7), (1e30, 0x7), (float("inf"), 0x7), (-float("inf"), 0xF), (-100.0, 0xF),
        (0.0, 0x0), (-0.0, 0x0), (-0.1, 0x8), (float("nan"), 0x0),
    ],
)
def test_round_e2m1_ties_to_even_and_saturates(x, code):
    got = int(nvfp4.round_e2m1(torch.tensor([x]))[0])
    assert got == code, f"round_e2m1({x}) = {got:#x}, expected {code:#x}"


def test_round_e2m1_is_nearest_even_on_random_values():
    q = torch.cat([torch.randn(20000) * 3, torch.empty(20000).uniform_(-7, 7)])
    codes = nvfp4.round_e2m1(q)
    for x, c in zip(q.tolist(), codes.tolist()):
        mag = _nearest_even(min(abs(x), 6.0), list(MAGS))
        assert c & 0x7 == mag and (c >> 3) == (x < 0), f"x={x}: code {c:#x}"


def test_round_e4m3_matches_bit_level_nearest_even():
    grid = _e4m3_values()
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    samples = grid + mids + [m * (1 + 1e-6) for m in mids] + [m * (1 - 1e-6) for m in mids]
    samples += torch.exp(torch.empty(3000).uniform_(-16, 7)).tolist()
    samples += [2.0**-10, 2.0**-10 * 1.001, 2.0**-11, 447.0, 448.0, 463.9, 464.0, 470.0, 480.0, 1e6]
    x = torch.tensor(samples, dtype=torch.float32)
    got = nvfp4.round_e4m3(x).view(torch.uint8).tolist()
    for v, code in zip(x.tolist(), got):
        expected = _nearest_even(min(v, 448.0), grid)
        assert code == expected, f"e4m3({v!r}) = {code:#x}, expected {expected:#x}"


def test_round_e4m3_agrees_with_torch_cast_in_range():
    x = torch.exp(torch.empty(100000).uniform_(-18, 6)) * torch.randn(100000).sign()
    ours = nvfp4.round_e4m3(x).view(torch.uint8)
    torch_cast = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, torch_cast)


def test_round_e4m3_nonfinite_is_nan():
    out = nvfp4.round_e4m3(torch.tensor([float("nan"), float("inf"), -float("inf")]))
    assert out.view(torch.uint8).tolist() == [0x7F] * 3
    assert torch.isnan(out.float()).all()


def test_pack_puts_even_k_in_low_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x7]], dtype=torch.uint8)
    packed = nvfp4.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x7F]]
    assert torch.equal(nvfp4.unpack_e2m1(packed), codes)


def test_pack_unpack_round_trip_and_torch_fp4_view():
    codes = torch.randint(0, 16, (33, 64), dtype=torch.uint8)
    packed = nvfp4.pack_e2m1(codes)
    assert packed.shape == (33, 32) and packed.dtype == torch.uint8
    assert torch.equal(nvfp4.unpack_e2m1(packed), codes)
    fp4 = packed.view(torch.float4_e2m1fn_x2)  # torch's packed-pair dtype: same bytes, same shape
    assert fp4.shape == packed.shape and torch.equal(fp4.view(torch.uint8), packed)


def test_pack_rejects_odd_k_and_unpack_rejects_non_uint8():
    with pytest.raises(ValueError, match="even last dimension"):
        nvfp4.pack_e2m1(torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        nvfp4.unpack_e2m1(torch.zeros(3, 4, dtype=torch.int32))


def _one_block(values) -> torch.Tensor:
    x = torch.zeros(1, 16)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return x


def test_all_zero_block_has_zero_scale_and_zero_codes():
    packed, scales = nvfp4.quantize_nvfp4(torch.zeros(2, 32))
    assert scales.view(torch.uint8).eq(0).all() and packed.eq(0).all()
    assert nvfp4.dequantize_nvfp4(packed, scales).eq(0).all()


def test_scale_that_rounds_to_zero_gives_zero_codes():
    # amax / 6 = 2**-10 is the tie between 0 and the smallest subnormal 2**-9: rounds to 0 (even).
    for amax in (6 * 2.0**-10, 6 * 2.0**-12, 1e-30):
        packed, scales = nvfp4.quantize_nvfp4(_one_block([amax, -amax / 2]))
        assert scales.view(torch.uint8).item() == 0, amax
        assert packed.eq(0).all(), amax


def test_subnormal_scale_is_used_and_saturates():
    # amax / 6 = 3 * 2**-10 = 1.5 * 2**-9: tie between codes 1 and 2, so s = 2 * 2**-9 = 2**-8.
    amax = 18 * 2.0**-10
    packed, scales = nvfp4.quantize_nvfp4(_one_block([amax, -amax, 2.0**-8 * 1.5]))
    assert scales.view(torch.uint8).item() == 0x02 and scales.float().item() == 2.0**-8
    codes = nvfp4.unpack_e2m1(packed)[0, :3].tolist()
    # amax * 2**8 = 4.5 -> 4 (code 6); 1.5 exactly -> code 3.
    assert codes == [0x6, 0xE, 0x3]
    # s rounded down below amax / 6 makes x / s exceed 6: saturate.
    amax = 6 * 2.0**-9 * 1.2  # amax/6 = 1.2 * 2**-9 -> s = 2**-9, x / s = 7.2
    packed, scales = nvfp4.quantize_nvfp4(_one_block([amax]))
    assert scales.float().item() == 2.0**-9 and nvfp4.unpack_e2m1(packed)[0, 0].item() == 0x7


def test_large_block_saturates_scale_at_448():
    packed, scales = nvfp4.quantize_nvfp4(_one_block([6000.0, -3000.0, 448.0]))
    assert scales.float().item() == 448.0
    assert nvfp4.unpack_e2m1(packed)[0, :3].tolist() == [0x7, 0xF, 0x2]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_block_is_nan_and_leaves_other_blocks_alone(bad):
    x = torch.randn(1, 48)
    x[0, 20] = bad
    packed, scales = nvfp4.quantize_nvfp4(x)
    clean_packed, clean_scales = nvfp4.quantize_nvfp4(torch.cat([x[:, :16], x[:, 32:]], dim=1))
    assert scales.view(torch.uint8)[0, 1].item() == nvfp4.E4M3_NAN_BYTE
    assert nvfp4.unpack_e2m1(packed)[0, 16:32].eq(0).all()
    deq = nvfp4.dequantize_nvfp4(packed, scales)
    assert torch.isnan(deq[0, 16:32]).all() and torch.isfinite(deq[0, :16]).all()
    assert torch.equal(scales.view(torch.uint8)[:, [0, 2]], clean_scales.view(torch.uint8))
    assert torch.equal(packed[:, [*range(8), *range(16, 24)]], clean_packed)


def _log_uniform_blocks(rows, k):
    x = torch.randn(rows, k)
    block_mag = torch.exp(torch.empty(rows, k // 16, 1).uniform_(-20, 14))
    return (x.reshape(rows, k // 16, 16) * block_mag).reshape(rows, k)


def test_scales_are_e4m3_of_amax_over_6():
    x = _log_uniform_blocks(64, 256)
    scales = nvfp4.block_scales(x)
    amax = x.abs().reshape(64, 16, 16).amax(-1)
    expected = (amax / 6).clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(scales.view(torch.uint8), expected.view(torch.uint8))


def test_decode_of_encode_is_nearest_value_under_the_block_scale():
    x = _log_uniform_blocks(128, 256)
    packed, scales = nvfp4.quantize_nvfp4(x)
    deq = nvfp4.dequantize_nvfp4(packed, scales, torch.float64)
    s = scales.double().repeat_interleave(16, dim=1)
    grid = torch.tensor(MAGS, dtype=torch.float64)
    candidates = torch.cat([grid, -grid]).view(1, 1, -1) * s.unsqueeze(-1)
    best = (candidates - x.double().unsqueeze(-1)).abs().amin(-1)
    err = (deq - x.double()).abs()
    # x * (1/s) is one rounded float32 product: exact ties may tip by an ulp, nothing more.
    slack = x.double().abs() * 2.0**-22 + 1e-300
    assert (err <= best + slack).all(), f"worst excess {(err - best).max().item():.3e}"


def test_dequantize_checks_scale_layout():
    packed, scales = nvfp4.quantize_nvfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="do not match"):
        nvfp4.dequantize_nvfp4(packed, scales[:, :2])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        nvfp4.dequantize_nvfp4(packed, scales.float())


def test_quantize_rejects_k_not_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_nvfp4(torch.randn(2, 40))


def test_quantize_weight_uses_full_e4m3_range_per_row():
    w = torch.randn(32, 128) * torch.exp(torch.empty(32, 1).uniform_(-8, 4))
    w[5] = 0.0
    qweight, wscales, row_scale = nvfp4.quantize_weight(w)
    top = wscales.float().amax(dim=1)
    assert torch.all(top[torch.arange(32) != 5] == 448.0)
    deq = nvfp4.dequantize_nvfp4(qweight, wscales) * row_scale[:, None]
    rel = (deq - w).norm() / w.norm()
    assert rel < 0.12, f"relative weight error {rel:.3f}"
    assert deq[5].eq(0).all()


def test_quantize_weight_rejects_nonfinite():
    w = torch.randn(4, 32)
    w[1, 3] = math.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        nvfp4.quantize_weight(w)


def test_contract_quantizer_and_formula_match_the_independent_oracle():
    import oracle

    from svdq_linear import SVDQW4A4Linear

    x = _log_uniform_blocks(24, 128)
    x[3, 20] = float("nan")  # a NaN block
    x[7, 100] = float("inf")  # an Inf block
    x[9, :16] = 2.0**-140  # a block whose scale rounds to 0
    x[11, 32:48] *= 1e6  # saturating scales
    packed, scales = nvfp4.quantize_nvfp4(x)
    codes, scale_bytes = oracle.quantize_act(x)
    assert torch.equal(scales.view(torch.uint8), scale_bytes), "E4M3 block scales differ from the oracle"
    assert torch.equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4)), "packed E2M1 codes differ from the oracle"
    m = SVDQW4A4Linear.from_linear(torch.nn.Linear(128, 48), rank=8, act_max=torch.rand(128) * 10 + 0.1)
    xin = torch.randn(6, 128) * 3
    y = nvfp4.w4a4_linear(xin, m.qweight, m.wscales, m.smooth, m.proj_down, m.proj_up, m.wcscale, m.bias,
                          accum_dtype=torch.float64)
    want = oracle.w4a4_linear(m, xin)
    assert torch.allclose(y, want, rtol=1e-12, atol=1e-12), f"max |diff| {(y - want).abs().max().item():.3e}"


def test_weight_rows_far_below_float32_normals_get_finite_scales():
    """``quantize_weight`` divides a row by ``max / 2688``. Below about 3e-35 that scale was a float32 subnormal of
    few bits (values clipped) or 0 (NaN block scales, which the loader refuses). It is now at least the smallest
    normal float32: such rows keep finite scales, and what they lose is below that scale's reach."""
    w = torch.randn(4, 32)
    for row, top in ((1, 1e-43), (2, 5e-42), (3, 1e-36)):
        w[row] *= top / w[row].abs().max()
    q, s, r = nvfp4.quantize_weight(w)
    assert not ((s.view(torch.uint8) & 0x7F) == 0x7F).any(), "NaN block scales"
    assert (r >= torch.finfo(torch.float32).tiny).all()
    d = nvfp4.dequantize_weight(q, s, r)
    err = (d - w).abs().amax(dim=1) / w.abs().amax(dim=1)
    assert err[0] < 1 / 6 and err[3] < 1 / 6, err
    assert (d[1:3].abs() <= w[1:3].abs().amax(dim=1, keepdim=True)).all()
    from svdq_linear import NVFP4W4A16Linear

    lin = torch.nn.Linear(32, 4)
    with torch.no_grad():
        lin.weight.copy_(w)
    NVFP4W4A16Linear.from_linear(lin)  # refused the NaN scales before


def test_every_scale_and_midpoint_takes_the_reciprocal_rule():
    """Each value is multiplied by ``1 / s`` (one float32 rounding), not divided by ``s``: the two differ only where a
    value over its scale lands on an E2M1 midpoint, e.g. the scale byte 0x77 at 5.0 (found by a mutation probe: the
    random blocks above never hit one). Every finite positive scale byte times every midpoint, in blocks whose
    maximum (6 s) fixes the scale, against the oracle (which multiplies by the reciprocal, element by element)."""
    import oracle

    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -2.5, -5.0]
    rows = []
    for byte in range(1, 0x7F):
        s = oracle.e4m3_value(byte)
        rows.append([6.0 * s] + [m * s for m in mids] + [0.0] * 5)
    x = torch.tensor(rows, dtype=torch.float32)
    packed, scales = nvfp4.quantize_nvfp4(x)
    codes, scale_bytes = oracle.quantize_act(x)
    assert torch.equal(scales.view(torch.uint8), scale_bytes)
    diff = (packed != (codes[:, 0::2] | (codes[:, 1::2] << 4))).nonzero()
    assert diff.numel() == 0, f"{len(diff)} packed bytes differ, first at scale row {diff[0].tolist()}"
