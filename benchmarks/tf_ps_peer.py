"""The TensorFlow 2 peer of Downpour: tf.distribute.ParameterServerStrategy (asynchronous
by construction) on the reference MLP and Fashion-MNIST.

One parameter server and N workers, each a tf.distribute.Server in a process of its own on
loopback ports, plus this script's process as the coordinator (tf.distribute's "chief"):
a SimpleClusterResolver names them, and a ClusterCoordinator schedules training steps on
whichever worker is free. The variables and the Adagrad accumulators live on the
parameter server; each scheduled step reads the whole parameter vector from it, computes
the gradient of one batch on its worker and applies it there, as Downpour's
n_fetch = n_push = 1.

Same task and settings as benchmarks/bench_downpour.py: MLP 784-512-512-10 (ReLU,
softmax cross-entropy), initial parameters those distbelief draws for the same seed
(uniform He for the ReLU layers, uniform Glorot for the output layer, zero biases; the
same numbers, bit for bit), batch 64, Adagrad lr 0.02. The Adagrad is `--optimizer`:
  fused (default): tf.raw_ops.ResourceApplyAdagradV2, TF's own fused Adagrad kernel
      (accum += g^2; var -= lr * g / (sqrt(accum) + eps)), run on the parameter server
      beside the variable, accumulators from 0 and eps = 1e-10: distbelief's Adagrad
      (distbelief.model.optimizers.Adagrad), term for term.
  keras: keras.optimizers.Adagrad(0.02, initial_accumulator_value=0, epsilon=1e-10), the
      optimizer a Keras user takes; Keras 3 puts eps inside the root
      (var -= lr * g / sqrt(accum + eps)) and applies the accumulator and the variable
      update as two separate operations.

Each worker reads the training set from raw files this script writes from the HDF5 file
(tf.data: shuffle over the whole set, repeat, batch 64, so every batch is full, as
distbelief's TrainShard). The dataset function is traced once on the coordinator and
cannot carry a per-worker seed, so tf.data's shuffle runs unseeded: each worker draws its
own order (distbelief's replicas each use their own RNG too), and the seed fixes the
initial parameters only.

Threads: 2 cores here, so every process runs TF with intra_op = 1 thread and inter_op = 1
(tf.config.threading in the coordinator, ConfigProto in the servers), except the workers'
inter_op = 2: with one, a worker deadlocked on its first step (no progress in 60 s, TF
2.21.0); and numpy's BLAS in the coordinator with one thread. gRPC's own threads are not
configurable. The parameter server, with one thread for its ops, applies the updates one
at a time, as a distbelief shard (one rank) does.

The coordinator keeps `--in-flight` scheduled steps per worker outstanding (it waits on
the oldest's result, never spins) and, in a thread of its own, evaluates the whole test
set with numpy on the parameters it reads from the parameter server, every
`--eval-every` s counted from the end of the previous evaluation, training going on
meanwhile (distbelief's Downpour evaluates on shard 0 in a thread). Time counts from the
first scheduled step; the time to the target is the end of the first evaluation that met
it (distbelief's summary.json `time_to_target`). `--steps N` trains N steps (all workers
together) instead, no target; `--steps-per-call K` runs K steps in one scheduled function
(Keras's steps_per_execution; each still reads and updates the parameter server).

Staleness, as distbelief's shards count it (the updates applied between a step's read of
the parameters and its own update): a step counter on the parameter server is read
before the step's parameter reads (a control dependency) and incremented after its
updates; the step returns the difference less one. Measured with --optimizer fused only:
under the keras optimizer the same counter gave 0 for every step of 2 workers, which the
graph's partitioning, not the training, must explain, so it is reported as None.

Prints one JSON object: time_to_target (None if missed), steps_to_target (all workers, as
the counter stood when that evaluation began), steps, samples_per_second (all workers,
over the training wall time), final_test_accuracy, staleness_mean, and every evaluation
as [seconds, steps, accuracy].

Needs tensorflow-cpu, which distbelief never depends on: a venv of its own,

    python3 -m venv .venv-tf            # .gitignore has it
    .venv-tf/bin/pip install tensorflow-cpu==2.21.0 h5py numpy
    .venv-tf/bin/python benchmarks/tf_ps_peer.py --data data/fashion_mnist.h5 --workers 2
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Before numpy and TF load: one BLAS thread, TF's C++ logging quiet.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

SIZES = (784, 512, 512, 10)


def exit_with_parent() -> None:
    """End this server within a second of the coordinator's process going, however it
    went (a SIGKILL included)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def serve(cluster: dict, job: str, index: int) -> None:
    """One tf.distribute.Server (a parameter server or a worker), until killed."""
    import tensorflow as tf

    exit_with_parent()
    # A worker with one inter-op thread deadlocks on its first step (nothing in 60 s):
    # it needs a second to run the step's remote reads while the first waits on them.
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=2 if job == "worker" else 1)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job,
                                  task_index=index, protocol="grpc", config=config,
                                  start=True)
    server.join()


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def load_split(path: Path, split: str) -> tuple[np.ndarray, np.ndarray, float]:
    """(x uint8 (N, 784), y int32, scale) of one split of a distbelief HDF5 file."""
    import h5py

    with h5py.File(path, "r") as f:
        x = f[f"{split}/x"][...]
        y = f[f"{split}/y"][...]
        scale = float(f[f"{split}/x"].attrs.get("scale", 1.0))
    return x.reshape(len(x), -1), y.astype(np.int32), scale


