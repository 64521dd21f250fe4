"""Model parallelism: measured step time at P = 1 and 2 against the cost model, and what the
cost model predicts for 8, 32 and 81 machines.

(a) Measured, on this machine: a locally connected network large enough that compute
    dominates (32x32x3 input, 5x5 local layers of 16 channels, 10 classes; batch 64, random
    data). P = 1: `Network.loss_and_grad` in this process (the unpartitioned baseline) and
    `PartitionedNetwork` on one rank (the partitioned code's own overhead), interleaved
    `--repeats` times. P = 2: `PartitionedNetwork` under `mpiexec -n 2`, one BLAS thread
    per rank, a step timed on its slowest rank; the workers also time a ping-pong between
    the two ranks for the link's latency and bandwidth. Each figure is the best step of
    `--steps` x `--repeats` after `--warmup` untimed ones (the machine is shared: the best
    step is the one least disturbed). The CPU time per step is printed too: on a shared
    machine it shows the work each partition does, where wall time shows mostly the load.
(b) The cost model (distbelief.model.cost_model) with the flop rate measured at P = 1 (so it
    reproduces P = 1 by construction) and the measured link: its P = 2 step time next to
    the measured one, as a ratio.
(c) Predictions for 8, 32 and 81 machines: the paper-sized locally connected model
    (configs/paper_image_1_7b.toml, 1.7B parameters) and the 42M-parameter speech model
    (configs/paper_speech_42m.toml), with the link and per-machine rate stated in the
    output: one machine sustains `--machine-gflops` (default 250: 16 cores, as the paper's
    machines had, at about what one core here sustains on the local kernel when quiet);
    links InfiniBand EDR (12.5 GB/s, 2 us) and, for comparison with the paper's own
    figures (>12x on 81 machines; 2.2x on 8), 1 Gb/s Ethernet (0.125 GB/s, 50 us).

(d) With --fashion: wall time to 88% test accuracy (2000 test samples) on Fashion-MNIST
    of configs/fashion_mnist_local_partitioned.toml, Downpour with 1 shard + 2 replicas x
    2 partitions (5 ranks), against the single-process trainer on the same network
    (configs/fashion_mnist_local.toml) in the same run. On 2 cores the 5 ranks are
    oversubscribed: this shows that it trains to the target, not a speedup.

(e) With --sandblaster: Sandblaster L-BFGS on Fashion-MNIST with the locally connected
    network of configs/fashion_mnist_local.toml, 1 shard + coordinator + 2 replicas x 2
    partitions (6 ranks) against 2 replicas x 1 partition (4 ranks), `--sb-steps`
    iterations on batches of `--sb-batch` examples in units of 250, the two layouts
    interleaved `--sb-repeats` times: the median seconds per gradient evaluation (one
    batch: the units of every replica, pushes and the shards' finish) of each and their
    ratio, with the load average before each run. On 2 cores the 4 partitions
    oversubscribe: what the ratio can show here is the cost of partitioning, not a speedup.

    python benchmarks/bench_model_parallel.py            # ~30 s on 2 cores
    python benchmarks/bench_model_parallel.py --steps 20 --batch 128
    python benchmarks/bench_model_parallel.py --fashion  # adds (d), a few minutes
    python benchmarks/bench_model_parallel.py --sandblaster --skip-measured  # (e) alone

On a 2-core machine shared with other work the P = 2 figure suffers most (two ranks need
both cores); the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
INPUT_SHAPE = (32, 32, 3)
CLASSES = 10
LAYERS = [{"type": "local", "kernel": 5, "channels": 16, "activation": "relu"},
          {"type": "local", "kernel": 5, "channels": 16, "activation": "relu"},
          {"type": "dense", "units": CLASSES, "activation": "softmax"}]
IB = (12.5e9, 2e-6)
ETHERNET = (0.125e9, 50e-6)
PER_MACHINE_CORES = 16  # the paper's machines had 16 cores


def network():
    from distbelief.model.network import Network

    return Network(INPUT_SHAPE, LAYERS, CLASSES)


def batch(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.random((n, *INPUT_SHAPE), dtype=np.float32),
            rng.integers(0, CLASSES, n).astype(np.int32))


def timed_steps(step, warmup: int, steps: int, sync=None) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds of this process) of each of `steps` calls of `step()`
    after `warmup` untimed ones. CPU time is the work a step did, whatever else runs on
    the machine (waits sleep, so they cost almost none)."""
    for _ in range(warmup):
        step()
    wall, cpu = [], []
    for _ in range(steps):
        if sync:
            sync()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


# -- P = 1, in this process ------------------------------------------------------------------


