"""GPU time of the sm90 paths at a few tokens, without host overhead: CUDA-graph replays.

    python benchmarks/bench_small_m.py [--out FILE] [--sweep] [--crossover] [--mma] [--mma-sweep] [--words] [--tokens]
                                       [--fast-one] [--exact-one]

At M <= 64 one call is microseconds of GPU work behind ~0.2 ms of Python and launch overhead, so
``do_bench`` on the eager call measures the host. Here each variant is captured once in a CUDA graph
holding 20 calls and the replays are timed with events. Per shape: cuBLAS bf16 ``F.linear``; the
module's whole forward in the exact mode and W4A16 on its default path and with the path the small-M
kernels replaced (the Triton W4 GEMM); the Triton small-M kernel alone with its epilogue and low-rank
term (the GEMM target), its weight GB/s (4-bit codes and scales read once) against a device-to-device
copy measured in the same run; the fast mode's forward beside them. ``--sweep`` times the Triton
kernel's tile, warp and split choices. ``--mma`` times, per mode and token count, the module without
and with the warp tensor-core kernel (``small_m_mma``; ``SVDQ_SM90_SMALL_M_MMA`` 0 / 1) and that
kernel alone; ``--mma-sweep`` times that kernel at each prefetch depth and CTAs an SM. ``--fast-one``
times only the fast mode at 1-64 tokens: the module's routed path against ``small_m_fast``'s one launch
(``SVDQ_SM90_FAST_ONE_LAUNCH=1``, checked against the fast formula first) and that kernel at each CTAs
an SM and pipeline depth. ``--exact-one`` times the exact mode at 1-2 tokens: the module's routed path against
``small_m_fast.linear_exact`` (``SVDQ_SM90_EXACT_ONE_LAUNCH=1``, checked against the contract first) and that
kernel at each CTAs an SM.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _cuda import graph_call_ms  # noqa: E402
from _table import emit  # noqa: E402
from test_conformance import random_w4a4  # noqa: E402

import svdq_linear.backends.sm90 as sm90  # noqa: E402
from svdq_linear import NVFP4W4A16Linear  # noqa: E402
from svdq_linear.backends.sm90 import small_m  # noqa: E402

CALLS = 20


def graph_time(fn) -> float:
    """Median ms of one call, from replays of a graph of CALLS calls."""
    return graph_call_ms(fn, CALLS)


def copy_gbs_now() -> float:
    """Device-to-device copy bandwidth (read + write, GB/s) of 256 MiB, from graph replays."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (graph_time(lambda: dst.copy_(src)) * 1e-3) / 1e9


def module_time(q, x, small: bool, mma: str | None = None) -> float:
    """The module's forward with the small-M kernel on or off; ``mma`` sets SVDQ_SM90_SMALL_M_MMA
    (None: the default routing, tuning.use_small_m_mma)."""
    saved = sm90.SMALL_M
    sm90.SMALL_M = dict.fromkeys(saved, 64 if small else 0)  # read per call by the backend
    try:
        return env_time(lambda: q(x), sm90.ENV_SMALL_M_MMA, mma)
    finally:
        sm90.SMALL_M = saved


def env_time(fn, name: str, value: str | None) -> float:
    """graph_time with one environment variable set (or unset) while the graph is captured: the backend
    reads its routing switches per call, at capture."""
    saved = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        return graph_time(fn)
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def mma_kernel_call(q, x):
    """small_m_mma alone as the backend calls it, on the module's prepared state (activations and
    lora_act made beforehand)."""
    from svdq_linear import backends
    from svdq_linear.backends.sm90 import kernels, quack_fast, small_m_mma

    _, prep = backends.resolve(q, x)
    ex = prep.tensors()
    r = q.rank
    lora = torch.randn(x.shape[0], r, device="cuda", dtype=torch.float32) if r else None
    if q.mode == "fast":
        fw = quack_fast.FastWeight(*ex[-5:-1])
        a8, sa = kernels.quantize_act_fp8(x, q.smooth, inv_smooth=ex[-1], gemm_order=True)
        return lambda **kw: small_m_mma.linear_fast(a8, sa, fw, q.bias, q.proj_up if r else None, lora,
                                                    torch.bfloat16, **kw)
    xq = kernels.quantize_act(x, q.smooth)[0]
    blob, sf = ex[-4], ex[-3]
    lora16 = None if lora is None else lora.to(torch.bfloat16)
    return lambda **kw: small_m_mma.linear(xq, blob, sf, q.wcscale.float(), q.bias, q.proj_up if r else None, lora16,
                                           out_dtype=x.dtype, **kw)


