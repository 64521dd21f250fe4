"""What several test files use: command-line arguments, exit statuses, damaged files.
Fixtures live in conftest.py; launching jobs in helpers/mpi_jobs.py; helpers of one
algorithm's tests in helpers/<algorithm>.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py

from distbelief.records.metrics import read_metrics
from helpers.configs import small_config_text

# Every replica step takes at least 0.2 ms (a test-only delay), so that a kill at step 1000
# lands early in a run of 6000 steps however fast the machine is.
DELAY = "delay:*:0:0.0002s"


def set_args(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def finished(proc, out: Path) -> tuple[dict, list[dict]]:
    """summary.json and metrics.jsonl of a run that must have exited 0."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return json.loads((out / "summary.json").read_text()), read_metrics(out / "metrics.jsonl")


def exit_statuses(proc) -> list[int]:
    """The per-rank statuses cli_exit_status.py printed, and wrote to files under
    helpers.mpi_jobs.run_mpi (a line the launcher lost is found there), in rank order."""
    found = {int(r): int(s) for r, s in re.findall(r"rank (\d+) exit (\d+)", proc.stdout)}
    found.update(getattr(proc, "exit_files", {}))
    return [found[rank] for rank in sorted(found)]


def flip_bytes(path: Path) -> None:
    """Flip a few bytes in the middle of the parameters: same size, different content."""
    data = bytearray(path.read_bytes())
    with h5py.File(path, "r") as f:
        offset = f["params"].id.get_offset()
    for i in range(offset + 8, offset + 12):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def fault_config(hidden: int | None) -> str:
    """The fault-tolerance runs' Downpour configuration: softmax regression (None) or an
    MLP of `hidden` units, batches of 128, no step limit (each test sets its own)."""
    return small_config_text(hidden, data={"batch_size": 128},
                             run={"max_steps": None, "eval_every_seconds": 1,
                                  "progress_every_seconds": 1})
