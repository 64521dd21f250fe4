"""`distbelief prepare`: the kinds of dataset it writes (fashion-mnist, synthetic, arrays,
libsvm, sparse-synthetic), each kind's parser and the command that runs it.
distbelief.cli adds the `prepare` command and hands it to add_prepare_kinds; the long help
texts are in cli_help.py, the flags' types in cli_types.py."""

from __future__ import annotations

import argparse
import os
from typing import Any

from distbelief import cli_help, cli_types


def add_prepare_kinds(prepare: Any) -> None:
    """`prepare`'s kinds (its subcommands), each with its options and its command."""
    raw = argparse.RawDescriptionHelpFormatter  # the prepare kinds' descriptions
    kinds = prepare.add_subparsers(dest="dataset", required=True, metavar="DATASET")
    fashion = kinds.add_parser(
        "fashion-mnist", help="convert the Fashion-MNIST IDX files",
        description="Convert the four Fashion-MNIST IDX files (gzipped or not) of a folder "
        "to HDF5. Debian's dataset-fashion-mnist package installs them under "
        "/usr/share/datasets/fashion-mnist.")
    fashion.add_argument("--src", metavar="DIR", default="/usr/share/datasets/fashion-mnist",
                         help="folder with the IDX files (default: %(default)s)")
    fashion.add_argument("--out", metavar="FILE", default="data/fashion_mnist.h5",
                         help="HDF5 file to write (default: %(default)s)")
    fashion.set_defaults(func=cmd_prepare_fashion_mnist)

    synthetic = kinds.add_parser(
        "synthetic", help="generate a synthetic classification set",
        description="Generate inputs and label them with a random teacher network: a "
        "learnable task of any size, for runs larger than any real set at hand.")
    synthetic.add_argument("--out", metavar="FILE", required=True, help="HDF5 file to write")
    synthetic.add_argument("--train", metavar="N", type=cli_types.positive_int, required=True,
                           help="number of training samples")
    synthetic.add_argument("--test", metavar="N", type=cli_types.positive_int, required=True,
                           help="number of test samples")
    synthetic.add_argument("--shape", metavar="H,W,C", type=cli_types.shape, default=(28, 28, 1),
                           help="input shape, H,W,C or a flat F (default: 28,28,1)")
    synthetic.add_argument("--classes", metavar="K", type=cli_types.positive_int, default=10,
                           help="number of classes (default: %(default)s)")
    synthetic.add_argument("--seed", metavar="S", type=int, default=0,
                           help="random seed (default: %(default)s)")
    synthetic.set_defaults(func=cmd_prepare_synthetic)

    arrays = kinds.add_parser(
        "arrays", help="convert your own arrays (.npz, .npy pairs, another HDF5 file)",
        description=cli_help.ARRAYS_HELP, formatter_class=raw)
    arrays.add_argument("source", metavar="SOURCE", nargs="?",
                        help="an .npz or HDF5 file holding the arrays (leave it out to give "
                             ".npy files to --x and --y)")
    arrays.add_argument("--out", metavar="FILE", required=True,
                        help="HDF5 file to write (an existing file is never overwritten)")
    for flag, what in (("--x", "the inputs, (N, *input_shape)"),
                       ("--y", "the labels (N,) or float targets (N,) or (N, k)"),
                       ("--x-test", "the test inputs"), ("--y-test", "the test labels")):
        sparse = " (or a scipy.sparse save_npz file)" if flag.startswith("--x") else ""
        arrays.add_argument(flag, metavar="NAME", help=f"{what}: an array's name in SOURCE, "
                            f"or a .npy file without SOURCE{sparse}")
    arrays.add_argument("--test-fraction", metavar="F", type=float,
                        help="with no test split: hold out this fraction of the rows, "
                             "chosen at random (e.g. 0.1)")
    arrays.add_argument("--classes", metavar="K", type=cli_types.positive_int,
                        help="number of classes (default: the largest label + 1)")
    arrays.add_argument("--targets", choices=("classes", "values"),
                        help="what y holds: classes (labels 0..K-1) or values (float "
                             "targets: regression, or multi-label 0/1 outputs (N, k)); "
                             "default: classes for integer y or with --classes, values for "
                             "float or bool y")
    arrays.add_argument("--scale", metavar="S", type=float,
                        help="value = stored * S (default: 1/255 for uint8 inputs, else 1)")
    arrays.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                        help="keep the rows in the source's order (by default the training "
                             "rows are written in a seeded random order, so that every "
                             "replica's block of rows holds every class)")
    arrays.add_argument("--id-rows", metavar="R,R,...", type=cli_types.positive_ints,
                        help="the inputs are integer ids, one column per field, field f's "
                             "in [0, R_f): one table size per column (an ids file, for "
                             "embedding models: docs/sparse-models.md)")
    arrays.add_argument("--seed", metavar="S", type=int, default=0,
                        help="seed of the shuffle and the held-out rows (default: %(default)s)")
    arrays.set_defaults(func=cmd_prepare_arrays)
    _libsvm_parser(kinds)
    _sparse_synthetic_parser(kinds)


