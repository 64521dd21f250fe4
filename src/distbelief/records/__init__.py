"""What a run leaves behind: checkpoint (atomic, sharded HDF5 checkpoints and their
manifests), metrics (config.json, metrics.jsonl, summary.json: RunRecorder), report (tables
and figures from run folders), status (a run seen from its files), export (a trained model
as named arrays, read from a run, a checkpoint or an export file; HDF5 and safetensors
exports).
"""
