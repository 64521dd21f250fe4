"""RMA benchmarks for the parameter server: bandwidth against a memory copy, and the cost of
keeping MPI progressing on the shard.

    mpiexec -n 2 python benchmarks/bench_rma.py          # the report (1 shard, 1 replica)
    mpiexec -n 3 python benchmarks/bench_rma.py --progress --sleep adaptive --compute 3 \
        --pull overlapped --seconds 1.5                  # one progress configuration
    python benchmarks/bench_rma.py --sweep --seconds 1.5 --repeat 2 --pull overlapped
                                                         # all of them (launches mpiexec)

The report, for the reference MLP's 669,706 float32 parameters (2.7 MB): np.copyto of the
same bytes in the same run; raw Lock + Accumulate / Get / Get_accumulate(NO_OP) + Unlock
epochs against a spinning target; push, pull and push_pull through ParameterClient on
the RMA transport (the shard on its default Backoff) and on the shared-memory transport
(where a push includes the Adagrad step), each with its ratio to the copy; then steps/s,
time in pushes and pulls per step and the shard's CPU share (time.process_time over wall
time), pushing back to back, with a compute step between pushes, and idle.

`--progress` runs one configuration: how the shard polls (`--poll`: counters = serve_once
alone, test = Request.Test on a pending receive first, iprobe = Comm.Iprobe first), how it
waits between polls (`--sleep`: seconds, `adaptive` = the default Backoff, `adaptive:MAX`
= Backoff(max_sleep_s=MAX)), and what a replica step is: `--compute N` float32 matmuls
(256x784 @ 784x512), `--pace S` seconds of sleep (compute without CPU use), then a push
and `--pull` none / sequential (push, then pull) / overlapped (push_pull).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

N_PARAMS = 669_706  # the reference MLP 784-512-512-10
PAYLOAD = N_PARAMS * 4


def _mpi():
    from mpi4py import MPI  # imported late: the --sweep driver must not initialise MPI
    return MPI


def _adagrad(size: int):
    """The shards' optimizer: Adagrad, the DistBelief default (its fold is part of the cost)."""
    from distbelief.model.optimizers import make_optimizer
    return make_optimizer(True, 0.01, size)


def memcopy_rate(seconds: float = 0.5) -> float:
    """Payload bytes per second of np.copyto between two 2.7 MB vectors."""
    src = np.random.default_rng(0).random(N_PARAMS, dtype=np.float32)
    dst = np.empty_like(src)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        np.copyto(dst, src)
        n += 1
    return n * PAYLOAD / (time.perf_counter() - t0)


def raw_epochs(op: str, seconds: float) -> float:
    """Rank 1 runs lock/op/unlock epochs on rank 0's window while rank 0 spins in
    Request.Test; returns payload bytes/s on rank 1 (0 elsewhere). Collective over world."""
    MPI = _mpi()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    win = MPI.Win.Allocate(PAYLOAD if rank == 0 else 0, 4, comm=comm)
    buf = np.ones(N_PARAMS, dtype=np.float32)
    res = np.empty_like(buf)
    rate = 0.0
    if rank == 0:
        done = comm.Ibarrier()
        while not done.Test():
            pass
    else:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            win.Lock(0, MPI.LOCK_SHARED)
            if op == "accumulate":
                win.Accumulate(buf, 0, op=MPI.SUM)
            elif op == "get":
                win.Get(res, 0)
            else:
                win.Get_accumulate(buf, res, 0, op=MPI.NO_OP)
            win.Unlock(0)
            n += 1
        rate = n * PAYLOAD / (time.perf_counter() - t0)
        if rank == 1:
            comm.Ibarrier().Wait()
    comm.Barrier()
    win.Free()
    comm.Free()
    return rate


class Poller:
    """A shard service loop variant: an optional extra progress call, then serve_once,
    then a fixed sleep or the adaptive Backoff."""

    def __init__(self, comm, poll: str, sleep: str):
        from distbelief.runtime.backoff import Backoff
        self.MPI = _mpi()
        self.comm = comm
        self.poll = poll
        adaptive = sleep.startswith("adaptive")
        self.sleep = None if adaptive else float(sleep)
        self.backoff = Backoff()
        if ":" in sleep:  # adaptive:MAX to try other caps
            self.backoff = Backoff(max_sleep_s=float(sleep.split(":")[1]))
        self._buf = np.zeros(1, dtype=np.int8)
        # Never matched: Test on it only drives MPI progress.
        self._req = comm.Irecv(self._buf, source=self.MPI.ANY_SOURCE, tag=31337)

    def serve(self, shard) -> tuple[float, float]:
        """Serve until all clients finish; returns (cpu seconds, wall seconds)."""
        c0, t0 = time.process_time(), time.perf_counter()
        while not shard.finished:
            if self.poll == "test":
                self._req.Test()
            elif self.poll == "iprobe":
                self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=31337)
            did = shard.serve_once()
            if self.sleep is None:
                self.backoff.reset() if did else self.backoff.wait()
            elif self.sleep > 0:
                time.sleep(self.sleep)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        self._req.Cancel()
        self._req.Wait()
        return cpu, wall


