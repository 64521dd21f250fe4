"""DiLoCo against Downpour (n_fetch = n_push = 1, the paper's) and synchronous SGD: time and
training samples to the target test accuracy (default 88%) and the bytes each replica puts
on the wire per sample, with the reference MLP on Fashion-MNIST (configs/
fashion_mnist_mlp.toml: 784-512-512-10, Adagrad lr 0.02, batch 64), every run through the
command line, the kinds of one seed and replica count run one after the other.

    python benchmarks/bench_diloco.py --data data/fashion_mnist.h5
    python benchmarks/bench_diloco.py --data FILE --replicas 2 3 --seeds 0 1 \\
        --kinds downpour sync diloco diloco_async --inner-steps 50
    python benchmarks/bench_diloco.py --data FILE --links 0 1e9 2.5e8 --replicas 2 \
        --seeds 0 --kinds downpour sync diloco --figure slow_network.png

Kinds (R replicas):
  downpour             1 shard + R replicas, n_fetch = n_push = 1
  sync                 R ranks, one all-reduce of the gradient per step
  diloco               R ranks, synchronous DiLoCo (H = --inner-steps, outer Nesterov 0.7,
                       momentum 0.9: the configuration's defaults)
  diloco_bf16          the same with push_dtype = "bfloat16" (deltas all-gathered narrowed)
  diloco_async         1 shard + R replicas, asynchronous DiLoCo (outer Nesterov 0.7 / R per
                       delta, momentum 0.5: the asynchronous form's default)
  diloco_async_m09     the same with outer_momentum = 0.9, the synchronous form's
  diloco_async_dn      the same with outer_update = "delayed_nesterov" (Async Local-SGD's
                       rule: momentum 0.9, moved once every R deltas on their mean)
  diloco_async_rma     diloco_async over the RMA transport (the multi-node one)
  diloco_async_bf16    the same with push_dtype = "bfloat16": deltas narrowed on the wire
  torchft_diloco       the peer: torchft's DiLoCo, the diloco kind's settings
                       (benchmarks/diloco_torchft_peer.py, run by --torchft-python, a venv
                       with torch and torchft: that file's docstring says how to make it)
--steps N trains every run exactly N steps (all replicas together) with no target, so the
final accuracies compare at equal work: the accuracy cost of bfloat16 deltas, say (the
synchronous form is deterministic for a seed; samples to a target jump with the 1 s
evaluation grid).
--links RATE ... runs everything once per simulated network of RATE bytes/s (0: none;
DISTBELIEF_FAULTS link:*:0:RATEB/s: each replica sleeps its bytes sent + received over
RATE, right after each transfer; runtime/launching/faults.py); --figure draws the median time to
the target against the rate, one line per kind (R = the first --replicas).

Prints each run, then per replica count the medians over seeds and, seed by seed, each
kind's ratio to Downpour's (and to sync's and torchft's, when they ran) of the same seed: bytes
sent per sample, samples to the target, time to the target. A run that misses the target
has no samples or time to it (shown as -). `distbelief prepare fashion-mnist --out FILE`
writes the data file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "fashion_mnist_mlp.toml"
KINDS = ("downpour", "sync", "diloco", "diloco_bf16", "diloco_async", "diloco_async_m09",
         "diloco_async_dn", "diloco_async_rma", "diloco_async_bf16", "torchft_diloco")
PEER = REPO / "benchmarks" / "diloco_torchft_peer.py"


def command(kind: str, replicas: int, args: argparse.Namespace, out: Path,
            seed: int, link: float) -> tuple[list[str], dict[str, str]]:
    """The command line of one run and its extra environment."""
    if kind == "torchft_diloco":
        if not args.torchft_python.exists():
            sys.exit(f"bench_diloco: {args.torchft_python} does not exist: make the venv "
                     f"{PEER.name}'s docstring describes, or give --torchft-python")
        return [str(args.torchft_python), str(PEER), "--data", str(args.data.resolve()),
                "--replicas", str(replicas), "--seed", str(seed),
                "--inner-steps", str(args.inner_steps), "--target", str(args.target),
                "--eval-every", str(args.eval_every), "--steps", str(args.steps),
                "--max-seconds", str(args.max_seconds)], {}
    # --steps: a target no run reaches (the configuration file's would stop it early).
    stop = [f"run.max_steps={args.steps}", "run.target_accuracy=1.0"] if args.steps else \
        [f"run.target_accuracy={args.target}"]
    sets = [f'data.path="{args.data.resolve()}"', f'run.out_dir="{out}"',
            f"run.seed={seed}", *stop, f"run.max_seconds={args.max_seconds}",
            "run.threads=1",
            f"run.eval_every_seconds={args.eval_every}",
            "run.checkpoint_every_seconds=0"]
    env: dict[str, str] = {}
    ranks = replicas
    if kind == "downpour":
        sets += ['optimizer.algorithm="downpour"', "cluster.ps_shards=1"]
        ranks += 1
    elif kind == "sync":
        sets += ['optimizer.algorithm="sync"', "cluster.ps_shards=0"]
    else:
        sets += ['optimizer.algorithm="diloco"', f"optimizer.inner_steps={args.inner_steps}"]
        if kind in ("diloco", "diloco_bf16"):
            sets += ["cluster.ps_shards=0"]
        else:
            sets += ["optimizer.asynchronous=true", "cluster.ps_shards=1"]
            ranks += 1
        if kind == "diloco_async_m09":
            sets += ["optimizer.outer_momentum=0.9"]
        if kind == "diloco_async_dn":
            sets += ['optimizer.outer_update="delayed_nesterov"']
        if kind in ("diloco_async_rma", "diloco_async_bf16"):
            env["DISTBELIEF_PS_TRANSPORT"] = "rma"
        if kind in ("diloco_bf16", "diloco_async_bf16"):
            sets += ['optimizer.push_dtype="bfloat16"']
    if link:
        env["DISTBELIEF_FAULTS"] = f"link:*:0:{link:g}B/s"
    train = [sys.executable, "-m", "distbelief", "train", str(CONFIG), "--fresh",
             *(arg for s in sets for arg in ("--set", s))]
    return ["mpiexec", "-n", str(ranks), *train], env


def run_one(kind: str, replicas: int, args: argparse.Namespace, seed: int,
            link: float = 0.0) -> dict:
    """One run's figures: seconds and samples to the target (None if missed), bytes sent
    and received per sample, final accuracy."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{kind}-") as folder:
        out = Path(folder)
        cmd, extra = command(kind, replicas, args, out, seed, link)
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **extra}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.max_seconds + 180, check=False)
        if proc.returncode != 0:
            sys.exit(f"{kind} R={replicas} seed {seed} failed ({proc.returncode}):\n"
                     f"{proc.stderr[-2000:]}")
        if kind == "torchft_diloco":
            result = peer_result(proc.stdout)
        else:
            result = run_result(out, args.target)
    load = os.getloadavg()[0]
    shown = "-" if result["seconds"] is None else f"{result['seconds']:.1f}s"
    samples = "-" if result["samples"] is None else f"{result['samples']:,d}"
    stale = "" if result["staleness"] is None else f", staleness {result['staleness']:.2f}"
    where = f" link {link:g} B/s" if link else ""
    print(f"  {kind:18s} R={replicas} seed {seed}{where}: {shown} and {samples} samples to "
          f"{args.target:g}; {result['sent']:,.0f} B sent, {result['received']:,.0f} B "
          f"received per sample; final {result['final']:.4f}{stale}; load {load:.1f}",
          flush=True)
    return result