def measure_single(args: argparse.Namespace) -> dict:
    from mpi4py import MPI

    from distbelief.model.partitioned_network import PartitionedNetwork
    from distbelief.runtime.threads import set_blas_threads

    set_blas_threads(1)
    net = network()
    x, y = batch(args.batch)
    params = net.init_params(0)
    grad = np.zeros_like(params)
    part = PartitionedNetwork(net, MPI.COMM_SELF)
    plain, partitioned, cpu = [], [], []
    for _ in range(args.repeats):  # interleaved, so a neighbour's load hits both
        wall, used = timed_steps(lambda: net.loss_and_grad(params, x, y, grad),
                                 args.warmup, args.steps)
        plain.append(min(wall))
        cpu.append(min(used))
        partitioned.append(min(timed_steps(lambda: part.loss_and_grad(params, x, y, grad),
                                           args.warmup, args.steps)[0]))
    return {"network": min(plain), "partitioned": min(partitioned), "cpu": min(cpu)}


# -- P = 2, as an MPI worker -----------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from distbelief.model.partitioned_network import PartitionedNetwork
    from distbelief.runtime.threads import set_blas_threads

    set_blas_threads(1)
    comm = MPI.COMM_WORLD
    net = network()
    part = PartitionedNetwork(net, comm)
    x, y = batch(args.batch)
    params = part.init_params(0)
    grad = np.zeros_like(params)
    wall, cpu = timed_steps(lambda: part.loss_and_grad(params, x, y, grad),
                            args.warmup, args.steps * args.repeats, sync=comm.Barrier)
    times = np.array([wall, cpu])
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # a step ends on its slowest rank
    steps, cpu_step = float(times[0].min()), float(times[1].min())
    latency, bandwidth = ping_pong(comm)
    traffic = part.traffic.per_step()
    sent = comm.reduce(sum(traffic["forward"]) + sum(traffic["backward"]), op=MPI.SUM)
    if comm.Get_rank() == 0:
        print(json.dumps({"step": steps, "cpu": cpu_step, "latency": latency,
                          "bandwidth": bandwidth, "bytes_per_step": sent}), flush=True)


def ping_pong(comm) -> tuple[float, float]:
    """(one-way latency of an 8-byte message, bandwidth of 4 MB messages) between ranks 0
    and 1, medians of 20 round trips each."""
    rank = comm.Get_rank()
    results = []
    for size in (2, 1 << 20):
        buf = np.zeros(size, dtype=np.float32)
        times = []
        for _ in range(20):
            comm.Barrier()
            t0 = time.perf_counter()
            if rank == 0:
                comm.Send(buf, dest=1)
                comm.Recv(buf, source=1)
            elif rank == 1:
                comm.Recv(buf, source=0)
                comm.Send(buf, dest=0)
            times.append((time.perf_counter() - t0) / 2)
        results.append((statistics.median(times), buf.nbytes))
    (latency, _), (big, nbytes) = results
    return latency, nbytes / max(big - latency, 1e-9)


