"""The long help texts of the `distbelief` commands (distbelief.cli): each command's
description, its paragraphs and examples kept as written. The list of algorithms in
TRAIN_HELP is filled in from the registry by the command line.
"""

TRAIN_HELP = """\
Train the model of a TOML configuration until one of its stop rules fires (run.max_steps,
run.max_seconds, run.target_accuracy). The whole configuration, the data file included, is
checked first. Results go to run.out_dir (default runs/<config name>): config.json,
metrics.jsonl and summary.json. A relative data.path is read from the config file's folder,
a relative run.out_dir from the current one. Every key: docs/configuration.md. With
--model, a model of your own (numpy, PyTorch, anything with init_params, loss_and_grad and
predict) trains instead of [model]'s layers: docs/your-own-model.md.

algorithms (optimizer.algorithm; `distbelief help ALGORITHM` prints one's keys):
{algorithms}

Every algorithm but sgd runs over MPI ranks, started with mpiexec; cluster.partitions = P
splits each replica over P ranks. A layout whose ranks need more memory than a node has is
refused before anything starts.

Checkpoints go to run.out_dir/checkpoints every run.checkpoint_every_seconds and when the
run stops, also on SIGTERM or SIGUSR1 (exit 0) and Ctrl-C (exit 130; a second one stops at
once). A run.out_dir holding a checkpoint of the same settings resumes from it. One live
run per run.out_dir: `distbelief status RUN_DIR` names its owner.

examples:
  distbelief train configs/fashion_mnist_mlp.toml
  distbelief train configs/fashion_mnist_mlp.toml --set run.max_steps=20000 --resume
  mpiexec -n 4 python -m distbelief train configs/fashion_mnist_downpour.toml
  mpiexec -n 3 python -m distbelief train configs/fashion_mnist_averaging.toml \\
      --set optimizer.elastic_alpha=0.45
  cd examples && mpiexec -n 3 python -m distbelief train logistic.toml --model logistic:model
  distbelief help downpour
"""

HELP_HELP = """\
Print what an algorithm does and the [optimizer] keys it owns, with their defaults and
what they do, from the declarations config reads; `optimizer` prints the keys every
algorithm shares. docs/configuration.md has the same tables.

examples:
  distbelief help downpour
  distbelief help optimizer
"""

REPORT_HELP = """\
Plot one or more finished (or running) training runs: test accuracy against wall time,
test accuracy against training samples, and training loss against samples (the mean over
each 0.5 s of steps); for Downpour runs also the staleness histogram and the replicas'
throughput, for Sandblaster runs its iterations and work units. Several runs share each
figure, labelled by their folder names. The PNG files go into the run's own folder, or,
for several runs, into a compare-A+B folder beside the first; --out chooses another.
Needs matplotlib (pip install 'distbelief[plot]').

examples:
  distbelief report runs/fashion_mnist_mlp          # writes runs/fashion_mnist_mlp/*.png
  distbelief report runs/sgd runs/downpour          # writes runs/compare-sgd+downpour/*.png
  distbelief report runs/sgd runs/downpour --out plots/
"""

