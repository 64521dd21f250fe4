"""What several test files use: command-line arguments, exit statuses, damaged files.
Fixtures live in conftest.py; helpers of one algorithm's tests in helpers/<algorithm>.py."""

from __future__ import annotations

import re
from pathlib import Path

import h5py


def set_args(*overrides: str) -> list[str]:
    return [arg for override in overrides for arg in ("--set", override)]


def exit_statuses(proc) -> list[int]:
    """The per-rank statuses printed by cli_exit_status.py, in rank order."""
    found = sorted((int(r), int(s)) for r, s in re.findall(r"rank (\d+) exit (\d+)", proc.stdout))
    return [status for _, status in found]


def flip_bytes(path: Path) -> None:
    """Flip a few bytes in the middle of the parameters: same size, different content."""
    data = bytearray(path.read_bytes())
    with h5py.File(path, "r") as f:
        offset = f["params"].id.get_offset()
    for i in range(offset + 8, offset + 12):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))

