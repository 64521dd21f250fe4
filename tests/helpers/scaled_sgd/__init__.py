"""An algorithm with two [optimizer] keys of its own, as a new one would be added: this
folder (options.py, trainer.py) and one registry line, which tests/test_registry.py adds:

    Algorithm("scaled_sgd", "helpers.scaled_sgd.trainer:train", "sgd at a scaled rate",
              options="helpers.scaled_sgd.options:ScaledOptions", shards="ignored",
              one_process_trainer="helpers.scaled_sgd.trainer:train")
"""
