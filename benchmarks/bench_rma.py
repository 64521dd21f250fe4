"""RMA benchmarks for the parameter server: bandwidth against a memory copy, and the cost of
keeping MPI progressing on the shard.

    mpiexec -n 2 python benchmarks/bench_rma.py             # the report (1 shard, 1 replica)
    mpiexec -n 3 python benchmarks/bench_rma.py --progress --poll counters --sleep adaptive
    python benchmarks/bench_rma.py --sweep                   # launches the progress sweep

Default report, for the reference MLP's 669,706 float32 parameters (2.7 MB):
- push and pull bandwidth through ParameterClient (the shard serving with its default
  back-off), raw Accumulate / Get / Get_accumulate(NO_OP) epochs against a spinning target,
  and np.copyto of the same bytes in the same run, with the ratio;
- pushes/s and the shard's CPU share (time.process_time over wall time) for the chosen
  progress scheme, pushing back to back and with a compute step between pushes.

`--progress` runs one progress configuration: how the shard polls (`--poll`: counters =
serve_once alone, test = Request.Test on a pending receive first, iprobe = Comm.Iprobe
first) and how it waits between polls (`--sleep`: seconds, or `adaptive` = Backoff).
Replicas push for `--seconds`; with `--compute N` each replica does N float32 matmuls
(256x784 @ 784x512) before each push + pull, like a training step.
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


class _SGD:
    """Stand-in optimizer (distbelief.optimizers may not exist yet): params -= lr * grad."""

    def __init__(self, size: int):
        self.lr = np.float32(1e-6)

    def step(self, params: np.ndarray, grad: np.ndarray) -> None:
        params -= self.lr * grad


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
        from distbelief.parameter_server import Backoff
        self.MPI = _mpi()
        self.comm = comm
        self.poll = poll
        self.sleep = None if sleep == "adaptive" else float(sleep)
        self.backoff = Backoff()
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
                 size: int = N_PARAMS) -> dict | None:
    """One shard (rank 0) and world_size - 1 replicas pushing for `seconds`.

    Collective over COMM_WORLD. Returns the summary on rank 0, None elsewhere.
    """
    MPI = _mpi()
    from distbelief.parameter_server import ParameterServerShard, open_parameter_server
    from distbelief.topology import Topology
    world = MPI.COMM_WORLD
    topology = Topology(world.Get_size(), world.Get_rank(), 1)
    endpoint = open_parameter_server(world, topology, size, _SGD)
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


def client_rates(seconds: float) -> tuple[float, float]:
    """(push, pull) payload bytes/s through ParameterClient with the shard on its default
    Backoff. Collective over COMM_WORLD; meaningful on rank 1."""
    MPI = _mpi()
    from distbelief.parameter_server import ParameterServerShard, open_parameter_server
    from distbelief.topology import Topology
    world = MPI.COMM_WORLD
    topology = Topology(world.Get_size(), world.Get_rank(), 1)
    endpoint = open_parameter_server(world, topology, N_PARAMS, _SGD)
    rates = (0.0, 0.0)
    if isinstance(endpoint, ParameterServerShard):
        endpoint.serve()
    else:
        vec = np.ones(N_PARAMS, dtype=np.float32)
        measured = []
        for action in (endpoint.push, endpoint.pull):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                action(vec)
                n += 1
            measured.append(n * PAYLOAD / (time.perf_counter() - t0))
        rates = (measured[0], measured[1])
    endpoint.free()
    return rates


def report(seconds: float) -> None:
    """The default report; run with mpiexec -n 2."""
    MPI = _mpi()
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        if world.Get_rank() == 0:
            print("run the report with mpiexec -n 2 (1 shard + 1 replica)", file=sys.stderr)
        sys.exit(2)
    rank = world.Get_rank()
    copy = memcopy_rate() if rank == 1 else 0.0
    raw = {op: raw_epochs(op, seconds) for op in ("accumulate", "get", "get_accumulate")}
    push, pull = client_rates(seconds)
    chosen = [progress_run("counters", "adaptive", seconds, compute, pull)
              for compute, pull in ((0, "none"), (3, "sequential"), (3, "overlapped"))]
    if rank != 1:
        world.send(chosen, dest=1)
        return
    chosen = world.recv(source=0)
    print(f"payload {PAYLOAD / 1e6:.2f} MB (reference MLP, {N_PARAMS} float32), "
          f"1 shard + 1 replica, {seconds:.1f} s per measurement")
    print(f"{'operation':44s} {'GB/s':>7s} {'vs copy':>8s}")
    rows = [("np.copyto (same bytes, this process)", copy),
            ("raw Lock+Accumulate(SUM)+Unlock, target spins", raw["accumulate"]),
            ("raw Lock+Get+Unlock, target spins", raw["get"]),
            ("raw Lock+Get_accumulate(NO_OP)+Unlock, spins", raw["get_accumulate"]),
            ("ParameterClient.push (shard: default Backoff)", push),
            ("ParameterClient.pull (shard: default Backoff)", pull)]
    for name, rate in rows:
        print(f"{name:44s} {rate / 1e9:7.2f} {rate / copy:8.2f}")
    print("chosen progress scheme (serve_once + adaptive Backoff):")
    for r in chosen:
        what = ("back-to-back pushes" if not r["compute"] else
                f"step: {r['compute']} matmuls, push, pull ({r['pull']})")
        print(f"  {what}: {r['pushes_per_s']:.0f} pushes/s, shard CPU "
              f"{r['shard_cpu_pct']:.1f}%, push {r['push_ms']:.2f} ms + pull "
              f"{r['pull_ms']:.2f} ms per step, {r['folds']} folds; exclusive sections held "
              f"{r['hold_mean_ms']:.2f} ms mean ({r['hold_max_ms']:.2f} max), lock wait max "
              f"{r['wait_max_ms']:.2f} ms")


def sweep(seconds: float, replicas: list[int], computes: list[int], pull: str) -> None:
    """Launch one mpiexec per progress configuration and print a table (no MPI here)."""
    polls = ["counters", "test", "iprobe"]
    sleeps = ["0", "5e-05", "0.0001", "0.001", "adaptive"]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    print(f"{'poll':9s} {'sleep':9s} {'repl':>4s} {'comp':>4s} {'pushes/s':>9s} "
          f"{'GB/s':>6s} {'steps/s':>8s} {'push_ms':>7s} {'pull_ms':>7s} {'shardCPU%':>9s} "
          f"{'folds':>6s} {'hold_ms':>7s}",
          flush=True)
    for compute in computes:
        for n_rep in replicas:
            for poll in polls:
                for sleep in sleeps:
                    if poll != "counters" and sleep not in ("0", "0.001"):
                        continue  # the poll call only matters at the extremes
                    cmd = ["mpiexec", "-n", str(n_rep + 1), sys.executable, __file__,
                           "--progress", "--poll", poll, "--sleep", sleep,
                           "--seconds", str(seconds), "--compute", str(compute),
                           "--pull", pull if compute else "none", "--json"]
                    out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env,
                                         timeout=120)
                    if out.returncode:
                        print(out.stderr[-2000:], file=sys.stderr)
                        continue
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    print(f"{poll:9s} {sleep:9s} {n_rep:4d} {compute:4d} "
                          f"{r['pushes_per_s']:9.0f} {r['GB_per_s']:6.2f} "
                          f"{r['steps_per_s_per_replica']:8.0f} {r['push_ms']:7.2f} "
                          f"{r['pull_ms']:7.2f} {r['shard_cpu_pct']:9.1f} "
                          f"{r['folds']:6d} {r['hold_mean_ms']:7.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--progress", action="store_true", help="one progress configuration")
    p.add_argument("--sweep", action="store_true", help="all progress configurations")
    p.add_argument("--poll", choices=["counters", "test", "iprobe"], default="counters")
    p.add_argument("--sleep", default="adaptive", help="seconds between polls, or adaptive")
    p.add_argument("--compute", type=int, default=0, help="matmuls per step (0: none)")
    p.add_argument("--pull", choices=["none", "sequential", "overlapped"], default="none",
                   help="per step: push only, push then pull, or push_pull")
    p.add_argument("--replicas", default="1,2", help="sweep: replica counts")
    p.add_argument("--computes", default="0,3", help="sweep: matmuls per step")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.sweep:
        sweep(args.seconds, [int(x) for x in args.replicas.split(",")],
              [int(x) for x in args.computes.split(",")], args.pull)
    elif args.progress:
        r = progress_run(args.poll, args.sleep, args.seconds, args.compute, args.pull)
        if r is not None:
            print(json.dumps(r) if args.json else r, flush=True)
    else:
        report(args.seconds)


if __name__ == "__main__":
    main()