def measure_two(args: argparse.Namespace) -> dict:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", __file__, "--worker",
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                          check=False)
    if proc.returncode != 0:
        sys.exit(f"P = 2 worker failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the report ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--machine-gflops", type=float, default=250.0,
                        help="sustained GFLOP/s of one machine for the predictions (c) "
                             "(default: %(default)s, 16 cores at about the ~16 GFLOP/s one "
                             "core of the development machine sustains on the local kernel "
                             "when quiet)")
    parser.add_argument("--fashion", action="store_true",
                        help="also (d): time to 88%% on Fashion-MNIST, Downpour 2x2 + 1 "
                             "shard against the single-process trainer")
    parser.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5",
                        help="Fashion-MNIST HDF5 for --fashion and --sandblaster (default: "
                             "%(default)s)")
    parser.add_argument("--sandblaster", action="store_true",
                        help="also (e): Sandblaster seconds per gradient evaluation, 2 "
                             "replicas x 2 partitions against 2 x 1, Fashion-MNIST local "
                             "network")
    parser.add_argument("--sb-batch", type=int, default=6000,
                        help="(e): examples per gradient evaluation (default: %(default)s)")
    parser.add_argument("--sb-steps", type=int, default=4,
                        help="(e): L-BFGS iterations per run (default: %(default)s)")
    parser.add_argument("--sb-repeats", type=int, default=2,
                        help="(e): runs of each layout, interleaved (default: %(default)s)")
    parser.add_argument("--skip-measured", action="store_true",
                        help="skip (a)-(c), run only the optional sections asked for")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from distbelief.config import load_config
    from distbelief.model.cost_model import Link, predict, step_time
    from distbelief.model.network import Network

    if args.skip_measured:
        optional_sections(args)
        return
    net = network()
    print(f"load average before: {os.getloadavg()[0]:.2f}; network {net.layout.size:,d} "
          f"parameters, batch {args.batch}\n{net.describe()}")
    single = measure_single(args)
    two = measure_two(args)
    load = os.getloadavg()[0]
    # The per-core rate the cost model needs: total flops of a step / the measured step.
    flops_per_step = step_time(net.layers, 1, args.batch, 1.0, Link(1.0, 0.0))[0]
    rate = flops_per_step / single["network"]
    link = Link(two["bandwidth"], two["latency"])
    p2 = predict(net, 2, args.batch, rate, link)
    measured_speedup = single["network"] / two["step"]
    print(f"\n(a,b) measured step time against the cost model (load average {load:.2f}); "
          f"sustained rate at P=1 {rate / 1e9:.2f} GFLOP/s; link measured between the two "
          f"ranks: {two['latency'] * 1e6:.1f} us, {two['bandwidth'] / 1e9:.2f} GB/s")
    print(f"{'':<28}{'measured ms':>12}{'model ms':>10}{'model/measured':>16}")
    print(f"{'P=1 Network':<28}{single['network'] * 1e3:>12.1f}"
          f"{single['network'] * 1e3:>10.1f}{'1.00 (fitted)':>16}")
    print(f"{'P=1 PartitionedNetwork':<28}{single['partitioned'] * 1e3:>12.1f}"
          f"{'':>10}{single['partitioned'] / single['network']:>15.2f}x of Network")
    print(f"{'P=2 PartitionedNetwork':<28}{two['step'] * 1e3:>12.1f}"
          f"{p2.step_seconds * 1e3:>10.1f}{p2.step_seconds / two['step']:>16.2f}")
    print(f"speedup P=2 over P=1: measured {measured_speedup:.2f}x, model {p2.speedup:.2f}x; "
          f"bytes between partitions per step: measured {two['bytes_per_step']:,.0f}, "
          f"model {p2.bytes_per_step - 3 * 2 * args.batch * 4:,d} (+ loss Allreduces)")
    print(f"CPU time per step (the work, less sensitive to other jobs): P=1 Network "
          f"{single['cpu'] * 1e3:.1f} ms, P=2 slowest partition {two['cpu'] * 1e3:.1f} ms: "
          f"{single['cpu'] / two['cpu']:.2f}x less per partition")

    machine = args.machine_gflops * 1e9
    print(f"\n(c) predictions, one machine sustaining {args.machine_gflops:g} GFLOP/s "
          f"(--machine-gflops; the paper's machines had {PER_MACHINE_CORES} cores)")
    models = [("paper_image_1_7b.toml", (200, 200, 3), 1000, (1, 8, 32, 81),
               "paper: >12x on 81 machines"),
              ("paper_speech_42m.toml", (440,), 8192, (1, 8, 32),
               "paper: 2.2x on 8 machines")]
    for name, shape, classes, counts, paper in models:
        config = load_config(REPO / "configs" / name, check_data=False)
        model = Network(shape, [dict(layer) for layer in config.model.layers], classes)
        for label, (bandwidth, latency) in (("InfiniBand EDR 12.5 GB/s, 2 us", IB),
                                            ("1 Gb/s Ethernet 0.125 GB/s, 50 us", ETHERNET)):
            cells = []
            for count in counts[1:]:
                p = predict(model, count, config.data.batch_size, machine,
                            Link(bandwidth, latency))
                cells.append(f"{count} machines {p.speedup:.1f}x ({p.step_seconds * 1e3:.0f} ms)")
            one = predict(model, 1, config.data.batch_size, machine, Link(bandwidth, latency))
            print(f"{name} ({model.layout.size / 1e6:,.0f}M params, batch "
                  f"{config.data.batch_size}), {label}: 1 machine {one.step_seconds * 1e3:.0f} "
                  f"ms; " + "; ".join(cells) + f"   [{paper}]")
    optional_sections(args)


def optional_sections(args: argparse.Namespace) -> None:
    if args.fashion:
        print("\n(d) Fashion-MNIST, locally connected network, to 88% test accuracy")
        time_to_target(args.data.resolve())
    if args.sandblaster:
        print(f"\n(e) Sandblaster L-BFGS, Fashion-MNIST locally connected network "
              f"(configs/fashion_mnist_local.toml), 1 shard + coordinator, batch "
              f"{args.sb_batch} in units of 250, {args.sb_steps} iterations per run")
        sandblaster_partitions(args.data.resolve(), args.sb_batch, args.sb_steps,
                               args.sb_repeats)


