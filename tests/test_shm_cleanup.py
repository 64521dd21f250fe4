"""A job's shared-memory files in /dev/shm are removed after its ranks die, whatever kills
them: the guardian of a node's first rank tells a cleaner outside the job what its worker
maps, and the cleaner removes those files once no process maps them
(distbelief.runtime.launching.guardian.SharedSegments); never a file of another job, never one a
live process maps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from distbelief.runtime.launching.guardian import keeps_the_node_clean

MAPPER = """
import mmap, sys, time
with open(sys.argv[1], "r+b") as f:
    m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
time.sleep(120)
"""
GUARDIAN = """
import sys, time
from distbelief.runtime.launching.guardian import SharedSegments
segments = SharedSegments(int(sys.argv[1]), keeper=True)
segments.note()
print("noted", sorted(segments.seen), flush=True)
time.sleep(120)
"""


def _start(code: str, *args: object) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    return proc


def _shm_file() -> Path:
    path = Path("/dev/shm") / f"distbelief-test-{uuid.uuid4().hex}"
    path.write_bytes(b"\0" * 4096)
    return path


def _kill(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


def _gone_within(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def files():
    made: list[Path] = []

    def make() -> Path:
        made.append(_shm_file())
        return made[-1]

    yield make
    for path in made:
        path.unlink(missing_ok=True)


def test_a_job_killed_as_a_whole_leaves_nothing_and_touches_nothing_else(files):
    ours, theirs = files(), files()  # theirs: another job's file, never mapped by ours
    worker = _start(MAPPER, ours)
    assert worker.stdout.readline().strip() == "mapped"
    guardian = _start(GUARDIAN, worker.pid)
    try:
        assert str(ours) in guardian.stdout.readline()
        # What hydra does when a rank dies of a signal: SIGKILL to every process of the job.
        _kill(guardian, worker)
        assert _gone_within(ours, 15), f"{ours} was left behind"
        assert theirs.exists()
    finally:
        _kill(guardian, worker)


def test_a_file_still_mapped_by_a_live_process_waits_for_it(files):
    path = files()
    worker, neighbour = _start(MAPPER, path), _start(MAPPER, path)
    assert worker.stdout.readline().strip() == "mapped"
    assert neighbour.stdout.readline().strip() == "mapped"
    guardian = _start(GUARDIAN, worker.pid)
    try:
        assert str(path) in guardian.stdout.readline()
        _kill(guardian, worker)
        time.sleep(3.0)  # a cleaner's look or two: the neighbour (another rank) maps it
        assert path.exists()
        _kill(neighbour)
        assert _gone_within(path, 15)
    finally:
        _kill(guardian, worker, neighbour)


@pytest.mark.parametrize("environ, keeper", [
    ({"MPI_LOCALRANKID": "0"}, True), ({"MPI_LOCALRANKID": "3"}, False),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, False), ({"SLURM_LOCALID": "0"}, True),
    ({}, True),  # a launcher that says nothing: every rank keeps its node clean
])
def test_the_first_rank_of_each_node_keeps_it_clean(environ, keeper):
    assert keeps_the_node_clean(environ) is keeper
