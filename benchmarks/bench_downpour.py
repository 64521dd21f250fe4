"""Downpour SGD on Fashion-MNIST with the reference MLP 784-512-512-10 (Adagrad lr 0.02 on
the shard, batch 64): against PyTorch CPU and against distbelief's single-process loop.

    python benchmarks/bench_downpour.py                    # everything, ~6 minutes
    python benchmarks/bench_downpour.py --only throughput  # one section: target,
                                                           # throughput, replicas, bandwidth

Sections (each Downpour run is `mpiexec -n N python -m mpi4py bench_downpour.py --worker`,
which calls distbelief.algorithms.downpour.train on configs/fashion_mnist_downpour.toml, so an
exception on any rank aborts the job):
(a) target: wall time to `--target` test accuracy, 1 shard + 1 replica (2 ranks on the 2
    cores, shared-memory transport) with run.threads = T on every rank, interleaved seed by
    seed with benchmarks/torch_peer.py (same MLP, torch.optim.Adagrad lr 0.02, batch 64)
    with T threads, T = 1 and 2; both evaluate on
    the whole test set every `--eval-every` s (Downpour on shard 0, in a thread, without
    pausing the replica; torch pauses to evaluate). Median of `--seeds` seeds.
(b) throughput: the replica's samples/s (its steps x 64 / its training wall time, RMA
    included) against the single-process loop of bench_train.py (next_batch,
    loss_and_grad, Adagrad step; no warm-up excluded in either), same number of steps,
    1 thread; overhead = 1 - replica / single. n_fetch = n_push = 1, 2, 4, 8 with the
    read-your-writes fetch the CLI uses, and 1/1 with optimizer.fetch = "asynchronous"
    for comparison, on the transport a one-node job gets (shared memory); then 1/1 with
    each optimizer.fetch and 4/4 on the RMA transport that multi-node jobs use
    (DISTBELIEF_PS_TRANSPORT=rma). "comm ms/step" is the replica's time in pushes and
    fetches per step: on shared memory it includes the optimizer step the replica applies
    itself (the single-process loop pays that too). Best of `--repeats` interleaved rounds.
(c) replicas: 2 and 3 replicas + 1 shard (3 and 4 ranks on 2 cores: OVERSUBSCRIBED):
    total and per-replica samples/s, staleness, and time to the target.
(d) bandwidth: benchmarks/bench_rma.py's report (push and pull of the 2.7 MB parameter
    vector against np.copyto), and the RMA rate seen inside the training runs of (b).
(e) interleaved: the overhead of (b) at n_fetch = n_push = 1 measured inside one replica
    process (2 ranks: the shard serves as in Downpour), alternating blocks of `--block`
    single-process steps (next_batch, loss_and_grad, Adagrad on private parameters) and
    Downpour steps (next_batch, loss_and_grad, push_pull_own: push, then read-your-writes
    catch_up), on
    both transports, then on RMA with optimizer.fetch = "asynchronous" (push_pull only)
    and "overlapped" (push_pull_overlapped, transfers completed during the next step);
    overhead = 1 - 1 / (median over pairs of adjacent blocks of the
    Downpour block's time over the single-process block's).
    Both kinds see the same load, so this figure holds still on a busy machine where the
    separate runs of (b) do not.
(f) transports (issue 17): 1 shard + 2 replicas, samples/s per replica on shared memory,
    RMA, RMA through MPI's network module (MPIR_CVAR_NOLOCAL=1) and 3 fake hosts (hydra's
    `-launcher fork -hosts`, which picks RMA by itself), with each optimizer.fetch, each
    as a ratio to shared memory in the same sweep; then time to the target, 1 shard + 1
    replica, shared memory and RMA with each optimizer.fetch.
(g) osc (issue 28; run it in an Open MPI environment): 1 shard + 2 replicas on the RMA
    transport, samples/s per replica with Open MPI's osc/ucx forced onto UCX's
    shared-memory transports (the component InfiniBand clusters use) against
    `--mca osc ^ucx` (osc/sm or osc/rdma), interleaved rounds, best kept, as a ratio.
(h) push-dtype (issue 28): time and samples to the target with optimizer.push_dtype =
    "bfloat16" against "float32", RMA transport, 1 shard + `--replicas` replica(s), seed
    by seed in turn (the order alternating), medians and their ratios, with the bytes
    each pushed and pulled per sample. `--round-pulls` adds a third run whose replicas
    round every pulled parameter vector to bfloat16 (the numbers a narrowed pull would
    give, not its speed: nothing narrower moves). Then, as (e), inside one replica
    process against one shard (2 ranks, RMA): `--blocks` x `--block` read-your-writes
    Downpour steps alternating between a float32 and a bfloat16 parameter server opened
    side by side, and the median ratio of adjacent blocks' times, which holds still on
    a busy machine where the separate runs do not.

The machine is shared: each row shows the load average just before it was measured, and
the figures to quote are the best rounds (throughput) taken when the load was lowest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distbelief.algorithms.downpour.options import FETCHES

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "fashion_mnist_downpour.toml"
BENCH = Path(__file__).resolve().parent
BATCH = 64
N_PARAMS = 669_706


# -- the Downpour worker (runs under mpiexec) ------------------------------------------------


def downpour_worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    from distbelief.algorithms import downpour
    from distbelief.config import load_config

    overrides = [f'data.path="{args.data.resolve()}"', f'run.out_dir="{args.out}"',
                 f"run.threads={args.threads}", f"run.seed={args.seed}",
                 f"run.max_steps={args.steps}", f"run.max_seconds={args.max_seconds}",
                 f"run.target_accuracy={args.target}", f"run.eval_every_seconds={args.eval_every}",
                 f"optimizer.n_fetch={args.n_fetch}", f"optimizer.n_push={args.n_push}",
                 f'optimizer.push_dtype="{args.push_dtype}"']
    config = load_config(CONFIG, overrides + [f'optimizer.fetch="{args.fetch}"'])
    if args.round_pulls:
        round_pulls()
    summary = downpour.train(config, MPI.COMM_WORLD, stream=None)
    if summary is not None:
        print(json.dumps(summary))


def round_pulls() -> None:
    """(h) --round-pulls: every RMA pull rounds what it read to bfloat16, as a pull of
    bfloat16 parameters would give them (the read-your-writes fetch reads only by pull)."""
    from distbelief.model import kernels
    from distbelief.ps.rma_client import RmaClient

    pull = RmaClient.pull

    def rounded(self, out):
        versions = pull(self, out)
        kernels.bf16_round(out, out)
        return versions

    RmaClient.pull = rounded


def push_dtype_interleaved_worker(args: argparse.Namespace) -> None:
    """(h): rank 0 serves a float32 and a bfloat16 parameter server side by side, rank 1
    alternates blocks of Downpour steps (push_pull_own) on the one and the other."""
    import numpy as np
    from mpi4py import MPI

    from distbelief.algorithms.common import open_data
    from distbelief.algorithms.downpour.options import PUSH_DTYPES
    from distbelief.config import load_config
    from distbelief.data.hdf5 import TrainShard
    from distbelief.model.optimizers import make_optimizer
    from distbelief.ps.endpoint import ParameterServerShard, ServerSpec
    from distbelief.ps.transport import open_parameter_server
    from distbelief.runtime.backoff import PacedBackoff
    from distbelief.runtime.communicators.topology import Topology
    from distbelief.runtime.threads import set_blas_threads

    set_blas_threads(1)
    config = load_config(CONFIG, [f'data.path="{args.data.resolve()}"'])
    info, network = open_data(config)
    world = MPI.COMM_WORLD
    topology = Topology(world.Get_size(), world.Get_rank(), 1)
    lr = config.optimizer.learning_rate
    initial = network.init_params(0)
    servers = {dtype: open_parameter_server(world, ServerSpec(
                   topology, initial.size, lambda n: make_optimizer(True, lr, n), initial,
                   push_dtype=dtype), transport="rma")
               for dtype in PUSH_DTYPES}
    if isinstance(servers["float32"], ParameterServerShard):
        backoff = PacedBackoff()
        while not all(shard.finished for shard in servers.values()):
            traffic = [shard.serve_once() for shard in servers.values() if not shard.finished]
            backoff.reset() if any(traffic) else backoff.wait()
        for shard in servers.values():
            shard.free()
        return
    data = TrainShard(info, seed=0)
    params = {dtype: initial.copy() for dtype in servers}
    grad = np.zeros_like(initial)
    times: dict[str, list[float]] = {dtype: [] for dtype in servers}
    in_transport: dict[str, list[float]] = {dtype: [] for dtype in servers}
    for _ in range(args.blocks):
        for dtype, client in servers.items():
            t0, transport = time.perf_counter(), 0.0
            for _ in range(args.block):
                x, y = data.next_batch(BATCH)
                network.loss_and_grad(params[dtype], x, y, grad)
                t1 = time.perf_counter()
                client.push_pull_own(grad, params[dtype])
                transport += time.perf_counter() - t1
            times[dtype].append((time.perf_counter() - t0) / args.block)
            in_transport[dtype].append(transport / args.block)
    for client in servers.values():  # both finished before the collective frees
        client.finish()
    for client in servers.values():
        client.free()
    ratios = [b / f for f, b in zip(times["float32"], times["bfloat16"], strict=True)]
    print(json.dumps({dtype: statistics.median(t) for dtype, t in times.items()}
                     | {f"{dtype} transport": statistics.median(t)
                        for dtype, t in in_transport.items()}
                     | {"ratio": statistics.median(ratios)}))


def interleaved_worker(args: argparse.Namespace) -> None:
    """(e): rank 0 serves, rank 1 alternates single-process and Downpour blocks."""
    import numpy as np
    from mpi4py import MPI

    from distbelief.algorithms.common import open_data
    from distbelief.config import load_config
    from distbelief.data.hdf5 import TrainShard
    from distbelief.model.optimizers import make_optimizer
    from distbelief.ps.endpoint import ParameterServerShard, ServerSpec
    from distbelief.ps.transport import open_parameter_server
    from distbelief.runtime.backoff import PacedBackoff
    from distbelief.runtime.communicators.topology import Topology
    from distbelief.runtime.threads import set_blas_threads

    set_blas_threads(1)
    config = load_config(CONFIG, [f'data.path="{args.data.resolve()}"'])
    info, network = open_data(config)
    world = MPI.COMM_WORLD
    topology = Topology(world.Get_size(), world.Get_rank(), 1)
    lr = config.optimizer.learning_rate
    initial = network.init_params(0)
    endpoint = open_parameter_server(world, ServerSpec(
        topology, initial.size, lambda n: make_optimizer(True, lr, n), initial),
        transport=args.transport)
    if isinstance(endpoint, ParameterServerShard):
        endpoint.serve(PacedBackoff())
        endpoint.free()
        return
    data = TrainShard(info, seed=0)
    local, remote, spare = initial.copy(), initial.copy(), initial.copy()
    grad, in_flight = np.zeros_like(local), np.zeros_like(local)
    optimizer = make_optimizer(True, lr, local.size)
    times: dict[str, list[float]] = {"single": [], "downpour": []}
    for _ in range(args.blocks):
        for kind, block_times in times.items():
            t0 = time.perf_counter()
            for _ in range(args.block):
                x, y = data.next_batch(BATCH)
                if kind == "single":
                    network.loss_and_grad(local, x, y, grad)
                    optimizer.step(local, grad)
                elif args.fetch == "overlapped":
                    network.loss_and_grad(remote, x, y, grad)
                    target = remote if endpoint.pull_in_flight else spare
                    if endpoint.push_pull_overlapped(grad, target)[1]:
                        remote, spare = spare, remote
                    grad, in_flight = in_flight, grad
                elif args.fetch == "own_pushes":
                    network.loss_and_grad(remote, x, y, grad)
                    endpoint.push_pull_own(grad, remote)
                else:
                    network.loss_and_grad(remote, x, y, grad)
                    endpoint.push_pull(grad, remote)
            block_times.append((time.perf_counter() - t0) / args.block)
    endpoint.free()
    # Each Downpour block against the single-process block just before it: the pairs see
    # nearly the same load, so their ratio holds still while the load moves.
    ratios = [d / s for s, d in zip(times["single"], times["downpour"], strict=True)]
    print(json.dumps({kind: statistics.median(t) for kind, t in times.items()}
                     | {"ratio": statistics.median(ratios)}))


# -- runs (in subprocesses) --------------------------------------------------------------------


def run_json(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                            cwd=REPO, env=env)
    if result.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def downpour_run(args: argparse.Namespace, ranks: int = 2, threads: int = 1, seed: int = 0,
                 steps: int = 0, target: float = 0.99, n_fetch: int = 1, n_push: int = 1,
                 fetch: str = "own_pushes", eval_every: float = 1000.0,
                 transport: str = "auto", extra_env: dict | None = None,
                 launcher: tuple[str, ...] = (), push_dtype: str = "float32",
                 round_pulls: bool = False) -> dict:
    """One Downpour run; `transport` goes to the parameter server through
    $DISTBELIEF_PS_TRANSPORT ("auto": shared memory here, one node; "rma": the multi-node
    path); `extra_env` and `launcher` (mpiexec options) for the multi-node rows."""
    env = {**os.environ, "DISTBELIEF_PS_TRANSPORT": transport, **(extra_env or {})}
    with tempfile.TemporaryDirectory() as out:
        cmd = ["mpiexec", *launcher, "-n", str(ranks), sys.executable, "-m", "mpi4py",
               __file__,
               "--worker", "--data", str(args.data), "--out", out, "--threads", str(threads),
               "--seed", str(seed), "--steps", str(steps), "--target", str(target),
               "--n-fetch", str(n_fetch), "--n-push", str(n_push),
               "--eval-every", str(eval_every), "--max-seconds", str(args.max_seconds),
               "--push-dtype", push_dtype] + (["--round-pulls"] if round_pulls else [])
        return run_json(cmd + ["--fetch", fetch],
                        args.max_seconds + 300, env)


def single_process_rate(args: argparse.Namespace, steps: int) -> float:
    cmd = [sys.executable, str(BENCH / "bench_train.py"), "--worker", "throughput",
           "--threads", "1", "--data", str(args.data), "--steps", str(steps), "--warmup", "0"]
    return run_json(cmd, 600)["samples_per_second"]


def torch_time_to_target(args: argparse.Namespace, threads: int, seed: int) -> dict:
    cmd = [sys.executable, str(BENCH / "torch_peer.py"), "target", "--threads", str(threads),
           "--data", str(args.data), "--seed", str(seed), "--target", str(args.target),
           "--eval-every", str(args.eval_every), "--max-seconds", str(args.max_seconds)]
    return run_json(cmd, args.max_seconds + 300)


# -- sections -------------------------------------------------------------------------------


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def ratio(ours: float | None, peer: float | None) -> str:
    return "-" if ours is None or peer is None else f"{ours / peer:.2f}"


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "not reached" if value is None else format(value, spec)


def median_or_none(values: list[float | None]) -> float | None:
    return statistics.median(values) if values and None not in values else None


def section_target(args: argparse.Namespace) -> None:
    print(f"\n(a) wall time to {args.target} test accuracy, 1 shard + 1 replica (2 ranks) vs "
          f"torch, eval every {args.eval_every} s on the whole test set, median of "
          f"{args.seeds} seed(s)")
    print(f"{'threads':>7} {'downpour':>10} {'torch':>10} {'ratio':>6}   seconds")
    for threads in args.threads:
        before = load()
        ours, peer = [], []
        for s in range(args.seeds):  # interleaved, so that both see the same load
            ours.append(downpour_run(args, threads=threads, seed=s, target=args.target,
                                     eval_every=args.eval_every))
            peer.append(torch_time_to_target(args, threads, s))
        t_ours = median_or_none([r["time_to_target"] for r in ours])
        t_peer = median_or_none([r["time_to_target"] for r in peer])
        print(f"{threads:>7} {fmt(t_ours):>10} {fmt(t_peer):>10} {ratio(t_ours, t_peer):>6}   "
              f"(steps {[r['steps'] for r in ours]} vs {[r['steps'] for r in peer]}; "
              f"replica {ours[0]['replicas'][0]['samples_per_second']:,.0f} samples/s; "
              f"{ours[0]['shards'][0]['transport']}; {before})", flush=True)


def section_throughput(args: argparse.Namespace) -> list[dict]:
    own, asynchronous, overlapped = FETCHES
    cadences = [(1, 1, own, "auto"), (2, 2, own, "auto"), (4, 4, own, "auto"),
                (8, 8, own, "auto"), (1, 1, asynchronous, "auto"), (1, 1, own, "rma"),
                (1, 1, asynchronous, "rma"), (1, 1, overlapped, "rma"), (4, 4, own, "rma")]
    print(f"\n(b) replica samples/s vs the single-process loop, {args.steps} steps, 1 thread, "
          f"1 shard + 1 replica, best of {args.repeats} interleaved rounds")
    best_single = 0.0
    best: dict[tuple, dict] = {}
    loads = []
    for _ in range(args.repeats):
        loads.append(os.getloadavg()[0])
        best_single = max(best_single, single_process_rate(args, args.steps))
        for n_fetch, n_push, fetch, transport in cadences:
            r = downpour_run(args, steps=args.steps, n_fetch=n_fetch, n_push=n_push,
                             fetch=fetch, transport=transport)
            rep = r["replicas"][0] | {"transport": r["shards"][0]["transport"]}
            key = (n_fetch, n_push, fetch, transport)
            if key not in best or rep["samples_per_second"] > best[key]["samples_per_second"]:
                best[key] = {**rep, "load": os.getloadavg()[0]}
    print(f"single-process loop: {best_single:,.0f} samples/s (loads at round starts: "
          f"{', '.join(f'{x:.1f}' for x in loads)})")
    print(f"{'n_fetch/n_push':>14} {'transport':>9} {'fetch':>13} {'samples/s':>10} "
          f"{'overhead':>9} {'comm ms/step':>12} {'staleness':>9}")
    for (n_fetch, n_push, kind, _), rep in best.items():
        rate = rep["samples_per_second"]
        print(f"{f'{n_fetch}/{n_push}':>14} {rep['transport']:>9} {kind:>13} {rate:>10,.0f} "
              f"{1 - rate / best_single:>8.1%} {rep['rma_seconds'] / rep['steps'] * 1e3:>12.3f} "
              f"{rep['staleness']['mean']:>9.2f}   (load {rep['load']:.1f})")
    return [rep | {"key": key} for key, rep in best.items()]


def section_replicas(args: argparse.Namespace) -> None:
    print(f"\n(c) more replicas, 1 shard, 1 thread each: OVERSUBSCRIBED ({os.cpu_count()} "
          f"cores for 3 and 4 ranks); {args.steps} steps in total, then time to "
          f"{args.target}")
    print(f"{'replicas':>8} {'total samples/s':>15} {'per replica':>24} {'staleness':>9} "
          f"{'to target':>9}")
    for replicas in (1, 2, 3):
        before = load()
        r = downpour_run(args, ranks=replicas + 1, steps=args.steps)
        t = downpour_run(args, ranks=replicas + 1, target=args.target,
                         eval_every=args.eval_every)
        per = ", ".join(f"{x['samples_per_second']:,.0f}" for x in r["replicas"])
        total = r["steps"] * BATCH / max(x["train_seconds"] for x in r["replicas"])
        print(f"{replicas:>8} {total:>15,.0f} {per:>24} {r['staleness']['mean']:>9.2f} "
              f"{fmt(t['time_to_target']):>8}s   ({t['steps']} steps; {before})", flush=True)


def section_bandwidth(args: argparse.Namespace, runs: list[dict] | None) -> None:
    print("\n(d) push and pull bandwidth (2.7 MB) against a plain copy: "
          "benchmarks/bench_rma.py report, best of 2 rounds")
    result = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(BENCH / "bench_rma.py"),
                             "--repeat", "2"], capture_output=True, text=True, timeout=600,
                            check=False, cwd=REPO)
    lines = result.stdout.splitlines()
    for line in lines[: next((i for i, x in enumerate(lines) if x.startswith("progress")),
                             len(lines))]:
        print(f"  {line}")
    if result.returncode != 0:
        print(f"  bench_rma.py failed: {result.stderr[-500:]}")
    for rep in runs or []:
        n_fetch, n_push, fetch, _ = rep["key"]
        moved = (rep["pushes"] + rep["fetches"] + rep["refetches"]) * N_PARAMS * 4
        print(f"  in training, n_fetch/n_push {n_fetch}/{n_push} {rep['transport']}"
              f" {fetch}: {moved / rep['rma_seconds'] / 1e9:.2f}"
              f" GB/s moved while in RMA calls ({rep['refetches']} re-fetches for "
              f"{rep['fetches']} fetches)")


def section_interleaved(args: argparse.Namespace) -> None:
    print(f"\n(e) overhead at n_fetch = n_push = 1, measured inside the replica process: "
          f"{args.blocks} x {args.block} single-process steps interleaved with as many "
          f"Downpour steps, medians")
    print(f"{'transport':>9} {'fetch':>12} {'single ms/step':>14} {'downpour ms/step':>16} "
          f"{'overhead':>9}"
          f"   (median block times; overhead from the median pair ratio)")
    for transport, fetch in (("shared", FETCHES[0]),) + tuple(("rma", f) for f in FETCHES):
        before = load()
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", __file__,
               "--interleaved-worker", "--transport", transport, "--data", str(args.data),
               "--blocks", str(args.blocks), "--block", str(args.block), "--fetch", fetch]
        r = run_json(cmd, 600)
        print(f"{transport:>9} {fetch:>12} {r['single'] * 1e3:>14.3f} "
              f"{r['downpour'] * 1e3:>16.3f} {1 - 1 / r['ratio']:>8.1%}   ({before})",
              flush=True)


NOLOCAL = {"MPIR_CVAR_NOLOCAL": "1"}
FAKE_HOSTS = ("-launcher", "fork", "-hosts", "h1,h2,h3", "-ppn", "1")
TRANSPORT_ROWS = [
    ("shared memory (one node's default)", "shared", {}, (), "own_pushes"),
    ("RMA (DISTBELIEF_PS_TRANSPORT=rma)", "rma", {}, (), "own_pushes"),
    ("  fetch = asynchronous", "rma", {}, (), "asynchronous"),
    ("  fetch = overlapped", "rma", {}, (), "overlapped"),
    ("RMA through MPI's network module (MPIR_CVAR_NOLOCAL=1)", "rma", NOLOCAL, (),
     "own_pushes"),
    ("  fetch = asynchronous", "rma", NOLOCAL, (), "asynchronous"),
    ("  fetch = overlapped", "rma", NOLOCAL, (), "overlapped"),
    ("3 fake hosts (-launcher fork -hosts h1,h2,h3 -ppn 1)", "auto", {}, FAKE_HOSTS,
     "own_pushes"),
    ("  fetch = overlapped", "auto", {}, FAKE_HOSTS, "overlapped"),
]


def section_transports(args: argparse.Namespace) -> None:
    """(f) issue 17's rows, transport by transport and fetch by fetch, each against shared
    memory measured in the same sweep: samples/s per replica with 1 shard + 2 replicas,
    and time to the target with 1 shard + 1 replica."""
    print(f"\n(f) transports: 1 shard + 2 replicas, {args.steps} steps in total, mean "
          f"samples/s per replica, best of {args.repeats} interleaved rounds; vs shared")
    best: dict[int, float] = {}
    loads = []
    for _ in range(args.repeats):
        loads.append(os.getloadavg()[0])
        for row, (_, transport, env, launcher, fetch) in enumerate(TRANSPORT_ROWS):
            r = downpour_run(args, ranks=3, steps=args.steps, transport=transport,
                             extra_env=env, launcher=launcher, fetch=fetch)
            rate = statistics.mean(x["samples_per_second"] for x in r["replicas"])
            best[row] = max(best.get(row, 0.0), rate)
    for row, rate in best.items():
        print(f"  {TRANSPORT_ROWS[row][0]:<56} {rate:>8,.0f}  {ratio(rate, best[0]):>5}")
    print(f"  (loads at round starts: {', '.join(f'{x:.1f}' for x in loads)})")


def section_transport_target(args: argparse.Namespace) -> None:
    """(f), second part: time to the target with 1 shard + 1 replica on shared memory and
    on RMA with each optimizer.fetch, seed by seed in turn (none with --seeds 0)."""
    if args.seeds < 1:
        return
    print(f"  time to {args.target}, 1 shard + 1 replica, median of {args.seeds} seed(s):")
    runs = [("shared", "own_pushes")] + [("rma", fetch) for fetch in FETCHES]
    times: dict[tuple[str, str], list[float | None]] = {run: [] for run in runs}
    for seed in range(args.seeds):
        for (transport, fetch), got in times.items():
            got.append(downpour_run(args, seed=seed, target=args.target,
                                    eval_every=args.eval_every, transport=transport,
                                    fetch=fetch)["time_to_target"])
    shared = median_or_none(times[runs[0]])
    for (transport, fetch), got in times.items():
        t = median_or_none(got)
        print(f"    {transport:>6} {fetch:<12} {fmt(t):>11} s  {ratio(t, shared):>5} "
              f"({', '.join(fmt(x) for x in got)})")
    print(f"  ({load()})", flush=True)


OSC_UCX = {"OMPI_MCA_osc": "ucx", "OMPI_MCA_osc_ucx_tls": "any",
           "OMPI_MCA_osc_ucx_devices": "any", "OMPI_MCA_pml": "ob1"}
OSC_ROWS = [("osc/ucx forced (OMPI_MCA_osc=ucx, tls/devices any, pml ob1)", OSC_UCX),
            ("--mca osc ^ucx (osc/sm here)", {"OMPI_MCA_osc": "^ucx"})]


def section_osc(args: argparse.Namespace) -> None:
    """(g) Open MPI's osc/ucx against its other one-sided components, same sweep."""
    from mpi4py import MPI

    if "Open MPI" not in MPI.Get_library_version():
        print("\n(g) osc: skipped, mpi4py is not built on Open MPI")
        return
    print(f"\n(g) osc: 1 shard + 2 replicas, RMA transport, {args.steps} steps in total, "
          f"mean samples/s per replica, best of {args.repeats} interleaved rounds")
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    best: dict[int, float] = {}
    loads = []
    for _ in range(args.repeats):
        loads.append(os.getloadavg()[0])
        for row, (_, env) in enumerate(OSC_ROWS):
            r = downpour_run(args, ranks=3, steps=args.steps, transport="rma",
                             extra_env={**root, **env}, launcher=("--oversubscribe",))
            rate = statistics.mean(x["samples_per_second"] for x in r["replicas"])
            best[row] = max(best.get(row, 0.0), rate)
    for row, rate in best.items():
        print(f"  {OSC_ROWS[row][0]:<62} {rate:>8,.0f}  {ratio(rate, best[1]):>5}")
    print(f"  (loads at round starts: {', '.join(f'{x:.1f}' for x in loads)})")


