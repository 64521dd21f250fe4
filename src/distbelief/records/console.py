"""Progress lines on the terminal, and what happens when nobody reads them any more.

A training run prints its progress to a stream (rank 0's standard output). Everything it
prints is also in metrics.jsonl and summary.json, so the terminal is a view, not a
record: when its reader leaves (`distbelief train ... | head`, a closed ssh session) the
run must go on and end as it would have, with its checkpoints. Python raises
BrokenPipeError on such a write; `say` takes it as "stop printing", once.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import IO

# The streams whose reader left; nothing more is written to them. Weak, so that a stream
# gone and another created in its place (the same id) is not taken for it.
_closed: weakref.WeakSet = weakref.WeakSet()


def say(stream: IO[str] | None, text: str) -> None:
    """Print a line of `text` to `stream` (None: stay quiet) and flush it. A stream whose
    reader left is silenced, with one note on stderr, instead of ending the run."""
    if stream is None or stream in _closed:
        return
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        _closed.add(stream)
        _point_at_devnull(stream)
        print("distbelief: the reader of the output left (a pipe was closed); the run goes "
              "on, and its progress is in metrics.jsonl", file=sys.stderr, flush=True)


def _point_at_devnull(stream: IO[str]) -> None:
    # What is still buffered in `stream` is flushed again at exit, and would raise again:
    # send it, and anything a later plain print writes there, to /dev/null instead.
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file (a StringIO in tests): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
