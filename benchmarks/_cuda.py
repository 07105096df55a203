"""Shared GPU timing for the benchmarks: a callable captured in a CUDA graph, its replays timed; a host profile;
a callable run under settings of its own."""

import cProfile
import io
import os
import pstats
import time

import torch


def graph_of(fn, reps: int = 1) -> torch.cuda.CUDAGraph:
    """``reps`` calls of ``fn`` captured back to back in one CUDA graph (after two warm-up calls)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def with_env(values: dict, fn):
    """``fn`` as a callable that runs under the environment ``values`` (a None value leaves that setting as it is)
    and puts the previous values back after it: the library reads its settings per call, so a capture of it
    records the kernels those settings pick."""
    def run():
        was = {key: os.environ.get(key) for key in values}
        for key, v in values.items():
            if v is not None:
                os.environ[key] = v
        try:
            return fn()
        finally:
            for key, v in was.items():
                if v is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = v
    return run


def graphed(fn):
    """``fn`` captured in a CUDA graph: replaying it times the GPU work without Python's launch cost."""
    return graph_of(fn).replay


def replay_call_ms(g: torch.cuda.CUDAGraph, calls: int, replays: int = 30) -> float:
    """Median ms of one call, from ``replays`` event-timed replays of ``g``, a graph of ``calls`` calls."""
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[len(times) // 2]


def graph_call_ms(fn, calls: int, replays: int = 30) -> float:
    """Median ms of one call of ``fn``, from ``replays`` event-timed replays of a graph of ``calls`` calls."""
    return replay_call_ms(graph_of(fn, calls), calls, replays)


def host_profile(fn, calls: int = 1, top: int = 30, warmup: int = 1) -> tuple[str, float, float]:
    """cProfile's top functions by own time over ``calls`` calls of ``fn`` (after ``warmup`` calls and a
    sync), with the host seconds until the last call returned and until the GPU finished."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue(), host, total
