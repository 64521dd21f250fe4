"""Model parallelism against the unpartitioned Network, on every rank of COMM_WORLD (P =
world size): loss, gradient, evaluation and bytes exchanged, for dense, locally connected,
mixed networks and the paper's image layers (local, pool, lcn), with balanced and unequal
(some empty) blocks.

Run: mpiexec -n P python -m mpi4py tests/mpi_programs/mp_gradients.py
Prints "OK <case> <splits>" per checked case; any failed check aborts the job.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from distbelief.model.layers import Dense, Lcn, Local, Pool
from distbelief.model.network import Network
from distbelief.model.partition import balanced_splits, split_units
from distbelief.model.partitioned_network import PartitionedNetwork

NETWORKS = {
    "dense": ((20,), [{"type": "dense", "units": 13, "activation": "relu"},
                      {"type": "dense", "units": 7, "activation": "tanh"},
                      {"type": "dense", "units": 5, "activation": "softmax"}], 5),
    # Layer 1 (stride 2 over 10x8) leaves input row 9 and column 7 unread.
    "local": ((12, 10, 2), [{"type": "local", "kernel": 3, "channels": 4, "activation": "relu"},
                            {"type": "local", "kernel": 3, "stride": 2, "channels": 3,
                             "activation": "sigmoid"},
                            {"type": "local", "kernel": 3, "channels": 5,
                             "activation": "softmax"}], 10),
    "mixed": ((10, 10, 1), [{"type": "local", "kernel": 3, "channels": 4, "activation": "relu"},
                            {"type": "local", "kernel": 3, "channels": 2, "activation": "tanh"},
                            {"type": "dense", "units": 16, "activation": "relu"},
                            {"type": "dense", "units": 6, "activation": "softmax"}], 6),
    # The paper's stages: local -> L2 pool -> lcn, then local -> overlapping max pool ->
    # lcn with a window wider than the band, then softmax.
    "image": ((14, 12, 2), [{"type": "local", "kernel": 3, "channels": 4, "activation": "relu"},
                            {"type": "pool", "mode": "l2", "kernel": 2},
                            {"type": "lcn", "kernel": 3, "floor": 0.2},
                            {"type": "local", "kernel": 2, "channels": 3,
                             "activation": "tanh"},
                            {"type": "pool", "mode": "max", "kernel": 2, "stride": 1},
                            {"type": "lcn", "kernel": 5},
                            {"type": "dense", "units": 5, "activation": "softmax"}], 5),
    # Parameter-free layers first (they read the data batch), a stride above the kernel.
    "image-first": ((17, 9, 3), [{"type": "lcn", "kernel": 5, "floor": 0.3},
                                 {"type": "pool", "mode": "max", "kernel": 2, "stride": 3},
                                 {"type": "local", "kernel": 2, "channels": 4,
                                  "activation": "relu"},
                                 {"type": "dense", "units": 7, "activation": "softmax"}], 7),
    # Max pooling over ties: on integer inputs (TIED_INPUTS), then on a relu layer's zeros,
    # overlapping windows across the band edges. Each tie's gradient goes to the window's
    # first maximum on every P, through the argmax the forward saved.
    "image-ties": ((13, 11, 2), [{"type": "pool", "mode": "max", "kernel": 3, "stride": 1},
                                 {"type": "local", "kernel": 2, "channels": 5,
                                  "activation": "relu"},
                                 {"type": "pool", "mode": "max", "kernel": 3, "stride": 2},
                                 {"type": "dense", "units": 4, "activation": "softmax"}], 4),
}
TIED_INPUTS = {"image-ties"}
BATCH = 7
# A batch whose per-row vectors are over 1 KB: Open MPI 5's nonblocking collectives read
# such a send buffer after the call has returned (a small one is read at once), so a
# buffer that is not kept alive until the wait shows up here (run_large_batch).
LARGE_BATCH = 600


def check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"rank {MPI.COMM_WORLD.Get_rank()}: CHECK FAILED: {message}")


def skewed_splits(units: int, parts: int, shift: int) -> list[int]:
    """Blocks of unequal sizes (weights 1, 2, .. rotated by `shift`), some maybe empty."""
    weights = np.roll(np.arange(1, parts + 1), shift)
    sizes = np.floor(units * weights / weights.sum()).astype(int)
    sizes[int(np.argmax(weights))] += units - sizes.sum()
    return [0, *np.cumsum(sizes).tolist()]


def owner(bounds: list[int], unit: int) -> int:
    return int(np.searchsorted(bounds, unit, side="right") - 1)


def cut_edges(network: Network, splits: list[list[int]], layer_index: int) -> int:
    """(input value, receiving partition) pairs with the value owned elsewhere, counted
    from the geometry: every output unit, every input it is wired to."""
    layer = network.layers[layer_index]
    below_bounds = splits[layer_index - 1]
    bounds = splits[layer_index]
    pairs = set()
    below = network.layers[layer_index - 1]
    if isinstance(layer, Dense):
        # The value's owner: dense below splits by unit, local below by output row.
        per_block = 1 if isinstance(below, Dense) else below.out_shape[1] * below.out_shape[2]
        for v in range(layer.units):
            dest = owner(bounds, v)
            for u in range(layer.in_size):
                if owner(below_bounds, u // per_block) != dest:
                    pairs.add((u, dest))
        return len(pairs)
    height, width, channels = layer.in_shape
    ho, wo, _ = layer.out_shape
    for i in range(ho):
        dest = owner(bounds, i)
        for j in range(wo):
            for y, x in receptive_field(layer, i, j, height, width):
                if owner(below_bounds, y) != dest:  # image layer below: split unit = row
                    for c in range(channels):
                        pairs.add(((y * width + x) * channels + c, dest))
    return len(pairs)


def receptive_field(layer, i: int, j: int, height: int, width: int) -> list[tuple[int, int]]:
    """The input pixels output (i, j) depends on, from each layer's definition."""
    if isinstance(layer, (Local, Pool)):
        return [(i * layer.stride + dy, j * layer.stride + dx)
                for dy in range(layer.kernel) for dx in range(layer.kernel)]
    assert isinstance(layer, Lcn)
    # y(i, j) divides by a deviation over a window of v, each v over a window of x.
    reach = 2 * (layer.kernel // 2)
    return [(y, x) for y in range(max(0, i - reach), min(height, i + reach + 1))
            for x in range(max(0, j - reach), min(width, j + reach + 1))]


def close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    scale = max(float(np.abs(b).max()) if b.size else 0.0, 1e-3)
    err = float(np.abs(a - b).max()) if b.size else 0.0
    check(err <= 2e-5 * scale, f"{what}: max error {err:g} against scale {scale:g}")


def run_case(comm: MPI.Comm, name: str, splits: list[list[int]] | None, label: str) -> None:
    input_shape, layers, classes = NETWORKS[name]
    network = Network(input_shape, layers, classes)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((BATCH, *input_shape)).astype(np.float32)
    if name in TIED_INPUTS:
        x = np.round(x)  # mostly -1, 0 and 1: most max windows hold ties
    y = rng.integers(0, classes, BATCH)
    params = network.init_params(5)
    params += rng.standard_normal(params.shape).astype(np.float32) * 0.05  # nonzero biases
    full_grad = network.layout.empty()
    full_loss = network.loss_and_grad(params, x, y, full_grad)

    part = PartitionedNetwork(network, comm, splits)
    mine = part.local_params(params)
    grad = np.zeros_like(mine)
    loss = part.loss_and_grad(mine, x, y, grad)
    check(abs(loss - full_loss) <= 1e-5 * max(1.0, abs(full_loss)),
          f"{name} {label}: loss {loss} != {full_loss}")
    close(grad, part.local_params(full_grad), f"{name} {label}: gradient")
    # The same step twice: buffers reused (what max pooling saved too), nothing carried
    # over.
    saved = [lb.saved for lb in part._buffers_for(BATCH)]
    grad2 = np.zeros_like(mine)
    part.loss_and_grad(mine, x, y, grad2)
    check(np.array_equal(grad, grad2), f"{name} {label}: second step differs")
    check(all(a is lb.saved for a, lb in zip(saved, part._buffers_for(BATCH))),
          f"{name} {label}: the saved buffers were allocated again")

    # Whole-model vectors (Downpour's mode): only this partition's pieces are written.
    big = np.zeros_like(params)
    part.loss_and_grad(params, x, y, big)
    written = np.zeros(params.shape, dtype=bool)
    for a, b in part.pieces:
        written[a:b] = True
    check(not big[~written].any(), f"{name} {label}: wrote outside its pieces")
    check(np.array_equal(big[written], grad), f"{name} {label}: whole-vector gradient")

    # The partitions together own every parameter exactly once.
    counts = np.zeros(params.shape, dtype=np.int64)
    counts[written] = 1
    comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
    check(bool((counts == 1).all()), f"{name} {label}: pieces do not tile the vector")

    full_eval = network.evaluate(params, x, y, batch_size=3)
    eval_ = part.evaluate(mine, x, y, batch_size=3)
    check(abs(eval_.loss - full_eval.loss) <= 1e-5 * max(1.0, full_eval.loss) and
          eval_.score == full_eval.score, f"{name} {label}: evaluate {eval_} != {full_eval}")

    # Bytes: one way per cut edge per sample, 4 bytes, forward and backward alike.
    plan_splits = part.plan.splits
    sent_f = part.traffic.forward.copy()
    sent_b = part.traffic.backward.copy()
    comm.Allreduce(MPI.IN_PLACE, sent_f, op=MPI.SUM)
    comm.Allreduce(MPI.IN_PLACE, sent_b, op=MPI.SUM)
    steps = part.traffic.steps
    check(steps == 3, f"steps counted {steps}")
    for i in range(len(network.layers)):
        edges = cut_edges(network, plan_splits, i) if i > 0 else 0
        want = steps * edges * BATCH * 4
        check(sent_f[i] == want, f"{name} {label}: layer {i} forward bytes {sent_f[i]} "
                                 f"!= {edges} cut edges x {BATCH} x 4 x {steps} steps = {want}")
        check(sent_b[i] == want, f"{name} {label}: layer {i} backward bytes {sent_b[i]} "
                                 f"!= {want}")
    if comm.Get_rank() == 0:
        print("OK", name, label, plan_splits, "bytes/step", (sent_f // steps).tolist(),
              flush=True)


def run_large_batch(comm: MPI.Comm) -> None:
    """Loss, gradient and evaluation of one batch of LARGE_BATCH rows, in one piece."""
    network = Network(*NETWORKS["dense"])
    rng = np.random.default_rng(12)
    x = rng.standard_normal((LARGE_BATCH, *network.input_shape)).astype(np.float32)
    y = rng.integers(0, network.num_classes, LARGE_BATCH)
    params = network.init_params(6)
    full_grad = network.layout.empty()
    full_loss = network.loss_and_grad(params, x, y, full_grad)
    part = PartitionedNetwork(network, comm)
    mine = part.local_params(params)
    grad = np.zeros_like(mine)
    loss = part.loss_and_grad(mine, x, y, grad)
    check(abs(loss - full_loss) <= 1e-5 * max(1.0, abs(full_loss)),
          f"large batch: loss {loss} != {full_loss}")
    close(grad, part.local_params(full_grad), "large batch: gradient")
    full_eval = network.evaluate(params, x, y, batch_size=LARGE_BATCH)
    eval_ = part.evaluate(mine, x, y, batch_size=LARGE_BATCH)
    check(abs(eval_.loss - full_eval.loss) <= 1e-5 * max(1.0, full_eval.loss) and
          eval_.score == full_eval.score, f"large batch: evaluate {eval_} != {full_eval}")
    if comm.Get_rank() == 0:
        print("OK dense large-batch", flush=True)


def main() -> None:
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    run_large_batch(comm)
    for name, (input_shape, layers, classes) in NETWORKS.items():
        network = Network(input_shape, layers, classes)
        run_case(comm, name, None, "balanced")
        for shift in range(min(size, 2)):
            splits = [skewed_splits(split_units(layer), size, shift + i)
                      for i, layer in enumerate(network.layers)]
            trained = [b for b, layer in zip(splits, network.layers) if layer.num_params]
            if all(any(b[p] < b[p + 1] for b in trained) for p in range(size)):
                run_case(comm, name, splits, f"skewed{shift}")
        if size > 1:  # one layer entirely on the last partition
            splits = [balanced_splits(split_units(layer), size) for layer in network.layers]
            units = split_units(network.layers[1])
            splits[1] = [0] * size + [units]
            run_case(comm, name, splits, "one-owner")


if __name__ == "__main__":
    main()
