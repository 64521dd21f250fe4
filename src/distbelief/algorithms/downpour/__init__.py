"""Downpour SGD (Dean et al., NIPS 2012): asynchronous model replicas around a sharded
parameter server, over MPI one-sided communication. A replica that dies does not stop
the others.

    mpiexec -n N python -m distbelief train CONFIG      # [optimizer] algorithm = "downpour"

ROLES (distbelief.runtime.topology): world ranks 0..S-1 are parameter-server shards
(`[cluster] ps_shards = S`), the others are replicas 0..R-1 (each of P ranks with model
parallelism). Every rank validates the rank count and the data against the configuration
before it communicates, so a bad configuration ends the job with exit 2 on every rank.

REPLICAS train on disjoint parts of the training set (`TrainShard(info, replica, R,
seed)`, each with its own shuffling stream). A replica fetches the parameters before
every `n_fetch`-th step and pushes the sum of its gradients after every `n_push`-th step;
when both fall together it uses `push_pull`, one set of rounds. By default
(`optimizer.fetch = "own_pushes"`) a fetch returns parameters that contain the replica's
own earlier pushes (read-your-writes: `ParameterClient.catch_up`), which is the order in
which DistBelief's server answers a replica and makes one replica exactly sequential SGD;
the staleness of a push then counts only other replicas' updates. "asynchronous" skips
that wait (one replica ends 0.4-3 points lower at equal steps), "overlapped" also leaves
the push and the fetch in flight while the next step computes (docs/downpour.md, "Fetch").
A replica never waits for another.

RUN CONTROL (distbelief.ps.run_control). After the set-up a replica takes part in no
collective: a collective that includes a dead rank never completes. Everything it must
agree on rides on the pushes it makes anyway, through the run control block on shard 0:
each push claims its next `n_push` steps from the global step counter (atomic, so
max_steps counts TOTAL steps across replicas exactly), reports the steps it finished and
their loss sum, publishes its heartbeat and the signals it received, and reads shard 0's
commands: stop, pause for a checkpoint, lost, and at the end the teardown. With
`warm_start_steps = W`, replicas other than 0 poll the block (1 to 20 ms sleeps) and
start once replica 0 has reported W steps.

SHARDS serve (ParameterServerShard.serve: poll, fold, sleep between polls) and, between
polls, take part in rounds among themselves (distbelief.runtime.agreement.Rounds over the
shards' communicator: the shards' signals, rank 0's checkpoint and end flags). Shards
cannot be lost without losing parameters, so their collectives are safe.

SHARD 0 (Supervisor) also runs the run, between polls: it reads the control block (every
CONTROL_POLL_S at most), writes training lines and progress, evaluates snapshots of the
global parameters in a thread (replicas never stall for it), applies the stop rules
(max_seconds, target_accuracy, a non-finite training loss, a replica giving up on
non-finite gradients, a signal), asks for checkpoints, and watches the replicas.

LOST REPLICAS. Shard 0 sweeps every SWEEP_S (and at once when a SIGUSR1 is reported):
a replica whose process on this node is gone (distbelief.runtime.liveness; any of its P ranks),
whose heartbeat file on another node (distbelief.runtime.nodes says which ranks share a
node, distbelief.runtime.heartbeat how they beat) has not changed for
`run.heartbeat_timeout_seconds` (30 s), or whose BEAT in the control block has not moved
for `run.replica_timeout_seconds` (alive but stuck), is declared lost: LOST is set in its
slots (a replica that was only stalled stops when it reads it), the summary records it, checkpoints give it no part (a resume
starts it on a fresh pass), and the run goes on without it: the steps it was granted and
had not pushed (at most n_push) are not trained. Whether the other ranks live on is the
launcher's choice: MPICH's hydra keeps them with `-disable-auto-cleanup`
(docs/checkpoints-and-reliability.md says what each launcher does). A lost SHARD ends the
job: every rank checks the shards (shards each other, replicas when they sweep; by /proc
on this node, by heartbeat on another) and the first to find one gone aborts the job with
a message; a rank blocked inside MPI on a dead shard (an RMA epoch that never completes)
is ended by its stall watchdog's thread once the shard is found gone. Rerunning resumes
from the last checkpoint.

SIGNALS. SIGTERM and SIGUSR1 (SLURM's time limit, `sbatch --signal=B:USR1@N`) are counted
on the ranks they reach (common.StopSignals): replicas publish their counts in the
block, shards in their rounds. Shard 0 stops the run (STOP_SIGNAL): replicas stop after
their current block, the run ends with its final checkpoint and no final evaluation,
every rank exits 0. Hydra with `-disable-auto-cleanup` also sends SIGUSR1 (several) to
every rank when a rank dies; shard 0 tells the two apart by sweeping first: a SIGUSR1
reported within NOTICE_WINDOW_S of finding a rank gone is the launcher's notice, any other
is a stop request (so a real one that lands in that window is missed). When ranks on
other nodes are watched by heartbeat, a SIGUSR1 waits run.heartbeat_timeout_seconds
longer before it counts as a stop request, the time a death there takes to be found.

CHECKPOINTS (distbelief.records.checkpoint's format; `run.checkpoint_every_seconds`,
`checkpoint_every_steps`, `keep_checkpoints`) are global consistency points:
  1. shard 0 adds 1 to CHECKPOINT (request k);
  2. each replica reads it with its next push (all its computed steps are pushed then),
     publishes its data position and local step count with ACKED = k, and pauses,
     polling the block with sleeps;
  3. once every replica has acked k, finished, or been lost, shard 0 raises the flag in
     the next shards' round and the shards, together: fold what is pending, shard 0 names
     ckpt-<step> (bcast), each shard writes its slice and shard 0 every replica's part
     from the published positions (gather), shard 0 commits (bcast of the outcome);
  4. shard 0 adds 1 to RELEASE: the replicas go on.
The pause is about one block of the slowest replica plus the writes. A step-based
checkpoint lands at the first round after its multiple. A shard holding non-finite values
writes nothing and the run stops as diverged; a write that fails stops the run with that
error on every rank (exit 2).

NON-FINITE GRADIENTS. A replica checks every step's loss and gradient (one dot product)
and drops a non-finite gradient instead of pushing it (counted); after
`run.max_bad_gradients_in_a_row` of them it publishes GAVE_UP and stops; shard 0 stops the
run, whose final checkpoint holds the last, finite, state, and every rank raises
BadGradients (exit 2).

END OF THE RUN. A replica stops when a claim grants it nothing (max_steps used up), or
when it reads STOP or LOST. It publishes FINISHED with its final data position (its last
push is in), sends its statistics to rank 0 (point-to-point), and polls the block until
TEARDOWN. Shard 0, once every replica has finished or been lost, ends the shards' serving
with a round; then the shards, together: fold the rest, gather statistics and the final
slices, shard 0 evaluates the final parameters, the final checkpoint, summary.json;
TEARDOWN is FREE when no rank was lost (every rank then frees the windows together) and
LEAVE otherwise (no rank frees: a collective would wait for the dead; each live client
rank reads it, then sends rank 0 a message that it leaves, and shard 0 stays inside MPI
until it has every live rank's message: over RMA a rank's last epoch on shard 0's window
completes only while shard 0 progresses it, so none is left waiting in an Unlock).

METRICS: rank 0 owns the run folder (config.json, metrics.jsonl, summary.json;
distbelief.records.metrics.RunRecorder, the contract of the single-process trainer; `step` and
`samples` are totals over all replicas). summary.json adds per-replica steps, samples/s,
pushes, fetches, RMA time and staleness (mean, max, histogram), per-shard statistics,
the combined staleness and `lost_replicas`.

Threads: each replica rank uses 1 BLAS thread unless `[run] threads` says otherwise (ranks
oversubscribe small machines; more threads per rank only fight over the cores). Shards
always use 1: their own work is elementwise, and shard 0's evaluations run beside the
replicas, so more BLAS threads there would only take cores from them.

MODULES (each imports only those before it; this one imports them all): plan (the
constants, errors, DownpourPlan, grant, Ending), run (open_run, OpenRun, Start: the set-up
and the restore), replica (Replica, PartitionedReplica, make_replica), shards (_ShardRole:
what every shard does), supervisor (Supervisor: shard 0, and the summary); train is here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import RESUME_MODES, StopSignals, open_data
from distbelief.algorithms.downpour.plan import grant, plan_run
from distbelief.algorithms.downpour.replica import make_replica
from distbelief.algorithms.downpour.run import OpenRun, open_run, shard_lost_message
from distbelief.algorithms.downpour.shards import _ShardRole
from distbelief.algorithms.downpour.supervisor import Supervisor
from distbelief.config import Config
from distbelief.runtime import watchdog
from distbelief.runtime.liveness import Peers
from distbelief.runtime.threads import set_blas_threads
from distbelief.runtime.topology import Topology
from distbelief.runtime.watchdog import RankLost, abort_job

# What the command line, the tests and the benchmarks use from here.
__all__ = ["OpenRun", "grant", "open_run", "plan_run", "train"]


# ------------------------------------------------------------------------------------------
# Entry point


def train(config: Config, comm: MPI.Comm, stream: IO[str] | None = sys.stdout,
          resume: str = "auto",
          replica_role: Callable[..., Any] = make_replica,
          shard_update: Callable[[int], Any] | None = None) -> dict[str, Any] | None:
    """Run Downpour SGD on the ranks of `comm`; returns the run summary on rank 0, None
    on the other ranks.

    What a replica's fetch waits for is `optimizer.fetch` (config.FETCHES; the default,
    "own_pushes", makes one replica exactly sequential SGD). `resume` is one of common.RESUME_MODES ("auto": continue from a
    checkpoint in out_dir if there is one; "require"; "fresh").

    Collective over `comm` for the set-up: every rank calls it with the same
    configuration. It validates the rank count and data first, without communicating
    (ConfigError/DataError on every rank), then sets up and picks the checkpoint to resume
    from (any rank's UserError there is raised on every rank), opens the parameter
    server. Then replicas communicate one-sidedly only, shards among themselves (module
    docstring), and at the end every rank frees the windows together unless a rank was
    lost. Rank 0 writes the run folder and prints to `stream`; raises TrainingDiverged,
    BadGradients or CheckpointError (RunFailed off the shards) on every live rank when
    the run failed.

    `replica_role(run, network, fetch)` makes a replica rank's role and
    `shard_update(size)` a shard's update rule (default: optimizer.update's); the
    variants that reuse Downpour's machinery (EASGD: distbelief.algorithms.downpour.elastic)
    pass their own.
    """
    if resume not in RESUME_MODES:
        raise ValueError(f"resume must be one of {RESUME_MODES}, got {resume!r}")
    info, network = open_data(config)
    # Validated before the handlers go in: a bad configuration fails at once.
    topology = plan_run(config, comm.Get_size(), comm.Get_rank(), info.n_train).topology
    set_blas_threads((config.run.threads or 1) if topology.is_replica else 1)
    # Handlers first: a signal that arrives during the set-up is counted and acted on
    # once training runs, instead of killing the rank (SIGUSR1's default action).
    with StopSignals() as signals:
        # Collective: the first, so the set-up is watched too. On several nodes every
        # rank beats in out_dir (distbelief.runtime.heartbeat) until the end.
        peers = Peers.gather(comm, config.run.out_dir, config.run.heartbeat_timeout_seconds)
        guard = watchdog.Watchdog(
            topology.world_rank, topology.describe_rank, config.run.stall_warn_seconds,
            config.run.stall_abort_seconds, lambda message: abort_job(comm, message),
            peers.gone, lambda lost: _abort_for(comm, topology, lost, peers))
        others = [r for r in range(topology.world_size) if r != topology.world_rank]
        with watchdog.watching(guard), _closing(peers):
            try:
                with guard.waiting("the other ranks to set the run up", others):
                    run = open_run(config, comm, resume, stream, signals, info, network,
                                   peers, shard_update)
                with np.errstate(over="ignore", invalid="ignore"):
                    role = _make_role(run, config, network, info, stream,
                                      replica_role)
                    role.run()
                    ending = role.finish()
                run.close(ending.teardown)
            except RankLost as lost:
                _abort_for(comm, topology, lost, peers)
    ending.raise_error(config)
    return ending.summary


def _abort_for(world: MPI.Comm, topology: Topology, lost: RankLost, peers: Peers) -> None:
    """A rank this one waited for is gone where nothing can go on without it: a shard, or
    any rank during the set-up or once the run is ending. Abort the job with a message."""
    if lost.rank < topology.ps_shards:
        abort_job(world, shard_lost_message(lost.rank, f"is gone{peers.how_gone(lost.rank)}"))
    else:
        watchdog.abort_for(world, topology.describe_rank, lost)


@contextmanager
def _closing(peers: Peers) -> Iterator[None]:
    """Stop this rank's heartbeat at the end, however the run ends (but an abort)."""
    try:
        yield
    finally:
        peers.close()


def _make_role(run: OpenRun, config: Config, network: Any, info: Any,
               stream: IO[str] | None,
               replica_role: Callable[..., Any] = make_replica) -> Any:
    topology = run.plan.topology
    if topology.is_replica:  # partitioned when partitions > 1
        return replica_role(run, network, config.optimizer.fetch)
    if topology.world_rank == 0:
        return Supervisor(run, config, network, info, stream)
    return _ShardRole(run)