def replica_rate(run: dict) -> float:
    """Mean samples/s per replica (its steps over its training wall time)."""
    return statistics.mean(r["samples_per_second"] for r in run["replicas"])


def samples_to_target(run: dict) -> int | None:
    """Samples trained, over all replicas, when the evaluation that reached the target
    was taken (None: not reached)."""
    step = run["target_reached_step"]
    return None if step is None else step * BATCH


def section_push_dtype(args: argparse.Namespace) -> None:
    """(h) bfloat16 pushes against float32 pushes, RMA: time and samples to the target
    (none with --seeds 0), then the interleaved step times."""
    kinds = [("float32", False), ("bfloat16", False)]
    if args.round_pulls:
        kinds.append(("bfloat16", True))
    print(f"\n(h) push_dtype: time and samples to {args.target}, RMA transport, 1 shard + "
          f"{args.replicas} replica(s), eval every {args.eval_every} s, {args.seeds} seed(s) "
          "in turn, medians")
    if args.seeds >= 1:
        push_dtype_to_target(args, kinds)
    print(f"  interleaved, 1 shard + 1 replica, {args.blocks} x {args.block} steps of each, "
          "ms/step (of which in push_pull_own), bfloat16 / float32 as the median ratio of "
          "adjacent blocks:")
    for label, env in (("RMA on one node", {}),
                       ("RMA through the network module (MPIR_CVAR_NOLOCAL=1)", NOLOCAL)):
        before = load()
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", __file__,
               "--push-dtype-interleaved-worker", "--data", str(args.data),
               "--blocks", str(args.blocks), "--block", str(args.block)]
        r = run_json(cmd, 600, {**os.environ, **env})
        print(f"    {label}: float32 {r['float32'] * 1e3:.3f} "
              f"({r['float32 transport'] * 1e3:.3f}), bfloat16 {r['bfloat16'] * 1e3:.3f} "
              f"({r['bfloat16 transport'] * 1e3:.3f}), ratio {r['ratio']:.3f} ({before})",
              flush=True)


