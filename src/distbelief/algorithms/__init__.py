"""The training algorithms, each a `train(config, ...)` that cli._train dispatches to.

common (what every trainer shares: run folder, data, evaluation set, stop rules and
signals, the checkpoint to start from), sgd (the single-process baseline), downpour
(asynchronous SGD against the parameter server, partitioned replicas included),
partitioned_sgd (one replica over P ranks), sandblaster/ (batch L-BFGS with work units).
A new algorithm goes here: docs/architecture.md says how.
"""
