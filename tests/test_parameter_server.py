"""Roles, communicators and the sharded parameter server (Downpour SGD over MPI RMA).

The pure parts (rank-count validation, role arithmetic, back-off) are tested in-process;
everything that communicates runs as an MPI job from tests/mpi_programs/ under a timeout,
at several rank counts including odd splits. The programs check their own invariants on
every rank and raise (aborting the job) when one fails; the tests check the exit status
and that every rank reported what it verified.
"""

from __future__ import annotations

import re
import time

import pytest
from helpers.mpi_jobs import REPO, job_env, run_mpi

from distbelief.errors import ConfigError
from distbelief.ps import transport
from distbelief.ps.endpoint import TRANSPORT_ENV
from distbelief.runtime import backoff as backoff_module
from distbelief.runtime.communicators.topology import Topology, validate_rank_count

PROGRAMS = REPO / "tests" / "mpi_programs"
TIMEOUT = 90
# Both transports run on this one node: "shared" is what a one-node job uses, "rma" what a
# multi-node job uses (forced here with the programs' --transport).
TRANSPORTS = ["shared", "rma"]
# The RMA cases also run on simulated nodes (conftest.py: DISTBELIEF_TEST_NODES).
TRANSPORTS_NODES = ["shared", pytest.param("rma", marks=pytest.mark.nodes)]


def mpi4py_job(n: int, program: str, *args: object, timeout: float = TIMEOUT,
               env: dict[str, str] | None = None):
    """`mpiexec -n N python -m mpi4py PROGRAM ARGS`: an exception on any rank aborts."""
    return run_mpi(n, ["-m", "mpi4py", PROGRAMS / program, *args], timeout=timeout, env=env)


def assert_ok(proc) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"


# --- pure: rank counts and roles ----------------------------------------------------------

def test_rank_count_leaving_no_replica_names_numbers_and_fix():
    with pytest.raises(ConfigError) as err:
        validate_rank_count(world_size=2, ps_shards=2)
    message = str(err.value)
    assert "2 MPI rank(s) leave 0 for model replicas" in message
    assert "mpiexec -n 3" in message


def test_rank_count_counts_coordinator_and_partitions():
    assert validate_rank_count(3, 2) == 1
    assert validate_rank_count(5, 2) == 3
    assert validate_rank_count(8, 1, partitions=2, coordinator=True) == 3
    with pytest.raises(ConfigError, match="mpiexec -n 3"):
        validate_rank_count(2, 1, coordinator=True)
    with pytest.raises(ConfigError, match="not a multiple of partitions=2. Run with 6 or 8"):
        validate_rank_count(7, 1, partitions=2, coordinator=True)
    for bad in ({"ps_shards": -1}, {"ps_shards": 1, "partitions": 0}):
        with pytest.raises(ConfigError):
            validate_rank_count(4, **bad)


def test_without_shards_every_rank_is_a_replica():
    """sync, averaging and hogwild keep no parameters on shards (ps_shards = 0)."""
    roles = [Topology(3, r, 0) for r in range(3)]
    assert [t.replica_index for t in roles] == [0, 1, 2]
    assert roles[0].shard_ranks == range(0) and "no shards" in roles[0].describe()
    assert validate_rank_count(4, 0, partitions=2) == 2
    with pytest.raises(ConfigError, match=r"Run with 2 or 4 ranks"):
        validate_rank_count(3, 0, partitions=2)


def test_topology_rejects_bad_rank_count_on_construction():
    with pytest.raises(ConfigError):
        Topology(world_size=2, world_rank=0, ps_shards=2)
    with pytest.raises(ConfigError):
        Topology(world_size=3, world_rank=3, ps_shards=1)


