"""The `distbelief` command line: train, compare, report, status, prepare, inspect,
costmodel, evaluate, export.

`main()` is the entry point of both `distbelief` and `python -m distbelief`. A UserError
(bad configuration or data) becomes one line, `distbelief: error: <message>`, on stderr and
exit status 2; anything else is a bug and keeps its traceback. Under MPI with several ranks
an unhandled exception aborts the whole job (a rank that just exits would leave the others
waiting forever), and a UserError, which every rank hits because they all validate the same
inputs, is printed by rank 0 only.

mpi4py is imported only when the run needs MPI (starting MPI costs time): for
`algorithm = "downpour"` or `"sandblaster"`, or when an MPI launcher started several ranks.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from distbelief import __version__, cli_help, cli_prepare, cli_types
from distbelief.algorithms import registry
from distbelief.errors import EXIT_USER_ERROR, UserError
from distbelief.model import subnormals
from distbelief.runtime.launching import guardian, launcher
from distbelief.runtime.launching.guardian import start_mpi

PROG = "distbelief"


def _algorithm_lines() -> str:
    """The registry's algorithms, one entry each: the name and its summary."""
    import textwrap

    width = max(len(name) for name in registry.names())
    return "\n".join(textwrap.fill(a.summary, 88, initial_indent=f"  {a.name:<{width}}  ",
                                   subsequent_indent=" " * (width + 4))
                     for a in registry.ALGORITHMS)


def _train_help() -> str:
    return cli_help.TRAIN_HELP.format(algorithms=_algorithm_lines())


def _algorithm_list() -> str:
    """'sgd (one process, the baseline), ... and hogwild (...)', from the registry."""
    named = [f"{a.name} ({a.summary})" for a in registry.ALGORITHMS]
    return ", ".join(named[:-1]) + " and " + named[-1]


