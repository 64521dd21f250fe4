"""`distbelief compare`: one configuration trained by several algorithms, one run after
another, and the paper's comparison drawn from their run folders (Dean et al. 2012,
Figures 4 and 5).

    plan      the grid of runs (algorithms x replicas x learning rates x seeds), each
              run's overrides and its MPI rank count
    running   launching each run (mpiexec or the user's launcher), progress, resume state,
              signals forwarded to the run
    results   the table (time and samples to the target, final accuracy: median and
              spread over seeds) and the two figures

It stands on config, records and runtime only: each run is a `distbelief train` process,
so its folder is exactly what train writes and `distbelief report RUN` works on it.
"""