def push_dtype_to_target(args: argparse.Namespace, kinds: list[tuple[str, bool]]) -> None:
    """(h), first part: each kind of run seed by seed, the order alternating."""
    runs: dict[tuple[str, bool], list[dict]] = {kind: [] for kind in kinds}
    loads = []
    for seed in range(args.seeds):
        loads.append(os.getloadavg()[0])
        order = kinds if seed % 2 == 0 else kinds[::-1]  # neither always runs first
        for push_dtype, rounded in order:
            runs[(push_dtype, rounded)].append(downpour_run(
                args, ranks=1 + args.replicas, seed=seed, target=args.target,
                eval_every=args.eval_every, transport="rma", push_dtype=push_dtype,
                round_pulls=rounded))
    base = runs[kinds[0]]
    t_base = median_or_none([r["time_to_target"] for r in base])
    n_base = median_or_none([samples_to_target(r) for r in base])
    rate_base = statistics.median(replica_rate(r) for r in base)
    print(f"  {'pushes':<26} {'time (s)':>9} {'ratio':>6} {'samples':>9} {'ratio':>6} "
          f"{'samples/s':>9} {'ratio':>6} {'sent B/sample':>13} {'received B/sample':>17}"
          "   per seed: time, samples")
    for (push_dtype, rounded), got in runs.items():
        t = median_or_none([r["time_to_target"] for r in got])
        n = median_or_none([samples_to_target(r) for r in got])
        rate = statistics.median(replica_rate(r) for r in got)
        sent = statistics.median(r["bytes_sent"] / r["samples"] for r in got)
        received = statistics.median(r["bytes_received"] / r["samples"] for r in got)
        name = push_dtype + (", pulls rounded" if rounded else "")
        seeds = "; ".join(f"{fmt(r['time_to_target'])} {fmt(samples_to_target(r), ',.0f')}"
                          for r in got)
        print(f"  {name:<26} {fmt(t):>9} {ratio(t, t_base):>6} {fmt(n, ',.0f'):>9} "
              f"{ratio(n, n_base):>6} {rate:>9,.0f} {ratio(rate, rate_base):>6} "
              f"{sent:>13,.0f} {received:>17,.0f}   ({seeds})", flush=True)
    # Each seed's runs ran back to back, so their ratio sees nearly one load: the median
    # of those ratios holds still while the machine's load moves.
    for kind, got in list(runs.items())[1:]:
        paired = {what: [None if a is None or b is None else b / a
                         for a, b in zip(map(pick, base), map(pick, got), strict=True)]
                  for what, pick in (("time", lambda r: r["time_to_target"]),
                                     ("samples", samples_to_target),
                                     ("samples/s", replica_rate))}
        print(f"  {kind[0]}{', pulls rounded' if kind[1] else ''} / float32, median of the "
              f"per-seed ratios: " + ", ".join(
                  f"{what} {fmt(median_or_none([x for x in got if x is not None]), '.2f')}"
                  f" ({', '.join(fmt(x, '.2f') for x in got)})"
                  for what, got in paired.items()))
    print(f"  (loads at seed starts: {', '.join(f'{x:.1f}' for x in loads)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=REPO / "data" / "fashion_mnist.h5")
    p.add_argument("--only", choices=["target", "throughput", "replicas", "bandwidth", "osc",
                                      "interleaved", "transports", "transport-target",
                                      "push-dtype"])
    p.add_argument("--threads", default="1,2", help="(a): thread counts")
    p.add_argument("--seeds", type=int, default=1, help="(a): seeds, median reported")
    p.add_argument("--steps", type=int, default=4000, help="(b), (c): steps per run")
    p.add_argument("--repeats", type=int, default=2, help="(b): rounds, best kept")
    p.add_argument("--target", type=float, default=0.88)
    p.add_argument("--eval-every", type=float, default=2.0)
    p.add_argument("--max-seconds", type=float, default=120.0)
    p.add_argument("--blocks", type=int, default=60, help="(e): blocks of each kind")
    p.add_argument("--block", type=int, default=30, help="(e): steps per block")
    p.add_argument("--replicas", type=int, default=1, help="(h): replicas")
    p.add_argument("--round-pulls", action="store_true",
                   help="(h): also a run with every pull rounded to bfloat16")
    # worker options
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--n-fetch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--n-push", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--fetch", default="own_pushes", help=argparse.SUPPRESS)
    p.add_argument("--interleaved-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--push-dtype-interleaved-worker", action="store_true",
                   help=argparse.SUPPRESS)
    p.add_argument("--transport", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--push-dtype", default="float32", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.interleaved_worker:
        interleaved_worker(args)
        return
    if args.push_dtype_interleaved_worker:
        push_dtype_interleaved_worker(args)
        return
    if args.worker:
        args.threads = int(args.threads)
        downpour_worker(args)
        return
    if not args.data.is_file():
        raise SystemExit(f"{args.data} missing: run `distbelief prepare fashion-mnist`")
    args.threads = [int(t) for t in args.threads.split(",")]
    print(f"Downpour, MLP 784-512-512-10, Adagrad lr 0.02, batch {BATCH}, {args.data.name}; "
          f"{os.cpu_count()} cores; {load()} before")
    runs = None
    if args.only in (None, "target"):
        section_target(args)
    if args.only in (None, "throughput"):
        runs = section_throughput(args)
    if args.only in (None, "replicas"):
        section_replicas(args)
    if args.only in (None, "bandwidth"):
        section_bandwidth(args, runs)
    if args.only in (None, "interleaved"):
        section_interleaved(args)
    if args.only in (None, "transports"):
        section_transports(args)
    if args.only == "osc":  # not in the default sweep: it needs Open MPI's mpi4py
        section_osc(args)
    if args.only in (None, "transports", "transport-target"):
        section_transport_target(args)
    if args.only in (None, "push-dtype"):
        section_push_dtype(args)


if __name__ == "__main__":
    main()
