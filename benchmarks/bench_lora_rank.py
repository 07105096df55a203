"""What a LoRA costs on a quantized layer: a W4A4 layer (rank 32) timed before and after ``svdq_linear.fuse_lora``
adds an adapter of rank 16, 64 or 128 to its low-rank branch, in both sm90 modes, against ``F.linear`` bf16 timed
in the same run. Each LoRA'd output is first checked against the base layer's output plus ``x A^T B^T``.

    python benchmarks/bench_lora_rank.py [--out FILE] [--shapes MxKxN,...] [--ranks 16,64,128]

Times: the median of 30 replays of a CUDA graph of 20 calls (``_cuda.graph_call_ms``), in ms a call.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _cuda import graph_call_ms  # noqa: E402
from _table import emit  # noqa: E402
from test_conformance import random_w4a4  # noqa: E402

import svdq_linear  # noqa: E402

CALLS = 20


class Holder(nn.Module):
    """A one-layer model, so ``fuse_lora`` finds ``transformer.lin``."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin


def lora_for(x: torch.Tensor, y: torch.Tensor, n: int, r: int) -> dict[str, torch.Tensor]:
    """A diffusers-format adapter on ``lin`` whose term ``x A^T B^T`` has 0.3x the norm of the layer's output ``y``."""
    a = torch.randn(r, x.shape[1], device=x.device) / x.shape[1] ** 0.5
    b = torch.randn(n, r, device=x.device)
    b *= 0.3 * y.norm() / ((x.float() @ a.T) @ b.T).norm()
    return {"transformer.lin.lora_A.weight": a.to(torch.bfloat16),
            "transformer.lin.lora_B.weight": b.to(torch.bfloat16)}


def wall_ms(fn, calls: int) -> float:
    """Mean wall ms of ``calls`` calls (the CPU smoke run)."""
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) * 1e3 / calls


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out/bench_lora_rank.md")
    p.add_argument("--shapes", default="4096x3072x3072,4096x3072x12288,4096x15360x3072,256x3072x3072,16x3072x3072,"
                                       "1x3072x3072")
    p.add_argument("--ranks", default="16,64,128")
    p.add_argument("--base-rank", type=int, default=32)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (reference backend, wall time)")
    args = p.parse_args()
    dev = torch.device(args.device)
    timed = graph_call_ms if dev.type == "cuda" else wall_ms
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU smoke run, reference backend"
    rows = [f"# A LoRA's cost on a W4A4 layer ({name}; base rank {args.base_rank}; ms a call; ratio: bf16 / layer)",
            "",
            "| M x K x N | mode | bf16 ms | base ms (ratio) | "
            + " | ".join(f"+ LoRA r {r}: rank, ms (ratio, vs base)" for r in ranks)
            + " | worst rel. error of the change |",
            "|---|---|---|---|" + "---|" * len(ranks) + "---|"]
    for m, k, n in shapes:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        t_bf16 = timed(lambda: F.linear(x, w), CALLS)
        for mode in ("exact", "fast"):
            lin = random_w4a4(k, n, args.base_rank, torch.bfloat16, dev).set_mode(mode)
            model = Holder(lin)
            y0 = lin(x).float()
            t_base = timed(lambda: lin(x), CALLS)
            cells, worst = [], 0.0
            for r in ranks:
                lora = lora_for(x, y0, n, r)
                svdq_linear.fuse_lora(model, lora)
                a, b = lora["transformer.lin.lora_A.weight"].float(), lora["transformer.lin.lora_B.weight"].float()
                want = (x.float() @ a.T) @ b.T  # the adapter's term; the layer's change must be it
                err = ((lin(x).float() - y0 - want).norm() / want.norm()).item()
                worst = max(worst, err)
                if not err < 0.05:  # bf16 rounding of the two outputs and of x / smooth: about 1e-2
                    raise SystemExit(f"{m}x{k}x{n} {mode} + r {r}: the LoRA changed the output by x A^T B^T with a "
                                     f"relative error of {err:.3g}")
                t = timed(lambda: lin(x), CALLS)
                cells.append(f"{lin.rank}, {t:.4f} ({t_bf16 / t:.2f}x, {t / t_base:.3f})")
                svdq_linear.unfuse_lora(model)
            rows.append(f"| {m}x{k}x{n} | {mode} | {t_bf16:.4f} | {t_base:.4f} ({t_bf16 / t_base:.2f}x) | "
                        + " | ".join(cells) + f" | {worst:.2e} |")
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    emit(rows, args.out)


if __name__ == "__main__":
    main()