def kernel_call(q, x, mode: str, fma: bool | None = None):
    """The small-M kernel alone as the backend calls it (activations and lora_act made beforehand);
    ``exact`` reads quack's blob where quack is installed (as the backend does), ``exact-canonical``
    the canonical tensors, ``w4a16`` the canonical ones too. ``fma`` forces the multiply-add form (the
    exact mode's activations then quantized in the kernel) or the dot instead of ``small_m.use_fma``."""
    n, k = q.out_features, q.in_features
    if mode == "w4a16":
        return lambda **kw: small_m.linear(x, small_m.CANONICAL, q.qweight, q.wscales, q.wcscale.float(), n,
                                           act=small_m.ACT_X, bias=q.bias, out_dtype=x.dtype, fma=fma, **kw)
    if mode not in ("exact", "exact-canonical"):
        raise ValueError(f"expected mode 'w4a16', 'exact' or 'exact-canonical', got {mode!r}")
    # the same lora_act for every call on this layer and input (the forms are compared with each other)
    lora = torch.randn(x.shape[0], q.rank, device="cuda", dtype=torch.bfloat16,
                       generator=torch.Generator(device="cuda").manual_seed(x.shape[0]))
    lay, w, s = small_m.CANONICAL, q.qweight, q.wscales
    if mode == "exact" and sm90._quack_module() is not None:
        from svdq_linear.backends.sm90 import quack_gemm

        lay, w, s = small_m.QUACK, quack_gemm.repack_weight(q.qweight), quack_gemm.repack_scales(q.wscales)
    in_kernel = small_m.use_fma(x.shape[0], n, k) if fma is None else fma
    act = small_m.ACT_NVFP4 if in_kernel else small_m.ACT_X
    a = x
    if not in_kernel:  # the dot reads the exact activations, as the backend hands them over
        from svdq_linear.backends.sm90 import kernels

        a = kernels.quantize_act(x, q.smooth)[0]
    return lambda **kw: small_m.linear(a, lay, w, s, q.wcscale.float(), n, act=act, smooth=q.smooth, bias=q.bias,
                                       proj_up=q.proj_up, lora_act=lora, out_dtype=x.dtype, fma=fma, **kw)


SHAPES = [("attn", 1, 3072, 3072), ("attn", 4, 3072, 3072), ("attn", 8, 3072, 3072), ("attn", 16, 3072, 3072),
          ("attn", 64, 3072, 3072), ("ff up", 1, 3072, 12288), ("ff down", 1, 12288, 3072)]
ADALN = [("adaLN W4A16", 1, 3072, 18432), ("adaLN W4A16", 2, 3072, 18432), ("adaLN W4A16", 4, 3072, 9216)]
# (block_n, block_k, warps, pipeline stages) tried by --sweep; the repacked layouts are read 64 rows a tile
SWEEP_CANONICAL = [(64, 128, 8, 1), (64, 128, 8, 3), (64, 128, 8, 4), (64, 64, 4, 3), (64, 64, 8, 3), (128, 128, 8, 3)]
SWEEP_REPACKED = [(64, 64, 8, 3), (64, 128, 8, 1), (64, 128, 8, 3), (64, 128, 8, 4), (64, 64, 4, 3), (64, 256, 8, 3)]
SWEEP_DOT = [(64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3)]


WORDS_CASES = [("attn 3072x3072", 1, 3072, 3072, "w4a16"), ("adaLN 3072x18432", 1, 3072, 18432, "w4a16"),
               ("adaLN single 3072x9216", 1, 3072, 9216, "w4a16"), ("attn 3072x3072", 2, 3072, 3072, "w4a16"),
               ("ff down 12288x3072", 1, 12288, 3072, "w4a16"), ("attn 3072x3072", 1, 3072, 3072, "exact-canonical")]
# small_m.linear keywords tried by --words (with words=True); 2026-12-04h-11: a decode that loaded the
# block columns one by one lost 1.4-2.5x at the rule's split; h-13: no stage / split / register variant
# beat the default at the adaLN shape; i-1: the prefetch 0-4 %; i-2: the block chain 2-10 %, k-step 256
# with it 1.97x at adaLN
WORDS_CONFIGS = [dict(block_k=128, chain=False), dict(block_k=128, chain=True), dict(block_k=256, chain=True),
                 dict(block_k=256, chain=True, prefetch=True), dict(block_k=256, chain=True, num_stages=2),
                 dict(block_k=256, chain=True, num_stages=4), dict(block_k=512, chain=True),
                 dict(block_k=256, chain=True, block_n=32), dict(block_k=256, chain=True, block_n=128)]


def _checked_times(call, base, kws: list[dict]) -> tuple[list[str], float | None]:
    """``call(**kw)`` for each of ``kws``: its output compared with ``base`` (fp32 summation order only),
    then timed. Table cells (``WRONG`` marks a mismatch) and the best time of those that matched."""
    cells, best = [], None
    for kw in kws:
        y = call(**kw)
        ok = torch.allclose(y.float(), base.float(), rtol=2e-2, atol=1e-3 * base.float().abs().max().item())
        t = graph_time(lambda kw=kw: call(**kw))
        best = t if ok and (best is None or t < best) else best
        cells.append(f"{t * 1e3:.1f}" + ("" if ok else " WRONG"))
    return cells, best


# --tokens: 1-4 tokens, the dot against the multiply-add form's word decode with the block chain (the
# k-step decoded once for every token) at three tiles: what small_m.use_fma (the chain up to 2 tokens)
# is set from
TOKENS_CASES = [("adaLN 3072x18432", 3072, 18432, "w4a16"), ("adaLN single 3072x9216", 3072, 9216, "w4a16"),
                ("ff down 12288x3072", 12288, 3072, "w4a16"), ("attn 3072x3072", 3072, 3072, "w4a16"),
                ("attn 3072x3072", 3072, 3072, "exact-canonical"), ("ff up 3072x12288", 3072, 12288, "exact-canonical"),
                ("ff down 12288x3072", 12288, 3072, "exact-canonical")]
