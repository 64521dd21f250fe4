"""The processes around a rank: the guardian, what the launcher says through the
environment (launcher), ending a stuck launcher (stuck_launcher), test-only faults."""
