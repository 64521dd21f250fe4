"""distbelief.train from a user's script on every rank, with a model of their own:

    mpiexec -n N python tests/mpi_programs/own_model_train.py CONFIG OUT_DIR

Prints each rank's summary (its stop reason and test accuracy), then trains again: the run
is finished, so the second call returns the same summary untouched, on every rank too."""

import sys

import own_models
from mpi4py import MPI

import distbelief

if __name__ == "__main__":
    for call in ("first", "again"):
        summary = distbelief.train(sys.argv[1], model=own_models.logistic(),
                                   overrides=[f'run.out_dir="{sys.argv[2]}"'])
        text = "None" if summary is None else (f"{summary['stop_reason']} "
                                               f"{summary['final_test_accuracy']!r}")
        print(f"rank {MPI.COMM_WORLD.Get_rank()} {call} summary: {text}", flush=True)
