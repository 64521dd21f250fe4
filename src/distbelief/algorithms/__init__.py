"""The training algorithms, each a `train(config, ...)` that cli._train dispatches to.

sgd (the single-process baseline, and today the run set-up the others share), downpour
(asynchronous SGD against the parameter server), partitioned_sgd (one replica over P ranks,
and Downpour's partitioned replica), sandblaster/ (batch L-BFGS with work units).
"""