def progress_run(poll: str, sleep: str, seconds: float, compute: int, pull: str,
                 pace: float = 0.0, size: int = N_PARAMS, transport: str = "rma"
                 ) -> dict | None:
    """One shard (rank 0) and world_size - 1 replicas pushing for `seconds`, on the
    parameter server's `transport` ("rma": what the shard's polling is about).

    Collective over COMM_WORLD. Returns the summary on rank 0, None elsewhere.
    """
    MPI = _mpi()
    from distbelief.ps.endpoint import ParameterServerShard, ServerSpec
    from distbelief.ps.transport import open_parameter_server
    from distbelief.runtime.communicators.topology import Topology
    world = MPI.COMM_WORLD
    topology = Topology(world.Get_size(), world.Get_rank(), 1)
    endpoint = open_parameter_server(world, ServerSpec(topology, size, _adagrad),
                                     transport=transport)
    mine = {"pushes": 0, "steps_s": 0.0}
    if isinstance(endpoint, ParameterServerShard):
        poller = Poller(world, poll, sleep)
        cpu, wall = poller.serve(endpoint)
        mine.update(cpu=cpu, wall=wall, folds=endpoint.stats.folds,
                    hold_max_ms=endpoint.stats.hold_max_s * 1e3,
                    hold_mean_ms=endpoint.stats.hold_total_s * 1e3
                    / max(endpoint.stats.exclusive_sections, 1),
                    wait_max_ms=endpoint.stats.wait_max_s * 1e3)
    else:
        grad = np.ones(size, dtype=np.float32)
        params = np.empty(size, dtype=np.float32)
        a = np.ones((256, 784), dtype=np.float32)
        b = np.ones((784, 512), dtype=np.float32)
        n, t_push, t_pull, t0 = 0, 0.0, 0.0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(compute):
                a @ b
            if pace:
                time.sleep(pace)  # a step's compute without using the CPU
            t1 = time.perf_counter()
            if pull == "overlapped":
                endpoint.push_pull(grad, params)
            else:
                endpoint.push(grad)
            t2 = time.perf_counter()
            if pull == "sequential":
                endpoint.pull(params)
            t_push += t2 - t1
            t_pull += time.perf_counter() - t2
            n += 1
        mine.update(pushes=n, steps_s=n / (time.perf_counter() - t0),
                    push_ms=t_push / n * 1e3, pull_ms=t_pull / n * 1e3)
    endpoint.free()
    everyone = world.gather(mine, root=0)
    if world.Get_rank() != 0:
        return None
    shard, replicas = everyone[0], everyone[1:]
    pushes = sum(r["pushes"] for r in replicas)
    return {"poll": poll, "sleep": sleep, "replicas": len(replicas), "compute": compute,
            "pull": pull, "pushes_per_s": pushes / seconds,
            "GB_per_s": pushes * size * 4 / seconds / 1e9,
            "steps_per_s_per_replica": sum(r["steps_s"] for r in replicas) / len(replicas),
            "push_ms": sum(r["push_ms"] for r in replicas) / len(replicas),
            "pull_ms": sum(r["pull_ms"] for r in replicas) / len(replicas),
            "shard_cpu_pct": 100 * shard["cpu"] / shard["wall"], "folds": shard["folds"],
            "hold_mean_ms": shard["hold_mean_ms"], "hold_max_ms": shard["hold_max_ms"],
            "wait_max_ms": shard["wait_max_ms"]}


