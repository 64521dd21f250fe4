"""What the MPI launcher tells a process through its environment, read before MPI starts
(so that a plain run never starts MPI), for MPICH's Hydra, SLURM's srun and Open MPI's
mpirun (PRRTE) alike; and the Open MPI settings the command line defaults before MPI_Init.
Once MPI is up, world_rank reads this process's rank from mpi4py instead.

Each launcher names the rank and the job size in its own variables:

| launcher | rank | size |
|---|---|---|
| MPICH's Hydra, srun --mpi=pmi2 | PMI_RANK | PMI_SIZE |
| Open MPI's mpirun / mpiexec | OMPI_COMM_WORLD_RANK (and PMIX_RANK) | OMPI_COMM_WORLD_SIZE |
| srun --mpi=pmix (Open MPI 5 on SLURM) | PMIX_RANK | none: SLURM_STEP_NUM_TASKS |
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")

OSC_VARIABLE = "OMPI_MCA_osc"
INFINIBAND_DEVICES = Path("/sys/class/infiniband")


def launcher_rank(environ: Mapping[str, str] = os.environ) -> str | None:
    """This process's world rank as the launcher set it, or None outside a launcher."""
    for name in RANK_VARIABLES:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return value
    return None


def sends_death_notices(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the launcher may signal SIGUSR1 to every rank when one dies: MPICH's Hydra
    does under -disable-auto-cleanup (its proxies set HYDI_CONTROL_FD in every rank). srun
    and Open MPI's mpirun send nothing (benchmarks/probe_signals.py), so there every
    SIGUSR1 is a stop request."""
    return "HYDI_CONTROL_FD" in environ


def launcher_size(environ: Mapping[str, str] = os.environ) -> int:
    """The number of ranks the launcher started; 1 outside a launcher."""
    names = list(SIZE_VARIABLES)
    if "PMIX_RANK" in environ:
        # A PMIx launcher other than Open MPI's own (srun --mpi=pmix) sets no size variable;
        # SLURM names the step's task count.
        names.append("SLURM_STEP_NUM_TASKS")
    for name in names:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def launched_with_several_ranks() -> bool:
    """True when an MPI launcher (MPICH/Slurm PMI, Open MPI) started more than one rank.

    Read from the launcher's environment so that a plain run never starts MPI.
    """
    if "mpi4py.MPI" in sys.modules:
        return True  # e.g. `python -m mpi4py -m distbelief`: MPI is up already
    return launcher_size() > 1


def world_rank() -> int:
    """This process's rank in COMM_WORLD, 0 when MPI was never started."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 0
    return mpi.COMM_WORLD.Get_rank()


def quiet_osc_ucx(environ: MutableMapping[str, str] = os.environ,
                  devices: Path = INFINIBAND_DEVICES) -> bool:
    """Exclude Open MPI's osc/ucx component on a machine without InfiniBand devices, unless
    the user chose the one-sided components (OMPI_MCA_osc set, even empty). Returns whether
    it did. Call before MPI_Init; other MPIs ignore the variable.

    Why: Open MPI 5 asks osc/ucx first at every window creation; where UCX finds no device
    it supports (no InfiniBand: workstations, CI, containers) the component declines, and
    says so as `osc_ucx_component.c:375 Error` on every rank and for every window. Open MPI
    goes on with osc/rdma or osc/sm either way. With an InfiniBand device present osc/ucx
    is the component clusters use, and distbelief's RMA transport is built for it (Put,
    Get and int64 atomics only: docs/rma-protocol.md); CI tests it by forcing it onto
    UCX's shared-memory transports (OMPI_MCA_osc=ucx, which this leaves alone).
    """
    if OSC_VARIABLE in environ or _has_devices(devices):
        return False
    environ[OSC_VARIABLE] = "^ucx"
    return True


def _has_devices(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError:
        return False
