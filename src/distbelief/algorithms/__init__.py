"""The training algorithms, one module or package each, with a `train(config, ...)` that
`launch.py` runs once it set the run up; `registry.py` lists them (a new algorithm is a
folder and a line there, docs/architecture.md says how). `session.py` is the run skeleton every trainer composes
(RunSession), `common.py` what it is made of: run folder, data, evaluation set, stop
rules and signals, the checkpoint to start from. `memory_plan.py` checks, before a run is
set up, that each node can hold its ranks' predicted memory.
"""
