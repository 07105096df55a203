"""An NVFP4 decoder/encoder written from the format's definition, independent of ``svdq_linear.nvfp4``.

The tests hold the library to this, so a wrong table or rounding rule in the library cannot make its
own oracle agree with it. Definitions used (the contract's, restated):

- E2M1 code ``s mmm``: bit 3 is the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- E4M3 (float8_e4m3fn) byte ``s eeee mmm``, bias 7: ``e = 0`` is subnormal, ``m/8 * 2^-6``; otherwise
  ``(1 + m/8) * 2^(e-7)``; ``e = 15, m = 7`` is NaN (0x7F, 0xFF); there is no Inf; largest is 448.
- Packing: element ``2i`` of a row in the low nibble of byte ``i``, element ``2i+1`` in the high nibble.
- Activation blocks of 16: ``s = e4m3(amax / 6)`` (nearest, ties to even, saturating; NaN/Inf block:
  NaN scale, codes 0), ``r = 1 / s`` in float32 (0 for s = 0 or NaN), ``code = e2m1(x * r)`` nearest,
  ties to even, saturating at 6.

Everything here is plain Python arithmetic on float64 values, or float32 where the contract rounds.
"""

from __future__ import annotations

import math

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e4m3_value(byte: int) -> float:
    """The value of one E4M3 byte, by bit arithmetic."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * (m / 8) * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


E4M3_TABLE = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float64)


def decode_e4m3(t: torch.Tensor) -> torch.Tensor:
    """float64 values of a float8_e4m3fn (or uint8) tensor, through the table above."""
    return E4M3_TABLE.to(t.device)[t.view(torch.uint8).long()]


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of E2M1 codes (uint8 0..15)."""
    codes = codes.long()
    mags = torch.tensor(E2M1, dtype=torch.float64, device=codes.device)[codes & 7]
    return torch.where(codes & 8 != 0, -mags, mags)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., K]`` of packed ``[..., K/2]`` uint8: low nibble first."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``[..., K]``: each code's value times its block's scale."""
    vals = decode_e2m1(unpack(packed))
    return vals * decode_e4m3(scales).repeat_interleave(16, dim=-1)


def _nearest_even(x: float, grid: list[float]) -> int:
    """Index of the grid value nearest to ``x`` (grid ascending), ties to the even index."""
    best = min(range(len(grid)), key=lambda i: (abs(grid[i] - x), i % 2))
    return best


_E4M3_POSITIVE = [e4m3_value(b) for b in range(0x7F)]  # 0x00..0x7E: every finite non-negative value


def encode_e4m3(x: float) -> int:
    """The byte of ``x >= 0`` rounded to E4M3: nearest, ties to even, saturating at 448; NaN/Inf: 0x7F."""
    if not math.isfinite(x):
        return 0x7F
    return _nearest_even(min(x, 448.0), _E4M3_POSITIVE)


def encode_e2m1(x: float) -> int:
    """The E2M1 code of ``x``: nearest magnitude, ties to even, saturating at 6; NaN: 0."""
    if math.isnan(x):
        return 0
    mag = _nearest_even(min(abs(x), 6.0), list(E2M1))
    return mag | (8 if x < 0 else 0)


def f32(v: float) -> float:
    """``v`` rounded to float32."""
    return torch.tensor(v, dtype=torch.float32).item()


def quantize_act(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``[M, K]`` uint8, scale bytes ``[M, K/16]`` uint8) of float32 ``xs``, element by element."""
    rows, k = xs.shape
    codes = torch.zeros(rows, k, dtype=torch.uint8)
    scales = torch.zeros(rows, k // 16, dtype=torch.uint8)
    data = xs.float().cpu().tolist()
    for i in range(rows):
        for b in range(k // 16):
            block = data[i][16 * b:16 * b + 16]
            if not all(math.isfinite(v) for v in block):
                scales[i, b] = 0x7F
                continue
            amax = max(abs(v) for v in block)
            byte = encode_e4m3(f32(amax / 6.0))  # the division is a float32 one
            scales[i, b] = byte
            s = e4m3_value(byte)
            r = f32(1.0 / s) if s > 0 else 0.0
            for j, v in enumerate(block):
                codes[i, 16 * b + j] = encode_e2m1(f32(v * r))
    return codes, scales


def smooth_input(x: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """float32 ``x * (1 / smooth)``: the reciprocal rounded to float32, then one float32 multiply."""
    return x.float() * (1.0 / smooth.float())


def w4a4_linear(module, x: torch.Tensor) -> torch.Tensor:
    """float64 ``y`` of an ``SVDQW4A4Linear`` for ``x [..., K]`` from its tensors and the definitions above."""
    x2 = x.reshape(-1, module.in_features)
    xs = smooth_input(x2, module.smooth)
    codes, scales = quantize_act(xs)
    a = decode_e2m1(codes) * decode_e4m3(scales).repeat_interleave(16, dim=-1)
    w = dequantize(module.qweight.cpu(), module.wscales.cpu())
    y = (a @ w.T) * module.wcscale.double().cpu()
    if module.bias is not None:
        y = y + module.bias.double().cpu()
    y = y + (xs.double().cpu() @ module.proj_down.double().cpu()) @ module.proj_up.double().cpu().T
    return y.reshape(*x.shape[:-1], module.out_features)


def w4a16_linear(module, x: torch.Tensor) -> torch.Tensor:
    """float64 ``y`` of an ``NVFP4W4A16Linear``: ``x (Qw * wcscale)^T + bias``."""
    w = dequantize(module.qweight.cpu(), module.wscales.cpu()) * module.wcscale.double().cpu()[:, None]
    y = x.double().cpu() @ w.T
    return y if module.bias is None else y + module.bias.double().cpu()