def _libsvm_parser(kinds: Any) -> None:
    """`prepare libsvm`: svmlight/libsvm text to a sparse dataset (data.libsvm)."""
    libsvm = kinds.add_parser(
        "libsvm", help="convert svmlight/libsvm text (RCV1, news20, Criteo samples)",
        description=cli_help.LIBSVM_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    libsvm.add_argument("source", metavar="FILE", help="the training examples, one a line: "
                        "label id:value id:value ...")
    libsvm.add_argument("--out", metavar="FILE", required=True,
                        help="HDF5 file to write (an existing file is never overwritten)")
    libsvm.add_argument("--test", metavar="FILE",
                        help="the test examples, in the same format (default: hold out "
                             "--test-fraction of FILE's)")
    libsvm.add_argument("--features", metavar="N", type=cli_types.positive_int,
                        help="the feature table's rows: ids must be 0..N-1 (default: the "
                             "largest id in the files + 1)")
    libsvm.add_argument("--test-fraction", metavar="F", type=float,
                        help="without --test: hold out this fraction of the rows, chosen at "
                             "random (default: 0.1)")
    libsvm.add_argument("--no-shuffle", dest="shuffle", action="store_false",
                        help="keep the training rows in the file's order (by default they "
                             "are written in a seeded random order, so that every replica's "
                             "block of rows is a fair sample)")
    libsvm.add_argument("--seed", metavar="S", type=int, default=0,
                        help="seed of the shuffle and the held-out rows (default: %(default)s)")
    libsvm.set_defaults(func=cmd_prepare_libsvm)


def _sparse_synthetic_parser(kinds: Any) -> None:
    """`prepare sparse-synthetic`: the sparse workloads' data (data.synthetic_sparse)."""
    synthetic = kinds.add_parser(
        "sparse-synthetic", help="generate sparse data with a planted model (logistic, mf, "
        "fields)", description=cli_help.SPARSE_SYNTHETIC_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    synthetic.add_argument("kind", metavar="KIND", choices=("logistic", "mf", "fields"),
                           help="logistic, mf or fields")
    synthetic.add_argument("--out", metavar="FILE", required=True,
                           help="HDF5 file to write (an existing file is never overwritten)")
    count = cli_types.positive_int
    synthetic.add_argument("--train", metavar="N", type=count,
                           help="training rows (default: logistic 50,000, mf 200,000, "
                                "fields 100,000)")
    synthetic.add_argument("--test", metavar="N", type=count,
                           help="test rows (default: 10,000; mf 20,000)")
    synthetic.add_argument("--features", metavar="N", type=count,
                           help="logistic: the feature table's rows (default: 100,000)")
    synthetic.add_argument("--nnz", metavar="K", type=count,
                           help="logistic: about this many distinct ids a row (default: 40)")
    synthetic.add_argument("--users", metavar="N", type=count,
                           help="mf: user ids (default: 10,000)")
    synthetic.add_argument("--items", metavar="N", type=count,
                           help="mf: item ids (default: 5,000)")
    synthetic.add_argument("--rank", metavar="K", type=count,
                           help="mf: the planted factors' rank (default: 8)")
    synthetic.add_argument("--noise", metavar="S", type=float,
                           help="mf: the targets' noise, a standard deviation (default: 0.1; "
                                "the floor is about its square)")
    synthetic.add_argument("--fields", metavar="F", type=count,
                           help="fields: id fields a row (default: 8)")
    synthetic.add_argument("--field-rows", metavar="N", type=count,
                           help="fields: each field's table rows (default: 10,000)")
    synthetic.add_argument("--dim", metavar="D", type=count,
                           help="fields: the planted embeddings' width (default: 4)")
    synthetic.add_argument("--zipf", metavar="A", type=cli_types.positive_float,
                           help="the ids' Zipf exponent: rank r is drawn with weight "
                                "(r + 1)**-A (default: 1.1)")
    synthetic.add_argument("--seed", metavar="S", type=int, default=0,
                           help="random seed (default: %(default)s)")
    synthetic.set_defaults(func=cmd_prepare_sparse_synthetic)



def cmd_prepare_fashion_mnist(args: argparse.Namespace) -> int:
    from distbelief.data.converters import convert_idx
    from distbelief.errors import DataError

    if not os.path.isdir(args.src):
        raise DataError(f"{args.src}: no such folder; install Debian's Fashion-MNIST package "
                        "(sudo apt-get install dataset-fashion-mnist) or give the folder "
                        "holding the four IDX files with --src DIR")
    print(f"wrote {convert_idx(args.src, args.out)}")
    return 0


def cmd_prepare_arrays(args: argparse.Namespace) -> int:
    from distbelief.data.arrays import convert_arrays

    convert_arrays(args.source, args.out, args.x, args.y, args.x_test, args.y_test,
                   test_fraction=args.test_fraction, classes=args.classes, scale=args.scale,
                   shuffle=args.shuffle, seed=args.seed, targets=args.targets,
                   id_rows=args.id_rows)
    return 0


def cmd_prepare_libsvm(args: argparse.Namespace) -> int:
    from distbelief.data.libsvm import convert_libsvm

    convert_libsvm(args.source, args.out, test=args.test, features=args.features,
                   test_fraction=args.test_fraction, shuffle=args.shuffle, seed=args.seed)
    return 0


def cmd_prepare_sparse_synthetic(args: argparse.Namespace) -> int:
    from distbelief.data.synthetic_sparse import Options, kind_options, make_sparse_synthetic

    given = kind_options(args.kind, vars(args))
    shared = {name: getattr(args, name) for name in ("train", "test", "zipf")
              if getattr(args, name) is not None}
    made = make_sparse_synthetic(args.kind, args.out,
                                 Options(**given, **shared, seed=args.seed))
    print(f"wrote {made.summary()}")
    return 0


def cmd_prepare_synthetic(args: argparse.Namespace) -> int:
    from distbelief.data.converters import make_synthetic

    path = make_synthetic(args.out, args.train, args.test, args.shape, args.classes,
                          seed=args.seed)
    print(f"wrote {path}")
    return 0
