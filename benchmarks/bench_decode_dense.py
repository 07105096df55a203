"""The exact GEMM at large M: in-register decode (quack W4) against decode-once + dense bf16 GEMM (H100/H200).

    python benchmarks/bench_decode_dense.py [--out FILE] [--quick]

Same run, per shape, R = 32, activations ready (CUDA-graph replays, ms; ratio = cuBLAS bf16 / time):
- cuBLAS bf16 ``x @ W^T`` at [M, K] x [N, K] (the baseline);
- "W4 now": quack's NVFP4 W4 GEMM with the low-rank MMA in its accumulator (the exact path today);
- "decode": ``decode_weight`` into a [N, K + 32] bf16 scratch;
- "dense": quack's dense bf16 GEMM at K + 32 with ``acc * wcscale + bias`` fused (low rank in the last 32
  columns), per tile / cluster config;
- "decode + dense": both in one graph, best config;
- "cuBLAS cat + epi": cuBLAS at K + 32 (bf16 out) and a torch ``* wcscale + bias`` pass, for reference.
Every output is checked against the contract (float64, ``nvfp4.tolerance``) before it is timed.

Measured and rejected (docs/perf.md, 2026-12-06): quack's dense bf16 GEMM alone is no faster than its W4
GEMM at these shapes, so the decode pass only adds. The decode kernel stays here, with the benchmark.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_conformance import _expected_and_bound, random_w4a4  # noqa: E402

from _cuda import graphed  # noqa: E402
from _table import Log  # noqa: E402

from svdq_linear.backends.sm90 import kernels, quack_gemm  # noqa: E402

SHAPES = [("single out", 4608, 15360, 3072), ("ref 4352x15360x3840", 4352, 15360, 3840),
          ("ff down", 4096, 12288, 3072), ("ref 4352x3840x3072", 4352, 3840, 3072),
          ("fused qkv", 4096, 3072, 9216), ("attn out", 4096, 3072, 3072)]
CONFIGS = [(128, 256, 2, 1), (128, 256, 1, 1), (128, 192, 1, 1), (256, 128, 1, 2)]  # tile M, N, cluster M, N
R = 32



_ROWS = 64  # quack's blob: [N / 64, K / 64, 128, 16] bytes, a 64 x 64 weight tile a [128, 16] chunk
_KT = 64


@triton.jit
def _decode_kernel(blob_ptr, sf_ptr, out_ptr, KT, stride_o, TILES: tl.constexpr):
    # One program: 64 weight rows (g) x TILES k-tiles of 64. quack's permutation, as index arithmetic:
    # row r = 16 t2 + 8 p0 + t1, byte column c = 8 b + 4 p1 + t0 -> chunk [32 t2 + 4 t1 + t0, 4 b + 2 p1 + p0];
    # scales: row r = 16 s1 + 8 i + s0, block b -> [8 s1 + s0, b, i] of a [32, 4, 2] strip.
    g = tl.program_id(0)
    kt0 = tl.program_id(1) * TILES
    r = tl.arange(0, 64)
    c = tl.arange(0, 32)
    t2, p0, t1 = r // 16, (r // 8) % 2, r % 8
    b, p1, t0 = c // 8, (c // 4) % 2, c % 4
    w_off = (32 * t2 + 4 * t1)[:, None] * 16 + (t0 * 16 + 4 * b + 2 * p1)[None, :] + p0[:, None]
    bs = tl.arange(0, 4)
    s_off = ((8 * t2 + t1) * 8 + p0)[:, None] + (bs * 2)[None, :]
    kk = tl.arange(0, 64)
    for i in range(TILES):
        kt = kt0 + i
        if kt < KT:
            chunk = (g * KT + kt).to(tl.int64)
            wp = tl.load(blob_ptr + chunk * 2048 + w_off)  # [64, 32] bytes
            sc = tl.load(sf_ptr + chunk * 256 + s_off)  # [64, 4] E4M3
            code = tl.interleave(wp & 0xF, wp >> 4).to(tl.int32)  # element 2j is the low nibble
            bits = ((code & 7) << 22) | ((code & 8) << 28)
            v = bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2**126: the E2M1 value
            scf = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            scf = tl.where((sc & 0x7F) == 0x7F, float("nan"), scf)  # NaN as the GPU reads it (the interpreter: 480)
            w = tl.reshape(tl.reshape(v, (64, 4, 16)) * scf[:, :, None], (64, 64))
            rows = (g * 64 + r).to(tl.int64)
            tl.store(out_ptr + rows[:, None] * stride_o + (kt * 64 + kk)[None, :], w.to(tl.bfloat16))


def decode_weight(blob: torch.Tensor, sf: torch.Tensor, out: torch.Tensor, tiles: int = 4) -> torch.Tensor:
    """Write the weight that ``blob`` / ``sf`` (``quack_gemm.repack_*``) hold, as exact bf16 values, into
    ``out[:, :K]`` (``out`` bf16 ``[N, >= K]``, unit stride along K); returns ``out``."""
    if blob.dtype != torch.uint8 or blob.dim() != 4 or tuple(blob.shape[2:]) != (128, 16):
        raise ValueError(f"decode_weight: blob must be uint8 [N/64, K/64, 128, 16], got {blob.dtype} "
                         f"{tuple(blob.shape)}")
    g, kt = blob.shape[:2]
    if tuple(sf.shape) != (g, kt, 32, 4, 2):
        raise ValueError(f"decode_weight: sf must be [{g}, {kt}, 32, 4, 2] for this blob, got {tuple(sf.shape)}")
    n, k = g * _ROWS, kt * _KT
    if out.dtype != torch.bfloat16 or out.dim() != 2 or out.shape[0] != n or out.shape[1] < k or out.stride(1) != 1:
        raise ValueError(f"decode_weight: out must be bf16 [{n}, >= {k}] with unit stride along K, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if not (blob.is_contiguous() and sf.is_contiguous()):
        raise ValueError("decode_weight: blob and sf must be contiguous")
    grid = (g, triton.cdiv(kt, tiles))
    _decode_kernel[grid](blob, sf.view(torch.uint8), out, kt, out.stride(0), TILES=tiles, num_warps=4)
    return out


def timer(fn) -> float:
    return do_bench(graphed(fn), warmup=10, rep=100, return_mode="median")


def _epi():
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import RowVecLoad

    @gemm_epilogue(ops={"wc": RowVecLoad("wc"), "bias": RowVecLoad("bias")})
    def dense_epi(acc, wc, bias):
        return {"D": acc * wc + bias}

    return dense_epi


def within(y, expected, bound) -> float:
    """Worst |y - expected| / bound (<= 1 passes)."""
    return ((y.double().cpu() - expected.double()).abs() / bound.double()).max().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_decode_dense.md")
    p.add_argument("--quick", action="store_true", help="the two K = 15360 shapes only")
    args = p.parse_args()
    log = Log()

    dev = torch.device("cuda")
    epi = _epi()
    log(f"# decode + dense against the in-register decode ({torch.cuda.get_device_name()}, R = {R})\n")
    heads = " | ".join(f"dense {a}x{b} c{c}x{d}" for a, b, c, d in CONFIGS)
    log("| shape | M | K | N | cuBLAS bf16 | W4 now | decode | " + heads
        + " | decode + dense | cuBLAS cat + epi | worst err / tol (now, dense) |")
    log("|---|---|---|---|---|---|---|" + "---|" * len(CONFIGS) + "---|---|---|")
    for label, m_tok, k, n in SHAPES[:2] if args.quick else SHAPES:
        log(shape_row(label, m_tok, k, n, dev, epi))
        torch.cuda.empty_cache()
    log.write(args.out)


def shape_row(label: str, m_tok: int, k: int, n: int, dev, epi) -> str:
    """One table row: every variant checked against the contract, then timed."""
    torch.manual_seed(0)
    mod = random_w4a4(k, n, R, torch.bfloat16, dev)
    x = torch.randn(m_tok, k, device=dev, dtype=torch.bfloat16)
    expected, bound = _expected_and_bound(mod, x)
    wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    t_bf16 = timer(lambda: x @ wb.T)

    w = quack_gemm.prepare(mod.qweight, mod.wscales, mod.wcscale, mod.bias)
    xq, _, _ = kernels.quantize_act(x, mod.smooth, out_dtype=torch.bfloat16)
    pds = (mod.proj_down.float() / mod.smooth[:, None]).bfloat16()
    lora = x @ pds
    lu = (mod.proj_up.float() / mod.wcscale.float()[:, None]).bfloat16().contiguous()
    seg = torch.zeros(n // 64, device=dev, dtype=torch.int32)
    y_now = quack_gemm.gemm(xq, w, lr_acc=(lu, lora, seg))
    e_now = within(y_now, expected, bound)
    t_now = timer(lambda: quack_gemm.gemm(xq, w, lr_acc=(lu, lora, seg)))

    scratch = torch.empty(n, k + R, device=dev, dtype=torch.bfloat16)
    scratch[:, k:] = lu
    t_dec = timer(lambda: decode_weight(w.blob, w.sf, scratch))
    decode_weight(w.blob, w.sf, scratch)
    acat = torch.cat([xq, lora], 1)
    out = torch.empty(m_tok, n, device=dev, dtype=torch.bfloat16)
    ea = {"wc": w.wc, "bias": w.bias}
    cells, best, e_dense = [], None, float("nan")
    for tm, tn, cm, cn in CONFIGS:
        def run(tm=tm, tn=tn, cm=cm, cn=cn):
            epi.gemm(acat, scratch, out, epi_args=ea, tile_M=tm, tile_N=tn, cluster_M=cm, cluster_N=cn)
        try:
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a config quack refuses: report it and go on
            cells.append(f"error {type(e).__name__}")
            continue
        err = within(out, expected, bound)
        if not err <= 1.0:
            cells.append(f"fails ({err:.2g}x tol)")
            continue
        e_dense = err if e_dense != e_dense else max(e_dense, err)
        t = timer(run)
        cells.append(f"{t:.4f} ({t_bf16 / t:.2f}x)")
        if best is None or t < best[0]:
            best = (t, run)
    if best is not None:
        def both(run=best[1]):
            decode_weight(w.blob, w.sf, scratch)
            run()
        t_both = timer(both)
        both_cell = f"**{t_both:.4f} ({t_bf16 / t_both:.2f}x)**"
    else:
        both_cell = "-"
    wc_row, bias_row = w.wc.reshape(1, -1), w.bias.reshape(1, -1)
    t_cat = timer(lambda: (acat @ scratch.T) * wc_row + bias_row)
    return (f"| {label} | {m_tok} | {k} | {n} | {t_bf16:.4f} | {t_now:.4f} ({t_bf16 / t_now:.2f}x) | {t_dec:.4f} | "
            + " | ".join(cells)
            + f" | {both_cell} | {t_cat:.4f} ({t_bf16 / t_cat:.2f}x) | {e_now:.3g}, {e_dense:.3g} |")


if __name__ == "__main__":
    main()
