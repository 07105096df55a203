"""Shared GPU timing for the benchmarks: a callable captured in a CUDA graph."""

import torch


def graphed(fn):
    """``fn`` captured in a CUDA graph: replaying it times the GPU work without Python's launch cost."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay
