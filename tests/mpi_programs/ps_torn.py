"""No torn reads, in the style of MPICH's test/mpi/rma/atomic_get.c.

mode "set": each shard keeps overwriting its whole slice with a constant vector (all
elements k, k = 1, 2, ...) by its publishing scheme while the clients pull; every pulled
slice must be constant and k must never decrease.

mode "fold": the clients push gradients of -1 (SGD, lr 1: each push adds 1 to every
parameter) and pull, in turn separately and overlapped (push_pull); every pulled slice must be constant and equal to the number of pushes
its shard reports as applied in the same pull, and versions must never decrease.

--slow-reads S (rma): every client read sleeps S seconds once registered on its buffer,
before its Get, as a reader descheduled on a loaded node, while the shard publishes every
millisecond or so ("set"): the shard must go on publishing around it (into the other
buffer, or the newest in place: the values pulled still change), never into the
registered one (no pull is torn), and every pull must end.

--slow-reads S --slow-reader-alone (rma, "fold"): only the first client reads slowly, while
the others push and then pull until the pull holds their push (read-your-writes, as
Downpour's default fetch). With two buffers, the slow reader's registration on the older
one holds the shard's publishes back: the shard must say it held some and then published
into its newest buffer in place, so that the fast clients are not held to the slow one's
pace (each pulls at least 4 times as often), and no pull may be torn or inconsistent.
"""

import time

import numpy as np
from mpi4py import MPI
from ps_common import check, open_server, parser, say

from distbelief.ps import rma_windows
from distbelief.ps.endpoint import ParameterServerShard


def serve_set(shard: ParameterServerShard) -> None:
    k = 0
    while not shard.finished:
        k += 1
        shard.set_parameters(np.full(shard.stop - shard.start, k, dtype=np.float32))
        shard.serve_once()
    say(f"shard {shard.rank} set {k} constant vectors; {shard.stats.holds} publish(es) "
        "waited for a buffer without readers")
    return k


def check_pull(endpoint, params, last, mode, versions) -> np.ndarray:
    seen = np.empty(len(endpoint.ranges))
    for s, (start, stop) in enumerate(endpoint.ranges):
        part = params[start:stop]
        check(bool((part == part[0]).all()),
              f"torn read of shard {s}: values {np.unique(part)[:5]}")
        if mode == "fold":
            check(part[0] == endpoint.applied_pushes[s],
                  f"shard {s}: parameters {part[0]} but {endpoint.applied_pushes[s]} pushes "
                  f"applied at version {versions[s]}")
            seen[s] = versions[s]
        else:
            seen[s] = part[0]
    check(bool((seen >= last).all()), f"went back: {last} -> {seen}")
    return seen


def _done(elapsed: float, seconds: float, first: np.ndarray | None,
          last: np.ndarray) -> bool:
    if elapsed < seconds:
        return False
    changed = first is not None and bool((last > first).all())
    return changed or elapsed >= 10 * seconds


def slow_down_reads(seconds: float) -> None:
    """Sleep before each Get of a registered buffer."""
    issue = rma_windows.PublishedReader.issue_get

    def slowed(self, *args, **kwargs):
        time.sleep(seconds)
        issue(self, *args, **kwargs)

    rma_windows.PublishedReader.issue_get = slowed


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--mode", choices=["set", "fold"], required=True)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--slow-reads", type=float, default=0.0)
    p.add_argument("--slow-reader-alone", action="store_true")
    args = p.parse_args()
    topology, endpoint = open_server(args)
    pulls = 0
    slow = args.slow_reads > 0 and (not args.slow_reader_alone
                                    or topology.world_rank == topology.ps_shards)
    if isinstance(endpoint, ParameterServerShard):
        if args.mode == "set":
            serve_set(endpoint)
        else:
            endpoint.serve()
        if args.slow_reader_alone:
            in_place = endpoint.stats.publishes_in_place  # what summary.json reports
            check(endpoint.stats.holds > 0 and in_place > 0, f"shard {endpoint.rank}: "
                  f"{endpoint.stats.holds} publish(es) held, {in_place} in place")
            say(f"shard {endpoint.rank}: {endpoint.stats.holds} publish(es) held, "
                f"{in_place} in place, {endpoint.stats.folds} folds")
    else:
        if slow:
            slow_down_reads(args.slow_reads)
        params = np.empty(args.size, dtype=np.float32)
        minus_one = np.full(args.size, -1, dtype=np.float32)
        last = np.zeros(topology.ps_shards)
        first = None
        t0 = time.perf_counter()
        # `--seconds` of pulls, longer (up to ten times) until a change was seen: through
        # MPI's network module (simulated nodes) on a busy machine a second may hold only
        # a pull or two.
        while not _done(time.perf_counter() - t0, args.seconds, first, last):
            if args.slow_reader_alone and not slow:
                endpoint.push_pull_own(minus_one, params)
                versions = endpoint.pulled_versions.copy()
            elif args.mode == "fold" and pulls % 2:
                _, versions = endpoint.push_pull(minus_one, params)
            else:
                if args.mode == "fold":
                    endpoint.push(minus_one)
                versions = endpoint.pull(params)
            last = check_pull(endpoint, params, last, args.mode, versions)
            first = last.copy() if first is None else first
            pulls += 1
        # Without a change during the run the check above would prove nothing.
        check(bool((last > first).all()),
              f"values never changed in {pulls} pulls: {first} -> {last}")
        say(f"rank {topology.world_rank}: {pulls} pulls consistent, {first} -> {last}")
        endpoint.finish()
    endpoint.free()
    # Every pull (push_pull included) counts once on every shard.
    total = MPI.COMM_WORLD.allreduce(pulls)
    if args.slow_reader_alone:
        counts = MPI.COMM_WORLD.allgather(pulls)[topology.ps_shards:]
        check(min(counts[1:]) >= 4 * counts[0],
              f"the fast clients were held to the slow reader's pace: pulls {counts}")
    if isinstance(endpoint, ParameterServerShard):
        check(endpoint.stats.pulls == total,
              f"shard {endpoint.rank} counted {endpoint.stats.pulls} pulls, clients made {total}")


if __name__ == "__main__":
    main()