def test_roles_shards_first_then_coordinator_then_replica_blocks():
    roles = [Topology(8, r, 1, partitions=2, coordinator=True) for r in range(8)]
    assert [t.role for t in roles] == ["shard", "coordinator"] + ["replica"] * 6
    assert roles[0].coordinator_rank == 1 and roles[0].num_replicas == 3
    assert [(t.replica_index, t.partition_index) for t in roles[2:]] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert roles[0].replica_ranks(2) == range(6, 8)
    assert roles[0].shard_index == 0 and roles[1].shard_index is None
    plain = [Topology(5, r, 2) for r in range(5)]
    assert [t.role for t in plain] == ["shard"] * 2 + ["replica"] * 3
    assert plain[4].replica_index == 2 and plain[2].first_replica_rank == 2


def test_backoff_doubles_up_to_the_cap_and_resets_after_work(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(backoff_module.time, "sleep", sleeps.append)
    backoff = backoff_module.Backoff(min_sleep_s=1e-4, max_sleep_s=1e-3)
    for _ in range(6):
        backoff.wait()
    assert sleeps == pytest.approx([1e-4, 2e-4, 4e-4, 8e-4, 1e-3, 1e-3])
    backoff.reset()
    sleeps.clear()
    backoff.wait()
    assert sleeps == pytest.approx([1e-4])


def test_transport_request_is_validated_before_communication(monkeypatch):
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)
    assert transport.requested_transport() == "auto"
    monkeypatch.setenv(TRANSPORT_ENV, "rma")
    assert transport.requested_transport() == "rma"
    assert transport.requested_transport("shared") == "shared"  # the caller's choice wins
    monkeypatch.setenv(TRANSPORT_ENV, "infiniband")
    with pytest.raises(ConfigError, match="DISTBELIEF_PS_TRANSPORT.*auto, shared, rma"):
        transport.requested_transport()


# --- MPI jobs ------------------------------------------------------------------------------

@pytest.mark.parametrize("n, shards, partitions, coordinator", [
    (3, 1, 1, False), (5, 2, 1, False), (6, 1, 2, True)])
def test_split_communicators(n, shards, partitions, coordinator):
    args = ["--shards", shards, "--partitions", partitions]
    proc = mpi4py_job(n, "topology_split.py", *args, *(["--coordinator"] if coordinator else []))
    assert_ok(proc)
    assert proc.stdout.count(" ok") == n


@pytest.mark.parametrize("transport", TRANSPORTS_NODES)
@pytest.mark.parametrize("n, shards, size, pushes, extra", [
    (2, 1, 1000, 20, []),
    (3, 2, 1001, 20, []),             # one replica, size not divisible by the shards
    (5, 2, 1001, 20, []),             # 2 shards + 3 replicas
    (4, 2, 1001, 20, ["--coordinator"]),
    (6, 2, 1001, 20, []),             # 2 shards + 4 replicas
    # One big shard and 4 replicas: a take (rma) or a fold (shared) without the exclusive
    # lock loses pushes here (checked by breaking the lock on purpose: rma caught in 4
    # runs out of 4, shared in 2 out of 2).
    (5, 1, 669_706, 40, []),
])
@pytest.mark.both_mpis
@pytest.mark.matrix
def test_pushes_are_applied_exactly_once(n, shards, size, pushes, extra, transport):
    proc = mpi4py_job(n, "ps_exact.py", "--shards", shards, "--size", size,
                      "--pushes", pushes, "--lr", 0.5, "--transport", transport, *extra)
    assert_ok(proc)
    for s in range(shards):
        assert f"shard {s} exact: transport={transport}" in proc.stdout


@pytest.mark.parametrize("env_value, expected", [(None, "shared"), ("rma", "rma")])
def test_auto_transport_is_shared_on_one_node_unless_the_environment_says_rma(
        env_value, expected):
    env = job_env()
    env.pop(TRANSPORT_ENV, None)
    if env_value:
        env[TRANSPORT_ENV] = env_value
    proc = mpi4py_job(3, "ps_exact.py", "--shards", 1, "--size", 1000, "--pushes", 5,
                      "--lr", 0.5, "--transport", "auto", env=env)
    assert_ok(proc)
    assert f"shard 0 exact: transport={expected}" in proc.stdout


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n, shards, adagrad", [
    (2, 1, True), (3, 2, True), (4, 2, True), (3, 1, False)])
