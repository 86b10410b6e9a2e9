#!/usr/bin/env python3
"""The overhead of calling picaso from Python: composing 10 states through `picaso.compose`
against the same composition timed inside Rust, in the same process and run.

    python scripts/bench_python_compose.py [--model models/picaso-mamba2]

Both sides compose 10 states of the model into a new state, allocating and freeing it inside
the timing. Rounds alternate the two sides; each side's time in a round is the median of
`--calls` calls, and the table gives the medians over rounds. A second table does the same on
the tiny fixture model, where the composition itself is nearly free: that is the fixed cost
of a call (argument conversion, releasing the GIL, the result object).
"""
import argparse
import statistics
import time

import picaso
from picaso import _picaso

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", default="models/picaso-mamba2")
ap.add_argument("--tiny", default="testdata/mamba2/g1/hf")
ap.add_argument("--rounds", type=int, default=9)
ap.add_argument("--calls", type=int, default=50)
a = ap.parse_args()


def measure(states, methods):
    py, rust = {m: [] for m in methods}, {m: [] for m in methods}
    for _ in range(a.rounds):
        for m in methods:
            rust[m].append(statistics.median(_picaso._compose_seconds(states, m, a.calls)))
            times = []
            for _ in range(a.calls):
                t = time.perf_counter()
                picaso.compose(states, m)  # the result is freed inside the timing, as on the Rust side
                times.append(time.perf_counter() - t)
            py[m].append(statistics.median(times))
    return {m: (statistics.median(rust[m]), statistics.median(py[m])) for m in methods}


for path, unit, scale in [(a.model, "ms", 1e3), (a.tiny, "µs", 1e6)]:
    model = picaso.Model.load(path)
    states = [model.state([(7 * t + i) % 90 + 1 for t in range(16)]) for i in range(10)]
    rows = measure(states, list(picaso.METHODS))
    print(f"\n{path}: 10 states × {states[0].nbytes / 2**20:.3f} MiB; medians of {a.calls} calls, median of {a.rounds} rounds ({unit})")
    print("| method | Rust, in process | Python `picaso.compose` | Python ÷ Rust | difference |")
    print("|---|---:|---:|---:|---:|")
    for m, (r, p) in rows.items():
        print(f"| {m} | {scale * r:.3f} | {scale * p:.3f} | {p / r:.3f}× | {1e6 * (p - r):+.1f} µs |")
