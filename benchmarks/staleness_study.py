"""Issue 45's staleness study: Downpour with many replicas on few cores, where staleness
is large and measured, and what each staleness option does about it.

Every run is `distbelief compare` on configs/fashion_mnist_mlp.toml (the reference MLP
784-512-512-10 on Fashion-MNIST, batch 64), Downpour on 1 shard + R replicas (R + 1
ranks; on a 2-core machine every R here is OVERSUBSCRIBED, so the tail of the staleness
is what the OS scheduler makes it). Runs are made comparable by an equal sample budget,
`run.max_steps` global steps of one batch (`--steps`), not by seconds; `--max-seconds`
is only a guard, and the target is set out of reach (0.99) so that no run stops early.

    python benchmarks/staleness_study.py                 # run every part, then report
    python benchmarks/staleness_study.py --parts adagrad,dcasgd --seeds 0
    python benchmarks/staleness_study.py --report-only   # the tables and the figure only

The parts (each one `compare` folder under --out; seeds 0 and 1, except sgd_rate and
rates, seed 0):

    sgd_rate     fixed-rate SGD at R = 4, lr 0.05 and 0.2: the rate picked for `sgd`
    adagrad      Adagrad (lr 0.02) x {plain, max_staleness=2, staleness_scaling=inverse},
                 R = 4, 8, 16
    dcasgd       update = "dcasgd" (an update rule of its own, SGD with delay
                 compensation, dc_lambda 0.04), at the SGD rate, R = 4, 8, 16
    sgd          fixed-rate SGD (lr 0.05, the rate that trains at R = 4) x the 3 options
    adarevision  AdaRevision (lr 0.02) x the 3 options
    rates        the rate at which each first fails, at R = 16: Adagrad x the 3 options
                 at lr 0.08, 0.32 and 0.16 (0.02 is in `adagrad`), dcasgd at 0.2, 0.8
                 and 0.1; and plain Adagrad at R = 4 at the same rates, for the "more
                 replicas need a smaller rate" complaint (0.16 and 0.1 were added once
                 0.08 and 0.32 had bracketed the failures)
    straggler    R = 8, replica 7 (rank 8) 3x slower (DISTBELIEF_FAULTS delay:8:0:3x),
                 plain against max_staleness=2
    link         R = 8, every replica behind a simulated 500 MB/s link
                 (DISTBELIEF_FAULTS link:*:0:500e6B/s), plain against max_staleness=2

The report reads each run's summary.json (final test accuracy, per-push staleness mean
and max, clock_lead for the bounded runs) and compare.json, prints the tables as
markdown (also written to OUT/study.md) and draws docs/figures/staleness_study.png:
final accuracy against replicas per method, and mean staleness against replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "fashion_mnist_mlp.toml"
FIGURE = ROOT / "docs" / "figures" / "staleness_study.png"

ADAGRAD_LR = 0.02
SGD_LR = 0.05
FAIL_BELOW = 0.5  # a run "fails" with a final test accuracy below this, or no result

OPTIONS = {  # the option's name in the tables -> its compare overrides
    "plain": "",
    "max_staleness=2": "optimizer.max_staleness=2",
    "inverse": 'optimizer.staleness_scaling="inverse"',
}
RULES = {"adagrad": "", "sgd": 'optimizer.update="sgd"',
         "adarevision": 'optimizer.update="adarevision"',
         "dcasgd": 'optimizer.update="dcasgd"'}


def spec(rule: str, option: str) -> str:
    overrides = [o for o in (RULES[rule], OPTIONS[option]) if o]
    return "downpour" + (":" + ",".join(overrides) if overrides else "")


def invocation(folder: str, algorithms: list[str], replicas: list[int], rates: list[float],
               faults: str | None = None, seeds: str = "0,1") -> dict:
    """One compare run: its folder under --out, algorithms, replica counts, learning rates,
    the DISTBELIEF_FAULTS it runs under, and its seeds (unless --seeds gives others)."""
    return {"folder": folder, "algorithms": algorithms, "replicas": replicas,
            "rates": rates, "faults": faults, "seeds": seeds}


def parts() -> dict[str, list[dict]]:
    """Each part: the compare invocations it makes."""
    three = list(OPTIONS)
    adagrad = [spec("adagrad", o) for o in three]
    bounded = [spec("adagrad", o) for o in ("plain", "max_staleness=2")]
    dcasgd = [spec("dcasgd", "plain")]
    a, s = ADAGRAD_LR, SGD_LR
    return {
        "sgd_rate": [invocation("sgd_rate", [spec("sgd", "plain")], [4], [s, 4 * s],
                                seeds="0")],
        "adagrad": [invocation("adagrad", adagrad, [4, 8, 16], [a])],
        "dcasgd": [invocation("dcasgd", dcasgd, [4, 8, 16], [s])],
        "sgd": [invocation("sgd", [spec("sgd", o) for o in three], [16, 4, 8], [s])],
        "adarevision": [invocation("adarevision", [spec("adarevision", o) for o in three],
                                   [16, 4, 8], [a])],
        "rates": [invocation("rates_adagrad", adagrad, [16], [4 * a, 16 * a, 8 * a],
                             seeds="0"),
                  invocation("rates_dcasgd", dcasgd, [16], [4 * s, 16 * s, 2 * s],
                             seeds="0"),
                  invocation("rates_r4", [spec("adagrad", "plain")], [4],
                             [4 * a, 16 * a, 8 * a], seeds="0")],
        "straggler": [invocation("straggler", bounded, [8], [a], "delay:8:0:3x")],
        "link": [invocation("link", bounded, [8], [a], "link:*:0:500e6B/s")],
    }


def run_part(invocation: dict, out: Path, steps: int, max_seconds: float,
             seeds: str | None) -> None:
    argv = [sys.executable, "-m", "distbelief", "compare", str(CONFIG)]
    for algorithm in invocation["algorithms"]:
        argv += ["--algorithm", algorithm]
    argv += ["--replicas", ",".join(map(str, invocation["replicas"])),
             "--learning-rates", ",".join(f"{r:g}" for r in invocation["rates"]),
             "--seeds", seeds or invocation["seeds"], "--set", f"run.max_steps={steps}",
             "--max-seconds", f"{max_seconds:g}", "--target", "0.99",
             "--out", str(out / invocation["folder"])]
    env = dict(os.environ)
    env.pop("DISTBELIEF_FAULTS", None)
    if invocation.get("faults"):
        env["DISTBELIEF_FAULTS"] = invocation["faults"]
    print(("DISTBELIEF_FAULTS=" + invocation["faults"] + " " if invocation.get("faults")
           else "") + " ".join(argv[1:]), flush=True)
    subprocess.run(argv, env=env, check=False)


# ---- the report -------------------------------------------------------------------------

def describe(run: dict) -> tuple[str, str]:
    """(rule, option) of a compare.json run, from its overrides."""
    overrides = " ".join(run["overrides"])
    rule = next((r for r, o in RULES.items() if o and o in overrides), "adagrad")
    option = next((n for n, o in OPTIONS.items() if o and o in overrides), "plain")
    return rule, option


def collect(out: Path) -> list[dict]:
    rows = []
    for state_file in sorted(out.glob("*/compare.json")):
        folder = state_file.parent
        for run in json.loads(state_file.read_text())["runs"]:
            rule, option = describe(run)
            row = {"part": folder.name, "rule": rule, "option": option, "R": run["replicas"],
                       "lr": run["learning_rate"], "seed": run["seed"], "state": run.get("state"),
                       "exit": run.get("exit_status"), "seconds": run.get("seconds")}
            summary_path = folder / "runs" / run["folder"] / "summary.json"
            if summary_path.exists():
                s = json.loads(summary_path.read_text())
                stal = s.get("staleness") or {}
                lead = s.get("clock_lead") or {}
                row.update(acc=s.get("final_test_accuracy"), steps=s.get("steps"),
                           stop=s.get("stop_reason"), wall=s.get("wall_seconds"),
                           st_mean=stal.get("mean"), st_max=stal.get("max"),
                           lead_max=lead.get("max"), lead_mean=lead.get("mean"),
                           waits=lead.get("waits"), blocks=lead.get("blocks"),
                           wait_s=lead.get("wait_seconds"))
            rows.append(row)
    return rows


def fails(row: dict) -> bool:
    return row.get("acc") is None or row["acc"] < FAIL_BELOW


def outcome(row: dict) -> str:
    """A run's final accuracy (mean staleness), and why it stopped if not at max_steps."""
    if row.get("acc") is None:
        return f"no result ({row.get('state')}, exit {row.get('exit')})"
    text = f"{row['acc']:.4f} ({row['st_mean']:.1f})"
    if row.get("stop") != "max_steps":
        text += f" [stopped: {row.get('stop')}, step {row.get('steps')}]"
    return text


