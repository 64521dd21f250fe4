"""distbelief.train from a user's script on every rank, with a model of their own:

    mpiexec -n N python tests/mpi_programs/own_model_train.py CONFIG OUT_DIR

Prints the summary's stop reason and accuracy on the rank that has it."""

import sys

import own_models

import distbelief

if __name__ == "__main__":
    summary = distbelief.train(sys.argv[1], model=own_models.logistic(),
                               overrides=[f'run.out_dir="{sys.argv[2]}"'])
    if summary is not None:
        print(f"summary: {summary['stop_reason']} {summary['final_test_accuracy']:.4f}",
              flush=True)
