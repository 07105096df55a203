"""Where the one-launch fast kernel's time goes (``sm90/small_m_fast.py``): each CTA's global-timer stamps
at its phase ends, from one traced launch, beside CUDA-graph times of the untraced kernel.

    python benchmarks/trace_small_m_fast.py [--out FILE] [--quick | --tokens 9,9p,9r0,16,16n | --exact]

Per layer and token count, and per measurement setting (``poll``: how waits poll; ``ctas_per_sm``: the
split's target, ``fit N`` the default's, what the compiled kernel lets stay resident): cuBLAS bf16 and the
kernel in CUDA-graph replays (us), then from one traced launch the
times (us, from the first CTA's start) at which: the last CTA started; the producers' amax were all in;
their ``lora_act`` partials were all in; the quantizers' ``a8`` were all in (FP8 dots); the workers left
their wait (first / median / last); finished their k-loop (median / last); counted their partial (last);
the last epilogue ended; the last CTA ended. Then the workers' k-loop times (us: median, 90th percentile,
longest), the SMs the grid landed on, the most CTAs one SM held, and the median k-loop time of the workers
on SMs holding that many against those on the other SMs (whether the slow loops are the crowded SMs'). Then,
for the slowest tenth of the k-loops against the rest (medians): when the loop started, the latency of a
probe load of the split's first and last k-tile's weight word right after the wait (in L2 by then, or still
coming from DRAM), and the split's position (0 first, 1 last). The
global timer ticks in ns but may advance in steps of up to 1 us on some parts: read the figures as such.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _table import emit  # noqa: E402
from bench_small_m import graph_time  # noqa: E402
from test_sm90_small_m_fast import _layer, _operands  # noqa: E402

from svdq_linear.backends.sm90 import small_m_fast as smf  # noqa: E402

EXACT_LAYERS = (("attn", 3072, 3072), ("ff up", 3072, 12288), ("ff down", 12288, 3072), ("single out", 15360, 3072))
CASES = (("attn", 3072, 3072, 1), ("ff down", 12288, 3072, 1), ("ff down", 12288, 3072, 16), ("attn", 3072, 3072, 64))
# (poll, ctas_per_sm): None = the default's fitted target
SETTINGS = ((0, None), (0, 4), (0, 5), (0, 6), (1, None))


def _q(v: torch.Tensor, f: float) -> float:
    return float(v.float().quantile(f)) / 1e3 if v.numel() else float("nan")


def phases(tr: torch.Tensor, p: int, q: int, split: int = 1) -> list[float]:
    """The phase-end times (us) of one traced launch (``tr [grid, TRACE_COLS]``, -1 where a CTA did not
    stamp; ``p`` producers, ``q`` quantizers, ``split`` splits a group)."""
    t, sm = tr[:, 7] & 0xFFFFFFFF, tr[:, 7] >> 32
    t0 = tr[:, 0].min()
    rel = torch.where(tr[:, :7] >= 0, tr[:, :7] - t0, torch.full_like(tr[:, :7], -1))
    prod, quant, work = rel[t < p], rel[(t >= p) & (t < p + q)], rel[t >= p + q]

    def col(r, c):
        v = r[:, c]
        return v[v >= 0]

    loop = (work[:, 2] - work[:, 1]).float()
    per_sm = torch.bincount(sm, minlength=int(sm.max()) + 1)  # CTAs an SM held over the launch
    crowd = per_sm[sm[t >= p + q]]
    top = int(per_sm.max())
    slow = loop >= loop.quantile(0.9)
    wt = tr[t >= p + q]
    probe1, probe2 = (wt[:, 8] - wt[:, 1]).float(), (wt[:, 9] - wt[:, 1]).float()
    pos = ((t[t >= p + q] - p - q) % split).float() / max(split - 1, 1) * 1e3  # (_q divides by 1e3)
    start = work[:, 1].float()

    def two(v):
        return f"{_q(v[slow], 0.5):.1f} / {_q(v[~slow], 0.5):.1f}"

    return [_q(rel[:, 0], 1), _q(col(prod, 1), 1), _q(col(prod, 2), 1), _q(col(quant, 2), 1) if q else float("nan"),
            _q(col(work, 1), 0), _q(col(work, 1), 0.5), _q(col(work, 1), 1), _q(col(work, 2), 0.5), _q(col(work, 2), 1),
            _q(col(work, 3), 1), _q(col(work, 5), 1), _q(rel[:, 6], 1), _q(loop, 0.5), _q(loop, 0.9), _q(loop, 1),
            int((per_sm > 0).sum()), top, _q(loop[crowd == top], 0.5), _q(loop[crowd < top], 0.5),
            two(start), two(probe1), two(probe2), f"{_q(pos[slow], 0.5):.2f} / {_q(pos[~slow], 0.5):.2f}"]


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true",
                    help="one token at attn and ff down, the default against the fixed target of 5 only")
    ap.add_argument("--exact", action="store_true",
                    help="instead: the exact mode's one launch (linear_exact) at 1 and 2 tokens of the four Flux layers, "
                         "default setting and 4-6 CTAs an SM ('amax in': the producers' activation codes)")
    ap.add_argument("--tokens", help="instead: ff down (12288 -> 3072) at these token counts, default setting only; "
                    "a count ending in p: its x padded with zero tokens to the tile's rows; in r0: no low-rank branch; "
                    "in n: the kernel built with M not specialized (Triton builds M % 16 == 0 apart: 16 tokens' "
                    "build or 9's)")
    args = ap.parse_args()
    cases = [c for c in CASES if c[3] == 1] if args.quick else CASES
    settings = [(0, None), (0, 5)] if args.quick else SETTINGS
    if args.tokens:
        cases = [("ff down", 12288, 3072, t) for t in args.tokens.split(",")]
        settings = [(0, None)]
    run = smf.linear
    if args.exact:
        cases = [(label, k, n, m) for label, k, n in EXACT_LAYERS for m in (1, 2)]
        settings = [(0, None), (0, 4), (0, 5), (0, 6)]
        run = smf.linear_exact
    heads = ["last start", "amax in", "lora in", "a8 in", "wait first", "wait med", "wait last", "loop med",
             "loop last", "counted last", "epi last", "end", "loop us", "loop p90", "loop max", "SMs", "most an SM",
             "loop med there", "loop med elsewhere", "loop start slow / rest", "probe first slow / rest",
             "probe last slow / rest", "split pos slow / rest"]
    rows = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; "
            "rank 32, bias; times in us (graph: CUDA-graph replays; the rest from one traced launch, from the first "
            "CTA's start)", "",
            "| layer | M | poll | CTAs/SM | grid | cuBLAS | graph us | ratio | " + " | ".join(heads) + " |",
            "|---|---|---|---|---|---|---|---|" + "---|" * len(heads)]
    gen = torch.Generator().manual_seed(0)
    kernel = smf._fast_small_m_kernel
    unspecialized = triton.jit(kernel.fn, do_not_specialize=["M"])
    for label, k, n, spec in cases:
        smf._fast_small_m_kernel = kernel
        if str(spec).endswith("n"):
            smf._fast_small_m_kernel = unspecialized
            spec = str(spec)[:-1]
            label += " M unspecialized"
        m = int(str(spec).removesuffix("p").removesuffix("r0"))
        q, ws, wc, smooth, pd, up = _layer(n, k, 32, gen)
        ops = _operands(q, ws, wc, smooth, pd, up, torch.randn(n, generator=gen))
        if args.exact:  # what the exact mode's prepared state holds: quack's blob and strip, wcscale, smooth
            from svdq_linear.backends.sm90 import quack_gemm

            ops = dict(smooth=smooth.cuda(), blob=quack_gemm.repack_weight(q).cuda(),
                       strip=quack_gemm.repack_scales(ws).cuda(), cs=wc.cuda(), bias=ops["bias"],
                       proj_down=ops["proj_down"], proj_up=ops["proj_up"])
        x = (torch.randn(m, k, generator=gen) * 3).bfloat16().cuda()
        if str(spec).endswith("r0"):  # no low-rank branch: no producers' lora_act beside the workers
            ops.update(proj_down=None, proj_up=None)
            label += " r0"
        if str(spec).endswith("p"):  # the same tokens and zero ones up to the tile's rows: no row past M
            x = torch.cat([x, x.new_zeros(smf.rows(m, smf.use_dots(m, n, k)) - m, k)])
            label += f" {m} padded"
            m = x.shape[0]
        lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
        t_ref = graph_time(lambda: F.linear(x, lin.weight, lin.bias))
        smf._FITTED.clear()
        want = run(x, **ops)
        (fit,) = smf._FITTED.values()
        for poll, setting in settings:
            cps = setting or fit
            y = run(x, **ops, poll=poll, ctas_per_sm=setting)
            same = torch.equal(y, want) if cps == fit else True  # (another split sums in another order)
            t = graph_time(lambda: run(x, **ops, poll=poll, ctas_per_sm=setting))
            dot = False if args.exact else None
            sms = smf.sm_count(x.device)  # as the launch plans its split
            grid = smf.grid_size(m, n, k, sms, ctas_per_sm=cps, dot=dot)
            split, _, prods, _ = smf.plan(m, n, k, sms, ctas_per_sm=cps, dot=dot)
            tr = torch.full((grid, smf.TRACE_COLS), -1, dtype=torch.int64, device="cuda")
            run(x, **ops, poll=poll, ctas_per_sm=setting, trace=tr)  # compiles the traced build
            tr.fill_(-1)
            run(x, **ops, poll=poll, ctas_per_sm=setting, trace=tr)
            torch.cuda.synchronize()
            ph = phases(tr.cpu(), prods, prods if dot is None and smf.use_dots(m, n, k) else 0, split)
            rows.append(f"| {label} | {m} | {poll} | {cps if setting else f'fit {fit}'} | {grid} | {t_ref * 1e3:.1f} | {t * 1e3:.1f}"
                        f"{'' if same else ' (DIFFERS)'} | {t_ref / t:.2f}x | " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in ph) + " |")
            print(rows[-1], flush=True)
    emit(rows, args.out)


if __name__ == "__main__":
    main()
