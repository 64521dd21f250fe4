"""What a run leaves behind: checkpoint (atomic, sharded HDF5 checkpoints and their
manifests), metrics (config.json, metrics.jsonl, summary.json: RunRecorder), report (tables
and figures from run folders).
"""
