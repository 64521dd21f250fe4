"""Noticing what died or stalled: dead ranks (liveness, heartbeat), stalled waits
(watchdog), and whether a run directory's owner is still alive (ownership)."""