def _command(commands: Any, name: str, summary: str, description: str,
             func: Callable[[argparse.Namespace], int] | None = None) -> Any:
    """A subcommand that `func` runs: `summary` in the list of commands, `description`
    (its paragraphs and examples kept as written) in its --help."""
    parser = commands.add_parser(name, help=summary, description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if func is not None:
        parser.set_defaults(func=func)
    return parser


def _json_option(parser: Any, what: str = "") -> None:
    """--json: print `what` as one JSON object, for scripts."""
    parser.add_argument("--json", action="store_true",
                        help=f"print {what + ' as ' if what else ''}one JSON object, for scripts")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="DistBelief (Dean et al., NIPS 2012) on MPI. Algorithms "
        f"(optimizer.algorithm): {_algorithm_list()}; with cluster.partitions = P, "
        "sgd, downpour and sandblaster split each model replica over P ranks "
        "(partitioned model parallelism).",
        epilog="Run 'distbelief COMMAND --help' for each command's options and examples.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = _command(commands, "train", "train a model from a TOML configuration",
                     _train_help(), cmd_train)
    train.add_argument("config", metavar="CONFIG", help="the TOML configuration file")
    train.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
                       dest="overrides",
                       help="override one configuration key; VALUE is read as TOML "
                            "(100, 1e-3, true, \"text\", [1, 2]) or else as a bare string; "
                            "may be repeated")
    _model_option(train, "instead of [model]'s layers")
    start = train.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="resume from the newest valid checkpoint in run.out_dir; fail if "
                            "there is none (without this flag a run resumes when it can and "
                            "starts fresh otherwise)")
    start.add_argument("--fresh", action="store_true",
                       help="start over: move the previous run's checkpoints, metrics, "
                            "summary and config in run.out_dir to a previous-<time>/ folder "
                            "there (nothing is deleted)")

    helper = _command(commands, "help", "print an algorithm's description and its "
                      "[optimizer] keys", cli_help.HELP_HELP, cmd_help)
    helper.add_argument("algorithm", metavar="ALGORITHM", nargs="?", default=None,
                        help=f"one of {', '.join(registry.names())}, or optimizer (the "
                             "shared keys); none: the list of algorithms")

    report = _command(commands, "report", "plot the curves of one or more runs",
                      cli_help.REPORT_HELP, cmd_report)
    report.add_argument("run_dirs", metavar="RUN_DIR", nargs="+",
                        help="a run's output folder (holding metrics.jsonl)")
    report.add_argument("--out", metavar="DIR", default=None,
                        help="folder for the PNG files (default: the run's folder; for "
                             "several runs, compare-A+B beside the first)")

    compare = _command(commands, "compare", "train one configuration with several "
                       "algorithms and compare them (table, figures)", cli_help.COMPARE_HELP,
                       cmd_compare)
    compare.add_argument("config", metavar="CONFIG", help="the base TOML configuration")
    compare.add_argument("--algorithm", metavar="NAME[:SECTION.KEY=VALUE,...]",
                         action="append", required=True, dest="algorithms",
                         help="an algorithm to run, with settings of its own; repeat it "
                              "for each algorithm")
    compare.add_argument("--replicas", metavar="R,R,...", type=cli_types.positive_ints,
                         default=(1,), help="replica counts (default: 1)")
    compare.add_argument("--seeds", metavar="S,S,...", type=cli_types.seeds, default=(0,),
                         help="run.seed values; the table gives the median and spread "
                              "over them (default: 0)")
    compare.add_argument("--learning-rates", metavar="LR,LR,...", type=cli_types.positive_floats,
                         default=(), help="optimizer.learning_rate values (default: the "
                                          "configuration's)")
    compare.add_argument("--max-seconds", metavar="S", type=cli_types.positive_float, default=None,
                         help="run.max_seconds of every run: the time budget")
    compare.add_argument("--target", metavar="VALUE", type=cli_types.positive_float,
                         default=None, help="the target of every run, replacing the "
                         "configuration's: a value of the runs' score (accuracy; r2 for "
                         "model.loss = \"mse\"), or of --target-metric")
    compare.add_argument("--target-metric", metavar="NAME", default=None,
                         help="the metric --target is a value of: loss, or one the model's "
                              "loss reports (accuracy, r2, rmse, auc); a loss or an rmse is "
                              "reached by falling to it (default: the score)")
    compare.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
                         dest="overrides", help="override a configuration key for every run "
                                                "(as train's --set); may be repeated")
    compare.add_argument("--launcher", metavar="COMMAND", default=None,
                         help="how to start a run's ranks, {n} standing for the rank count "
                              "(default: \"mpiexec -n {n}\")")
    compare.add_argument("--run-timeout", metavar="S", type=cli_types.positive_float, default=None,
                         help="end a run still going S seconds after its start and record "
                              "it as timed out (default: its run.max_seconds plus 120 s or "
                              "half the budget, whichever is more; none without a "
                              "run.max_seconds)")
    compare.add_argument("--out", metavar="DIR", default=None,
                         help="the comparison's folder (default: comparisons/<config name>)")

    status = _command(commands, "status", "say whether a run is alive, where, and "
                      "how far it got", cli_help.STATUS_HELP, cmd_status)
    status.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder")
    _json_option(status, "the same")

    inspect = _command(commands, "inspect", "show what a checkpoint holds and whether "
                       "it is valid", cli_help.INSPECT_HELP, cmd_inspect)
    inspect.add_argument("path", metavar="CHECKPOINT_OR_RUN_DIR",
                         help="a checkpoint folder, a checkpoints/ folder or a run.out_dir")

    cost = _command(commands, "costmodel", "predict step time, throughput and memory per "
                    "rank for shards x replicas x partitions, or plan a layout",
                    cli_help.COSTMODEL_HELP, cmd_costmodel)
    cost.add_argument("config", metavar="CONFIG", help="the TOML configuration file")
    cost.add_argument("--partitions", metavar="P,P,...", type=cli_types.positive_ints,
                      default=(1, 2, 4, 8), help="partition counts of one replica "
                      "(default: 1,2,4,8)")
    cost.add_argument("--layouts", metavar="S:R:P,...", type=cli_types.layouts, default=(),
                      help="Downpour layouts to predict: S shards, R replicas, P partitions "
                           "each (S = 0: one replica without shards)")
    cost.add_argument("--plan", action="store_true",
                      help="suggest the fastest layouts that fit --nodes nodes of --cores "
                           "ranks and --memory bytes each")
    cost.add_argument("--nodes", metavar="N", type=cli_types.positive_int, default=1,
                      help="nodes for --plan (default: %(default)s)")
    cost.add_argument("--cores", metavar="C", type=cli_types.positive_int, default=None,
                      help="cores per node: one rank each for --plan; with --layouts, "
                           "ranks beyond this share the cores (default: no sharing; "
                           "with --measure, this machine's count)")
    cost.add_argument("--memory", metavar="SIZE", default=None,
                      help="memory per node (64G, 512M): layouts that need more are marked "
                           "(--layouts) or left out (--plan)")
    cost.add_argument("--measure", action="store_true",
                      help="time this machine instead of --gflops, --bandwidth, --latency, "
                           "--fold-rate and --half-width")
    cost.add_argument("--gflops", type=cli_types.positive_float, default=10.0,
                      help="sustained GFLOP/s of one rank on whole layers (default: "
                           "%(default)s; --measure times it)")
    cost.add_argument("--bandwidth", metavar="GB/S", type=cli_types.positive_float, default=12.5,
                      help="link bandwidth per rank, each way, in GB/s (default: "
                           "%(default)s, 100 Gb/s InfiniBand EDR); with --plan, per node, "
                           "shared by its ranks")
    cost.add_argument("--latency", metavar="US", type=float, default=2.0,
                      help="latency per exchange, in microseconds (default: %(default)s)")
    cost.add_argument("--message-us", metavar="US", type=float, default=0.0,
                      help="processor time per message, paid one after another, in "
                           "microseconds (default: %(default)s)")
    cost.add_argument("--half-width", metavar="UNITS", type=float, default=0.0,
                      help="a layer block this many units wide computes at half the rate "
                           "of a wide one (default: %(default)s, no penalty)")
    cost.add_argument("--fold-rate", metavar="GPARAM/S", type=cli_types.positive_float, default=1.2,
                      help="parameters per second (x 1e9) a shard's Adagrad folds "
                           "(default: %(default)s)")
    cost.add_argument("--transport", choices=("rma", "shared"), default="rma",
                      help="parameter-server transport for --layouts and --plan (default: "
                           "%(default)s; shared: every rank on one node)")
    cost.add_argument("--batch", metavar="N", type=cli_types.positive_int, default=None,
                      help="batch size (default: the configuration's data.batch_size)")
    cost.add_argument("--input-shape", metavar="H,W,C", type=cli_types.shape, default=None,
                      help="input shape instead of the data file's (needs --classes)")
    cost.add_argument("--classes", metavar="K", type=cli_types.positive_int, default=None,
                      help="number of classes instead of the data file's")

    evaluate = _command(commands, "evaluate", "print a trained model's loss and "
                        "accuracy on a dataset file", cli_help.EVALUATE_HELP, cmd_evaluate)
    evaluate.add_argument("path", metavar="RUN_DIR|CHECKPOINT",
                          help="a run folder, a checkpoint folder or an export file")
    evaluate.add_argument("--data", metavar="FILE", default=None,
                          help="dataset file (default: the run's own data.path)")
    evaluate.add_argument("--split", choices=("test", "validation", "train"), default="test",
                          help="which part of the file: test, validation (the run's "
                               "held-out rows or /val) or train (default: %(default)s)")
    _which_option(evaluate)
    _model_option(evaluate, "that the run trained")
    _json_option(evaluate)

    export = _command(commands, "export", "write a trained model's weights as named "
                      "arrays (HDF5 or safetensors)", cli_help.EXPORT_HELP, cmd_export)
    export.add_argument("path", metavar="RUN_DIR|CHECKPOINT",
                        help="a run folder or a checkpoint folder")
    export.add_argument("--out", metavar="FILE", required=True, help="the file to write")
    export.add_argument("--format", choices=("hdf5", "safetensors"),
                        help="file format (default: the one FILE's extension names, .h5 "
                             "or .safetensors; a mismatch is refused)")
    export.add_argument("--with-optimizer", action="store_true",
                        help="also write the optimizer state (Adagrad's accumulators), "
                             "named optimizer.<state>.layers.<i>.weight, ...")
    _which_option(export, "; last with --with-optimizer: the best holds no optimizer "
                          "state")

    prepare = _command(commands, "prepare", "write a dataset as HDF5", cli_help.PREPARE_HELP)
    cli_prepare.add_prepare_kinds(prepare)
    return parser


