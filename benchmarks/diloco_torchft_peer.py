"""The PyTorch peer of distbelief's synchronous DiLoCo: torchft's DiLoCo (PyTorch's
fault-tolerant training library, torchft.local_sgd.DiLoCo) on the reference MLP.

Same task and settings as `bench_diloco.py`'s `diloco` kind: the model, init and batching
of benchmarks/torch_peer.py (784-512-512-10, batch 64, one thread per process), R replica
groups of one process each, inner torch.optim.Adagrad(lr 0.02) for H steps, then torchft
all-reduces the replicas' pseudo-gradients (global minus local parameters) and the outer
torch.optim.SGD(lr 0.7, momentum 0.9, nesterov=True) steps the global parameters.
torchft's Manager joins each round through its lighthouse (started here, on localhost)
and a Gloo process group; replica i trains on its own shuffle (seed + i).

Replica 0 evaluates the whole test set after a round when --eval-every seconds have passed
since its last evaluation (evaluation time included, distbelief's cadence). When it reaches
--target at round k it says so through shared memory before its next inner step; every
replica stops after round k + 1 (which replica 0 cannot finish before the others see
the word), so the job ends without a timeout; past --max-seconds the same, without a
target. --steps N trains N steps instead (all replicas together, whole rounds, as
distbelief's run.max_steps) with no target. Times count from the first inner step (the
lighthouse is set-up, as distbelief's start-up is; the first quorum, at the end of round
1, is timed like every other).

Every replica builds the same initial parameters from the seed, so the Manager runs with
init_sync=False, which torchft's docstring asks for then: with its default, True, the
other replicas replaced their parameters by one replica's (an HTTP checkpoint transfer) at
the end of round 1, throwing their round's work away.

The lighthouse runs in this script's process. Ctrl-C, SIGTERM or the job's deadline
(--max-seconds + 120 s) kill every replica; if the script itself is killed (SIGKILL, a
caller's timeout), each replica sees its parent gone and exits within a second.

Prints one JSON object: time_to_target (None if missed), samples_to_target (all
replicas), rounds, final accuracy, and bytes_sent_per_sample (the all-reduce payload, 4
bytes a parameter per round, the figure distbelief's summary gives for its own DiLoCo).

Needs torch and torchft, which distbelief never depends on: a venv of their own,

    python3 -m venv .venv-torchft       # .gitignore has it
    .venv-torchft/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    .venv-torchft/bin/pip install torchft==0.2.0 h5py numpy
    .venv-torchft/bin/python benchmarks/diloco_torchft_peer.py --data data/fashion_mnist.h5 \\
        --replicas 2 --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def exit_with_parent() -> None:
    """End this replica within a second of the script's process going, however it went
    (a SIGKILL included: the finally below that kills the replicas then never runs)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def replica(index: int, args: argparse.Namespace, lighthouse: str, stop_round, result) -> None:
    """One replica group (one process): train until the agreed round, replica 0 evaluating."""
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch_peer import Batches, evaluate, load_split, make_model
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    exit_with_parent()
    torch.set_num_threads(1)
    x, y = load_split(args.data, "train")
    test_x, test_y = load_split(args.data, "test") if index == 0 else (None, None)
    model = make_model(args.seed)  # every replica starts from the same parameters
    batches = Batches(x, y, args.batch_size, args.seed + index)
    inner = torch.optim.Adagrad(model.parameters(), lr=args.lr)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=True)
    store = dist.TCPStore(host_name="localhost", port=0, is_master=True,
                          wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(), min_replica_size=args.replicas,
        load_state_dict=lambda state: model.load_state_dict(state["model"]),
        state_dict=lambda: {"model": model.state_dict()},
        replica_id=str(index), store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lighthouse, port=0, use_async_quorum=False,
        timeout=timedelta(seconds=60), init_sync=False)  # torchft's setting for seeded init
    steps = rounds = 0
    reached = samples = None
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.inner_steps):
            start = time.perf_counter()
            last_eval = start
            while True:
                xb, yb = batches.next()
                inner.zero_grad(set_to_none=True)
                F.cross_entropy(model(xb), yb).backward()
                inner.step()  # every inner_steps-th step, DiLoCo's round
                steps += 1
                if steps % args.inner_steps:
                    continue
                rounds += 1
                now = time.perf_counter()
                if 0 <= stop_round.value <= rounds:
                    break
                if (index == 0 and now - start > args.max_seconds
                        and not 0 <= stop_round.value <= rounds + 1):
                    stop_round.value = rounds + 1  # out of time: all end after the next round
                if index == 0 and now - last_eval >= args.eval_every:
                    accuracy = evaluate(model, test_x, test_y)
                    last_eval = time.perf_counter()
                    if accuracy >= args.target and reached is None:
                        reached = last_eval - start
                        samples = steps * args.batch_size * args.replicas
                        stop_round.value = rounds + 1
        if index == 0:
            result.put({"time_to_target": reached, "samples_to_target": samples,
                        "rounds": rounds, "steps_per_replica": steps,
                        "final_test_accuracy": evaluate(model, test_x, test_y),
                        "seconds": time.perf_counter() - start})
    finally:
        manager.shutdown(wait=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--eval-every", type=float, default=1.0)
    parser.add_argument("--max-seconds", type=float, default=150.0)
    parser.add_argument("--steps", type=int, default=0,
                        help="train this many steps (all replicas together, rounded up to "
                             "whole rounds, as distbelief's run.max_steps) with no target")
    args = parser.parse_args()
    # SIGTERM (kill, timeout) as Ctrl-C: the finally below ends the replicas and lighthouse.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    rounds = math.ceil(args.steps / (args.replicas * args.inner_steps)) if args.steps else -1
    if args.steps:
        args.target = math.inf
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas)
    context = mp.get_context("spawn")
    # No multiprocessing Manager: its server process would outlive a killed script.
    stop_round, result = context.Value("i", rounds), context.SimpleQueue()
    procs = [context.Process(target=replica, args=(i, args, lighthouse.address(),
                                                    stop_round, result))
             for i in range(args.replicas)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.max_seconds + 120
    try:
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:  # a replica past its deadline, SIGTERM or Ctrl-C: end them all
            if proc.is_alive():
                proc.kill()
                proc.join()
        lighthouse.shutdown()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed or result.empty():
        sys.exit(f"diloco_torchft_peer: replicas exited {[p.exitcode for p in procs]}")
    num_params = 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    print(json.dumps({**result.get(), "replicas": args.replicas, "seed": args.seed,
                      "bytes_sent_per_sample":
                      4 * num_params / (args.inner_steps * args.batch_size)}))

if __name__ == "__main__":
    main()
