"""Parameter averaging (`optimizer.algorithm = "averaging"`), issue 14's supervisor pattern,
in two forms chosen by `optimizer.elastic_alpha` (the registry's line picks the trainer):

    unset  collective.py: every rank a replica (cluster.ps_shards = 0); replicas train
           locally and every `average_every` steps their parameters are averaged with a
           polled Iallreduce. A lost replica stops the run (one line, exit 1).
    set    elastic.py: asynchronous EASGD (Zhang, Choromanska, LeCun 2015), a
           replica role on Downpour's machinery, the center variable on the
           parameter-server shards (ps_shards >= 1). A lost replica does not stop the others.

    mpiexec -n R python -m distbelief train CONFIG      # [optimizer] algorithm = "averaging"

Each module's docstring cites its sources and says what is kept local.
"""