def initial_params(seed: int) -> list[np.ndarray]:
    """[w1, b1, w2, b2, w3, b3], w as (in, out): distbelief's Network.init_params(seed) bit
    for bit (one PCG64 stream of float32 values filling each (out, in) weight matrix in
    turn; uniform He, sqrt(6 / fan_in), for the ReLU layers, uniform Glorot, sqrt(6 /
    (fan_in + fan_out)), for the output layer; zero biases, nothing drawn for them)."""
    rng = np.random.default_rng(seed)
    params = []
    for layer, (fan_in, fan_out) in enumerate(itertools.pairwise(SIZES)):
        last = layer == len(SIZES) - 2
        limit = np.sqrt(6.0 / (fan_in + fan_out if last else fan_in))
        w = np.empty((fan_out, fan_in), np.float32)
        rng.random(dtype=np.float32, out=w)
        w *= np.float32(2.0 * limit)
        w -= np.float32(limit)
        params += [np.ascontiguousarray(w.T), np.zeros(fan_out, np.float32)]
    return params


def accuracy(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    h = x
    for layer in range(0, len(params) - 2, 2):
        h = np.maximum(h @ params[layer] + params[layer + 1], 0.0)
    logits = h @ params[-2] + params[-1]
    return float(np.mean(logits.argmax(axis=1) == y))


def start_cluster(workers: int) -> tuple[dict, list[subprocess.Popen]]:
    ports = free_ports(workers + 1)
    cluster = {"ps": [f"localhost:{ports[0]}"],
               "worker": [f"localhost:{p}" for p in ports[1:]]}
    procs = []
    for job, addresses in cluster.items():
        for index in range(len(addresses)):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--serve", job, "--index", str(index),
                 "--cluster", json.dumps(cluster)]))
    return cluster, procs


