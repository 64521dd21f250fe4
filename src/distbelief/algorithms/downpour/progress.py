"""What shard 0 knows of a Downpour run's progress (RunProgress): the global steps and loss
as it last read them from the run control block, and the decision to stop, which it
writes into the block for the replicas to read.
"""

from __future__ import annotations

import math
from typing import Any

from distbelief.ps import run_control as rc


class RunProgress:
    """The run's global steps (earlier jobs' `base` included) and loss sum as last read,
    the loss of the newest training line, and why and how the run stops (the STOP and
    STOP_ARG slots: the replicas stop when they read them). Writes only shard 0's block."""

    def __init__(self, shard: Any, base: int):
        self.shard = shard  # shard 0's ParameterServerShard, which holds the block
        self.base = base  # global steps before this job
        self.steps, self.loss_total, self.loss = base, 0.0, math.nan
        self.reason: str | None = None
        self.stop_code, self.stop_arg = 0, 0

    def stop(self, code: int, reason: str, arg: int = 0) -> None:
        """Stop the run: the first reason counts, except that an error (divergence, bad
        gradients, a failed checkpoint) overrides a budget or a signal."""
        errors = (rc.STOP_BAD_GRADIENTS, rc.STOP_DIVERGED, rc.STOP_CHECKPOINT_FAILED)
        if self.stop_code and (self.stop_code in errors or code not in errors):
            return
        self.shard.add_run_control(rc.STOP, code - self.stop_code)
        self.shard.add_run_control(rc.STOP_ARG, arg - self.stop_arg)
        self.stop_code, self.stop_arg, self.reason = code, arg, reason
