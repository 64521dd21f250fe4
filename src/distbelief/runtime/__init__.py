"""The machinery of an MPI run, independent of the model and the algorithm, by role:

- communicators: which world rank plays which role and the communicators (topology), the
  ranks that share a node (nodes), where the shards go (placement), and polled collectives
  that never block on a dead rank (agreement).
- health: noticing dead ranks (liveness, heartbeat), stalled waits (watchdog), and the one
  live owner of a run directory (ownership: whether its owner is alive, decided as
  liveness decides for a rank, whose process_start_time liveness reads).
- launching: the process around a rank and its launcher: the guardian that turns a
  worker's death into an exit status, what the launcher says through the environment
  (launcher), ending a stuck launcher (stuck_launcher), test-only injected faults (faults).

Left here, because every role and the layers above use them and none owns them: backoff
(the spacing of polling loops), counters (what a process asked of the file system and of
one-sided MPI), memory (peak RSS per rank, a node's memory) and threads (BLAS threads).
"""