def train(args: argparse.Namespace, cluster: dict, train_dir: Path) -> dict:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    test_x, test_y, scale = load_split(args.data, "test")
    test_x = test_x.astype(np.float32) * np.float32(scale)
    with strategy.scope():
        variables = [tf.Variable(p, name=f"p{i}")
                     for i, p in enumerate(initial_params(args.seed))]
        if args.optimizer == "keras":
            import keras

            optimizer = keras.optimizers.Adagrad(args.lr, initial_accumulator_value=0.0,
                                                 epsilon=1e-10)
            optimizer.build(variables)
        else:
            accums = [tf.Variable(tf.zeros_like(p), name=f"accum{i}")
                      for i, p in enumerate(variables)]
        applied = tf.Variable(0, dtype=tf.int64, name="applied")  # steps, all workers
    lr = tf.constant(args.lr, tf.float32)
    eps = tf.constant(1e-10, tf.float32)
    scale32 = tf.constant(scale, tf.float32)

    def dataset_fn() -> tf.data.Dataset:
        x = tf.data.FixedLengthRecordDataset(str(train_dir / "x"), 784)
        y = tf.data.FixedLengthRecordDataset(str(train_dir / "y"), 4)
        return (tf.data.Dataset.zip(x, y)
                .shuffle(60_000, reshuffle_each_iteration=True)  # unseeded: see the docstring
                .repeat()
                .batch(args.batch_size, drop_remainder=True)
                .map(lambda x, y: (tf.cast(tf.io.decode_raw(x, tf.uint8), tf.float32)
                                   * scale32,
                                   tf.reshape(tf.io.decode_raw(y, tf.int32), [-1])))
                .prefetch(1))

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def one_step(x, y):
        # Staleness as distbelief's shards count it: the updates applied between this
        # step's read of the parameters and its own update (the counter is read before
        # the parameters, and again after the update).
        seen = applied.read_value()
        with tf.control_dependencies([seen]), tf.GradientTape() as tape:
            h = x
            for layer in range(0, len(variables) - 2, 2):
                h = tf.nn.relu(h @ variables[layer] + variables[layer + 1])
            logits = h @ variables[-2] + variables[-1]
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        grads = tape.gradient(loss, variables)
        if args.optimizer == "keras":
            updates = [optimizer.apply_gradients(zip(grads, variables))]  # its iterations
        else:
            updates = [tf.raw_ops.ResourceApplyAdagradV2(var=v.handle, accum=a.handle, lr=lr,
                                                         epsilon=eps, grad=g,
                                                         use_locking=False)
                       for v, a, g in zip(variables, accums, grads, strict=True)]
        with tf.control_dependencies(updates):
            now = applied.assign_add(1)
        return now - seen - 1

    @tf.function
    def step_fn(it):
        staleness = tf.constant(0, tf.int64)
        for _ in tf.range(args.steps_per_call):
            x, y = next(it)
            staleness += strategy.run(one_step, args=(x, y))
        return staleness  # summed over the call's steps

    window = args.in_flight * args.workers
    stop = threading.Event()
    evals: list[tuple[float, int, float]] = []
    reached: list[tuple[float, int]] = []  # time, steps (all workers) at the evaluation
    start = [0.0]

    def evaluator() -> None:
        next_eval = start[0] + args.eval_every
        while not stop.wait(max(0.0, next_eval - time.perf_counter())):
            step = int(applied.numpy()) - warmup_steps
            got = accuracy([v.numpy() for v in variables], test_x, test_y)
            now = time.perf_counter()
            evals.append((now - start[0], step, got))
            if got >= args.target and not reached:
                reached.append((now - start[0], step))
                stop.set()
            next_eval = now + args.eval_every

    # One step per worker first: tf.function traces and every worker builds its graph
    # (set-up, as distbelief's start-up is), then the clock starts.
    for _ in range(args.workers):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    warmup_steps = args.workers * args.steps_per_call
    start[0] = time.perf_counter()
    thread = None
    if args.steps == 0:
        thread = threading.Thread(target=evaluator, daemon=True)
        thread.start()
    calls = staleness = 0
    pending: collections.deque = collections.deque()
    total_calls = -(-args.steps // args.steps_per_call) if args.steps else None
    while not stop.is_set():
        if total_calls is not None and calls >= total_calls:
            break
        if time.perf_counter() - start[0] >= args.max_seconds:
            break
        if len(pending) >= window:
            staleness += int(pending.popleft().fetch())  # waits on the oldest: never spins
        pending.append(coordinator.schedule(step_fn, args=(iterator,)))
        calls += 1
    coordinator.join()
    staleness += sum(int(p.fetch()) for p in pending)
    train_seconds = time.perf_counter() - start[0]
    stop.set()
    if thread is not None:
        thread.join()
    steps = calls * args.steps_per_call
    final = accuracy([v.numpy() for v in variables], test_x, test_y)
    return {"impl": "tf_ps", "optimizer": args.optimizer, "workers": args.workers,
            "steps_per_call": args.steps_per_call, "seed": args.seed,
            "time_to_target": reached[0][0] if reached else None,
            "steps_to_target": reached[0][1] if reached else None,
            "steps": steps, "warmup_steps": warmup_steps,
            "samples_per_second": steps * args.batch_size / train_seconds,
            "train_seconds": train_seconds, "final_test_accuracy": final,
            "staleness_mean": staleness / steps if args.optimizer == "fused" else None,
            "evaluations": [[round(t, 2), n, round(a, 4)] for t, n, a in evals],
            "tensorflow": tf.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("data/fashion_mnist.h5"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", choices=("fused", "keras"), default="fused")
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--eval-every", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--steps", type=int, default=0,
                        help="train this many steps (all workers) instead of to the target")
    parser.add_argument("--steps-per-call", type=int, default=1)
    parser.add_argument("--in-flight", type=int, default=2,
                        help="scheduled steps outstanding per worker")
    parser.add_argument("--serve", choices=("ps", "worker"), help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(json.loads(args.cluster), args.serve, args.index)
        return
    for name in ("workers", "batch_size", "steps_per_call", "in_flight"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.data.is_file():
        parser.error(f"{args.data} missing: run `distbelief prepare fashion-mnist`")
    x, y, _ = load_split(args.data, "train")
    cluster, procs = start_cluster(args.workers)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            train_dir = Path(tmp)
            x.tofile(train_dir / "x")
            y.astype("<i4").tofile(train_dir / "y")
            del x, y
            result = train(args, cluster, train_dir)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    print(json.dumps(result), flush=True)
    # TF's coordinator threads can keep the interpreter from exiting once the servers are
    # gone; the result is out, so leave without waiting for them.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