# ---------------------------------------------------------------------------------------
# Commands


def cmd_train(args: argparse.Namespace) -> int:
    from distbelief.config import load_config

    several = launcher.launched_with_several_ranks()
    if several and "mpi4py.MPI" not in sys.modules and not guardian.is_worker():
        # This process is what the launcher started: it becomes the rank's guardian and
        # the same command runs as its worker (distbelief.runtime.launching.guardian says why).
        return guardian.run_guarded(args.argv)
    if guardian.is_worker():
        guardian.bind_to_guardian()
        from distbelief.runtime.launching.faults import Faults

        Faults.for_rank(int(launcher.launcher_rank() or 0)).before_mpi_init()
    from distbelief.algorithms.common import note_interrupt

    # Ctrl-C (or mpiexec forwarding it) stops a run like SIGTERM: distbelief.algorithms.common.
    signal.signal(signal.SIGINT, note_interrupt)
    # Several ranks: start MPI before anything can fail, so errors are reported once and
    # an unhandled exception aborts the job.
    comm = start_mpi() if several else None
    model = _own_model(args)
    config = load_config(args.config, args.overrides, open_data=False,  # launch opens it
                         own_model=model is not None)
    from distbelief.algorithms import launch  # numpy: after the subnormal mode is set

    return launch.run(config, comm, _resume_mode(args), model)