COMPARE_HELP = """\
Train one configuration with several algorithms, one run after another, and compare them
as Dean et al. 2012 did (Figures 4 and 5): a table of the time and training samples to
the target and the final value of its metric (median and [min-max] over the seeds), and
figures: that metric against wall time, one curve per algorithm, time to the target
against the cores (MPI ranks) a run used, one line per algorithm, and the metric against
the bytes the replicas sent.

--algorithm NAME[:SECTION.KEY=VALUE,...] (repeatable) gives an algorithm and the settings
only its runs get, e.g. sync:optimizer.backup_workers=1 or
sandblaster:data.batch_size=6000. Every algorithm runs at every --replicas count (sgd
runs once: it is one process), every --learning-rates value and every --seeds value.
--max-seconds sets run.max_seconds for all runs.

The target: CONFIG's own (run.target_accuracy, run.target_loss, or run.target_metric with
run.target_value), or --target VALUE for all runs, which replaces it. --target is a value
of the runs' score: accuracy for model.loss = "cross_entropy" and
"binary_cross_entropy", r2 for "mse". --target-metric NAME makes it a value of another
metric the loss reports: loss (any loss), rmse (mse), auc (binary_cross_entropy). An
accuracy, r2 or auc is reached by rising to the target, a loss or an rmse by falling to
it. With a validation split (data.validation in CONFIG, or --set data.validation=0.1),
the target, the time to it and the curves use the validation figures, and the final
value is each run's test figure, evaluated once at its end.

Each run is `distbelief train`, started as LAUNCHER python -m distbelief train CONFIG
--set ... with LAUNCHER's {n} replaced by the run's rank count: ps_shards + replicas x
partitions, one more for Sandblaster's coordinator; algorithms that keep no parameters
on shards run with cluster.ps_shards = 0; "sgd" runs without a launcher. Its output is
shown indented as it comes and kept in DIR/logs/; its folder DIR/runs/NAME is an ordinary
run.out_dir (`distbelief report DIR/runs/NAME` works). A run that fails (non-zero exit) is
shown as FAILED, counted in the table's "failed" column, and the comparison goes on.

Run the same command again to resume: runs that finished with the same settings are not
run again, an interrupted one continues from its checkpoint, one whose settings changed
starts over (train --fresh: the old files are moved aside). Ctrl-C (or SIGTERM, SIGUSR1:
SLURM's time limit) is passed to the current run as SIGUSR1, which every launcher passes
to the ranks: the run checkpoints and stops, no other run starts, the table of what
finished is written, and compare exits 130 after Ctrl-C, 0 after SIGTERM or SIGUSR1 (so
slurm/compare.sbatch requeues the job). A second Ctrl-C kills the run at once. A run that
fails does not change the exit status: the table counts it. One comparison at a time
owns DIR.
Writes DIR/table.csv, DIR/runs.csv, DIR/METRIC_vs_time.png,
DIR/time_to_target_vs_cores.png and DIR/METRIC_vs_bytes_sent.png, METRIC the target's
(accuracy_vs_time.png, loss_vs_time.png; needs matplotlib: pip install
'distbelief[plot]'). The table and runs.csv also give the bytes the replicas sent per
sample trained (summary.json's bytes_sent_per_sample).

examples:
  distbelief compare configs/fashion_mnist_mlp.toml --algorithm sgd --algorithm downpour \\
      --algorithm sandblaster:data.batch_size=6000 --replicas 2 --target 0.88 \\
      --max-seconds 120 --out comparisons/fashion_mnist
  distbelief compare configs/fashion_mnist_mlp.toml --algorithm downpour \\
      --algorithm sync:optimizer.backup_workers=1 --replicas 1,2,4 --seeds 0,1,2 \\
      --learning-rates 0.01,0.02
  # a regression (examples/regression.toml; its data: examples/regression.py): the time
  # to a validation loss of 0.012
  distbelief compare examples/regression.toml --algorithm sgd --algorithm downpour \\
      --target-metric loss --target 0.012 --max-seconds 60
  # inside an sbatch allocation (see slurm/compare.sbatch):
  distbelief compare configs/fashion_mnist_mlp.toml --algorithm downpour --replicas 4,8,16 \\
      --launcher "srun --mpi=pmix -n {n}"
"""

INSPECT_HELP = """\
Show what a checkpoint holds: step, samples, training time, config hash, the parameter
layout, the shards and their ranges, and every part file with its size and whether its
sha256 checksum matches. Given a run folder (or its checkpoints/ folder), shows every
checkpoint there, newest first, and any leftovers of an interrupted commit. Exit status 0
when the checkpoint (or, for a folder, the newest one) is valid, 1 when it is not.

examples:
  distbelief inspect runs/fashion_mnist_mlp
  distbelief inspect runs/fashion_mnist_mlp/checkpoints/ckpt-0000004000
"""

STATUS_HELP = """\
Say what the run in RUN_DIR is doing, from its files alone (no MPI: run it on a login
node): whether a run owns the folder and where (host, process, SLURM job, since when), its
last step, last evaluation and last checkpoint, and when it last showed a sign of life
(its heartbeat or its newest metrics line). A run on another host whose heartbeat is older
than run.owner_timeout_seconds is reported as taken for dead. Nothing is written.

examples:
  distbelief status runs/fashion_mnist_mlp
  distbelief status runs/fashion_mnist_mlp --json
"""