@pytest.mark.matrix
def test_shard_optimizer_matches_local_optimizer(n, shards, adagrad, transport):
    # An odd size, so that the two shards' slices differ in length.
    proc = mpi4py_job(n, "ps_adagrad.py", "--shards", shards, "--size", 100_003,
                      "--lr", 0.05, "--pushes", 10, "--transport", transport,
                      *(["--adagrad"] if adagrad else []))
    assert_ok(proc)
    assert proc.stdout.count("matches the local optimizer after 10 pushes") == shards


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pushes_and_pulls_of_pieces_apply_at_those_coordinates_alone(transport):
    # A row-sharded sparse model's traffic (use_pieces): pieces pushed, folded lazily by
    # Adagrad on 2 shards, and pieces pulled by another replica, against a local reference.
    proc = mpi4py_job(4, "ps_adagrad.py", "--shards", 2, "--size", 10_007, "--lr", 0.05,
                      "--pushes", 6, "--transport", transport, "--adagrad", "--pieces")
    assert_ok(proc)
    assert proc.stdout.count("matches the local optimizer after 6 pushes") == 2
    assert "pulled pieces match the local optimizer" in proc.stdout


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pieces_pull_on_other_shards_than_the_push_returns(transport):
    # A batch's rows on one shard, the next batch's on another: read-your-writes must wait
    # for the shards the pull reads, and never for one only pushed to (it hung over RMA).
    proc = mpi4py_job(3, "ps_pieces_catch_up.py", "--shards", 2, "--size", 1_000,
                      "--transport", transport, timeout=60)
    assert_ok(proc)
    assert "every push seen" in proc.stdout


@pytest.mark.both_mpis
@pytest.mark.parametrize("transport", TRANSPORTS_NODES)
@pytest.mark.parametrize("n, shards, mode", [
    (2, 1, "set"), (3, 2, "set"), (4, 1, "fold"), (5, 2, "fold"), (6, 2, "fold")])
@pytest.mark.matrix
def test_pulls_are_never_torn(n, shards, mode, transport):
    # Checked by breaking the scheme on purpose: a publish (rma) or a pull (shared)
    # without its lock was caught by "set" and by "fold".
    proc = mpi4py_job(n, "ps_torn.py", "--shards", shards, "--size", 669_706,
                      "--mode", mode, "--seconds", 1.0, "--transport", transport)
    assert_ok(proc)
    assert proc.stdout.count("pulls consistent") == n - shards


@pytest.mark.both_mpis
@pytest.mark.nodes
@pytest.mark.parametrize("n, shards, mode, alone", [
    (2, 1, "set", False), (4, 2, "set", False), (3, 1, "fold", True)])
def test_a_reader_slower_than_the_publishes_still_pulls(n, shards, mode, alone):
    # Each read sleeps 50 ms once registered, before its Get, while the shards publish
    # about every millisecond: they must publish around it (the values still change) and
    # never into the buffer it reads (no torn pull). Before issue 28 (a seqlock) every
    # such read tore, and only a hold let it end. `alone`: one slow reader among fast
    # pushers holds the publishes back (two buffers), never the folds nor the others.
    proc = mpi4py_job(n, "ps_torn.py", "--shards", shards, "--size", 100_000,
                      "--mode", mode, "--seconds", 1.0, "--transport", "rma",
                      "--slow-reads", 0.05, *(["--slow-reader-alone"] if alone else []))
    assert_ok(proc)
    assert proc.stdout.count("pulls consistent") == n - shards
    assert proc.stdout.count("publish(es) held") == (shards if alone else 0)


@pytest.mark.parametrize("transport", TRANSPORTS_NODES)
@pytest.mark.parametrize("n, shards, extra", [
    (3, 1, []), (4, 2, []), (5, 2, []), (6, 1, ["--coordinator"])])