def _resume_mode(args: argparse.Namespace) -> str:
    """train's --resume / --fresh as a distbelief.algorithms.common.RESUME_MODES value."""
    return "require" if args.resume else "fresh" if args.fresh else "auto"


def cmd_compare(args: argparse.Namespace) -> int:
    from distbelief.compare import compare

    return compare(args.config, args.algorithms, args.replicas, args.seeds,
                   args.learning_rates, args.max_seconds, args.target, args.overrides,
                   args.launcher, args.run_timeout, args.out, args.target_metric)


def cmd_costmodel(args: argparse.Namespace) -> int:
    from distbelief.algorithms.memory_plan import costmodel

    return costmodel(args.config, partitions=args.partitions, layouts=args.layouts,
                     plan=args.plan, nodes=args.nodes, cores=args.cores, memory=args.memory,
                     measure=args.measure, gflops=args.gflops, bandwidth=args.bandwidth,
                     latency=args.latency, message_us=args.message_us,
                     half_width=args.half_width, fold_rate=args.fold_rate,
                     transport=args.transport, batch=args.batch,
                     input_shape=args.input_shape, classes=args.classes)


def cmd_inspect(args: argparse.Namespace) -> int:
    from distbelief.records.checkpoint import describe, inspect_path

    reports = inspect_path(args.path)
    print("\n\n".join(describe(r) for r in reports))
    return 0 if reports[0].valid else 1


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from distbelief.records.status import describe, run_status

    state = run_status(args.run_dir)
    print(json.dumps(state, indent=2) if args.json else describe(state))
    return 0