def run_result(out: Path, target: float) -> dict:
    """A distbelief run's figures, from its summary.json and metrics.jsonl."""
    summary = json.loads((out / "summary.json").read_text())
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    hit = next((e for e in evals if e.get("kind") == "eval"
                and e.get("test_accuracy", 0) >= target), None)
    return {"seconds": summary["time_to_target"],
            "samples": hit["samples"] if hit is not None else None,
            "sent": summary.get("bytes_sent_per_sample"),
            "received": summary.get("bytes_received_per_sample"),
            "final": summary["final_test_accuracy"],
            "staleness": (summary.get("staleness") or {}).get("mean")}


def peer_result(stdout: str) -> dict:
    """The torchft peer's figures, from the JSON line it prints last (an all-reduce
    receives what it sends)."""
    peer = json.loads(stdout.strip().splitlines()[-1])
    return {"seconds": peer["time_to_target"], "samples": peer["samples_to_target"],
            "sent": peer["bytes_sent_per_sample"], "received": peer["bytes_sent_per_sample"],
            "final": peer["final_test_accuracy"], "staleness": None}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def show(values: list[float | None], spec: str) -> str:
    kept = [v for v in values if v is not None]
    if not kept:
        return "-"
    text = f"{statistics.median(kept):{spec}}"
    missing = len(values) - len(kept)
    return text + (f" ({missing} missed)" if missing else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--kinds", nargs="+", choices=KINDS,
                        default=["downpour", "sync", "diloco", "diloco_async"])
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--max-seconds", type=float, default=150.0)
    parser.add_argument("--eval-every", type=float, default=1.0)
    parser.add_argument("--links", type=float, nargs="+", default=[0.0],
                        help="simulated network rates in bytes/s (0: none)")
    parser.add_argument("--figure", type=Path, default=None)
    parser.add_argument("--from-log", type=Path, default=None,
                        help="no runs: read an earlier run's printed lines (its other "
                             "options given again) and report and draw them")
    parser.add_argument("--torchft-python", type=Path,
                        default=REPO / ".venv-torchft" / "bin" / "python",
                        help="the Python of a venv with torch and torchft, for the "
                             "torchft_diloco kind")
    parser.add_argument("--steps", type=int, default=0,
                        help="train exactly this many steps (all replicas) and compare the "
                             "final accuracy, instead of stopping at --target")
    args = parser.parse_args()
    print(f"bench_diloco: target {args.target:g}, H = {args.inner_steps}; {CONFIG.name}, "
          f"threads 1", flush=True)
    everything: dict[float, dict[tuple[str, int, int], dict]] = {}
    if args.from_log is not None:
        everything = read_log(args.from_log)
        args.links = sorted(everything)
    for link in args.links if args.from_log is None else ():
        results = everything[link] = {}
        for replicas in args.replicas:
            for seed in args.seeds:
                for kind in args.kinds:
                    results[kind, replicas, seed] = run_one(kind, replicas, args, seed, link)
    for link, results in everything.items():
        report(args, results, link)
    if args.figure is not None:
        plot(args, everything, args.figure)