def client_rates(seconds: float, transport: str) -> dict[str, float]:
    """Payload bytes/s of push, pull and push_pull through ParameterClient on `transport`,
    the shard on its default Backoff (on "shared" a push includes the Adagrad step, which
    the replica does itself). Collective over COMM_WORLD; meaningful on rank 1."""
    MPI = _mpi()
    from distbelief.ps.endpoint import ParameterServerShard, ServerSpec
    from distbelief.ps.transport import open_parameter_server
    from distbelief.runtime.communicators.topology import Topology
    world = MPI.COMM_WORLD
    topology = Topology(world.Get_size(), world.Get_rank(), 1)
    endpoint = open_parameter_server(world, ServerSpec(topology, N_PARAMS, _adagrad),
                                     transport=transport)
    rates: dict[str, float] = {}
    if isinstance(endpoint, ParameterServerShard):
        endpoint.serve()
    else:
        vec = np.ones(N_PARAMS, dtype=np.float32)
        out = np.empty_like(vec)
        actions = {"push": lambda: endpoint.push(vec), "pull": lambda: endpoint.pull(out),
                   "push_pull": lambda: endpoint.push_pull(vec, out)}
        for name, action in actions.items():
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                action()
                n += 1
            # push_pull moves the payload both ways
            rates[name] = n * PAYLOAD * (2 if name == "push_pull" else 1) / (
                time.perf_counter() - t0)
    endpoint.free()
    return rates


REPORT_STEPS = [  # (label, matmuls per step, pull mode, pace seconds, transport)
    ("back-to-back push", 0, "none", 0.0, "rma"),
    ("3 matmuls + push_pull", 3, "overlapped", 0.0, "rma"),
    ("3 matmuls + push + pull", 3, "sequential", 0.0, "rma"),
    ("idle: a push_pull every 0.2 s", 0, "overlapped", 0.2, "rma"),
    ("shared: back-to-back push", 0, "none", 0.0, "shared"),
    ("shared: 3 matmuls + push_pull", 3, "overlapped", 0.0, "shared"),
    ("shared: idle, push_pull every 0.2 s", 0, "overlapped", 0.2, "shared"),
]


def report(seconds: float, repeat: int) -> None:
    """The default report; run with mpiexec -n 2. Each quantity is measured `repeat`
    times in interleaved rounds (the machine is shared): bandwidths show the best round,
    the progress scheme the median."""
    MPI = _mpi()
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        if world.Get_rank() == 0:
            print("run the report with mpiexec -n 2 (1 shard + 1 replica)", file=sys.stderr)
        sys.exit(2)
    rank = world.Get_rank()
    bandwidth: dict[str, list[float]] = {}
    steps: dict[str, list[dict]] = {label: [] for label, *_ in REPORT_STEPS}
    for _ in range(repeat):
        measured = {"np.copyto (same bytes, same process)": memcopy_rate(seconds)}
        for op in ("accumulate", "get", "get_accumulate"):
            measured[f"raw Lock+{op}+Unlock, target spinning"] = raw_epochs(op, seconds)
        for name, rate in client_rates(seconds, "rma").items():
            measured[f"ParameterClient.{name}, rma"] = rate
        for name, rate in client_rates(seconds, "shared").items():
            adagrad = " (+Adagrad)" if "push" in name else ""
            measured[f"ParameterClient.{name}, shared{adagrad}"] = rate
        for key, value in measured.items():
            bandwidth.setdefault(key, []).append(value)
        for label, compute, pull, pace, transport in REPORT_STEPS:
            r = progress_run("counters", "adaptive", max(seconds, 5 * pace), compute, pull,
                             pace, transport=transport)
            if r is not None:
                steps[label].append(r)
    if rank == 0:
        world.send(steps, dest=1)
        return
    steps = world.recv(source=0)
    best = {k: max(v) for k, v in bandwidth.items()}
    copy = best["np.copyto (same bytes, same process)"]
    print(f"payload {PAYLOAD / 1e6:.2f} MB (reference MLP, {N_PARAMS} float32), 1 shard + "
          f"1 replica, best of {repeat} rounds of {seconds} s")
    print(f"{'operation':48s} {'GB/s':>7s} {'vs copy':>8s}")
    for name, rate in best.items():
        print(f"{name:48s} {rate / 1e9:7.2f} {rate / copy:8.2f}")
    print(f"progress scheme: serve_once + Backoff (50 us doubling to 0.5 ms), median of "
          f"{repeat} (shared: the replica folds; the shard only watches)")
    for label, runs in steps.items():
        med = {k: float(np.median([r[k] for r in runs]))
               for k in ("steps_per_s_per_replica", "push_ms", "pull_ms", "shard_cpu_pct",
                         "hold_mean_ms", "hold_max_ms", "wait_max_ms")}
        print(f"  {label:36s} {med['steps_per_s_per_replica']:6.0f} steps/s, "
              f"RMA {med['push_ms'] + med['pull_ms']:.2f} ms/step, shard CPU "
              f"{med['shard_cpu_pct']:4.1f}%, exclusive held {med['hold_mean_ms']:.2f} ms "
              f"(max {med['hold_max_ms']:.2f}), lock wait max {med['wait_max_ms']:.2f} ms")