@pytest.mark.matrix
def test_staleness_counts_updates_since_pull(n, shards, extra, transport):
    proc = mpi4py_job(n, "ps_staleness.py", "--shards", shards, "--size", 1001,
                      "--updates", 5, "--transport", transport, *extra)
    assert_ok(proc)
    assert "replica A: staleness 5 then 0" in proc.stdout
    assert "replica B: 5 pushes applied" in proc.stdout


@pytest.mark.both_mpis
@pytest.mark.nodes
@pytest.mark.parametrize("push_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n, shards, size", [(2, 1, 1000), (3, 2, 1001)])
def test_rma_census_float_data_moves_only_by_put_and_get(n, shards, size, push_dtype):
    # Every one-sided call is recorded: an accumulate of anything but one int64 fails the
    # job, and so does any step whose calls differ from docs/rma-protocol.md's table.
    # bfloat16 pushes make the same calls, their Put of MPI_UINT16_T, and the parameters
    # pulled after them hold the pushes rounded to bfloat16 (checked in the program).
    proc = mpi4py_job(n, "rma_census.py", "--shards", shards, "--size", size,
                      "--push-dtype", push_dtype)
    assert_ok(proc)
    assert proc.stdout.count("census ok") == n
    assert proc.stdout.count(f"({push_dtype} pushes)") == n
    for step in ("pull", "push", "push with a run control exchange", "finish",
                 "idle shard poll", "shard poll folding one push"):
        assert f"census {step}:" in proc.stdout
    assert ("census snapshot:" in proc.stdout) == (shards > 1)


@pytest.mark.parametrize("n, args, needle, transport", [
    (2, ["--shards", 2], "2 MPI rank(s) leave 0 for model replicas", None),
    (4, ["--shards", 1, "--partitions", 2], "not a multiple of partitions=2", None),
    (3, ["--shards", 2, "--size", 1], "cannot shard 1 parameters over 2", None),
    (3, ["--shards", 1], "must be one of auto, shared, rma", "infiniband"),
    # Agreed on every rank, after the communicator split: this program's update rule
    # keeps its state in a copy, which cannot be shared.
    (3, ["--shards", 1], "requested (DISTBELIEF_PS_TRANSPORT=shared) but the optimizer",
     "shared"),
])
def test_config_error_on_every_rank_before_communication(n, args, needle, transport):
    # Plain python, no mpi4py abort: every rank must fail by itself, without waiting for
    # the others (a rank blocked in a collective would time the test out).
    env = job_env()
    if transport:
        env[TRANSPORT_ENV] = transport
    proc = run_mpi(n, [PROGRAMS / "ps_config.py", *args], timeout=TIMEOUT, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # mpiexec may interleave the ranks' lines, so count rather than split lines.
    ranks = re.findall(r"rank (\d+): ConfigError: ", proc.stdout)
    assert sorted(map(int, ranks)) == list(range(n))
    assert proc.stdout.count(needle) == n


def test_fitting_configuration_runs():
    proc = run_mpi(3, [PROGRAMS / "ps_config.py", "--shards", 2, "--size", 3], timeout=TIMEOUT)
    assert_ok(proc)
    assert proc.stdout.count("configuration fits") == 3


@pytest.mark.parametrize("n, fail, transport", [
    (4, "shard", "shared"), (3, "replica", "shared"), (5, "replica", "shared"),
    (4, "shard", "rma"), (5, "replica", "rma")])
def test_exception_on_one_rank_aborts_the_job(n, fail, transport):
    t0 = time.perf_counter()
    proc = mpi4py_job(n, "ps_abort.py", "--shards", 1, "--size", 1000, "--fail", fail,
                      "--transport", transport, timeout=60)
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0
    assert "fails on purpose" in proc.stderr
    assert "unreachable" not in proc.stdout
    assert elapsed < 30, f"abort took {elapsed:.1f} s"
