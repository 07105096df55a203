"""The low-rank GEMMs with quack's K-stages under the library's and a tighter shared-memory count (H100/H200):

    python benchmarks/bench_lowrank_stages.py --accounting library|tight [--out FILE]
                                              [--cases exact:fused_qkv,...] [--reps 20] [--rounds 3]

``quack_lowrank.LowRankOperand.smem_bytes`` says how many bytes the low-rank buffers add to the epilogue
struct, ``(tile_M + tile_N) * W * 2`` and a 1024-byte pad for each buffer, and quack picks its K-stages
from what is left. quack already reserves one pad quantum for any epilogue shared memory, and a member
aligned to 1024 keeps the struct a multiple of 1024, so each buffer rounded up to 1024 would do
(``tight_count``): at 128 x 256 exact tiles and W = 32 that gives five K-stages instead of four, 512 bytes
being what the library's count lacks. ``--accounting tight`` patches that count in for this process
(before any kernel compiles). Run the script once per accounting, each with its own ``QUACK_CACHE_DIR``
(quack's disk cache keys a kernel by the source file's digest, which the patch does not change), and
alternate the processes.

Per case (a mode and one of ``bench_lowrank``'s whole-linear shapes, rank 32 or the fused windows): the
K-stages quack picked, then in ``--rounds`` rounds the module forward at rank 32 and the same layer with no
low-rank branch, each a CUDA graph of ``--reps`` calls replayed under the profiler (``timeline_exact``): the
GEMM kernel's median duration and the forward's period, us. The output's SHA-256 is printed: the stage count
does not change the arithmetic, so both accountings must give the same bits.

Measured on an H100 (docs/perf.md, 2026-12-06, twenty-sixth session): the fifth stage ran, gave the same bits
and was no faster, so the library keeps its count.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def tight_count(cta_tile_shape_mnk, w: int) -> int:
    """Each buffer's bytes rounded up to 1024, no pad of their own (quack's quantum covers the struct's)."""
    return sum(-(-rows * w * 2 // 1024) * 1024 for rows in cta_tile_shape_mnk[:2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--accounting", choices=("library", "tight"), required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="exact:fused_qkv,exact:ff_down,fast:single_out")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import cutlass.cute as cute
    from quack.epilogue.ops import EpiSmemBytes

    from svdq_linear.backends.sm90 import quack_lowrank

    if args.accounting == "tight":
        def smem_bytes(self, arg_tensor, cta_tile_shape_mnk, epi_tile, warp_shape_mnk=None):
            if self.dim == 1:
                return EpiSmemBytes()  # counted by lu, as the library's
            return EpiSmemBytes(unstaged=tight_count(cta_tile_shape_mnk, cute.size(arg_tensor, mode=[1])))

        quack_lowrank.LowRankOperand.smem_bytes = smem_bytes
    import quack.gemm_sm90 as gemm_sm90

    picked: list[tuple] = []
    compute = gemm_sm90.GemmSm90._compute_stages.__func__

    def spy(cls, cta, *a, **k):
        stages = compute(cls, cta, *a, **k)
        picked.append((tuple(cta), tuple(stages)))
        return stages

    gemm_sm90.GemmSm90._compute_stages = classmethod(spy)

    from bench_lowrank import FLUX, whole_module
    from test_conformance import random_w4a4
    from _cuda import graph_of
    from timeline_exact import kernel_spans, summarize

    shapes = {label.replace(" ", "_"): (m, k, n) for label, m, k, n in FLUX}
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; accounting {args.accounting}; graphs of "
             f"{args.reps} calls, {args.rounds} rounds", "",
             "| accounting | case | rank | K-stages, epilogue stages | round | GEMM kernel | forward period | "
             "output sha256 |", "|---|---|---|---|---|---|---|---|"]

    def log(s: str) -> None:
        lines.append(s)
        print(s, flush=True)

    dev = torch.device("cuda")
    with torch.no_grad():
        for case in args.cases.split(","):
            mode, label = case.split(":")
            m, k, n = shapes[label]
            torch.manual_seed(0)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            mods = {"32": whole_module(label.replace("_", " "), k, n, dev).set_mode(mode),
                    "0": random_w4a4(k, n, 0, torch.bfloat16, dev).set_mode(mode)}
            for rank, mod in mods.items():
                picked.clear()
                out = mod(x)
                torch.cuda.synchronize()
                digest = hashlib.sha256(out.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]
                stages = ", ".join(f"{cta}: {s[0]}, {s[1]}" for cta, s in picked) or "(cached)"
                g = graph_of(lambda mod=mod: mod(x), args.reps)
                for rnd in range(args.rounds):
                    period, rows = summarize(kernel_spans(g), args.reps)
                    gemm = [dur for name, _, dur, _ in rows if "cutlass" in name or "Gemm" in name]
                    log(f"| {args.accounting} | {case} | {rank} | {stages if rnd == 0 else ''} | {rnd} | "
                        f"{statistics.median(gemm) if gemm else float('nan'):.1f} | {period:.1f} | "
                        f"{digest if rnd == 0 else ''} |")
                del g
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