COSTMODEL_HELP = """\
Predict, before submitting a job, how fast a configuration trains and how much memory each
rank needs:

- model parallelism (--partitions): the step time of one replica split over P ranks, from
  each partition's floating-point work and the activations that cross partitions;
- data parallelism (--layouts S:R:P): Downpour's step time and throughput with S
  parameter-server shards, R replicas and P partitions each, counting each replica's push
  and pull, each shard's fold of every replica's gradient and its link, and the memory of
  every rank (the formulas: docs/performance.md, "Memory per rank");
- a plan (--plan --nodes N --cores C --memory M --bandwidth B): the layouts of up to N x C
  ranks (one per core) that fit nodes of M bytes, fastest first.

The machine figures come from options (--gflops, --bandwidth, ...) or, with --measure,
from timing this machine: a training step of the model, its widest GEMM at full and
narrow width, a Put and Get of the parameters through an MPI window (run it under
`mpiexec -n 2` to time one between two processes), and the Adagrad fold. The model and
what it leaves out: docs/model-parallelism.md, "Cost model". The data file is read only
for its shapes; give --input-shape and --classes to model a network without one.

examples:
  distbelief costmodel configs/fashion_mnist_local.toml --partitions 1,2,4,8
  distbelief costmodel configs/paper_speech_42m.toml --input-shape 440 --classes 8192 \\
      --partitions 1,2,4,8,16 --gflops 100 --bandwidth 1.25 --latency 50 \\
      --message-us 300 --half-width 1024          # the paper's Figure 3 shape
  mpiexec -n 2 python -m distbelief costmodel CONFIG --measure --layouts 1:1:1,2:1:1,1:2:1
  distbelief costmodel CONFIG --plan --nodes 8 --cores 16 --memory 64G --bandwidth 12.5
"""

EVALUATE_HELP = """\
Print the loss and accuracy of a trained model on a dataset file: by default the best
model of RUN_DIR (the best evaluation's, kept by run.keep_best; else its newest valid
checkpoint) on the run's own test set. --which last scores the newest checkpoint, which
gives a test-split run's final_test_accuracy (when the run evaluated its whole test set:
run.eval_samples = 0).
Works for every algorithm, shard count and partition count, in one process, without
mpiexec: run it on a login node. A checkpoint folder or a
`distbelief export` file works too. A damaged newest checkpoint is named on stderr and
the one before it used. --split validation reads the run's validation split: the rows
of /train it held out (data.validation), or the file's /val; --split train reads all of
/train, held-out rows included.

examples:
  distbelief evaluate runs/fashion_mnist_mlp
  distbelief evaluate runs/fashion_mnist_mlp --split validation
  distbelief evaluate runs/fashion_mnist_mlp --which last
  distbelief evaluate runs/fashion_mnist_mlp --data data/other.h5 --split train --json
  distbelief evaluate model.safetensors --data data/fashion_mnist.h5
"""

EXPORT_HELP = """\
Write a trained model (RUN_DIR's best model, kept by run.keep_best, else its newest valid
checkpoint: --which chooses; or a checkpoint folder) as
named per-layer float32 arrays, with the layer specification, the input shape and scale
and the class count as metadata: an HDF5 file that plain h5py reads, or a safetensors file
that safetensors.numpy / safetensors.torch read. Dense layers are named and shaped as
PyTorch's nn.Linear (layers.<i>.weight (out, in), layers.<i>.bias), so a ModuleList of
Linear layers load_state_dict()s them; docs/using-a-trained-model.md gives the shapes of
locally connected layers and a numpy forward. The format is the one FILE's extension
names (.h5, .safetensors) unless --format says. Optimizer state is left out unless
--with-optimizer, which reads the newest checkpoint (the best holds no optimizer state).
An existing file is never overwritten.

examples:
  distbelief export runs/fashion_mnist_mlp --out mlp.h5
  distbelief export runs/fashion_mnist_mlp --out mlp.safetensors
  distbelief export runs/fashion_mnist_mlp --which last --out last.h5
  distbelief export runs/fashion_mnist_mlp/checkpoints/ckpt-0000004000 --out mlp.h5 \\
      --with-optimizer
"""

PREPARE_HELP = """\
Write a dataset in distbelief's HDF5 format (/train/x, /train/y, /test/x, /test/y).

examples:
  distbelief prepare fashion-mnist
  distbelief prepare fashion-mnist --src ~/Downloads/fashion --out data/fashion_mnist.h5
  distbelief prepare synthetic --out data/synth.h5 --train 50000 --test 5000 \\
      --shape 28,28,1 --classes 10
  distbelief prepare arrays mnist.npz --out data/mnist.h5      (your own data)
  distbelief prepare libsvm rcv1_train.binary --out data/rcv1.h5      (sparse features)
  distbelief prepare sparse-synthetic logistic --out data/sparse_logistic.h5

Sparse features (svmlight/libsvm text, scipy.sparse matrices, id fields) are for the
sparse models: docs/sparse-models.md.
"""


