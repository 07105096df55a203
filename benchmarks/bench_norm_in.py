"""The activation pass fused into the adaLN norm (``sm90.norm_pass``, ``SVDQW4A4Linear.forward_ada_norm``) against
the norm written out, each whole: norm + linear, as a Flux single block (and a double block's q/k/v) run them.

    python benchmarks/bench_norm_in.py [--out FILE] [--shapes fused_qkv,single_fused_in] [--modes exact,fast]
                                       [--reps 20] [--rounds 5] [--splits 2,8] [--pair-nopdl]
                                       [--pair-lora "64,8,4,3;32,8,4,3"] [--rows [--rows-tiles 1x4,4x8]]

Per layer (``bench_lowrank``'s whole-linear rows: what fuse_qkv_projections builds, R = 32 a part) and mode, in
``--rounds`` alternating rounds, each a CUDA graph of ``--reps`` back-to-back calls timed by its kernels' span
(torch.profiler, as ``timeline_exact.py``):

- ``bf16``: the norm and modulation compiled (inductor's one kernel, ``nvfp4.ada_norm``) then ``F.linear``;
- ``written``: the same norm, then the layer on its output (the default path of every other layer);
- ``fused``: ``forward_ada_norm`` (the pass reads the norm's input and normalizes as it loads), in the split form
  (``SVDQ_SM90_ADA_NORM_FORM=split``: split-K apply tiles that add ``lora_act``'s partials) and the pair form
  (``pair``: ``lora_act`` and the pass in small tiles as a PDL pair after the statistics);
- ``norm alone`` / ``norm pass alone``: the compiled norm, and the fused pass without its GEMM (its two launches at
  ``norm_pass.auto_split``, and at ``--splits``; and at the apply tiles ``--tiles``, rows x warps).
  The fused rows take ``SVDQ_SM90_ADA_NORM_TILE``'s tile (32 x 4 by default); ``pair pass alone``: the pair
  form's three launches alone; with ``--pair-nopdl``, the pair form with ``SVDQ_SM90_PDL=0`` too (its launches and
  the GEMM one after the other: whether the GEMM's time after the pair depends on the overlap); with ``--pair-lora``,
  the pair form alone and whole at each ``lora_act`` launch named (``SVDQ_SM90_ADA_PAIR_LORA``); with ``--rows``,
  the rows form (``rows``: whole rows a program, the statistics and the pass from one read, then ``lora_act``)
  whole and alone, beside the pair form (and at ``--rows-tiles``, ``SVDQ_SM90_ADA_ROWS_TILE``).

Ratios: bf16 / path, each round's to the bf16 of that round, median over the rounds. The fused output is
checked against the written one first (the inputs differ by a rounding in a few elements).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cuda import graph_of, with_env  # noqa: E402
from bench_lowrank import FLUX, whole_module  # noqa: E402
from timeline_exact import time_rounds  # noqa: E402

from svdq_linear import backends, nvfp4  # noqa: E402
from svdq_linear.backends.sm90 import norm_pass, tuning  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="fused_qkv,single_fused_in")
    ap.add_argument("--modes", default="exact,fast")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--splits", default="2,8", help="the norm pass alone at these splits too")
    ap.add_argument("--tiles", default="32x4,64x4,64x8",
                    help="and at these apply tiles (rows x warps, tuning.ADA_NORM_TILES)")
    ap.add_argument("--pair-lora", default="",
                    help="';'-separated SVDQ_SM90_ADA_PAIR_LORA values (bm,S,w,st): the pair form alone and whole at "
                         "each")
    ap.add_argument("--rows", action="store_true",
                    help="also the rows form (SVDQ_SM90_ADA_NORM_FORM=rows: whole rows a program, the statistics and "
                         "the pass from one read of x, then lora_act), whole and its launches alone")
    ap.add_argument("--rows-tiles", default="",
                    help="with --rows, the rows form alone and whole at these SVDQ_SM90_ADA_ROWS_TILE tiles too "
                         "(rows x warps, e.g. 1x4,2x4,4x8)")
    ap.add_argument("--pair-nopdl", action="store_true",
                    help="also the pair form with SVDQ_SM90_PDL=0 (its launches and the GEMM one after the other)")
    args = ap.parse_args()
    want = [s.strip().replace("_", " ") for s in args.shapes.split(",")]
    modes = [s.strip() for s in args.modes.split(",")]
    lines = [f"# adaLN norm + linear: the pass fused into the norm — {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}; graphs of {args.reps} calls, {args.rounds} rounds; us a call", ""]

    def log(s: str = "") -> None:
        lines.append(s)
        print(s, flush=True)

    os.environ["SVDQ_SM90_ADA_NORM"] = "1"  # forward_ada_norm's pass (the default; a user's 0 would hide it)
    dev = torch.device("cuda")
    norm_c = torch.compile(nvfp4.ada_norm, dynamic=False)
    log("| layer | M x K -> N | mode | bf16 | written | fused split | fused pair | split / written | pair / written | "
        "norm alone | split pass alone | pair pass alone | max err / max (split, pair) | bf16 / written | "
        "bf16 / split | bf16 / pair |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def fused_in(mod, x, shift, scale, form, pdl=None):
        # pdl "0": the pair's kernels one after the other, the GEMM too
        return with_env({tuning.ENV_ADA_NORM_FORM: form, "SVDQ_SM90_PDL": pdl},
                        lambda: mod.forward_ada_norm(x, shift, scale, 1e-6))

    with torch.no_grad():
        for label, m, k, n in [s for s in FLUX if s[0] in want]:
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(1, m, k, device=dev, generator=g).bfloat16() * 2
            shift = (torch.randn(1, k, device=dev, generator=g) * 0.3).bfloat16()
            scale = (torch.randn(1, k, device=dev, generator=g) * 0.3).bfloat16()
            w = (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).bfloat16()
            for mode in modes:
                torch.manual_seed(0)
                mod = whole_module(label, k, n, dev).set_mode(mode)
                written = mod(norm_c(x, shift, scale, 1e-6))
                errs = []
                for form in ("split", "pair") + (("rows",) if args.rows else ()):
                    fused = fused_in(mod, x, shift, scale, form)()
                    errs.append(((fused.float() - written.float()).abs().max() / written.float().abs().max()).item())
                be, prep = backends.resolve(mod, x[0])
                ex = be.extra_tensors(prep)
                inv = ex[-1]
                pds = ex[0]

                def npass(split=None, block_k=64, tile=tuning.ada_norm_tile(), form="split"):
                    def fn():
                        kw = dict(split=split, block_k=block_k, block_m=tile[0], num_warps=tile[1], form=form,
                                  pdl=form != "split")
                        if mode == "fast":
                            return norm_pass.ada_norm_fast(x[0], shift, scale, 1e-6, inv, pds, **kw)
                        return norm_pass.ada_norm_exact(x[0], shift, scale, 1e-6, inv, pds, out_dtype=torch.bfloat16,
                                                        **kw)
                    return fn
                auto = norm_pass.auto_split(m, k, dev)
                graphs = {
                    "bf16": graph_of(lambda: F.linear(norm_c(x, shift, scale, 1e-6), w), args.reps),
                    "written": graph_of(lambda: mod(norm_c(x, shift, scale, 1e-6)), args.reps),
                    "fused": graph_of(fused_in(mod, x, shift, scale, "split"), args.reps),
                    "fused pair": graph_of(fused_in(mod, x, shift, scale, "pair"), args.reps),
                    "norm": graph_of(lambda: norm_c(x, shift, scale, 1e-6), args.reps),
                    "npass": graph_of(npass(), args.reps),
                    "pair pass": graph_of(npass(form="pair"), args.reps),
                }
                for cfg in args.pair_lora.split(";") if args.pair_lora else ():  # the pair's lora_act launch
                    tuning.parse_ada_pair_lora(cfg)  # a malformed one fails here, before any capture
                    at = {tuning.ENV_ADA_PAIR_LORA: cfg}
                    graphs[f"pair lora {cfg}"] = graph_of(with_env(at, npass(form="pair")), args.reps)
                    graphs[f"fused pair lora {cfg}"] = graph_of(with_env(at, fused_in(mod, x, shift, scale, "pair")),
                                                                args.reps)
                if args.rows:
                    graphs["fused rows"] = graph_of(fused_in(mod, x, shift, scale, "rows"), args.reps)
                    graphs["rows pass"] = graph_of(npass(form="rows"), args.reps)
                    for t in args.rows_tiles.split(",") if args.rows_tiles else ():
                        tuning.parse_ada_rows_tile(t)  # a malformed one fails here, before any capture
                        at = {tuning.ENV_ADA_ROWS_TILE: t}
                        graphs[f"rows pass {t}"] = graph_of(with_env(at, npass(form="rows")), args.reps)
                        graphs[f"fused rows {t}"] = graph_of(with_env(at, fused_in(mod, x, shift, scale, "rows")),
                                                             args.reps)
                if args.pair_nopdl:  # whether the GEMM's time after the pair depends on the PDL overlap
                    graphs["fused pair, no PDL"] = graph_of(fused_in(mod, x, shift, scale, "pair", "0"), args.reps)
                for sp in args.splits.split(","):  # the pass alone at other splits
                    sp = int(sp)
                    if sp != auto:
                        graphs[f"npass split {sp}"] = graph_of(npass(sp), args.reps)
                # other apply tiles (rows x warps; the fused row takes SVDQ_SM90_ADA_NORM_TILE's): 64 rows run
                # lora_act on wgmma with half the proj_down reloads (128-column steps measured 5-30 % slower: y-2)
                for t in args.tiles.split(",") if args.tiles else ():
                    tile = tuning.parse_ada_norm_tile(t)
                    if tile != tuning.ada_norm_tile():
                        graphs[f"npass split auto, tile {t}"] = graph_of(npass(tile=tile), args.reps)
                periods, kernels_of = time_rounds(graphs, args.rounds, args.reps)
                med = {what: statistics.median(p) for what, p in periods.items()}

                def ratio(what: str) -> float:
                    return statistics.median(b / q for b, q in zip(periods["bf16"], periods[what]))

                def gain(what: str) -> float:
                    return statistics.median(w_ / f for w_, f in zip(periods["written"], periods[what]))

                log(f"| {label} | {m}x{k}->{n} | {mode} | {med['bf16']:.1f} | {med['written']:.1f} | "
                    f"{med['fused']:.1f} | {med['fused pair']:.1f} | {gain('fused'):.3f}x | "
                    f"{gain('fused pair'):.3f}x | "
                    f"{med['norm']:.1f} | {med['npass']:.1f} | {med['pair pass']:.1f} | {errs[0]:.2e}, {errs[1]:.2e} | "
                    f"{ratio('written'):.3f}x | {ratio('fused'):.3f}x | {ratio('fused pair'):.3f}x |")
                others = [w_ for w_ in med if w_.startswith("npass split")]
                if others:
                    log(f"|  | norm pass alone: split {auto} (auto) {med['npass']:.1f}; " + "; ".join(
                        f"{w_.removeprefix('npass ')} {med[w_]:.1f}" for w_ in others) + " |" * 15)
                if args.rows:
                    over_pair = statistics.median(a / b for a, b in zip(periods["fused pair"], periods["fused rows"]))
                    log(f"|  | rows form: fused {med['fused rows']:.1f} (bf16 / it {ratio('fused rows'):.3f}x; "
                        f"written / it {gain('fused rows'):.3f}x; pair / it {over_pair:.3f}x"
                        + f"); pass alone {med['rows pass']:.1f} (pair's {med['pair pass']:.1f}); max err / max "
                        f"{errs[2]:.2e}" + " |" * 15)
                    tiles = [w_.removeprefix("rows pass ") for w_ in med if w_.startswith("rows pass ")]
                    if tiles:
                        log("|  | rows form at SVDQ_SM90_ADA_ROWS_TILE (rows x warps): pass alone / whole / bf16 over "
                            "whole: " + "; ".join(f"{t} {med['rows pass ' + t]:.1f} / {med['fused rows ' + t]:.1f} / "
                                                  f"{ratio('fused rows ' + t):.3f}x" for t in tiles) + " |" * 15)
                if args.pair_nopdl:
                    log(f"|  | fused pair, no PDL: {med['fused pair, no PDL']:.1f} (bf16 / it "
                        f"{ratio('fused pair, no PDL'):.3f}x)" + " |" * 15)
                cfgs = [w_.removeprefix("pair lora ") for w_ in med if w_.startswith("pair lora ")]
                if cfgs:
                    log("|  | pair form, lora_act (bm,S,w,st): pass alone / whole / bf16 over whole: " + "; ".join(
                        f"{c} {med['pair lora ' + c]:.1f} / {med['fused pair lora ' + c]:.1f} / "
                        f"{ratio('fused pair lora ' + c):.3f}x" for c in cfgs)
                        + f" (default {tuning.ada_pair_lora()}: {med['pair pass']:.1f} / {med['fused pair']:.1f})"
                        + " |" * 15)
                    for c in cfgs:
                        log(f"|  | kernels: pair pass, lora {c} | " + "; ".join(
                            f"`{name[:40]}` {dur:.1f} (gap {gap:.1f})"
                            for name, _, dur, gap in kernels_of["pair lora " + c]) + " |" * 15)
                for what in [w_ for w_ in ("written", "fused", "fused pair", "fused pair, no PDL", "fused rows",
                                           "rows pass", "pair pass") if w_ in graphs]:
                    log("|  | kernels: " + what + " | " + "; ".join(
                        f"`{name[:40]}` {dur:.1f} (gap {gap:.1f})" for name, _, dur, gap in kernels_of[what])
                        + " |" * 15)
    log("")
    log(f"tuning.ADA_NORM_MIN_M = {tuning.ADA_NORM_MIN_M}; apply tile {tuning.ada_norm_tile()}; "
        f"{os.environ.get('SVDQ_SM90_PDL', 'PDL: default')}")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