LINE = re.compile(r"^  (\S+)\s+R=(\d+) seed (\d+)(?: link (\S+) B/s)?: (\S+?)s? and "
                  r"(\S+) samples to \S+; (\S+) B sent, (\S+) B received per sample; "
                  r"final ([0-9.]+)")


def read_log(path: Path) -> dict[float, dict[tuple[str, int, int], dict]]:
    """The runs an earlier bench printed, as run_one returned them."""
    everything: dict[float, dict[tuple[str, int, int], dict]] = {}
    for text in path.read_text().splitlines():
        match = LINE.match(text)
        if match is None:
            continue
        kind, replicas, seed, link, seconds, samples, sent, received, final = match.groups()
        number = lambda s: None if s == "-" else float(s.replace(",", ""))
        everything.setdefault(float(link or 0), {})[kind, int(replicas), int(seed)] = {
            "seconds": number(seconds), "samples": number(samples), "sent": number(sent),
            "received": number(received), "final": float(final), "staleness": None}
    return everything


def report(args: argparse.Namespace, results: dict[tuple[str, int, int], dict],
           link: float) -> None:
    where = f", simulated link {link:g} B/s" if link else ""
    for replicas in args.replicas:
        print(f"\nR = {replicas}{where}: medians over seeds {args.seeds}")
        peers = [k for k in ("downpour", "sync", "torchft_diloco") if k in args.kinds]
        print(f"  {'kind':18s} {'time (s)':>10s} {'samples':>14s} {'B sent/sample':>14s} "
              f"{'final':>7s}" + "".join(f"   vs {k}: bytes, samples, time" for k in peers))
        for kind in args.kinds:
            rows = [results[kind, replicas, s] for s in args.seeds]
            line = (f"  {kind:18s} {show([r['seconds'] for r in rows], '.1f'):>10s} "
                    f"{show([r['samples'] for r in rows], ',.0f'):>14s} "
                    f"{show([r['sent'] for r in rows], ',.0f'):>14s} "
                    f"{show([r['final'] for r in rows], '.4f'):>7s}")
            for peer in peers:
                theirs = [results[peer, replicas, s] for s in args.seeds]
                parts = [show([ratio(r[k], p[k]) for r, p in zip(rows, theirs)], spec)
                         for k, spec in (("sent", ".4f"), ("samples", ".2f"),
                                         ("seconds", ".2f"))]
                line += f"   {', '.join(parts):>32s}"
            print(line)


def plot(args: argparse.Namespace, everything: dict[float, dict], path: Path) -> None:
    """Median time to the target against the simulated link rate, one line per kind; a
    kind that missed the target at a rate is drawn at --max-seconds with an open marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replicas = args.replicas[0]
    rates = sorted((r for r in everything if r), reverse=True)
    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    markers = dict(zip(args.kinds, "xs^vD+*"))
    for kind in args.kinds:
        xs, ys, missed = [], [], []
        for rate in rates:
            times = [everything[rate][kind, replicas, s]["seconds"] for s in args.seeds]
            kept = [t for t in times if t is not None]
            if kept:
                xs.append(rate * 8 / 1e9)
                ys.append(statistics.median(kept))
            else:
                missed.append(rate * 8 / 1e9)
        line, = ax.plot(xs, ys, marker="o", label=kind)
        if missed:
            ax.plot(missed, [args.max_seconds] * len(missed), marker=markers[kind],
                    markersize=9, linestyle="none", markerfacecolor="none",
                    color=line.get_color(),
                    label=f"{kind}: missed {args.target:g} within {args.max_seconds:g} s")
        free = [everything[0.0][kind, replicas, s]["seconds"] for s in args.seeds] \
            if 0.0 in everything else []
        free = [t for t in free if t is not None]
        if free:
            ax.axhline(statistics.median(free), color=line.get_color(), linestyle=":",
                       linewidth=1)
    ax.set_xscale("log")
    ticks = [rate * 8 / 1e9 for rate in rates]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("simulated network per replica (Gbit/s, log scale)")
    ax.set_ylabel(f"time to {args.target:g} test accuracy (s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.suptitle(f"Time to {args.target:g} against the network, {replicas} replicas, "
                 f"reference MLP\n(median of seeds {args.seeds}; H = {args.inner_steps}; "
                 f"dotted: no simulated link)", fontsize="medium")
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
