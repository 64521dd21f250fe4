"""The machinery of an MPI run, independent of the model and the algorithm.

topology (which world rank plays which role, and the communicators), backoff (the spacing
of polling loops), agreement (polled collectives that never block on a dead rank),
liveness and watchdog (noticing dead and stalled ranks), guardian (the per-rank process
that turns a worker's death into an exit status), faults (test-only injected faults),
threads (BLAS thread settings), launcher (what the MPI launcher tells a process through
its environment), memory (peak RSS per rank, a node's memory), counters (what a process
asked of the file system and of one-sided MPI).
"""