ARRAYS_HELP = """\
Convert your own arrays into distbelief's dataset format: an .npz archive, a pair of .npy
files, or datasets of another HDF5 file (Keras- or scikit-learn-style names such as
x_train, y_train, x_test, y_test are found by themselves; other names are given with --x,
--y, --x-test, --y-test). Inputs are (N, *input_shape): (N, F) features or (N, H, W, C)
images. y is either integer class labels 0..K-1, (N,), or float targets, (N,) or (N, k):
regression values, or multi-label 0/1 outputs (--targets overrides what y's type says).
uint8 inputs are kept as bytes (scale 1/255), other numbers are stored as float32. .npy
files and HDF5 datasets are read in blocks, so they may be larger than memory; an .npz
archive is read into memory. From Python: distbelief.data.write_dataset. More:
docs/your-own-data.md.

Sparse inputs (docs/sparse-models.md): a scipy.sparse matrix saved with
scipy.sparse.save_npz, given as --x (and --x-test), makes a file of sparse features (CSR
rows; scipy is not needed to read it); integer inputs (N, fields) with --id-rows, one
table size per field, make a file of id fields, for embedding models.

examples:
  distbelief prepare arrays mnist.npz --out data/mnist.h5
  distbelief prepare arrays --x features.npy --y labels.npy --test-fraction 0.1 \\
      --out data/mine.h5
  distbelief prepare arrays recordings.h5 --x train/X --y train/labels \\
      --x-test eval/X --y-test eval/labels --out data/speech.h5
  distbelief prepare arrays --x clicks.npz --y clicked.npy --test-fraction 0.1 \\
      --out data/clicks.h5                            # scipy.sparse.save_npz(clicks.npz, X)
  distbelief prepare arrays --x ratings_ids.npy --y ratings.npy --id-rows 10000,5000 \\
      --test-fraction 0.1 --out data/ratings.h5      # (user, item) ids per row
"""


LIBSVM_HELP = """\
Convert svmlight/libsvm text, the format RCV1, news20 and the Criteo samples ship in, into
a dataset of sparse features (docs/sparse-models.md). One example a line:

  label id:value id:value ...        e.g.   +1 3:0.25 17:1 1024:0.5

A `qid:N` token is ignored; `#` starts a comment; empty lines are skipped. Feature ids are
used as given: the table has --features rows (default: the largest id in the files + 1),
and a 1-based file leaves row 0 unused. An id that does not fit --features is an error
naming the file and the line.

The labels decide the targets: only 0/1, or only -1/+1, is a binary problem, stored as
values 0/1 (a model with one sigmoid output and binary_cross_entropy); other whole numbers
are class labels (they must be >= 0); any other number makes a regression (values).
With --test, both files share one feature table (the larger of the two, or --features);
without, --test-fraction of the rows (default 0.1) is held out as the test split, as
`prepare arrays` does. The training rows are written in a seeded random order.

The text is read in blocks of a few MB, never whole; the parsed ids and values wait in a
scratch folder beside --out (about 8 bytes an entry) until the file is written.

examples:
  distbelief prepare libsvm rcv1_train.binary --out data/rcv1.h5
  distbelief prepare libsvm news20.scale --test news20.t.scale --out data/news20.h5
  distbelief prepare libsvm day_0.svm --features 1000000 --test-fraction 0.05 \\
      --out data/criteo.h5
"""

SPARSE_SYNTHETIC_HELP = """\
Generate a synthetic dataset for a sparse workload, with a planted model, so that what a
learner reaches can be checked against what is there to learn. The data is synthetic: the
file's `source` attribute says so, and states the planted model's own loss on the test
split (the floor) beside a constant predictor's. The planted model is kept in the file
under /planted. Ids are drawn from a Zipf law (exponent --zipf, 1.1: a few ids very
common, most rare, as in text and click logs). KIND is one of:

  logistic  sparse features (CSR rows): about --nnz distinct ids a row out of --features,
            values 1 scaled to a unit L2 norm; a planted weight per feature and a bias;
            y ~ Bernoulli(sigmoid(x.w + b)), values 0/1. The Hogwild paper's sparse SVM and
            the click-through baseline. Floor: the planted model's test log-loss.
  mf        (user, item) id pairs (--users, --items); planted factors of rank --rank;
            y = U[user].V[item] + noise (--noise). Matrix factorisation; floor: the
            planted model's mse, about noise**2.
  fields    --fields ids a row, each of a table of --field-rows rows; planted embeddings
            of width --dim, concatenated, through a planted tanh layer to one logit;
            y ~ Bernoulli(sigmoid(logit)), values 0/1. Embeddings feeding a dense tower;
            floor: the planted model's test log-loss.

The defaults take a second or two; rows are generated and written in blocks, so tens of
millions of rows fit in bounded memory. The same options give the same file.

examples:
  distbelief prepare sparse-synthetic logistic --out data/sparse_logistic.h5
  distbelief prepare sparse-synthetic mf --users 50000 --items 20000 --train 5000000 \\
      --out data/mf.h5
  distbelief prepare sparse-synthetic fields --fields 4 --field-rows 1000 --seed 1 \\
      --out data/fields.h5
"""
