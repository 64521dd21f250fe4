"""What the MPI launcher tells a process (distbelief.runtime.launcher), for MPICH's Hydra,
Open MPI's mpirun and srun, and the osc/ucx default the command line sets before MPI_Init
under Open MPI."""

from __future__ import annotations

from pathlib import Path

import pytest

from distbelief.runtime.launcher import launcher_rank, launcher_size, quiet_osc_ucx


@pytest.mark.parametrize("environ, rank, size", [
    ({}, None, 1),                                                   # no launcher
    ({"PMI_RANK": "2", "PMI_SIZE": "5"}, "2", 5),                    # Hydra, srun --mpi=pmi2
    ({"OMPI_COMM_WORLD_RANK": "3", "PMIX_RANK": "3",
      "OMPI_COMM_WORLD_SIZE": "4"}, "3", 4),                         # Open MPI's mpirun
    ({"PMIX_RANK": "1", "SLURM_STEP_NUM_TASKS": "6"}, "1", 6),       # srun --mpi=pmix
    ({"SLURM_STEP_NUM_TASKS": "6"}, None, 1),                        # srun without MPI
    ({"PMI_RANK": "", "OMPI_COMM_WORLD_RANK": "0", "PMI_SIZE": "x"}, "0", 1),
], ids=["none", "hydra", "openmpi", "srun-pmix", "srun-no-mpi", "junk"])
def test_rank_and_size_from_each_launcher(environ: dict, rank: str | None, size: int) -> None:
    assert launcher_rank(environ) == rank
    assert launcher_size(environ) == size


def test_osc_ucx_is_excluded_only_without_infiniband_and_without_a_user_choice(
        tmp_path: Path) -> None:
    none = tmp_path / "none"  # no /sys/class/infiniband at all
    environ: dict[str, str] = {}
    assert quiet_osc_ucx(environ, none) and environ == {"OMPI_MCA_osc": "^ucx"}

    empty = tmp_path / "empty"
    empty.mkdir()
    environ = {}
    assert quiet_osc_ucx(environ, empty) and environ == {"OMPI_MCA_osc": "^ucx"}

    for chosen in ("ucx", "sm,rdma", ""):  # the user's choice wins, even an empty one
        environ = {"OMPI_MCA_osc": chosen}
        assert not quiet_osc_ucx(environ, none) and environ == {"OMPI_MCA_osc": chosen}

    infiniband = tmp_path / "infiniband"
    (infiniband / "mlx5_0").mkdir(parents=True)
    environ = {}
    assert not quiet_osc_ucx(environ, infiniband) and environ == {}
