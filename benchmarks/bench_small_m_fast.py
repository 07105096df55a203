"""The fast mode's one-launch kernel alone (``sm90/small_m_fast.py``) against cuBLAS bf16, CUDA-graph replays.

    python benchmarks/bench_small_m_fast.py [--out FILE] [--tokens 1,2,8,16,64] [--configs 4:0:5,8:0:3]

Needs no quack-kernels: the operands are made from random NVFP4 layers (``tests/test_sm90_small_m_fast``'s
helpers) and each launch is checked against the fast formula in float64 first. Per layer and token
count: cuBLAS bf16 ``F.linear``; the kernel in its default form (``small_m_fast.use_dots``) and, at 1-2
tokens, in the other one too; weight GB/s (codes and scales read once) against a
device-to-device copy measured in the same run. ``bench_small_m.py --fast-one`` times it against the
routed path through the module (that needs quack). ``--configs`` times the default form instead under
other occupancies, each ``warps:maxnreg:ctas_per_sm`` (maxnreg 0: the compiler's choice; ctas_per_sm 0: the
default, what the compiled kernel lets stay resident, shown as ``fit``), the first the
baseline of the ratio column, each launch checked too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _table import emit  # noqa: E402
from bench_small_m import copy_gbs_now, graph_time  # noqa: E402
from test_sm90_small_m_fast import _check, _layer, _operands, _want  # noqa: E402

from svdq_linear.backends.sm90 import small_m_fast  # noqa: E402

SHAPES = (("attn", 3072, 3072), ("ff up", 3072, 12288), ("ff down", 12288, 3072), ("single out", 15360, 3072))


def fast_layers(shapes, seed: int = 0):
    """Per ``(label, K, N)``: a random NVFP4 layer of rank 32 with a bias (``_layer``), the kernel's operands
    on the GPU and a bf16 ``nn.Linear`` of the same shape; the generator goes on to make the inputs."""
    gen = torch.Generator().manual_seed(seed)
    for label, k, n in shapes:
        layer = _layer(n, k, 32, gen)
        bias = torch.randn(n, generator=gen)
        ops = _operands(*layer, bias)
        yield label, k, n, gen, layer, bias, ops, torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--tokens", default="1,2,8,16,64")
    p.add_argument("--configs", help="warps:maxnreg:ctas_per_sm,... (occupancy sweep of the default form)")
    args = p.parse_args()
    if args.configs:
        return sweep(args)
    copy_gbs = copy_gbs_now()
    rows = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"CUDA-graph replays; device copy {copy_gbs:.0f} GB/s (read + write); rank 32, bias", "",
            "| layer | K | N | M | cuBLAS bf16 us | one launch us (form) | ratio | weight GB/s | % of copy | other form us | check |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, k, n, gen, (q, ws, wc, smooth, pd, up), bias, ops, lin in fast_layers(SHAPES):
        wbytes = n * k // 2 + n * k // 16
        for m in (int(t) for t in args.tokens.split(",")):
            x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
            xc = x.cuda()
            dot = small_m_fast.use_dots(m, n, k)  # the default form
            check = []
            for form in ((dot, not dot) if m <= small_m_fast.FMA_MAX_M else (dot,)):
                y = small_m_fast.linear(xc, **ops, out_dtype=torch.float32, dot=form)
                want, bound = _want(x.float(), q, ws, wc, smooth, pd, up, bias, form)
                try:
                    _check(y, want, bound, f"{label} m={m} dot={form}")
                    check.append("ok")
                except AssertionError as e:
                    check.append(f"WRONG ({str(e)[:80]})")
            t_ref = graph_time(lambda: F.linear(xc, lin.weight, lin.bias))
            t = graph_time(lambda: small_m_fast.linear(xc, **ops, dot=dot))
            other = "-"
            if m <= small_m_fast.FMA_MAX_M:
                t2 = graph_time(lambda: small_m_fast.linear(xc, **ops, dot=not dot))
                other = f"{t2 * 1e3:.1f} ({t_ref / t2:.2f}x)"
            gbs = wbytes / (t * 1e-3) / 1e9
            rows.append(f"| {label} | {k} | {n} | {m} | {t_ref * 1e3:.1f} | {t * 1e3:.1f} ({'dots' if dot else 'fma'}) "
                        f"| {t_ref / t:.2f}x | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | {other} | {', '.join(check)} |")
            print(rows[-1], flush=True)
    emit(rows, args.out)


def sweep(args) -> None:
    """The default form under each ``warps:maxnreg:ctas_per_sm`` of ``--configs`` (same run, CUDA graphs)."""
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    rows = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, "
            "CUDA-graph replays (us); rank 32, bias; config warps:maxnreg:ctas_per_sm (maxnreg 0: the compiler's; "
            "ctas 0: fitted), "
            f"ratio against {args.configs.split(',')[0]}", "",
            "| layer | M | cuBLAS bf16 | " + " | ".join(args.configs.split(",")) + " | best vs cuBLAS |",
            "|---|---|---|" + "---|" * len(configs) + "---|"]
    for label, k, n, gen, (q, ws, wc, smooth, pd, up), bias, ops, lin in fast_layers(SHAPES):
        for m in (int(t) for t in args.tokens.split(",")):
            x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
            xc = x.cuda()
            dot = small_m_fast.use_dots(m, n, k)
            want, bound = _want(x.float(), q, ws, wc, smooth, pd, up, bias, dot)
            t_ref = graph_time(lambda: F.linear(xc, lin.weight, lin.bias))
            cells, best, t0 = [], float("inf"), None
            for w, reg, c in configs:
                kw = dict(num_warps=w, maxnreg=reg or None, ctas_per_sm=c or None)
                small_m_fast._FITTED.clear()
                try:
                    _check(small_m_fast.linear(xc, **ops, out_dtype=torch.float32, **kw), want, bound, f"{label} {m}")
                except AssertionError as e:
                    cells.append(f"WRONG ({str(e)[:60]})")
                    continue
                t = graph_time(lambda: small_m_fast.linear(xc, **ops, **kw))
                t0 = t0 or t
                best = min(best, t)
                fit = list(small_m_fast._FITTED.values())  # (one build since the clear below)
                cells.append(f"{t * 1e3:.1f} ({t0 / t:.2f}x)" + (f" fit {fit[0]}" if not c and fit else ""))
            rows.append(f"| {label} | {m} | {t_ref * 1e3:.1f} | " + " | ".join(cells) + f" | {t_ref / best:.2f}x |")
            print(rows[-1], flush=True)
    emit(rows, args.out)


if __name__ == "__main__":
    main()