def cmd_help(args: argparse.Namespace) -> int:
    """`distbelief help [ALGORITHM]`: an algorithm's description and keys (config's)."""
    from distbelief import config

    if args.algorithm is None:
        print("algorithms (optimizer.algorithm):\n" + _algorithm_lines())
    elif args.algorithm == "optimizer":
        print(config.describe_shared())
    else:
        print(config.describe_algorithm(args.algorithm))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from distbelief.records.report import (
        default_out_dir,
        import_pyplot,
        load_run,
        plot_runs,
        summary_table,
        write_metrics_csv,
    )

    import_pyplot()  # fail on a missing matplotlib before reading anything
    runs = [load_run(path) for path in args.run_dirs]
    print(summary_table(runs))
    notes: list[str] = []
    out = args.out if args.out is not None else default_out_dir(args.run_dirs)
    for path in [*plot_runs(runs, out, notes), write_metrics_csv(runs, out)]:
        print(f"wrote {path}")
    for note in notes:
        print(note)
    return 0


def _which_option(parser: argparse.ArgumentParser, note: str = "") -> None:
    parser.add_argument("--which", choices=("best", "last"), default=None,
                        help="of a run folder: best, the model of its best evaluation "
                             "(run.keep_best), or last, its newest checkpoint (default: "
                             f"best where the run kept one, else last{note})")


def _model_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--model", metavar="MODULE:FACTORY", default=None, help=f"a model "
                        f"of your own, FACTORY() in MODULE, {what} (docs/your-own-model.md)")


def _own_model(args: argparse.Namespace) -> Any:
    from distbelief.model.protocol import load_factory

    return load_factory(args.model) if args.model else None


def cmd_evaluate(args: argparse.Namespace) -> int:
    import json

    from distbelief.api import evaluate_split
    from distbelief.records.export import read_trained
    from distbelief.records.metrics import FIGURES, scored_text

    trained = read_trained(args.path, data=args.data, which=args.which,
                           model=_own_model(args))
    for skipped in trained.source.get("skipped", []):
        print(f"{PROG}: skipped a damaged checkpoint: {skipped}", file=sys.stderr)
    result = evaluate_split(args.path, trained, args.data, args.split)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    which = f" ({result['which']})" if result["which"] else ""
    origin = f"; checkpoint{which} {result['checkpoint']}" if result["checkpoint"] else ""
    step = f", step {result['step']:,d}" if result["step"] is not None else ""
    kept = result["kept_for"]
    why = f", kept for its {scored_text(kept)}" if kept else ""
    figures = ", ".join(f"{name} {result[name]:.4f}" for name in ("loss", *FIGURES)
                        if result.get(name) is not None)
    print(f"{figures} on {result['data']} /{args.split} ({result['samples']:,d} samples); "
          f"model {args.path}{origin}{step}{why}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from distbelief.records.export import export_format, read_trained, write_export

    fmt = export_format(args.out, args.format)  # before the checkpoint is read
    trained = read_trained(args.path, with_optimizer=args.with_optimizer, which=args.which)
    for skipped in trained.source.get("skipped", []):
        print(f"{PROG}: skipped a damaged checkpoint: {skipped}", file=sys.stderr)
    path = write_export(trained, args.out, fmt)
    state = ", ".join(trained.state_names())
    if state:
        state = f", optimizer state {state}"
    elif args.with_optimizer:
        state = ", no optimizer state: plain SGD keeps none"
    which = f" ({trained.source['which']})" if trained.source.get("which") else ""
    kind = f"{len(trained.layers)} layers" if trained.own is None else \
        f"{trained.own['name']}, {len(trained.layout().entries)} slices"
    print(f"wrote {path} ({fmt}; {kind}{state}) from "
          f"{trained.source.get('path', args.path)}{which}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    subnormals.flush_from_the_start()  # first: before anything imports numpy
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    status = _run(args)
    guardian.end_process(status)  # returns unless MPI_Finalize must be skipped
    return status


def _run(args: argparse.Namespace) -> int:
    """The command's exit status, with user errors reported in one line (exit 2)."""
    try:
        return args.func(args)
    except UserError as e:
        if launcher.world_rank() == 0:
            message = " ".join(str(e).split("\n"))
            print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output left (`distbelief inspect run | head`): not an error.
        # Point stdout at /dev/null so that flushing it at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