def fmt(value, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def cell(group: list[dict] | None) -> str:
    """Each seed's final accuracy, then (staleness mean / max, over the seeds' runs)."""
    if not group:
        return "not run"
    done = [r for r in group if r.get("acc") is not None]
    accs = [f"{r['acc']:.4f}" for r in done]
    accs += [f"failed ({r.get('state')}, exit {r.get('exit')})" for r in group
             if r.get("acc") is None]
    text = ", ".join(accs)
    if done:
        text += (f" ({sum(r['st_mean'] for r in done) / len(done):.1f} / "
                 f"{max(r['st_max'] for r in done)})")
    leads = [r["lead_max"] for r in done if r.get("lead_max") is not None]
    if leads:
        text += f", lead {max(leads)}"
    for r in done:
        if r.get("stop") != "max_steps":
            text += f", seed {r['seed']} stopped: {r.get('stop')} at step {r.get('steps')}"
    return text


def method_name(rule: str, option: str, lr: float) -> str:
    return f"{rule} {lr:g}" + ("" if option == "plain" else f", {option}")


def report(out: Path, figure: Path) -> str:
    rows = collect(out)
    lines = []
    main = [r for r in rows if r["part"] in ("adagrad", "dcasgd", "sgd", "adarevision")]
    methods = []
    for r in main:
        key = (r["rule"], r["option"], r["lr"])
        if key not in methods:
            methods.append(key)
    counts = sorted({r["R"] for r in main})
    lines.append("Final test accuracy (mean / max per-push staleness; for a bound, the "
                 "largest clock lead), by replicas R:\n")
    lines.append("| method | " + " | ".join(f"R = {c}" for c in counts) + " |")
    lines.append("|---|" + "---:|" * len(counts))
    by: dict[tuple, list[dict]] = {}
    for r in main:
        by.setdefault((r["rule"], r["option"], r["lr"], r["R"]), []).append(r)
    for m in methods:
        lines.append(f"| {method_name(*m)} | "
                     + " | ".join(cell(by.get((*m, c))) for c in counts) + " |")

    rate_rows = [r for r in rows if r["R"] == 16 and r["part"] in
                 ("adagrad", "dcasgd", "rates_adagrad", "rates_dcasgd")]
    rate_rows += [r for r in rows if r["R"] == 4 and r["part"] in ("rates_r4",)
                  or (r["part"] == "adagrad" and r["R"] == 4 and r["option"] == "plain")]
    if any(r["part"].startswith("rates") for r in rows):
        lines.append(f"\nThe rate at which each first fails (final test accuracy below "
                     f"{FAIL_BELOW}, or no result), final accuracy at each rate:\n")
        lines.append("| method | R | rates: final accuracy (mean staleness) | first failing rate |")
        lines.append("|---|---:|---|---|")
        groups: dict[tuple, list[dict]] = {}
        for r in rate_rows:
            groups.setdefault((r["rule"], r["option"], r["R"]), []).append(r)
        for (rule, option, R), group in groups.items():
            group.sort(key=lambda r: (r["lr"], r["seed"]))
            rates = sorted({r["lr"] for r in group})
            text = ", ".join(f"{lr:g}: " + " and ".join(outcome(r) for r in group
                                                         if r["lr"] == lr)
                             for lr in rates)
            failing = next((f"{r['lr']:g}" for r in group if fails(r)),
                           f"none up to {group[-1]['lr']:g}")
            name = rule + ("" if option == "plain" else f", {option}")
            lines.append(f"| {name} | {R} | {text} | {failing} |")

    fault_rows = [r for r in rows if r["part"] in ("straggler", "link")]
    if fault_rows:
        lines.append("\nFaults at R = 8 (Adagrad lr 0.02):\n")
        lines.append("| fault | option | seed | final accuracy | staleness mean / max | "
                     "clock lead max | waited at the bound (all replicas) | wall s |")
        lines.append("|---|---|---:|---:|---|---:|---|---:|")
        for r in fault_rows:
            waited = ("-" if r.get("waits") is None else
                      f"{r['wait_s']:.1f} s, {r['waits']} of {r['blocks']} blocks")
            lines.append(f"| {r['part']} | {r['option']} | {r['seed']} | "
                         f"{fmt(r.get('acc'))} | "
                         f"{fmt(r.get('st_mean'), '.1f')} / {fmt(r.get('st_max'), 'd')} | "
                         f"{fmt(r.get('lead_max'), 'd')} | {waited} | "
                         f"{fmt(r.get('wall'), '.0f')} |")

    lines.append("\nEvery run (wall seconds, steps, stop reason):\n")
    lines.append("| part | rule | option | R | lr | seed | final acc | staleness mean / max | "
                 "steps | stop | wall s |")
    lines.append("|---|---|---|---:|---:|---:|---:|---|---:|---|---:|")
    for r in rows:
        lines.append(f"| {r['part']} | {r['rule']} | {r['option']} | {r['R']} | {r['lr']:g} | "
                     f"{r['seed']} | "
                     f"{fmt(r.get('acc'))} | {fmt(r.get('st_mean'), '.2f')} / "
                     f"{fmt(r.get('st_max'), 'd')} | {fmt(r.get('steps'), 'd')} | "
                     f"{r.get('stop') or r.get('state')} | {fmt(r.get('wall'), '.0f')} |")
    text = "\n".join(lines) + "\n"
    (out / "study.md").write_text(text)
    draw(by, methods, counts, figure)
    return text


def draw(by: dict, methods: list, counts: list, figure: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"adagrad": "tab:blue", "sgd": "tab:orange", "adarevision": "tab:green",
               "dcasgd": "tab:red"}
    styles = {"plain": ("-", "o"), "max_staleness=2": ("--", "s"), "inverse": (":", "^")}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for m in methods:
        rule, option, lr = m
        points = [(c, [r for r in by.get((*m, c), []) if r.get("acc") is not None])
                  for c in counts]
        points = [(c, g) for c, g in points if g]
        if not points:
            continue
        line, marker = styles[option]
        kw = {"color": colours[rule], "linestyle": line, "marker": marker,
                  "label": method_name(rule, option, lr)}
        xs = [c for c, _ in points]
        acc = [[r["acc"] for r in g] for _, g in points]
        mean = [sum(a) / len(a) for a in acc]
        err = [[m - min(a) for m, a in zip(mean, acc)], [max(a) - m for m, a in zip(mean, acc)]]
        left.errorbar(xs, mean, yerr=err, capsize=3, **kw)
        right.plot(xs, [sum(r["st_mean"] for r in g) / len(g) for _, g in points], **kw)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(c) for c in counts])
        ax.minorticks_off()
        ax.set_xlabel("replicas R (1 shard + R ranks, on 2 cores)")
        ax.grid(True, alpha=0.3)
    left.set_ylabel("final test accuracy")
    left.set_title("Final test accuracy, equal samples (mean; bars: seeds' range)")
    right.set_ylabel("mean staleness per push (shard updates)")
    right.set_title("Staleness each method saw")
    right.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(parts()),
                    help="comma-separated, from: " + ", ".join(parts()))
    ap.add_argument("--out", default=str(ROOT / "comparisons" / "staleness_study"))
    ap.add_argument("--steps", type=int, default=6000,
                    help="run.max_steps: global steps of batch 64 (default 6000)")
    ap.add_argument("--max-seconds", type=float, default=300.0,
                    help="a guard only (default 300)")
    ap.add_argument("--seeds", default=None,
                    help="run.seed values for every part, e.g. 0 (default: each part's "
                    "own, as the study ran: 0,1, and 0 for sgd_rate and rates); compare "
                    "runs only the runs not already finished in --out")
    ap.add_argument("--figure", default=str(FIGURE))
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    if not args.report_only:
        table = parts()
        for name in args.parts.split(","):
            for invocation in table[name]:
                run_part(invocation, out, args.steps, args.max_seconds, args.seeds)
    print(report(out, Path(args.figure)))


if __name__ == "__main__":
    main()
