"""Every fp32 value but NaN through the exact pass's E2M1 rounding (``kernels._nvfp4_dequant``'s formula, restated
in torch) against the contract's (``nvfp4.round_e2m1`` then ``decode_e2m1``), bit for bit (CPU, ~4 min):

    python benchmarks/check_e2m1_rounding.py

The formula: clamp q to +-6; ``c`` = 1.5 * 2**22 times the power of two of ``max(|q|, 1)`` (its exponent bits plus
22 << 23 and the 1.5 mantissa); ``(q + c) - c``; the sign bit of ``q + 0.0`` (``q < 0``) put back. torch's
CPU float ops round each step (no FMA contraction), as Triton's interpreter does; the GPU's contraction is
discussed in docs/perf.md (twenty-fifth session).
"""

from __future__ import annotations

import torch

from svdq_linear import nvfp4


def rounded(q: torch.Tensor) -> torch.Tensor:
    qc = q.clamp(-6.0, 6.0)
    c = ((qc.abs().clamp_min(1.0).view(torch.int32) & 0x7F800000) + 0x0B400000).view(torch.float32)
    v = (qc + c) - c
    return (v.view(torch.int32) | ((q + 0.0).view(torch.int32) & -2147483648)).view(torch.float32)


def main() -> int:
    bad, step = 0, 1 << 26
    for start in range(0, 1 << 32, step):
        bits = torch.arange(start, start + step, dtype=torch.int64)
        q = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
        q = q[~torch.isnan(q)]
        want = nvfp4.decode_e2m1(nvfp4.round_e2m1(q))
        diff = rounded(q).view(torch.int32) != want.view(torch.int32)
        if diff.any():
            i = diff.nonzero()[0, 0]
            print(f"mismatch at {q[i].item()!r}: {rounded(q[i:i + 1]).item()!r} against {want[i].item()!r}")
            bad += int(diff.sum())
    print(f"{bad} mismatches over every non-NaN fp32 value")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