def time_to_target(fashion: Path) -> None:
    """(d): both runs through the command line, in this order, each until 88% or 600 s."""
    import tempfile

    runs = [("Downpour 1 shard + 2 replicas x 2 partitions", ["mpiexec", "-n", "5"],
             "fashion_mnist_local_partitioned.toml"),
            ("single-process trainer", [], "fashion_mnist_local.toml")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, launcher, name in runs:
            out = Path(tmp) / name
            cmd = [*launcher, sys.executable, "-m", "distbelief", "train",
                   REPO / "configs" / name, "--set", f'data.path="{fashion}"', "--set",
                   f'run.out_dir="{out}"', "--set", "run.checkpoint_every_seconds=0"]
            load = os.getloadavg()[0]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                  check=False)
            if proc.returncode != 0:
                sys.exit(f"{label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
            summary = json.loads((out / "summary.json").read_text())
            results.append(summary["time_to_target"])
            shown = ("not reached" if summary["time_to_target"] is None
                     else f"{summary['time_to_target']:.1f} s")
            print(f"{label:<46} 88% in {shown} ({summary['steps']} steps, final "
                  f"{summary['final_test_accuracy']:.4f}; load average {load:.2f})")
    if None not in results:
        print(f"ratio Downpour/partitioned to single-process: {results[0] / results[1]:.2f}")


def sandblaster_partitions(fashion: Path, batch: int, steps: int, repeats: int) -> None:
    """(e): the command line's Sandblaster with 2 replicas x P partitions, P = 1 and 2
    interleaved; median seconds per gradient evaluation (metrics.jsonl's
    evaluation_seconds, every evaluation of the run) and the ratio."""
    import tempfile

    per_layout: dict[int, list[float]] = {1: [], 2: []}
    cpu_per_layout: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for partitions in (1, 2):
                out = Path(tmp) / f"p{partitions}_{repeat}"
                sets = ['optimizer.algorithm="sandblaster"', f'data.path="{fashion}"',
                        f"data.batch_size={batch}", "optimizer.work_unit_size=250",
                        "cluster.ps_shards=1", f"cluster.partitions={partitions}",
                        f"run.max_steps={steps}", "run.max_seconds=900",
                        "run.target_accuracy=0.999", "run.eval_every_seconds=1000",
                        "run.checkpoint_every_seconds=0", f'run.out_dir="{out}"']
                ranks = 2 + 2 * partitions
                cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "distbelief",
                       "train", REPO / "configs" / "fashion_mnist_local.toml",
                       *[a for o in sets for a in ("--set", o)]]
                env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
                load = os.getloadavg()[0]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                                      env=env, check=False)
                if proc.returncode != 0:
                    sys.exit(f"Sandblaster P={partitions} failed:\n{proc.stdout[-2000:]}\n"
                             f"{proc.stderr[-2000:]}")
                metrics = [json.loads(line) for line in
                           (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
                seconds = [s for m in metrics if m["kind"] == "train"
                           for s in m["evaluation_seconds"]]
                summary = json.loads((out / "summary.json").read_text())
                median = statistics.median(seconds)
                per_layout[partitions].append(median)
                # CPU seconds of every replica rank per evaluation: the work, which other
                # jobs on the machine do not change (a share of the cores does).
                cpu = sum(r["cpu_seconds"] for r in summary["replicas"]) / len(seconds)
                cpu_per_layout[partitions].append(cpu)
                units = [r["units_committed"] for r in summary["replicas"]
                         if r.get("partition", 0) == 0]
                print(f"  2 replicas x {partitions} partition(s), {ranks} ranks: median "
                      f"{median:.3f} s per gradient evaluation ({len(seconds)} evaluations, "
                      f"{batch / median:,.0f} examples/s), replicas' CPU {cpu:.3f} s per "
                      f"evaluation, units per replica {units}, loss "
                      f"{summary['final_loss']:.4f} (load average {load:.2f})")
    one, two = (statistics.median(per_layout[p]) for p in (1, 2))
    cpu_one, cpu_two = (statistics.median(cpu_per_layout[p]) for p in (1, 2))
    print(f"  seconds per gradient evaluation, 2x2 / 2x1: {two:.3f} / {one:.3f} = "
          f"{two / one:.2f}; replicas' CPU seconds per evaluation {cpu_two:.3f} / "
          f"{cpu_one:.3f} = {cpu_two / cpu_one:.2f} (load average now "
          f"{os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
