"""`distbelief status RUN_DIR`: what a run is doing, read from its folder alone.

Meant for a login node: no MPI, no lock, nothing written. The owner file
(distbelief.runtime.health.ownership) says whether a run holds the folder, where and since when; the
newest lines of metrics.jsonl give the last step and evaluation (a live run may be half
way through writing its last line: read_metrics drops it); checkpoints/ gives the newest
committed checkpoint (by name, not verified: `distbelief inspect` verifies) and the best
model (run.keep_best) with the figure its manifest records; summary.json
says how a run that ended stopped. config.json's run.max_steps and run.max_seconds give how
much of the budget is spent, and, while the run is alive, an ETA to the stop rule that comes
first (a budget at its step rate since it last (re)started, or its target accuracy at the
evaluations' trend), named. The last sign of life is the newer of the owner's heartbeat and
metrics.jsonl's last write, and says which it was.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from distbelief.errors import UserError
from distbelief.runtime.health import ownership

EVAL_KEYS = tuple(f"{split}_{figure}" for split in ("test", "val")
                  for figure in ("accuracy", "loss", "r2", "rmse", "auc"))
CHECKPOINTS_DIR = "checkpoints"  # distbelief.records.checkpoint.CHECKPOINTS_DIR, without h5py


def run_status(out_dir: str | Path) -> dict[str, Any]:
    """The state of the run in out_dir as a JSON-ready dict (see describe for the text)."""
    from distbelief.records.metrics import eval_accuracy, eval_loss, line_score, read_metrics

    out = Path(out_dir)
    if not out.is_dir():
        raise UserError(f"{out}: no such folder")
    names = ("owner.json", "metrics.jsonl", "summary.json", "config.json", CHECKPOINTS_DIR)
    if not any((out / name).exists() for name in names):
        raise UserError(f"{out} is not a run folder: it holds none of {', '.join(names)}")
    now = time.time()
    run_config = _run_config(out)
    timeout = float(run_config.get("owner_timeout_seconds", ownership.DEFAULT_TIMEOUT_S))
    owner = ownership.read_owner(out)
    state: dict[str, Any] = {"run_dir": str(out), "checked_at": now, "alive": False,
                             "owner": owner or None, "dead_because": None}
    if owner is not None:
        why = ownership.is_dead(owner, ownership.this_process(), timeout,
                                out / ownership.OWNER_FILE, now)
        state["alive"] = why is None
        state["dead_because"] = why
    # Two signs of life, on one clock (wall-clock UTC seconds): the owner's heartbeat,
    # refreshed every few seconds (ownership.HEARTBEAT_S), and metrics.jsonl's last write,
    # every half second while it trains. The newer is the last sign of life.
    signs = {"owner heartbeat": owner.get("heartbeat") if owner else None}
    metrics_path = out / "metrics.jsonl"
    lines: list[dict[str, Any]] = []
    if metrics_path.exists():
        lines = read_metrics(metrics_path)
        signs["metrics.jsonl written"] = metrics_path.stat().st_mtime
    # The "test" line is the model the test set scored, the best's step: not the last.
    with_step = [x for x in lines if "step" in x and x.get("kind") != "test"]
    evals = [x for x in lines if x.get("kind") == "eval"]
    state["last_step"] = with_step[-1]["step"] if with_step else None
    state["last_samples"] = with_step[-1].get("samples") if with_step else None
    state["last_eval"] = ({"step": evals[-1].get("step"), "time": evals[-1].get("time"),
                           "accuracy": eval_accuracy(evals[-1]), "loss": eval_loss(evals[-1]),
                           "score": line_score(evals[-1]),
                           "split": "validation" if "val_loss" in evals[-1] else "test",
                           **{k: evals[-1][k] for k in EVAL_KEYS if k in evals[-1]}}
                          if evals else None)
    # Downpour's lost replicas and the spares that took their parts over (events)
    state["replicas_lost"] = [x.get("replica") for x in lines if x.get("kind") == "replica_lost"]
    state["spare_takeovers"] = [{k: x.get(k) for k in ("spare", "replaced", "step", "seconds")}
                                for x in lines if x.get("kind") == "spare_took_over"]
    state["budget"] = _budget(run_config, with_step, state["alive"])
    state["last_checkpoint"] = _newest_checkpoint(out / CHECKPOINTS_DIR)
    state["best_checkpoint"] = _best_checkpoint(out / CHECKPOINTS_DIR)
    summary_path = out / "summary.json"
    summary = None
    if summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            summary = None  # being replaced right now (it is written atomically)
    state["stop_reason"] = summary.get("stop_reason") if summary else None
    state["target_met"] = ({"accuracy": summary.get("target_reached_accuracy"),
                            "step": summary.get("target_reached_step"),
                            "target": summary.get("target_accuracy")}
                           if summary and summary.get("reached_target") else None)
    known = {what: float(at) for what, at in signs.items() if at}
    newest = max(known, key=known.__getitem__, default=None)
    state["last_sign_of_life"] = known.get(newest) if newest else None
    state["sign_of_life"] = newest
    state["heartbeat"] = known.get("owner heartbeat")
    return state


def _run_config(out: Path) -> dict[str, Any]:
    """The [run] table of the run's config.json, or {} when it cannot be read."""
    try:
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        run = config["run"]
        return run if isinstance(run, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _budget(run: dict[str, Any], lines: list[dict[str, Any]],
            alive: bool) -> dict[str, Any] | None:
    """How much of run.max_steps / run.max_seconds the newest line has spent, and (alive)
    the seconds left to the stop rule that comes first (metrics.next_stop: a budget at the
    step rate since the run last started or resumed, or the target at the evaluations'
    trend), and which rule that is."""
    from distbelief.records.metrics import budget_fraction, eval_figures, next_stop, target_of

    max_steps, max_seconds = int(run.get("max_steps") or 0), float(run.get("max_seconds") or 0)
    target = target_of(run)
    if not lines or not (max_steps or max_seconds or target is not None):
        return None
    last = lines[-1]
    since = [x for x in lines if x.get("kind") == "resume"] or lines[:1]
    first = since[-1]
    spent = float(last.get("time", 0.0)) - float(first.get("time", 0.0))
    rate = (last["step"] - first["step"]) / spent if spent > 0 else 0.0
    elapsed = float(last.get("time", 0.0))
    evals = []  # (time, the target metric's value; a falling metric's negated: next_stop)
    for x in lines:
        value = eval_figures(x).get(target.metric) if target and x.get("kind") == "eval" \
            else None
        if value is not None and "time" in x:
            evals.append((float(x["time"]), value if target.rises else -value))
    found = next_stop(last["step"], elapsed, max_steps, max_seconds, rate, target,
                      evals) if alive else None
    return {"max_steps": max_steps, "max_seconds": max_seconds,
            "target_accuracy": run.get("target_accuracy"),
            "target": None if target is None else target.to_dict(),
            "fraction": budget_fraction(last["step"], elapsed, max_steps, max_seconds),
            "seconds_left": None if found is None else found[0],
            "eta_rule": None if found is None else found[1]}


def _newest_checkpoint(root: Path) -> dict[str, Any] | None:
    if not root.is_dir():
        return None
    found = []
    for path in root.iterdir():
        prefix, _, number = path.name.partition("-")
        if prefix == "ckpt" and number.isdigit() and path.is_dir():
            found.append((int(number), path))
    if not found:
        return None
    step, path = max(found)
    return {"step": step, "path": str(path), "written_at": path.stat().st_mtime}


def _best_checkpoint(root: Path) -> dict[str, Any] | None:
    """The newest best-* folder (run.keep_best) and the evaluation its manifest records
    (read, not verified)."""
    if not root.is_dir():
        return None
    found = [(int(p.name[5:]), p) for p in root.iterdir()
             if p.name.startswith("best-") and p.name[5:].isdigit() and p.is_dir()]
    if not found:
        return None
    step, path = max(found)
    try:
        best = json.loads((path / "manifest.json").read_text(encoding="utf-8"))["best"]
        score = str(best.get("score") or "accuracy")
        accuracy, split = float(best[score]), str(best.get("split", "test"))
    except (OSError, ValueError, KeyError, TypeError):
        accuracy, split, score = None, None, "accuracy"
    return {"step": step, "path": str(path), "accuracy": accuracy, "split": split,
            "score": score}


def _ago(then: float | None, now: float) -> str:
    if then is None:
        return "never"
    seconds = max(0.0, now - then)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def describe(state: dict[str, Any]) -> str:
    """The state as a few lines for a person."""
    from distbelief.records.metrics import eta_text

    now = state["checked_at"]
    owner = state["owner"]
    # The heartbeat is said once, on the last line, beside the other sign of life.
    if state["alive"]:
        head = f"running: {ownership.describe_owner(owner, now, heartbeat=False)}"
    elif owner is not None:
        head = (f"not running: its owner ({ownership.describe_owner(owner, now, False)}) "
                f"is taken for dead: {state['dead_because']}; the next run takes over")
    elif state["stop_reason"]:
        head = f"ended ({state['stop_reason']})"
        met = state.get("target_met")
        if state["stop_reason"] == "target_accuracy" and met and met["accuracy"] is not None:
            head += (f": {met['accuracy']:.4f} at step {met['step']:,d} met the target "
                     f"{met['target']:g}")
    else:
        head = "not running (no owner, no summary: the run was killed, or has not started)"
    lines = [f"{state['run_dir']}: {head}"]
    step = state["last_step"]
    lines.append(f"  last step:         {'-' if step is None else f'{step:,d}'}")
    ev = state["last_eval"]
    if ev:
        accuracy = ev.get("accuracy")
        shown = "-" if accuracy is None else f"{accuracy:.4f}"
        lines.append(f"  last evaluation:   {ev.get('split', 'test')} "
                     f"{ev.get('score', 'accuracy')} {shown} at "
                     f"step {ev.get('step'):,d}")
    else:
        lines.append("  last evaluation:   none yet")
    budget = state.get("budget")
    if budget:
        limits = " and ".join(text for text in (
            f"run.max_steps = {budget['max_steps']:,d}" if budget["max_steps"] else "",
            f"run.max_seconds = {budget['max_seconds']:g}" if budget["max_seconds"] else "")
            if text)
        fraction = budget["fraction"]
        spent = ("no run.max_steps or run.max_seconds" if fraction is None
                 else f"{100 * fraction:.0f}% of {limits}")
        left = budget["seconds_left"]
        eta = "" if left is None else f"; {eta_text(left, budget['eta_rule'])}"
        lines.append(f"  budget:            {spent}{eta}")
    lost, takeovers = state.get("replicas_lost"), state.get("spare_takeovers")
    if lost:
        taken = "".join(f"; spare {t['spare']} took replica {t['replaced']}'s part at step "
                        f"{t['step']:,d}" for t in takeovers or ())
        lines.append(f"  replicas lost:     {', '.join(map(str, lost))}{taken}")
    ck = state["last_checkpoint"]
    best = state.get("best_checkpoint")
    if best:
        figure = ("" if best["accuracy"] is None
                  else f", {best['split']} {best.get('score', 'accuracy')} "
                       f"{best['accuracy']:.4f}")
        lines.append(f"  best checkpoint:   {best['path']} (step {best['step']:,d}{figure})")
    lines.append(f"  last checkpoint:   {ck['path']} (step {ck['step']:,d}, written "
                 f"{_ago(ck['written_at'], now)})" if ck else "  last checkpoint:   none")
    lines.append(f"  last sign of life: {_sign_of_life(state, now)}")
    return "\n".join(lines)


def _sign_of_life(state: dict[str, Any], now: float) -> str:
    """"0s ago (metrics.jsonl written; owner heartbeat 4s ago)": the newest sign, what it
    was, and the owner's heartbeat when that is not it (it is refreshed only every few
    seconds, so on a training run it is the older of the two)."""
    newest, beat = state["last_sign_of_life"], state.get("heartbeat")
    if newest is None:
        return "never"
    what = state.get("sign_of_life") or "owner heartbeat"
    text = f"{_ago(newest, now)} ({what}"
    if beat is not None and what != "owner heartbeat":
        text += f"; owner heartbeat {_ago(beat, now)}"
    return text + ")"
