"""What run.tensorboard costs the training loop: RunRecorder.log per training line, with
and without TensorBoard events (records.tensorboard), and the writer's start-up.

Each round writes N training lines (loss, learning rate) to a fresh run folder and times
the calls (perf_counter, median of --repeats rounds); the writer's thread flushes the
file meanwhile, as in a run. Trainers write one training line every LOG_EVERY_SECONDS
(0.5 s), so the figure to compare is the per-line cost against 0.5 s.

    python benchmarks/bench_tensorboard.py [--lines 5000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from distbelief.records.metrics import LOG_EVERY_SECONDS, RunRecorder


def per_line(lines: int, tensorboard: bool) -> tuple[float, float]:
    """(seconds per log call, seconds to open the recorder) for one round."""
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        recorder = RunRecorder(Path(folder), stream=None, tensorboard=tensorboard)
        opened = time.perf_counter() - t0
        t0 = time.perf_counter()
        for step in range(1, lines + 1):
            recorder.log(step, 64 * step, 1.0 / step, learning_rate=0.05)
        took = time.perf_counter() - t0
        recorder.close()
    return took / lines, opened


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    per_line(10, True)  # imports tensorboardX once, outside the timings
    results = {}
    for tensorboard in (False, True):
        rounds = [per_line(args.lines, tensorboard) for _ in range(args.repeats)]
        results[tensorboard] = (statistics.median(r[0] for r in rounds),
                                statistics.median(r[1] for r in rounds))
    without, with_ = results[False][0], results[True][0]
    print(f"{args.lines} lines, median of {args.repeats} rounds")
    print(f"  metrics.jsonl only:     {without * 1e6:8.1f} us a line")
    print(f"  with TensorBoard:       {with_ * 1e6:8.1f} us a line "
          f"({with_ / without:.1f}x; +{(with_ - without) * 1e6:.1f} us)")
    print(f"  added per {LOG_EVERY_SECONDS:g} s of training: "
          f"{100 * (with_ - without) / LOG_EVERY_SECONDS:.4f}%")
    print(f"  opening the writer:     {results[True][1] * 1e3:8.1f} ms "
          f"(without: {results[False][1] * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
