"""CUDA-event timing shared by the benchmarks (run as scripts, so they import it by name)."""
import random
import statistics

import torch


def _time_once(fn, inner, setup=None):
    """Mean ms of ``inner`` back-to-back calls of ``fn`` (``setup`` runs first, untimed)."""
    if setup is not None:
        setup()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(inner):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / inner


def median_ms(fn, reps=10, warmup=2, inner=5, setup=None):
    """Median over ``reps`` of the mean time of ``inner`` back-to-back calls of ``fn``, in ms, from
    CUDA events (back-to-back calls let launch overhead overlap the GPU work, as in training).
    ``setup``, if given, runs before each rep, outside the timed interval."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    torch.cuda.synchronize()
    return statistics.median(_time_once(fn, inner, setup) for _ in range(reps))


def median_ms_interleaved(fns, reps=15, warmup=2, inner=5, setups=None):
    """{name: median ms} for several functions timed in turns: each rep times every function once, in an
    order shuffled from rep to rep (seeded: the same orders every run). Timing one function's reps all before
    the next lets a drift of the GPU's clocks (it heats up) favour whichever runs first; in turns, every one
    sees the same drift. Shuffled, not rotated: a rotation keeps each function's predecessor, and one that
    follows a light load (a slow layer that draws less power) would run at higher clocks every time.
    ``setups``: {name: callable} run before each of that function's timings (and warm-ups), untimed."""
    names = list(fns)
    setups = setups or {}
    for _ in range(warmup):
        for name in names:
            if name in setups:
                setups[name]()
            fns[name]()
    torch.cuda.synchronize()
    times = {name: [] for name in names}
    shuffler = random.Random(0)
    for _ in range(reps):
        for name in shuffler.sample(names, len(names)):
            times[name].append(_time_once(fns[name], inner, setups.get(name)))
    return {name: statistics.median(t) for name, t in times.items()}
