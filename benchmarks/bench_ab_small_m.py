"""The small-M kernels against a baseline revision's copies of them, kernel alone, same run (CUDA-graph replays).

    bash benchmarks/ab_base.sh REV .devcarry/base      # here: REV's small_m.py and small_m_fast.py
    python benchmarks/bench_ab_small_m.py --base .devcarry/base [--out FILE]

A change to a kernel is kept when it measures faster than the version before it on the same GPU in the
same process, not against figures from another run or card. The baseline files are loaded as modules of
``svdq_linear.backends.sm90`` under other names (``_base_small_m``, ``_base_small_m_fast``: their own sync
words and counters), so both versions run side by side. Every launch is checked first: the one-launch
fast kernel against the fast formula in float64 (both versions), the default small-M kernel (W4A16, and
the exact mode on the canonical tensors) against the baseline's output to fp32 summation order.
Needs no quack-kernels.
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
from _baseline import load_beside  # noqa: E402
from _table import emit  # noqa: E402
from bench_small_m import graph_time  # noqa: E402
from bench_small_m_fast import fast_layers  # noqa: E402
from test_conformance import random_w4a4  # noqa: E402
from test_sm90_small_m_fast import _check, _want  # noqa: E402

from svdq_linear import NVFP4W4A16Linear  # noqa: E402
from svdq_linear.backends.sm90 import kernels, small_m, small_m_fast  # noqa: E402

PKG = "svdq_linear.backends.sm90"
FAST_SHAPES = (("attn", 3072, 3072), ("ff up", 3072, 12288), ("ff down", 12288, 3072), ("single out", 15360, 3072))
FAST_TOKENS = (1, 2, 16, 64)
# (label, K, N, mode): the default small-M kernel as the backend calls it
SMALL_CASES = (("attn", 3072, 3072, "w4a16"), ("ff down", 12288, 3072, "w4a16"), ("adaLN", 3072, 18432, "w4a16"),
               ("attn", 3072, 3072, "exact-canonical"), ("ff down", 12288, 3072, "exact-canonical"))
SMALL_TOKENS = (1, 2, 4, 9, 16, 64)


def load_base(folder: str) -> dict[str, object]:
    """The baseline's ``small_m`` and ``small_m_fast`` as ``_base_small_m`` / ``_base_small_m_fast`` (the
    second importing the first), beside the current ones."""
    mods = {}
    for name in ("small_m", "small_m_fast"):
        src = (Path(folder) / f"{name}.py").read_text().replace("from .small_m import", "from ._base_small_m import")
        path = Path(folder) / f"_base_{name}.py"
        path.write_text(src)  # (Triton reads a kernel's source from its file)
        mods[name] = load_beside(path, PKG, f"_base_{name}")
    return mods


def fast_rows(base, tokens=FAST_TOKENS) -> list[str]:
    rows = ["", "The one-launch fast kernel (`small_m_fast.linear`, default form), rank 32, bias; us", "",
            "| layer | K | N | M | cuBLAS bf16 | baseline | now | now vs baseline | now vs cuBLAS |",
            "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    for label, k, n, gen, (q, ws, wc, smooth, pd, up), bias, ops, lin in fast_layers(FAST_SHAPES):
        for m in tokens:
            x = (torch.randn(m, k, generator=gen) * 3).bfloat16()
            xc = x.cuda()
            want, bound = _want(x.float(), q, ws, wc, smooth, pd, up, bias, small_m_fast.use_dots(m, n, k))  # (the looser bound)
            for mod in (base, small_m_fast):
                _check(mod.linear(xc, **ops, out_dtype=torch.float32), want, bound, f"{mod.__name__} {label} m={m}")
            t_ref = graph_time(lambda: F.linear(xc, lin.weight, lin.bias))
            t_base = graph_time(lambda: base.linear(xc, **ops))
            t_now = graph_time(lambda: small_m_fast.linear(xc, **ops))
            rows.append(f"| {label} | {k} | {n} | {m} | {t_ref * 1e3:.1f} | {t_base * 1e3:.1f} | {t_now * 1e3:.1f} | "
                        f"{t_base / t_now:.2f}x | {t_ref / t_now:.2f}x |")
            print(rows[-1], flush=True)
    return rows


def small_call(mod, q, x, mode: str, out_dtype: torch.dtype):
    """``mod.linear`` as the backend calls it on the canonical tensors (``bench_small_m.kernel_call``)."""
    n = q.out_features
    if mode == "w4a16":
        return lambda: mod.linear(x, mod.CANONICAL, q.qweight, q.wscales, q.wcscale.float(), n, act=mod.ACT_X,
                                  bias=q.bias, out_dtype=out_dtype)
    lora = torch.randn(x.shape[0], q.rank, device="cuda", dtype=torch.bfloat16,
                       generator=torch.Generator(device="cuda").manual_seed(x.shape[0]))
    in_kernel = small_m.use_fma(x.shape[0], n, q.in_features)
    a = x if in_kernel else kernels.quantize_act(x, q.smooth)[0]
    act = mod.ACT_NVFP4 if in_kernel else mod.ACT_X
    return lambda: mod.linear(a, mod.CANONICAL, q.qweight, q.wscales, q.wcscale.float(), n, act=act, smooth=q.smooth,
                              bias=q.bias, proj_up=q.proj_up, lora_act=lora, out_dtype=out_dtype)


def small_rows(base) -> list[str]:
    rows = ["", "The default small-M kernel (`small_m.linear`, its default configuration), kernel alone; us", "",
            "| layer | mode | K | N | M | cuBLAS bf16 | baseline | now | now vs baseline | now vs cuBLAS |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(rows), flush=True)
    torch.manual_seed(0)
    for label, k, n, mode in SMALL_CASES:
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        q = NVFP4W4A16Linear.from_linear(lin) if mode == "w4a16" else random_w4a4(k, n, 32, torch.bfloat16, "cuda")
        for m in SMALL_TOKENS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y_base = small_call(base, q, x, mode, torch.float32)()
            y_now = small_call(small_m, q, x, mode, torch.float32)()
            err = ((y_now - y_base).abs().max() / y_base.abs().max().clamp_min(1e-30)).item()
            if not err <= 1e-5:  # the same products, fp32 sums in another order
                raise AssertionError(f"{label} {mode} m={m}: now differs from the baseline by {err:.3g} of max |y|")
            t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
            t_base = graph_time(small_call(base, q, x, mode, x.dtype))
            t_now = graph_time(small_call(small_m, q, x, mode, x.dtype))
            rows.append(f"| {label} | {mode} | {k} | {n} | {m} | {t_ref * 1e3:.1f} | {t_base * 1e3:.1f} | "
                        f"{t_now * 1e3:.1f} | {t_base / t_now:.2f}x | {t_ref / t_now:.2f}x |")
            print(rows[-1], flush=True)
    return rows


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="a folder holding the baseline's small_m.py and small_m_fast.py")
    p.add_argument("--out")
    p.add_argument("--only", choices=("fast", "small"))
    p.add_argument("--fast-tokens", default=",".join(map(str, FAST_TOKENS)), help="the one-launch kernel's token counts")
    args = p.parse_args()
    mods = load_base(args.base)
    rev = (Path(args.base) / "REV").read_text().strip() if (Path(args.base) / "REV").exists() else "?"
    rows = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"CUDA-graph replays; baseline: {rev}"]
    for mod in (small_m, mods["small_m"]):
        if hasattr(mod, "reserve_sync_words"):
            mod.reserve_sync_words(torch.device("cuda"))
    if args.only != "small":
        rows += fast_rows(mods["small_m_fast"], tuple(int(t) for t in args.fast_tokens.split(",")))
    if args.only != "fast":
        rows += small_rows(mods["small_m"])
    emit(rows, args.out)


if __name__ == "__main__":
    main()
