"""Each rank's share of verifying checkpoints (distbelief.algorithms.common.latest_checkpoint):
rank 0 writes two checkpoints of 4 shard parts and a replicas part under ROOT (the newer
one with its shard part DAMAGED flipped, if given), then every rank verifies together
and rank 0 prints, as one JSON line, each rank's hashed parts and the step it found.

    mpiexec -n N python tests/mpi_programs/verify_spread.py ROOT [DAMAGED]
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from distbelief.algorithms.common import latest_checkpoint
from distbelief.config import settings_hash
from distbelief.model.layout import ParamLayout, balanced_ranges
from distbelief.records import checkpoint as ckpt


def write(root: Path, step: int) -> Path:
    layout = ParamLayout([(0, "w", (40,))])
    settings = {"t": 1}
    meta = ckpt.CheckpointMeta(step, step, 0.0, settings_hash(settings))
    partial = ckpt.prepare(root, step)
    ranges = balanced_ranges(40, 4)
    params = np.arange(40, dtype=np.float32)
    records = [ckpt.write_shard_part(partial, meta, i, a, b, params[a:b], {})
               for i, (a, b) in enumerate(ranges)]
    records.append(ckpt.write_replicas_part(partial, meta, [
        ckpt.ReplicaState(0, {"step": step}, {"epoch": 0}, None, {})]))
    return ckpt.commit(root, meta, settings=settings, algorithm="downpour", layout=layout,
                       shard_ranges=ranges, optimizer_state=[], parts=records,
                       num_replicas=1, keep=3)


if __name__ == "__main__":
    comm = MPI.COMM_WORLD
    root = Path(sys.argv[1])
    if comm.Get_rank() == 0:
        write(root, 10)
        newest = write(root, 20)
        if len(sys.argv) > 2:
            with open(newest / sys.argv[2], "r+b") as f:
                f.seek(-8, 2)
                f.write(b"\xff" * 8)
    comm.Barrier()
    hashed = []
    digest = ckpt._file_digest

    def counting(path: Path) -> tuple[int, str]:
        hashed.append(f"{path.parent.name}/{path.name}")
        return digest(path)

    ckpt._file_digest = counting
    found, damaged = latest_checkpoint(root, comm)
    mine = {"rank": comm.Get_rank(), "hashed": hashed,
            "step": None if found is None else found.step,
            "damaged": [problem for _, problem in damaged]}
    everyone = comm.gather(mine, root=0)
    if comm.Get_rank() == 0:
        print(json.dumps(everyone), flush=True)
