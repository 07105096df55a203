"""Build, check and time the low-rank branch of the quack GEMMs (both modes) in one run (H100/H200).

    python benchmarks/bench_lowrank.py [--out DIR] [--shapes flux|quick]

Per shape (M, K, N) and mode (exact: bf16 wgmma on the decoded NVFP4 weight; fast: FP8 wgmma), the
GEMM with its fused epilogue, activations ready, as CUDA-graph replays (GPU time):
- R = 0: the bare GEMM (``* scale + bias``);
- "tile": the low-rank term as an [M, N] bf16 tile read by the epilogue, plus the cuBLAS GEMM
  ``lora_act @ proj_up^T`` that writes it (timed with it: that is what the linear pays);
- "acc": the low-rank MMA in the main accumulator (``quack_lowrank``), R / 16 bf16 wgmmas after the
  K-loop on operands prefetched during it; "3x32" is a fused q/k/v's block-diagonal branch (R = 96),
  each weight tile reading its own 32-wide window.
Overheads are against R = 0 of the same mode in the same run. Each "acc" output is checked against
the "tile" output first (same math, different rounding of the low-rank operands: a bound of 2**-6
of ``|lora_act| @ |proj_up|^T`` plus the bf16 output roundings). Then the whole linears (the
module's forward, quantization included) against ``F.linear`` bf16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_conformance import random_w4a4  # noqa: E402

from _cuda import graphed, with_env  # noqa: E402

from svdq_linear.backends.sm90 import kernels, quack_fast, quack_gemm  # noqa: E402

FLUX = [  # (label, M, K, N)
    ("fused qkv", 4096, 3072, 9216), ("attn out", 4096, 3072, 3072), ("ff up", 4096, 3072, 12288),
    ("ff down", 4096, 12288, 3072), ("single fused in", 4608, 3072, 21504), ("single out", 4608, 15360, 3072),
    ("ref 4352x3840x3072", 4352, 3840, 3072), ("attn txt", 512, 3072, 3072), ("M=200", 200, 3072, 3072),
]
QUICK = [FLUX[0], FLUX[1], FLUX[3], FLUX[7]]
FUSED = {"fused qkv": (3072, 3072, 3072), "single fused in": (3072, 3072, 3072, 12288)}  # part widths
RANKS = (32, 64, "3x32")  # "3x32": three 32-wide windows (a fused q/k/v), R = 96 in the tile form


def timer(fn) -> float:
    return do_bench(graphed(fn), warmup=10, rep=100, return_mode="median")


def close(acc, tile, lowrank_abs, what):
    """``acc`` and ``tile`` differ by the low-rank operands' roundings (``lowrank_abs = |lora| @ |up|^T``)
    and two output roundings."""
    err = (acc.double() - tile.double()).abs()
    bound = lowrank_abs.double() * 2.0**-6 + (acc.double().abs() + tile.double().abs()) * 2.0**-8 + 1e-6
    if not bool((err <= bound).all()):
        raise AssertionError(f"{what}: acc and tile outputs differ by {(err / bound).max().item():.3g}x the bound")


TILE_SHAPES = [("single out", 4608, 15360, 3072), ("ref 4352x3840x3072", 4352, 3840, 3072),
               ("fused qkv", 4096, 3072, 9216), ("attn out", 4096, 3072, 3072)]
TILES = [(128, 256), (128, 192), (128, 128), (256, 128), (64, 256)]


def mode_gemm(mode: str, x: torch.Tensor, base):
    """``base``'s GEMM in ``mode`` on ``x`` (its activation pass done here): ``(run, col, to_la)`` with
    ``run(lowrank=None, lr_acc=None, tile=None)``, ``col`` the epilogue's per-column factor [N, 1] (what
    ``proj_up`` is divided by in the accumulator path) and ``to_la(lora)`` the ``lora_act`` that path reads
    (the fast mode's divided by the per-token scale)."""
    if mode == "exact":
        w = quack_gemm.prepare(base.qweight, base.wscales, base.wcscale, base.bias)
        xq, _, _ = kernels.quantize_act(x, base.smooth, out_dtype=torch.bfloat16)
        return ((lambda lowrank=None, lr_acc=None, tile=None: quack_gemm.gemm(xq, w, lowrank, lr_acc=lr_acc, tile=tile)),
                w.wc.reshape(-1, 1), lambda lora: lora)
    w = quack_fast.prepare(base.qweight, base.wscales, base.wcscale, base.bias)
    a8, sa = kernels.quantize_act_fp8(x, base.smooth, gemm_order=True)
    return ((lambda lowrank=None, lr_acc=None, tile=None: quack_fast.gemm(a8, sa, w, lowrank, lr_acc=lr_acc, tile=tile)),
            w.cs.reshape(-1, 1), lambda lora: (lora.float() / sa[:, None]).bfloat16())


def tile_sweep(log, dev, shapes=TILE_SHAPES, tiles=TILES) -> None:
    """Each mode's GEMM (R = 0, and R = 32 in the accumulator) at each candidate tile: quack's persistent
    scheduler leaves the last wave part-empty when the tile count is just above a multiple of the 132
    SMs (408 tiles of 128 x 256 at 4352 x 3072: 3.09 waves)."""
    log("\n## GEMM tiles (CUDA-graph replays, ms; ratio = cuBLAS bf16 / GEMM; tiles = CTAs' output tiles; "
        "each cell: R = 0, then R = 32 with the low-rank MMA in the accumulator)\n")
    log("| mode | shape | M | K | N | cuBLAS bf16 | " + " | ".join(f"{a}x{b}" for a, b in tiles) + " |")
    log("|---|---|---|---|---|---|" + "---|" * len(tiles))
    for label, m_tok, k, n in shapes:
        torch.manual_seed(0)
        x = torch.randn(m_tok, k, device=dev, dtype=torch.bfloat16)
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        t_bf16 = timer(lambda: x @ wb.T)
        base = random_w4a4(k, n, 0, torch.bfloat16, dev)
        for mode in ("exact", "fast"):
            run, col, to_la = mode_gemm(mode, x, base)
            lora = torch.randn(m_tok, 32, device=dev, dtype=torch.bfloat16)
            up = (torch.randn(n, 32, device=dev) * 1e-2 / col).bfloat16()
            lr = (up, to_la(lora), torch.zeros(n // 64, device=dev, dtype=torch.int32))
            ref = run(tile=tiles[0])
            cells = []
            for tile in tiles:
                if n % tile[0]:
                    cells.append("-")
                    continue
                try:
                    y = run(tile=tile)
                    run(lr_acc=lr, tile=tile)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a tile quack refuses: report and go on
                    cells.append(f"error {type(e).__name__}")
                    continue
                d = (y.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-30)
                if d > 1e-2:  # same products, same k order: at most output rounding apart
                    cells.append(f"differs ({d:.1e})")
                    continue
                t = timer(lambda: run(tile=tile))
                t_lr = timer(lambda: run(lr_acc=lr, tile=tile))
                count = -(-n // tile[0]) * -(-m_tok // tile[1])
                cells.append(f"{t:.4f} ({t_bf16 / t:.2f}x, {count} tiles); R=32 {t_lr:.4f} ({t_bf16 / t_lr:.2f}x)")
            log(f"| {mode} | {label} | {m_tok} | {k} | {n} | {t_bf16:.4f} | " + " | ".join(cells) + " |")
        torch.cuda.empty_cache()


def whole_module(label: str, k: int, n: int, dev):
    """A random layer for a whole-linear row, R = 32: for the ``FUSED`` labels what fuse_qkv_projections builds
    (the parts' branches side by side, one smoothing factor)."""
    from svdq_linear.fuse import concat_w4a4

    if label not in FUSED:
        return random_w4a4(k, n, 32, torch.bfloat16, dev)
    parts = [random_w4a4(k, n_i, 32, torch.bfloat16, dev) for n_i in FUSED[label]]
    for p_ in parts[1:]:
        p_.smooth.copy_(parts[0].smooth)
    return concat_w4a4(parts)


def lora_stream_table(log, dev, shapes, env_name: str | None = None, values=("0", "1"), same_bits=True,
                      mode: str = "exact") -> None:
    """The ``mode`` module forward (CUDA-graph replays) under two values of an environment variable, same run,
    against ``F.linear`` bf16. By default ``lora_act`` before the activation pass and beside it on a second
    stream (``SVDQ_SM90_LORA_STREAM``), both outputs checked to be the same bits first; with
    ``same_bits=False`` (another summation order of ``lora_act``) within a bf16 ulp of the output's largest
    magnitude instead."""
    import os

    from svdq_linear.backends import sm90

    env_name = env_name or sm90.ENV_LORA_STREAM
    if env_name == sm90.ENV_LORA_STREAM:
        log("\n## exact whole linear, lora_act serial / beside the pass (ms, ratio = cuBLAS bf16 / path)\n")
        log("| shape | M | K | N | cuBLAS bf16 | serial | beside | gain |")
    else:
        log(f"\n## {mode} whole linear, {env_name} = {values[0]} / {values[1]} "
            "(ms, ratio = cuBLAS bf16 / path)\n")
        log(f"| shape | M | K | N | cuBLAS bf16 | {values[0]} | {values[1]} | gain |")
    log("|---|---|---|---|---|---|---|---|")
    for label, m_tok, k, n in shapes:
        torch.manual_seed(0)
        mod = whole_module(label, k, n, dev).set_mode(mode)
        x = torch.randn(m_tok, k, device=dev, dtype=torch.bfloat16)
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        t_ref = timer(lambda: F.linear(x, w16, mod.bias))
        times, outs = {}, {}
        for i, env in enumerate(values):  # a third value: the first again, timed last (how far order moves a row)
            if env:
                os.environ[env_name] = env
            g_out = []
            replay = graphed(lambda: g_out.append(mod(x)))
            replay()
            torch.cuda.synchronize()
            outs[env] = g_out[-1].clone()
            times["again" if i == 2 else env] = do_bench(replay, warmup=10, rep=100, return_mode="median")
            os.environ.pop(env_name, None)
        o0, o1 = outs[values[0]], outs[values[1]]
        if same_bits and not torch.equal(o0, o1):
            raise AssertionError(f"{label}: {env_name} changed the output's bits")
        if not same_bits and (o0 - o1).abs().max() > o0.abs().max() * 2.0**-8:
            raise AssertionError(f"{label}: {env_name} moved the output by more than a bf16 ulp of its largest value: "
                                 f"{(o0 - o1).abs().max().item():.3g}")
        a, b = times[values[0]], times[values[1]]
        again = f" (again, last: {times['again']:.4f})" if len(values) > 2 else ""
        log(f"| {label} | {m_tok} | {k} | {n} | {t_ref:.4f} | {a:.4f} ({t_ref / a:.2f}x){again} | {b:.4f} "
            f"({t_ref / b:.2f}x) | {a / b:.3f}x |")
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--shapes", choices=["flux", "quick"], default="flux")
    p.add_argument("--whole-only", action="store_true", help="only the whole linears (skip the GEMM table)")
    p.add_argument("--tiles", action="store_true",
                   help="first, the GEMMs of both modes (R = 0 and 32) at candidate tiles (weight rows x tokens) "
                        "against cuBLAS")
    p.add_argument("--tiles-ab", action="store_true",
                   help="only 128x256 against 128x192 where the tile rule is close (tuning.prefill_tiles)")
    p.add_argument("--tile-list", default=None,
                   help="with --tiles: these tiles instead (weight rows x tokens, e.g. 128x256,128x224), at the "
                        "K = 15360 and 3840 shapes only")
    p.add_argument("--lora-stream", action="store_true",
                   help="only the exact whole linears with lora_act serial against beside the pass (two streams)")
    p.add_argument("--exact-lora", action="store_true",
                   help="only the exact whole linears with the pass and lora_act as two launches (the default) "
                        "against one read of x (SVDQ_SM90_EXACT_LORA=two against =one), two timed again last")
    p.add_argument("--pdl", action="store_true",
                   help="only the whole linears of both modes with lora_act and the pass as plain launches against "
                        "the PDL pair (SVDQ_SM90_PDL=0 against =1), 0 timed again last")
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    dev = torch.device("cuda")
    log(f"# low-rank branch in the accumulator — {torch.cuda.get_device_name()} — {time.strftime('%Y-%m-%d %H:%M')}")
    log("\nms, CUDA-graph replays; (+x%) = over the same mode's R = 0 GEMM; tile = epilogue tile + its cuBLAS GEMM\n")
    log("| mode | shape | M | K | N | R=0 | " + " | ".join(f"R={r} tile | R={r} acc" for r in RANKS) + " |")
    log("|---|---|---|---|---|---|" + "---|---|" * len(RANKS))
    shapes = QUICK if args.shapes == "quick" else FLUX
    if args.lora_stream or args.exact_lora or args.pdl:
        from svdq_linear.backends.sm90 import tuning

        big = [sh for sh in FLUX if sh[0] in ("fused qkv", "attn out", "ff up", "ff down", "single fused in",
                                              "single out", "ref 4352x3840x3072", "attn txt", "M=200")]
        if args.pdl:
            from svdq_linear.backends import sm90

            for mode in ("exact", "fast"):  # exact: lora_act from Triton's partials (another fp32 order) with PDL
                lora_stream_table(log, dev, big, sm90.ENV_PDL, ("0", "1", "0"), same_bits=mode == "fast", mode=mode)
        elif args.exact_lora:
            lora_stream_table(log, dev, big, tuning.ENV_EXACT_LORA, ("two", "one", "two"), same_bits=False)
        else:
            lora_stream_table(log, dev, big[:6])
        (out_dir / "bench_lowrank.md").write_text("\n".join(lines) + "\n")
        return
    if args.tiles and args.tile_list:
        tile_sweep(log, dev, TILE_SHAPES[:2], [tuple(int(v) for v in t.split("x")) for t in args.tile_list.split(",")])
    elif args.tiles:
        tile_sweep(log, dev)
    if args.tiles_ab:
        tile_sweep(log, dev, TILE_SHAPES[:2], [(128, 256), (128, 192)])
    for label, m_tok, k, n in ([] if args.whole_only else shapes):
        torch.manual_seed(0)
        x = torch.randn(m_tok, k, device=dev, dtype=torch.bfloat16)
        base = random_w4a4(k, n, 0, torch.bfloat16, dev)
        for mode in ("exact", "fast"):
            run, col, to_la = mode_gemm(mode, x, base)
            t0 = timer(run)
            cells = []
            for r in RANKS:
                segments = 3 if r == "3x32" else 1  # a fused q/k/v: block-diagonal proj_up, R = 96
                width = 32 if segments == 3 else r
                lora = torch.randn(m_tok, segments * width, device=dev, dtype=torch.bfloat16)
                seg = (torch.arange(n // 64, device=dev) * segments // (n // 64)).to(torch.int32)
                up_w = torch.randn(n, width, device=dev, dtype=torch.bfloat16) * 1e-2  # each row's own window
                up = torch.zeros(n, segments * width, device=dev, dtype=torch.bfloat16)  # the dense form, for the tile
                up.scatter_(1, (seg.repeat_interleave(64).long() * width)[:, None] + torch.arange(width, device=dev), up_w)
                lr_acc = ((up_w.float() / col).bfloat16(), to_la(lora), seg)
                y_tile = run(lowrank=lora @ up.T)
                y_acc = run(lr_acc=lr_acc)
                close(y_acc, y_tile, lora.float().abs() @ up.float().abs().T, f"{mode} {label} R={r}")
                t_tile = timer(lambda: run(lowrank=lora @ up.T))
                t_acc = timer(lambda: run(lr_acc=lr_acc))
                cells += [f"{t_tile:.4f} (+{t_tile / t0 - 1:.1%})", f"{t_acc:.4f} (+{t_acc / t0 - 1:.1%})"]
            log(f"| {mode} | {label} | {m_tok} | {k} | {n} | {t0:.4f} | " + " | ".join(cells) + " |")
        torch.cuda.empty_cache()

    log("\n## whole linear (module forward, R = 32 a part: fused q/k/v and the single blocks' fused input are "
        "concat_w4a4 of their parts), CUDA-graph replays, ms (ratio = cuBLAS bf16 / path)\n")
    log("Parts, each alone: quant = the activation pass (fast: with lora_act / sa), lora = x @ (proj_down / "
        "smooth), GEMM = the quack GEMM with the low-rank MMA in its accumulator; last column: the fast "
        "activation pass computing lora_act itself (replacing quant + lora).\n")
    log("| shape | M | K | N | cuBLAS bf16 | exact | exact: quant, lora, GEMM | fast | fast: quant, lora, GEMM | "
        "fast: quant with lora inside | lora as the backend runs it (tuning.lora_act_plan) | fast, lora by cuBLAS |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    import os

    from svdq_linear.backends.sm90 import tuning

    from svdq_linear.backends.sm90 import Sm90Backend, _mm_f32

    for label, m_tok, k, n in shapes:
        torch.manual_seed(0)
        mod = whole_module(label, k, n, dev)
        if label in FUSED:
            label = f"{label} (fused, R = {mod.rank})"
        x = torch.randn(m_tok, k, device=dev, dtype=torch.bfloat16)
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        t_ref = timer(lambda: F.linear(x, w16, mod.bias))
        cells = []
        for mode in ("exact", "fast"):
            mod.set_mode(mode)
            mod(x)
            t = timer(lambda: mod(x))
            # the parts as the backend runs them, from its own prepared state
            prep = Sm90Backend().prepare(mod, dev)
            pds_p, lu, seg = prep.proj_down_smoothed, prep.proj_up_bf16, prep.lowrank_segments
            assert seg is not None, "the accumulator path"
            w = prep.quack
            if mode == "exact":
                lora = x @ pds_p
                xq, _, _ = kernels.quantize_act(x, mod.smooth, out_dtype=torch.bfloat16)
                t_q = timer(lambda: kernels.quantize_act(x, mod.smooth, out_dtype=torch.bfloat16))
                t_l = timer(lambda: x @ pds_p)
                t_g = timer(lambda: quack_gemm.gemm(xq, w, lr_acc=(lu, lora, seg)))
            else:
                lora = _mm_f32(x, pds_p)
                a8, sa, la = kernels.quantize_act_fp8(x, mod.smooth, lora=lora, inv_smooth=prep.inv_smooth, gemm_order=True)
                t_q = timer(lambda: kernels.quantize_act_fp8(x, mod.smooth, lora=lora, inv_smooth=prep.inv_smooth, gemm_order=True))
                t_l = timer(lambda: _mm_f32(x, pds_p))
                t_g = timer(lambda: quack_fast.gemm(a8, sa, w, lr_acc=(lu, la, seg)))
                # lora_act computed inside the activation pass instead of by cuBLAS: checked, then timed
                _, _, la_f = kernels.quantize_act_fp8(x, mod.smooth, proj_down_smoothed=pds_p, gemm_order=True)
                bound = (x.float().abs() @ pds_p.float().abs()) / sa[:, None] * 2.0**-7 + 1e-30
                if not bool(((la_f.float() - la.float()).abs() <= bound).all()):
                    raise AssertionError(f"{label}: the fused lora_act differs from cuBLAS's beyond bf16 rounding")
                t_f = timer(lambda: kernels.quantize_act_fp8(x, mod.smooth, proj_down_smoothed=pds_p, gemm_order=True))
            cells += [f"{t:.4f} ({t_ref / t:.2f}x)", f"{t_q:.4f}, {t_l:.4f}, {t_g:.4f}"]
            if mode == "fast":
                cells.append(f"{t_f:.4f}")
                # lora_act as the backend computes it (cuBLAS or kernels.lora_act's partial sums) against
                # cuBLAS's: checked (fp32 sums of the same bf16 products), timed
                be = Sm90Backend()
                lt = be._lora_act(x, pds_p)
                lt = lt.sum(0) if lt.dim() == 3 else lt
                tol = (x.float().abs() @ pds_p.float().abs()) * 2.0**-16 + 1e-30
                if not bool(((lt - lora).abs() <= tol).all()):
                    raise AssertionError(f"{label}: the backend's lora_act differs from cuBLAS beyond fp32 summation")
                plan = tuning.lora_act_plan(m_tok, k, pds_p.shape[1], os.environ.get(tuning.ENV_LORA_ACT))
                what = "cuBLAS" if plan is None else f"{plan.block_m} rows, S={plan.split}, w{plan.num_warps} s{plan.num_stages}"
                cells.append(f"{timer(lambda: be._lora_act(x, pds_p)):.4f} ({what})")
                mod(x)
                cells.append(f"{with_env({tuning.ENV_LORA_ACT: 'cublas'}, lambda: timer(lambda: mod(x)))():.4f}")
            del w
        log(f"| {label} | {m_tok} | {k} | {n} | {t_ref:.4f} | " + " | ".join(cells) + " |")
        del mod
        torch.cuda.empty_cache()
    (out_dir / "bench_lowrank.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