TOKENS_CONFIGS = [dict(block_n=32, block_k=256), dict(block_n=64, block_k=128), dict(block_n=64, block_k=256)]


def tokens_table(copy_gbs: float, modes: tuple[str, ...] = ("w4a16", "exact-canonical")) -> list[str]:
    """1-4 tokens: the kernel alone with its dot forced (``fma=False``) and with the word decode's block
    chain forced (``fma=True``), each output checked against the dot's first; cuBLAS bf16 beside them,
    same run. ``modes``: which of ``TOKENS_CASES`` run."""
    rows = ["", "The small-M kernel at 1-4 tokens, kernel alone (us): dot = the tensor-core form (the default "
            "from 3 tokens), chain = multiply-adds with the word decode's block chain (block_n x block_k)", "",
            "| layer | mode | M | cuBLAS bf16 | dot | " + " | ".join(f"chain {c['block_n']}x{c['block_k']}" for c in TOKENS_CONFIGS)
            + " | best vs bf16 | best GB/s (% of copy) |", "|---|---|---|---|---|" + "---|" * len(TOKENS_CONFIGS) + "---|---|"]
    print("\n".join(rows), flush=True)
    for label, k, n, mode in [c for c in TOKENS_CASES if c[3] in modes]:
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        q = NVFP4W4A16Linear.from_linear(lin) if mode == "w4a16" else random_w4a4(k, n, 32, torch.bfloat16, "cuda")
        for m in (1, 2, 3, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
            dot = kernel_call(q, x, mode, fma=False)
            base = dot()
            t_dot = graph_time(dot)
            chain = kernel_call(q, x, mode, fma=True)
            cells, best = _checked_times(chain, base, [dict(words=True, chain=True, **cfg) for cfg in TOKENS_CONFIGS])
            cells = [f"{t_dot * 1e3:.1f}"] + cells
            best = t_dot if best is None else min(t_dot, best)
            gbs = (n * k // 2 + n * k // 16) / (best * 1e-3) / 1e9
            rows.append(f"| {label} | {mode} | {m} | {t_ref * 1e3:.1f} | " + " | ".join(cells)
                        + f" | {t_ref / best:.2f}x | {gbs:.0f} ({100 * gbs / copy_gbs:.0f}%) |")
            print(rows[-1], flush=True)
    return rows


def _words_label(cfg: dict) -> str:
    """A config's column title: ``words k256 chain st2 ...`` (defaults: 64-row tiles, 4 warps, split by the
    rule, 3 stages)."""
    short = dict(block_k="k", num_warps="w", split_k="s", num_stages="st", maxnreg="r", block_n="bn")
    return " ".join(["words"] + [f"{short[key]}{v}" for key, v in cfg.items() if key in short]
                    + [key for key in ("prefetch", "chain") if cfg.get(key)])


def words_table(copy_gbs: float) -> list[str]:
    """The multiply-add form's word decode against its per-byte decode: the kernel alone (epilogue
    included), each output compared with the per-byte one (fp32 summation order only) before it is
    timed; cuBLAS bf16 beside it, same run."""
    rows = ["", "The small-M kernel's multiply-add form, kernel alone (us; weight GB/s = codes + scales / time); "
            "bytes = per-byte decode (the default before), words = 32-bit word decode, k-step, warps, split, stages, register cap, activations and scales prefetched a step ahead, chain = each block's products in one multiply-add chain, k reduced after the loop", "",
            "| layer | M | mode | cuBLAS bf16 | bytes (default) | " + " | ".join(_words_label(c) for c in WORDS_CONFIGS)
            + " | best words vs bf16 | best GB/s (% of copy) |", "|---|---|---|---|---|" + "---|" * len(WORDS_CONFIGS) + "---|---|"]
    print("\n".join(rows), flush=True)
    for label, m, k, n, mode in WORDS_CASES:
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
        q = NVFP4W4A16Linear.from_linear(lin) if mode == "w4a16" else random_w4a4(k, n, 32, torch.bfloat16, "cuda")
        call = kernel_call(q, x, mode)
        base = call(words=False, block_k=64)  # the per-byte decode at its own k-step
        t_b = graph_time(lambda: call(words=False, block_k=64))
        # 64-row tiles unless the config says (the column titles)
        cells, best = _checked_times(call, base, [{"words": True, "block_n": 64, **cfg} for cfg in WORDS_CONFIGS])
        wbytes = n * k // 2 + n * k // 16
        if best is None:  # every config wrote something else than the per-byte decode
            rows.append(f"| {label} | {m} | {mode} | {t_ref * 1e3:.1f} | {t_b * 1e3:.1f} | " + " | ".join(cells) + " | - | - |")
        else:
            gbs = wbytes / (best * 1e-3) / 1e9
            rows.append(f"| {label} | {m} | {mode} | {t_ref * 1e3:.1f} | {t_b * 1e3:.1f} ({t_ref / t_b:.2f}x) | "
                        + " | ".join(cells) + f" | {t_ref / best:.2f}x | {gbs:.0f} ({100 * gbs / copy_gbs:.0f}%) |")
        print(rows[-1], flush=True)
    return rows


FAST_ONE_SHAPES = (("attn", 3072, 3072), ("ff up", 3072, 12288), ("ff down", 12288, 3072),
                   ("single out", 15360, 3072))


def _one_launch_cases(mode: str, tokens: tuple, env: str):
    """Per Flux layer (``FAST_ONE_SHAPES``) and token count: ``(label, k, n, m, q, x, t_ref, t_def, y_one,
    wbytes)``: a random ``mode`` module, cuBLAS bf16's time, the module's default path's time with ``env`` off,
    and its output with ``env`` set to "1" (the one launch)."""
    for label, k, n in FAST_ONE_SHAPES:
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        q = random_w4a4(k, n, 32, torch.bfloat16, "cuda").set_mode(mode)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
            t_def = env_time(lambda: q(x), env, "0")
            os.environ[env] = "1"
            try:
                y = q(x)
            finally:
                os.environ.pop(env, None)
            yield label, k, n, m, q, x, t_ref, t_def, y, n * k // 2 + n * k // 16


def _one_launch_row(label, k, n, m, t_ref, t_def, t_one, check, wbytes, copy_gbs, cells) -> str:
    """A one-launch table's row (ms in, us out; the one launch's weight GB/s against the copy's), printed too."""
    gbs = wbytes / (t_one * 1e-3) / 1e9
    row = (f"| {label} | {k} | {n} | {m} | {t_ref * 1e3:.1f} | {t_def * 1e3:.1f} ({t_ref / t_def:.2f}x) | "
           f"{t_one * 1e3:.1f} ({t_ref / t_one:.2f}x) | {check} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |"
           + "".join(f" {c} |" for c in cells))
    print(row, flush=True)
    return row


def fast_one_table(copy_gbs: float, sweep: bool = True, tokens: tuple = (1, 2, 8, 16, 64)) -> list[str]:
    """The fast mode at ``tokens`` (1-64): routed (up to five launches) against small_m_fast (one), and
    (``sweep``) the kernel at each split target x pipeline depth."""
    from test_sm90_fast import _assert_fast_formula

    from svdq_linear import backends
    from svdq_linear.backends.sm90 import ENV_FAST_ONE_LAUNCH, small_m_fast

    ctas, stages = ((4, 8, 16), (2, 3, 4)) if sweep else ((), ())
    rows = ["", "The fast mode at 1-64 tokens (us; ratio = cuBLAS bf16 / ours): 'routed' = the default path (FP8 pass, "
            "cuBLAS lora_act, small_m_mma or quack's GEMM, split-K epilogue); 'one launch' = small_m_fast "
            "(SVDQ_SM90_FAST_ONE_LAUNCH=1: its default form, small_m_fast.use_dots; 'check' = its output against "
            "the fast formula in float64); 'dots' = the FP8-dot form forced at 1-2 tokens; then the kernel at c CTAs "
            f"an SM (split target; default {small_m_fast.CTAS_PER_SM}) x s pipeline stages (default 3), us (weight GB/s)",
            "", "| layer | K | N | M | cuBLAS bf16 | routed | one launch | check | weight GB/s | % of copy | dots |"
            + "".join(f" c{c} s{st} |" for c in ctas for st in stages),
            "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (len(ctas) * len(stages))]
    for label, k, n, m, q, x, t_ref, t_def, y, wbytes in _one_launch_cases("fast", tokens, ENV_FAST_ONE_LAUNCH):
        try:
            _assert_fast_formula(q, x, y)
            check = "ok"
        except AssertionError as e:
            check = f"WRONG ({e})"
        t_one = env_time(lambda: q(x), ENV_FAST_ONE_LAUNCH, "1")
        _, prep = backends.resolve(q, x)
        ex = prep.tensors()
        blob, strip, cs, bias = ex[-5:-1]
        ops = (x, ex[-1], blob, strip, cs.reshape(-1), bias.reshape(-1) if q.bias is not None else None,
               ex[0][:, :q.rank], q.proj_up.contiguous())
        dots = "-"
        if m <= small_m_fast.FMA_MAX_M:
            t = graph_time(lambda: small_m_fast.linear(*ops, dot=True))
            dots = f"{t * 1e3:.1f} ({t_ref / t:.2f}x)"
        cells = []
        for c in ctas:
            for st in stages:
                t = graph_time(lambda: small_m_fast.linear(*ops, num_stages=st, ctas_per_sm=c))
                cells.append(f"{t * 1e3:.1f} ({wbytes / (t * 1e-3) / 1e9:.0f})")
        rows.append(_one_launch_row(label, k, n, m, t_ref, t_def, t_one, check, wbytes, copy_gbs, [dots] + cells))
    return rows


def _contract_check(q, x: torch.Tensor, y: torch.Tensor) -> str:
    """'ok' where the exact mode's output ``y`` of layer ``q`` on ``x`` is within the contract's tolerance of
    the float64 reference, else how far out it is."""
    from svdq_linear import nvfp4

    args = [t.cpu() if t is not None else None for t in
            (q.qweight, q.wscales, q.smooth, q.proj_down, q.proj_up, q.wcscale, q.bias)]
    want = nvfp4.w4a4_linear(x.cpu(), *args, torch.float64)
    bound = nvfp4.tolerance(x.cpu(), *args, torch.bfloat16)
    worst = ((y.double().cpu() - want).abs() / bound).max().item()
    return "ok" if worst <= 1 else f"WRONG ({worst:.2f}x the tolerance)"


def exact_one_table(copy_gbs: float, tokens: tuple = (1, 2), ctas: tuple = (4, 5, 6),
                    stages: tuple = (1, 2, 4)) -> list[str]:
    """The exact mode at 1-2 tokens: the module's routed path (quantize_act, cuBLAS lora_act, small_m_mma or the
    Triton small-M kernel) against ``small_m_fast.linear_exact`` (one launch, integer dot products; the default
    since the twentieth session), its output checked against the contract (``nvfp4.tolerance``) first, and that
    kernel at ``ctas`` CTAs an SM and at ``stages`` k-tiles in flight."""
    from svdq_linear import backends
    from svdq_linear.backends.sm90 import ENV_EXACT_ONE_LAUNCH, small_m_fast, tuning

    rows = ["", "The exact mode at 1-2 tokens (us; ratio = cuBLAS bf16 / ours): 'routed' = the path without the one "
            "launch (SVDQ_SM90_EXACT_ONE_LAUNCH=0); 'one launch' = small_m_fast.linear_exact, the default "
            "(SVDQ_SM90_EXACT_ONE_LAUNCH=1; 'check' = its output against the "
            "contract's tolerance); 'self acts' = the kernel alone with each worker quantizing its own k-range "
            "(self_acts=True) instead of waiting for the producers'; then the kernel alone at c CTAs an SM (split "
            "target), us (weight GB/s); then the kernel alone at the default split with s k-tiles in flight "
            "(num_stages; default 3), us", "",
            "| layer | K | N | M | cuBLAS bf16 | routed | one launch | check | weight GB/s | % of copy | self acts |"
            + "".join(f" c{c} |" for c in ctas) + "".join(f" s{st} |" for st in stages),
            "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * (len(ctas) + len(stages))]
    for label, k, n, m, q, x, t_ref, t_def, y, wbytes in _one_launch_cases("exact", tokens, ENV_EXACT_ONE_LAUNCH):
        check = _contract_check(q, x, y)
        t_one = env_time(lambda: q(x), ENV_EXACT_ONE_LAUNCH, "1")
        _, prep = backends.resolve(q, x)
        ex = prep.tensors()
        blob, sf, wc, bias = ex[-4:]
        ops = (x, q.smooth.float().contiguous(), blob, sf, wc.reshape(-1), bias.reshape(-1), ex[0][:, :q.rank],
               q.proj_up.contiguous())
        same = torch.equal(small_m_fast.linear_exact(*ops, self_acts=True), small_m_fast.linear_exact(*ops))
        t = graph_time(lambda: small_m_fast.linear_exact(*ops, self_acts=True))
        cells = [f"{t * 1e3:.1f} ({t_ref / t:.2f}x){'' if same else ' DIFFERS'}"]
        for c in ctas:
            t = graph_time(lambda: small_m_fast.linear_exact(*ops, ctas_per_sm=c))
            cells.append(f"{t * 1e3:.1f} ({wbytes / (t * 1e-3) / 1e9:.0f})")
        cps = tuning.exact_one_launch_ctas(m, n, k) or None  # the default split, as the backend passes it
        for st in stages:
            t = graph_time(lambda: small_m_fast.linear_exact(*ops, ctas_per_sm=cps, num_stages=st))
            cells.append(f"{t * 1e3:.1f}")
        rows.append(_one_launch_row(label, k, n, m, t_ref, t_def, t_one, check, wbytes, copy_gbs, cells))
    return rows


def exact_kernel_table(copy_gbs: float, tokens: tuple = (1, 2), ctas: tuple = (4, 5, 6),
                       stages: tuple = (1, 2, 3, 4)) -> list[str]:
    """``small_m_fast.linear_exact`` alone on operands repacked here (``quack_layout.repack_*``, plain torch), so
    it runs where quack is not installed (a Triton-only device call): its output against the contract first,
    then at ``ctas`` CTAs an SM and, at the default split (``tuning.exact_one_launch_ctas``), at ``stages``
    k-tiles in flight. The default column is the module's build (``tuning.exact_one_launch_stages``). The
    kernel-alone columns of ``exact_one_table`` time the same launch."""
    from svdq_linear.backends.sm90 import quack_layout, small_m_fast, tuning

    rows = ["", "The exact one launch alone (small_m_fast.linear_exact, rank 32, bias; us; ratio = cuBLAS bf16 / "
            "ours; 'check' = its output at the default split against the contract's tolerance): at c CTAs an SM "
            "(split target), us (weight GB/s); then at the default split with s k-tiles in flight (num_stages; "
            "the default column's: tuning.exact_one_launch_stages), us", "",
            "| layer | K | N | M | cuBLAS bf16 | check | default split |" + "".join(f" c{c} |" for c in ctas)
            + "".join(f" s{st} |" for st in stages),
            "|---|---|---|---|---|---|---|" + "---|" * (len(ctas) + len(stages))]
    for label, k, n in (("attn", 3072, 3072), ("ff up", 3072, 12288), ("ff down", 12288, 3072),
                        ("single out", 15360, 3072)):
        q = random_w4a4(k, n, 32, torch.bfloat16, "cuda")
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        wbytes = n * k // 2 + n * k // 16
        sm = q.smooth.float().contiguous()
        ops = (sm, quack_layout.repack_weight(q.qweight), quack_layout.repack_scales(q.wscales),
               q.wcscale.float().reshape(-1), q.bias.float().reshape(-1),
               (q.proj_down.float() / sm[:, None]).bfloat16(), q.proj_up.contiguous())
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cps = tuning.exact_one_launch_ctas(m, n, k) or None
            nst = tuning.exact_one_launch_stages(m, n, k)
            y = small_m_fast.linear_exact(x, *ops, ctas_per_sm=cps, num_stages=nst)
            check = _contract_check(q, x, y)
            t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
            t_def = graph_time(lambda: small_m_fast.linear_exact(x, *ops, ctas_per_sm=cps, num_stages=nst))
            pct = 100 * wbytes / (t_def * 1e-3) / 1e9 / copy_gbs
            cells = [f"{t_def * 1e3:.1f} ({t_ref / t_def:.2f}x, {pct:.0f}% of copy)"]
            for c in ctas:
                t = graph_time(lambda: small_m_fast.linear_exact(x, *ops, ctas_per_sm=c))
                cells.append(f"{t * 1e3:.1f} ({wbytes / (t * 1e-3) / 1e9:.0f})")
            for st in stages:
                t = graph_time(lambda: small_m_fast.linear_exact(x, *ops, ctas_per_sm=cps, num_stages=st))
                cells.append(f"{t * 1e3:.1f} ({t_ref / t:.2f}x)")
            rows.append(f"| {label} | {k} | {n} | {m} | {t_ref * 1e3:.1f} | {check} | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    return rows


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--crossover", action="store_true",
                   help="per mode and token count: the module with the GEMM it replaced, with the kernel's "
                        "multiply-adds and with its dot (what SMALL_M and small_m.use_fma are set from)")
    p.add_argument("--mma", action="store_true",
                   help="the module on its default path against the warp tensor-core kernel small_m_mma")
    p.add_argument("--mma-sweep", action="store_true",
                   help="small_m_mma alone at each prefetch depth and CTAs an SM (small_m_mma.DEPTH, CTAS_PER_SM)")
    p.add_argument("--words", action="store_true",
                   help="only the multiply-add kernel's word decode (small_m.linear(words=True), k-step x warps) "
                        "against its per-byte decode, kernel alone, W4A16 and the exact mode's canonical layout")
    p.add_argument("--tokens", action="store_true",
                   help="only 1-4 tokens: the kernel's dot against the word decode's block chain (fma=True) at "
                        "three tiles, kernel alone (what small_m.use_fma is set from)")
    p.add_argument("--fast-one", action="store_true",
                   help="only the fast mode at 1-64 tokens: the routed path against small_m_fast's one launch")
    p.add_argument("--exact-kernel", action="store_true",
                   help="the exact one launch alone on operands repacked here (no quack): splits, tiles in flight")
    p.add_argument("--exact-one", action="store_true",
                   help="only the exact mode at 1-2 tokens: the routed path against small_m_fast.linear_exact")
    p.add_argument("--no-sweep", action="store_true", help="with --fast-one: the default form only")
    p.add_argument("--fast-one-tokens", default="1,2,8,16,64", help="with --fast-one: the token counts (1-64)")
    p.add_argument("--tokens-modes", default="w4a16,exact-canonical",
                   help="with --tokens: the modes of TOKENS_CASES to run (comma-separated)")
    args = p.parse_args()
    copy_gbs = copy_gbs_now()
    rows = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"CUDA-graph replays of {CALLS} calls; device copy {copy_gbs:.0f} GB/s (read + write)", "",
            "us; ratio = cuBLAS bf16 time / ours; linear = the module's default path (small_m_mma up to 8 tokens in "
            "the exact mode: tuning.use_small_m_mma); 'before' = the path the small-M kernels replaced; kernel = "
            "small_m.linear alone (epilogue and low-rank term included), weight GB/s = codes + scales / its time; "
            "the fast mode runs quack's FP8 GEMM at every M (no small-M kernel)", "",
            "| layer | M | K | N | cuBLAS bf16 | mode | linear | before | kernel | kernel vs bf16 | weight GB/s | % of copy |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    have_fast = sm90._quack_fast_module() is not None
    if args.exact_kernel:
        rows = rows[:2] + exact_kernel_table(copy_gbs)
        emit(rows, args.out)
        return
    if args.exact_one:
        rows = rows[:2] + exact_one_table(copy_gbs)
        emit(rows, args.out)
        return
    if args.fast_one:
        rows = rows[:2] + fast_one_table(copy_gbs, not args.no_sweep,
                                         tuple(int(t) for t in args.fast_one_tokens.split(",")))
        emit(rows, args.out)
        return
    if args.words or args.tokens:
        rows = rows[:2] + (words_table(copy_gbs) if args.words else []) + (tokens_table(copy_gbs, tuple(args.tokens_modes.split(','))) if args.tokens else [])
        if args.out:
            Path(args.out).write_text("\n".join(rows) + "\n")
        return
    for label, m, k, n in SHAPES + ADALN:
        w4a16 = label.startswith("adaLN")
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
        wbytes = n * k // 2 + n * k // 16
        modes = ["w4a16"] if w4a16 else (["exact", "fast"] if have_fast else ["exact"])
        for mode in modes:
            if w4a16:
                q = NVFP4W4A16Linear.from_linear(lin)
            else:
                q = random_w4a4(k, n, 32, torch.bfloat16, "cuda").set_mode(mode)
            t_new = module_time(q, x, True)
            if mode == "fast":  # the baseline the small-M kernel lost to: quack's FP8 GEMM
                rows.append(f"| {label} | {m} | {k} | {n} | {t_ref * 1e3:.1f} | fast | {t_new * 1e3:.1f} "
                            f"({t_ref / t_new:.2f}x) | - | - | - | - | - |")
                print(rows[-1], flush=True)
                continue
            t_old = module_time(q, x, False)
            t_k = graph_time(kernel_call(q, x, mode))
            gbs = wbytes / (t_k * 1e-3) / 1e9
            rows.append(f"| {label} | {m} | {k} | {n} | {t_ref * 1e3:.1f} | {mode} | {t_new * 1e3:.1f} "
                        f"({t_ref / t_new:.2f}x) | {t_old * 1e3:.1f} ({t_ref / t_old:.2f}x) | {t_k * 1e3:.1f} | "
                        f"{t_ref / t_k:.2f}x | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |")
            print(rows[-1], flush=True)
    if args.sweep:
        rows += ["", "Sweep of the kernel alone (us): block_n x block_k, warps, pipeline stages, split (auto = small_m.split_for)", "",
                 "| layer | M | mode | config | us | weight GB/s |", "|---|---|---|---|---|---|"]
        for label, m, k, n, mode in [("attn", 1, 3072, 3072, "exact"), ("attn", 1, 3072, 3072, "exact-canonical"),
                                     ("adaLN W4A16", 1, 3072, 18432, "w4a16"), ("attn", 16, 3072, 3072, "exact")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q = (NVFP4W4A16Linear.from_linear(torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16))
                 if mode == "w4a16" else random_w4a4(k, n, 32, torch.bfloat16, "cuda"))
            call = kernel_call(q, x, mode)
            wbytes = n * k // 2 + n * k // 16
            repacked = mode == "exact"
            fma = small_m.use_fma(m, n, k)
            configs = SWEEP_REPACKED if fma and repacked else SWEEP_CANONICAL if fma else SWEEP_DOT
            before = len(rows)
            for bn, bk, nw, ns in configs:
                auto = small_m.split_for(2 if fma else 16, n, k, bn, bk)
                for split in sorted({max(1, auto // 2), auto, auto * 2}):
                    try:
                        t = graph_time(lambda: call(block_n=bn, block_k=bk, num_warps=nw, split_k=split, num_stages=ns))
                    except Exception as e:  # a config Triton cannot build (registers, shared memory)
                        rows.append(f"| {label} | {m} | {mode} | {bn}x{bk} w{nw} st{ns} s{split} | {type(e).__name__} | |")
                        continue
                    rows.append(f"| {label} | {m} | {mode} | {bn}x{bk} w{nw} st{ns} s{split}{' (auto)' if split == auto else ''}"
                                f" | {t * 1e3:.1f} | {wbytes / (t * 1e-3) / 1e9:.0f} |")
            print("\n".join(rows[before:]), flush=True)
    if args.crossover:
        rows += ["", "Crossover (module forward, us): 'before' = SMALL_M 0 (the fast mode: quack's FP8 GEMM, its only "
                 "path); 'fma' / 'dot' = the small-M kernel with small_m.use_fma forced on / off", "",
                 "| layer | K | N | mode | M | cuBLAS bf16 | before | small-M fma | small-M dot |", "|---|---|---|---|---|---|---|---|---|"]
        for label, k, n in (("attn", 3072, 3072), ("adaLN", 3072, 18432)):
            for mode in ("exact", "fast", "w4a16"):
                if mode == "fast" and not have_fast:
                    continue
                lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
                q = (NVFP4W4A16Linear.from_linear(lin) if mode == "w4a16"
                     else random_w4a4(k, n, 32, torch.bfloat16, "cuda").set_mode(mode))
                for m in (1, 2, 3, 4, 8, 16, 32, 64):
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
                    t_old = module_time(q, x, False)
                    if mode == "fast":  # no small-M kernel: the row is the baseline it lost to
                        rows.append(f"| {label} | {k} | {n} | {mode} | {m} | {t_ref * 1e3:.1f} | {t_old * 1e3:.1f} "
                                    "| - | - |")
                        print(rows[-1], flush=True)
                        continue
                    saved = small_m.use_fma
                    try:
                        small_m.use_fma = lambda *a: True
                        t_fma = module_time(q, x, True, "0") if m <= 8 else float("nan")
                        small_m.use_fma = lambda *a: False
                        t_dot = module_time(q, x, True, "0")
                    finally:
                        small_m.use_fma = saved
                    rows.append(f"| {label} | {k} | {n} | {mode} | {m} | {t_ref * 1e3:.1f} | {t_old * 1e3:.1f} | "
                                f"{t_fma * 1e3:.1f} | {t_dot * 1e3:.1f} |")
                    print(rows[-1], flush=True)
    if args.mma:
        rows += ["", "small_m_mma (warp mma.sync, split-K) against the path it replaces (SVDQ_SM90_SMALL_M_MMA=0; "
                 "exact: the Triton small-M kernel; fast: quack's FP8 GEMM) and with it (=1); us, ratio = cuBLAS "
                 "bf16 / ours; kernel = small_m_mma alone (split-K sum, epilogue and low-rank term included), weight "
                 "GB/s = codes + scales / its time; 'routed' = what tuning.use_small_m_mma picks by default", "",
                 "| layer | K | N | mode | M | cuBLAS bf16 | without | mma | mma fused (one launch) | mma kernel | "
                 "weight GB/s | % of copy | routed |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        from svdq_linear.backends.sm90 import ENV_MMA_FUSED, ENV_SMALL_M_MMA, tuning

        def fused_time(q, x):
            """The module with small_m_mma's fused kernel (SVDQ_SM90_MMA_FUSED=1), after checking it against
            the two-launch path's output."""
            os.environ[ENV_MMA_FUSED] = "1"
            os.environ[ENV_SMALL_M_MMA] = "1"
            try:
                y_f = q(x).float()
                os.environ.pop(ENV_MMA_FUSED)
                y_2 = q(x).float()
                os.environ[ENV_MMA_FUSED] = "1"
                err = ((y_f - y_2).norm() / y_2.norm().clamp(min=1e-30)).item()
                if not err < 1e-2:
                    raise AssertionError(f"the fused kernel's output differs from the two-launch path's ({err:.3g})")
                return env_time(lambda: q(x), ENV_SMALL_M_MMA, "1")
            finally:
                os.environ.pop(ENV_MMA_FUSED, None)
                os.environ.pop(ENV_SMALL_M_MMA, None)

        for label, k, n in (("attn", 3072, 3072), ("ff up", 3072, 12288), ("ff down", 12288, 3072)):
            lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
            wbytes = n * k // 2 + n * k // 16
            for mode in ("exact", "fast") if have_fast else ("exact",):
                q = random_w4a4(k, n, 32, torch.bfloat16, "cuda").set_mode(mode)
                for m in (1, 4, 8, 16, 32, 64):
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
                    t_def = env_time(lambda: q(x), ENV_SMALL_M_MMA, "0")
                    t_mma = env_time(lambda: q(x), ENV_SMALL_M_MMA, "1")
                    t_fus = fused_time(q, x)
                    t_k = graph_time(mma_kernel_call(q, x))
                    gbs = wbytes / (t_k * 1e-3) / 1e9
                    rows.append(f"| {label} | {k} | {n} | {mode} | {m} | {t_ref * 1e3:.1f} | {t_def * 1e3:.1f} "
                                f"({t_ref / t_def:.2f}x) | {t_mma * 1e3:.1f} ({t_ref / t_mma:.2f}x) | "
                                f"{t_fus * 1e3:.1f} ({t_ref / t_fus:.2f}x) | {t_k * 1e3:.1f} "
                                f"| {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | "
                                f"{'mma' if tuning.use_small_m_mma(mode, m, n, k) else '-'} |")
                    print(rows[-1], flush=True)
    if args.mma_sweep:
        from svdq_linear.backends.sm90 import small_m_mma

        loops, ctas = ((1, False), (2, False), (2, True), (3, True), (4, True)), (4, 8, 16)
        rows += ["", f"small_m_mma alone (us; weight GB/s): k-tiles of weight bytes in flight (d), 'u' = the loop "
                 f"unrolled by d (fixed ring slots; '-' where the split's k-tiles are not a multiple of d) x CTAs an "
                 f"SM (c, the split rule's target); defaults d{small_m_mma.DEPTH} c{small_m_mma.CTAS_PER_SM}", "",
                 "| layer | mode | M | " + " | ".join(f"d{d}{'u' if u else ''} c{c}" for d, u in loops for c in ctas)
                 + " |", "|---|---|---|" + "---|" * (len(loops) * len(ctas))]
        for label, k, n in (("attn", 3072, 3072), ("ff up", 3072, 12288), ("ff down", 12288, 3072)):
            wbytes = n * k // 2 + n * k // 16
            for mode in ("exact", "fast") if have_fast else ("exact",):
                q = random_w4a4(k, n, 32, torch.bfloat16, "cuda").set_mode(mode)
                for m in (1, 8, 16):
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    call = mma_kernel_call(q, x)
                    cells = []
                    for d, u in loops:
                        for c in ctas:
                            try:
                                call(depth=d, ctas_per_sm=c, unroll=u)
                            except ValueError:  # the unrolled loop needs a multiple of d k-tiles a split
                                cells.append("-")
                                continue
                            t = graph_time(lambda: call(depth=d, ctas_per_sm=c, unroll=u))
                            cells.append(f"{t * 1e3:.1f} ({wbytes / (t * 1e-3) / 1e9:.0f})")
                    rows.append(f"| {label} | {mode} | {m} | " + " | ".join(cells) + " |")
                    print(rows[-1], flush=True)
    emit(rows, args.out)


if __name__ == "__main__":
    main()
