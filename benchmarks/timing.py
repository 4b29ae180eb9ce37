"""CUDA-event timing shared by the benchmarks (run as scripts, so they import it by name)."""
import statistics

import torch


def median_ms(fn, reps=10, warmup=2, inner=5, setup=None):
    """Median over ``reps`` of the mean time of ``inner`` back-to-back calls of ``fn``, in ms, from
    CUDA events (back-to-back calls let launch overhead overlap the GPU work, as in training).
    ``setup``, if given, runs before each rep, outside the timed interval."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)
