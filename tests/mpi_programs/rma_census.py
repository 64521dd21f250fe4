"""A census of the RMA transport's one-sided calls (issue 28 item 4).

Every window of the parameter server is wrapped so that each one-sided call is recorded
(name, MPI datatype, element count, op). Every rank checks, over the whole run, that no
accumulate-family call (Accumulate, Get_accumulate, Fetch_and_op, Compare_and_swap and
their request forms) moves anything but one int64, so float data moves only by Put and
Get. Then the calls of single steps are counted against docs/rma-protocol.md's table:

- a replica's pull, push (with and without a run control exchange) and finish, uncontended
  (the shards have folded everything: no slot is taken, NEWEST does not move);
- a shard's poll that folds one push, and an idle poll;
- shard 0's snapshot of the other shard's slice (2 shards).

1 replica (world size = shards + 1); the census is exact only where nobody else moves.
With --push-dtype bfloat16 the pushes Put bfloat16 bits (MPI_UINT16_T, half the bytes)
and the parameters pulled after them hold each push rounded to bfloat16, widened exactly.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
from mpi4py import MPI
from ps_common import check, parser, say

from distbelief.model.optimizers import make_optimizer
from distbelief.ps import run_control as rc
from distbelief.ps.endpoint import ParameterClient, ParameterServerShard, ServerSpec
from distbelief.ps.transport import open_parameter_server
from distbelief.runtime.communicators.topology import Topology

ACCUMULATE_FAMILY = {"Accumulate", "Raccumulate", "Get_accumulate", "Rget_accumulate",
                     "Fetch_and_op", "Compare_and_swap"}
DATA_CALLS = {"Put", "Rput", "Get", "Rget"}
OP_NAMES = [(MPI.NO_OP, "NO_OP"), (MPI.SUM, "SUM"), (MPI.REPLACE, "REPLACE")]


def op_name(op: MPI.Op) -> str:
    return next((name for known, name in OP_NAMES if op == known), "?")


def _dtype_and_count(spec, target_spec=None) -> tuple[str, int]:
    """The MPI datatype name and element count of an mpi4py buffer spec (and target)."""
    buf, dtype = spec[0], spec[-1]
    if isinstance(target_spec, tuple):
        return dtype.Get_name(), int(target_spec[1])
    return dtype.Get_name(), int(np.asarray(buf).size)


class RecordingWindow:
    """An MPI.Win stand-in that records each one-sided call into `log` and forwards it."""

    def __init__(self, win: MPI.Win, log: list[tuple[str, str, int, str]]) -> None:
        self._win, self._log = win, log

    def __getattr__(self, name: str):
        attr = getattr(self._win, name)
        if name not in ACCUMULATE_FAMILY | DATA_CALLS:
            return attr

        def recorded(*args):
            if name in ("Fetch_and_op", "Compare_and_swap"):
                dtype, count = _dtype_and_count(args[0])
                op = op_name(args[4]) if name == "Fetch_and_op" else "CAS"
            elif name in ("Get", "Rget"):
                dtype, count = _dtype_and_count(args[0], args[2] if len(args) > 2 else None)
                op = "-"
            elif name in ("Get_accumulate", "Rget_accumulate"):
                dtype, count = _dtype_and_count(args[1], args[3] if len(args) > 3 else None)
                op = op_name(args[4])
            else:  # Put, Rput, Accumulate, Raccumulate
                dtype, count = _dtype_and_count(args[0], args[2] if len(args) > 2 else None)
                op = op_name(args[3]) if "ccumulate" in name else "-"
            self._log.append((name, dtype, count, op))
            return attr(*args)

        return recorded


def tally(log: list, since: int) -> Counter:
    """Calls by (name, op) since log position `since`."""
    return Counter((name, op) for name, _, _, op in log[since:])


def expect(what: str, got: Counter, want: dict) -> None:
    check(dict(got) == want, f"{what}: calls {dict(got)}, docs/rma-protocol.md says {want}")
    say(f"census {what}: {sorted(dict(got).items())}")


def wait_folded(client: ParameterClient, params: np.ndarray) -> None:
    """Until every push of this client is folded and published (pull included)."""
    client.catch_up(params)


def replica(client: ParameterClient, log: list, size: int, shards: int,
            push_dtype: str) -> None:
    params = np.empty(size, dtype=np.float32)
    # Not a bfloat16 value: a bfloat16 push carries 1/64, a float32 one all of it.
    grad = np.full(size, (1 + 2**-10) / 64, dtype=np.float32)
    pushed = np.float32(1 / 64) if push_dtype == "bfloat16" else grad[0]
    mark = len(log)
    client.pull(params)
    per = {("Fetch_and_op", "NO_OP"): 2, ("Fetch_and_op", "REPLACE"): 2,
           ("Accumulate", "SUM"): 1, ("Get", "-"): 3}
    expect("pull", tally(log, mark), {k: v * shards for k, v in per.items()})
    mark = len(log)
    client.push(grad)
    expect("push", tally(log, mark), {("Compare_and_swap", "CAS"): 2 * shards,
                                      ("Fetch_and_op", "NO_OP"): shards,
                                      ("Put", "-"): shards})
    wait_folded(client, params)
    control = rc.ControlExchange(0).set(claim=1, steps=1, loss_sum=0.5)
    mark = len(log)
    client.push(grad, control)
    # The exchange: claim and steps (Fetch_and_op SUM), the loss (Accumulate SUM), the six
    # commands (Fetch_and_op NO_OP), this replica's BEAT (Accumulate SUM), its LOST.
    expect("push with a run control exchange", tally(log, mark), {
        ("Compare_and_swap", "CAS"): 2 * shards,
        ("Fetch_and_op", "NO_OP"): shards + 6 + 1, ("Fetch_and_op", "SUM"): 2,
        ("Accumulate", "SUM"): 2, ("Put", "-"): shards})
    wait_folded(client, params)
    # SGD at rate 0.5 from zeros, two pushes folded
    want = np.float32(0) - np.float32(0.5) * pushed - np.float32(0.5) * pushed
    check(np.all(params == want), f"{push_dtype} pushes: pulled {params[:3]}, want {want}")
    width = 2 if push_dtype == "bfloat16" else 4
    check(client.bytes_sent == 2 * size * width, f"bytes_sent {client.bytes_sent}, want "
          f"{2 * size * width}")
    mark = len(log)
    client.finish()
    expect("finish", tally(log, mark), {("Accumulate", "SUM"): shards})


def shard_polls(shard: ParameterServerShard, log: list, world: int) -> tuple[Counter, Counter]:
    """Serve until finished; returns the calls of the first poll that folded exactly one
    push and of the last idle poll."""
    fold = idle = None
    while not shard.finished:
        mark, pushes = len(log), shard.stats.pushes
        traffic = shard.serve_once()
        calls = tally(log, mark)
        if shard.stats.pushes == pushes + 1 and fold is None:
            fold = calls
        elif not traffic and shard.stats.pushes == pushes:
            idle = calls
        time.sleep(1e-4)
    if idle is None:
        # On a loaded machine every poll may have seen traffic (shard 0's snapshot delays
        # its first polls); once every client has finished, a poll is idle.
        mark = len(log)
        shard.serve_once()
        idle = tally(log, mark)
    check(fold is not None and idle is not None, "no folding poll or no idle poll seen")
    return fold, idle


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--push-dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    world = MPI.COMM_WORLD.Get_size()
    check(world == args.shards + 1, "the census runs with exactly one replica")
    topology = Topology(world, MPI.COMM_WORLD.Get_rank(), args.shards)
    # With Downpour's run control block on shard 0, for the exchange.
    endpoint = open_parameter_server(MPI.COMM_WORLD, ServerSpec(
        topology, args.size, lambda n: make_optimizer(False, 0.5, n), control_replicas=1,
        push_dtype=args.push_dtype), transport="rma")
    log: list[tuple[str, str, int, str]] = []
    windows = endpoint._live()
    windows.accum = RecordingWindow(windows.accum, log)
    windows.params = RecordingWindow(windows.params, log)
    if isinstance(endpoint, ParameterServerShard):
        if endpoint.rank == 0 and args.shards > 1:
            mark = len(log)
            endpoint.snapshot(np.empty(args.size, dtype=np.float32))
            others = args.shards - 1
            got = tally(log, mark)
            # A reader whose re-read of NEWEST finds a newer buffer registers on that one
            # and re-reads again (docs/rma-protocol.md, step 3): one more REPLACE and one
            # more NO_OP per retry (seen on simulated nodes), never another Get.
            retries = got[("Fetch_and_op", "REPLACE")] - 2 * others
            expect("snapshot", got, {
                ("Fetch_and_op", "NO_OP"): 2 * others + max(retries, 0),
                ("Fetch_and_op", "REPLACE"): 2 * others + max(retries, 0),
                ("Get", "-"): 2 * others})
        fold, idle = shard_polls(endpoint, log, world)
        slots = windows.slots  # rma_windows.push_slots (tests/test_memory.py checks it)
        # A poll reads DONE, PULLS and every SLOT; a fold frees the slot, sets
        # VERSION_NOW, reads every READING, sets NEWEST and the client's FOLDED_HINT.
        expect("idle shard poll", idle, {("Fetch_and_op", "NO_OP"): 2 + slots})
        expect("shard poll folding one push", fold, {
            ("Fetch_and_op", "NO_OP"): 2 + slots + world, ("Compare_and_swap", "CAS"): 1,
            ("Fetch_and_op", "REPLACE"): 3})
    else:
        replica(endpoint, log, args.size, args.shards, args.push_dtype)
        puts = {dtype for name, dtype, _, _ in log if name == "Put"}
        want = {"bfloat16": "MPI_UINT16_T", "float32": "MPI_FLOAT"}[args.push_dtype]
        check(puts == {want}, f"pushes Put {puts}, want {want}")
    for name, dtype, count, op in log:
        if name in ACCUMULATE_FAMILY:
            check(dtype in ("MPI_INT64_T", "MPI_LONG") and count == 1,
                  f"{name}({op}) moved {count} x {dtype}: only count-1 int64 atomics allowed")
        else:
            check(name in DATA_CALLS, f"unexpected one-sided call {name}")
    float_moves = sum(1 for name, dtype, _, _ in log if dtype in ("MPI_FLOAT", "MPI_UINT16_T"))
    say(f"rank {topology.world_rank}: census ok, {len(log)} calls, {float_moves} of float data "
        f"all by Put/Get ({args.push_dtype} pushes)")
    endpoint.free()


if __name__ == "__main__":
    main()
