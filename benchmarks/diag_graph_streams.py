"""Replays of one-launch fast kernels captured in CUDA graphs, in several ways, each in its own process:
which way faults (``test_gpu_graphs_replayed_at_once_on_several_streams_keep_their_own_sync_words``).

    python benchmarks/diag_graph_streams.py MODE [LAYERS]

MODE: ``serial`` (each graph alone on the current stream, a sync after each), ``side`` (each alone on a
side stream), ``back`` (the three back to back on the current stream, one sync), ``concurrent`` (the three
at once on three streams, as the test), ``drop`` (as ``concurrent`` but the graphs' inputs are let go after
capture, as the test first did: their memory goes to the next layer's tensors). LAYERS: indices into the test's three layers (default 0,1,2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_sm90_small_m_fast import _layer, _operands  # noqa: E402

from svdq_linear.backends.sm90 import small_m_fast as smf  # noqa: E402

LAYERS = ((1, (3072, 3072)), (7, (3072, 12288)), (2, (12288, 3072)))


def main() -> None:
    mode = sys.argv[1]
    pick = [int(i) for i in (sys.argv[2] if len(sys.argv) > 2 else "0,1,2").split(",")]
    gen = torch.Generator().manual_seed(0)
    runs = []
    for i, (m, (n, k)) in enumerate(LAYERS):
        q, ws, wc, smooth, pd, up = _layer(n, k, 32, gen)
        ops = {a: (t.cuda() if t is not None else None) for a, t in _operands(q, ws, wc, smooth, pd, up, None).items()}
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        if i not in pick:
            continue
        want = smf.linear(x, **ops)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = smf.linear(x, **ops)
        torch.cuda.synchronize()
        runs.append((i, g, y, want) if mode == "drop" else (i, g, y, want, x, ops))
        print(f"layer {i}: m={m} n={n} k={k} captured", flush=True)
    streams = [torch.cuda.Stream() for _ in runs]
    for it in range(20):
        if mode == "serial":
            for i, g, *_ in runs:
                g.replay()
                torch.cuda.synchronize()
        elif mode == "side":
            for (i, g, *_), st in zip(runs, streams):
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    g.replay()
                torch.cuda.synchronize()
        elif mode == "back":
            for i, g, *_ in runs:
                g.replay()
            torch.cuda.synchronize()
        else:
            for (i, g, *_), st in zip(runs, streams):
                st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    g.replay()
            torch.cuda.synchronize()
        for i, g, y, want, *_ in runs:
            if not torch.equal(y, want):
                print(f"{mode}: layer {i} differs at iteration {it}: max {(y.float() - want.float()).abs().max()}")
    print(f"{mode} {pick}: ok", flush=True)


if __name__ == "__main__":
    main()