SWEEP_SCHEMES = [("counters", "0"), ("counters", "5e-05"), ("counters", "0.0001"),
                 ("counters", "0.001"), ("counters", "adaptive:0.00025"),
                 ("counters", "adaptive"), ("counters", "adaptive:0.001"), ("test", "0"),
                 ("test", "0.001"), ("iprobe", "0"), ("iprobe", "0.001")]
SWEEP_COLUMNS = ["pushes_per_s", "GB_per_s", "steps_per_s_per_replica", "push_ms", "pull_ms",
                 "shard_cpu_pct", "hold_mean_ms"]


def _one_progress_run(n_ranks: int, poll: str, sleep: str, seconds: float, compute: int,
                      pull: str) -> dict | None:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = ["mpiexec", "-n", str(n_ranks), sys.executable, __file__, "--progress",
           "--poll", poll, "--sleep", sleep, "--seconds", str(seconds),
           "--compute", str(compute), "--pull", pull, "--json"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env,
                         timeout=120)
    if out.returncode:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep(seconds: float, replicas: list[int], computes: list[int], pull: str,
          repeat: int) -> None:
    """Launch one mpiexec per progress configuration, `repeat` rounds interleaved (the
    machine is shared), and print the median of each column (no MPI in this process)."""
    configs = [(compute, n_rep, poll, sleep) for compute in computes for n_rep in replicas
               for poll, sleep in SWEEP_SCHEMES]
    results: dict[tuple, list[dict]] = {c: [] for c in configs}
    for _ in range(repeat):
        for compute, n_rep, poll, sleep in configs:
            r = _one_progress_run(n_rep + 1, poll, sleep, seconds, compute,
                                  pull if compute else "none")
            if r is not None:
                results[(compute, n_rep, poll, sleep)].append(r)
    print(f"median of {repeat} runs of {seconds} s; compute = matmuls per step "
          f"(0: back-to-back pushes), pull = {pull}")
    print(f"{'poll':9s} {'sleep':16s} {'repl':>4s} {'comp':>4s} {'pushes/s':>9s} {'GB/s':>6s} "
          f"{'steps/s':>8s} {'push_ms':>7s} {'pull_ms':>7s} {'shardCPU%':>9s} {'hold_ms':>7s}")
    for (compute, n_rep, poll, sleep), runs in results.items():
        if not runs:
            continue
        med = {k: float(np.median([r[k] for r in runs])) for k in SWEEP_COLUMNS}
        print(f"{poll:9s} {sleep:16s} {n_rep:4d} {compute:4d} {med['pushes_per_s']:9.0f} "
              f"{med['GB_per_s']:6.2f} {med['steps_per_s_per_replica']:8.0f} "
              f"{med['push_ms']:7.2f} {med['pull_ms']:7.2f} {med['shard_cpu_pct']:9.1f} "
              f"{med['hold_mean_ms']:7.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    p.add_argument("--progress", action="store_true", help="one progress configuration")
    p.add_argument("--sweep", action="store_true", help="all progress configurations")
    p.add_argument("--poll", choices=["counters", "test", "iprobe"], default="counters")
    p.add_argument("--sleep", default="adaptive", help="seconds between polls, or adaptive")
    p.add_argument("--compute", type=int, default=0, help="matmuls per step (0: none)")
    p.add_argument("--pace", type=float, default=0.0,
                   help="seconds each replica sleeps per step (compute without CPU use)")
    p.add_argument("--pull", choices=["none", "sequential", "overlapped"], default="none",
                   help="per step: push only, push then pull, or push_pull")
    p.add_argument("--replicas", default="1,2", help="sweep: replica counts")
    p.add_argument("--computes", default="0,3", help="sweep: matmuls per step")
    p.add_argument("--repeat", type=int, default=3, help="rounds (best or median)")
    p.add_argument("--transport", choices=["rma", "shared"], default="rma",
                   help="--progress: the parameter server's transport")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.sweep:
        sweep(args.seconds, [int(x) for x in args.replicas.split(",")],
              [int(x) for x in args.computes.split(",")], args.pull, args.repeat)
    elif args.progress:
        r = progress_run(args.poll, args.sleep, args.seconds, args.compute, args.pull,
                         args.pace, transport=args.transport)
        if r is not None:
            print(json.dumps(r) if args.json else r, flush=True)
    else:
        report(args.seconds, args.repeat)


if __name__ == "__main__":
    main()
