"""One model replica spread over the P ranks of a communicator (model parallelism).

`PartitionedNetwork` runs `Network`'s loss, gradient and evaluation with each layer's
units split over the ranks of `comm` as `distbelief.model.partition.Partitioning` says: rank p
holds only the parameters of its units (its weight rows and biases), computes only its
units' activations and gradients, and exchanges with the other partitions exactly the
values on cut edges, point-to-point:

    forward, layer l   every partition posts an Irecv per peer it needs inputs from and an
                       Isend per peer that needs its outputs of layer l-1, all at once
                       (tag 2l), then computes what needs no remote input while they fly:
                       a dense layer the partial product with its own input block, then
                       one GEMM per message in peer order as each arrives; a locally
                       connected layer its interior output rows (windows inside its own
                       input rows), then the boundary rows once the halos are in; a
                       pool or lcn layer (no parameters, little work) waits for its
                       halo rows and then runs its kernel on the whole band.
    backward, layer l  the mirror image (tag 2l+1): the input gradients destined to peers
                       are computed first (dense: their column blocks; local: the boundary
                       rows, whose windows hold the halo), sent, and the rest of the
                       layer's work (own block, weight gradient) overlaps the messages;
                       the owner sums what comes back into its outputs' gradient. A
                       pool or lcn layer computes its band's input gradient, halo rows
                       included, and sends the halo's share back.
    loss               the logits stay where they were computed; three Allreduces over
                       the batch's rows (max, sum of exponentials, the loss sum) give the
                       softmax cross-entropy and its gradient on every partition, so no
                       rank gathers the batch's logits; evaluation counts hits the same
                       way (a hit: the label's logit equals the row's global maximum).

Every partition of a replica reads the same data batch (the input layer is not split),
so layer 0 exchanges nothing. Bytes sent per layer and direction are counted in
`TrafficCounts` (plus the Allreduce payloads of the loss, counted apart).

Parameters and gradients are flat float32 vectors of either the partition's own size
(`local_size`: its pieces back to back in layout order, for the single-replica trainer)
or the whole model's (`layout.size`: only the partition's pieces are read and written,
for Downpour, whose client pulls and pushes exactly those pieces).

Every method that computes is collective over `comm`: all partitions call it with the
same batch, in the same order. Waits are polled with short sleeps (`wait_all`), never
MPICH's busy-polling blocking calls, so oversubscribed ranks leave the core to the
partner they wait for. Messages use tags 0 .. 2L-1 on `comm` (L layers), so
`comm` should carry no other point-to-point traffic (Downpour gives each replica its own). Messages never wait on a peer that could be waiting on us
(everything is non-blocking, completed within the layer), so the exchange cannot
deadlock; a partition blocks only for its peers' messages of the same layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mpi4py import MPI

from distbelief.errors import DataError
from distbelief.model import kernels
from distbelief.model.layers import NO_PARAMS, SAVED_DTYPE, Dense, Layer, Lcn, Pool
from distbelief.model.layout import DTYPE
from distbelief.model.losses import CrossEntropy, Evaluation
from distbelief.model.network import Network, evaluation_size
from distbelief.model.partition import LayerPart, Partitioning
from distbelief.runtime.communicators.agreement import wait_all
from distbelief.runtime.communicators.topology import world_ranks

FORWARD, BACKWARD = 0, 1
def _tag(layer: int, direction: int) -> int:
    return 2 * layer + direction


@dataclass
class TrafficCounts:
    """Bytes this partition sent, per layer and direction, over `steps` loss_and_grad
    calls (evaluation is not counted)."""

    forward: np.ndarray
    backward: np.ndarray
    loss: int = 0
    steps: int = 0

    def per_step(self) -> dict[str, list[float] | float]:
        steps = max(self.steps, 1)
        return {"forward": [float(b) / steps for b in self.forward],
                "backward": [float(b) / steps for b in self.backward],
                "loss": self.loss / steps}


@dataclass
class _LayerBuffers:
    """Work arrays of one layer for one batch size."""

    window: np.ndarray                  # (N, window) the inputs this partition holds
    out: np.ndarray                     # (N, own outputs) activations
    dout: np.ndarray                    # (N, own outputs) loss gradient
    dwindow: np.ndarray                 # (N, window) input gradient
    saved: np.ndarray                   # (N, saved_per_output * own outputs) for backward
    recv: list[np.ndarray] = field(default_factory=list)  # per part.recv message
    send: list[np.ndarray] = field(default_factory=list)  # per part.send message


def _gather_columns(source: np.ndarray, columns: slice | np.ndarray, out: np.ndarray) -> None:
    if isinstance(columns, slice):
        np.copyto(out, source[:, columns])
    else:
        np.take(source, columns, axis=1, out=out)


class PartitionedNetwork:
    """This rank's partition of `network`, exchanging with the others over `comm`."""

    def __init__(self, network: Network, comm: MPI.Comm,
                 splits: list[list[int]] | None = None):
        """`splits`: per layer, P+1 block boundaries in split units (None: balanced).
        Pure set-up (no communication); every rank must pass the same arguments."""
        if network.loss_fn.name != CrossEntropy.name:  # config.py refuses it first
            raise ValueError(f"model parallelism trains cross_entropy only, not "
                             f"{network.loss_fn.name}")
        self.network = network
        self.layers: list[Layer] = network.layers
        self.comm = comm
        self.partition = comm.Get_rank()
        self.plan = Partitioning(network.layers, network.layout, comm.Get_size(), splits)
        self.parts: list[LayerPart] = [self.plan.part(i, self.partition)
                                       for i in range(len(self.layers))]
        self.pieces = self.plan.pieces(self.partition)
        self.local_size = sum(stop - start for start, stop in self.pieces)
        self.traffic = TrafficCounts(np.zeros(len(self.layers), dtype=np.int64),
                                     np.zeros(len(self.layers), dtype=np.int64))
        self._buffers: dict[int, list[_LayerBuffers]] = {}
        self._view_cache: dict[str, tuple[np.ndarray, list]] = {}
        # The partners' world ranks, for the stall watchdog.
        self.partner_ranks = world_ranks(comm, [p for p in range(comm.Get_size())
                                                if p != self.partition])

    def _wait(self, requests: list[MPI.Request]) -> None:
        wait_all(requests, "the other partitions of this replica", self.partner_ranks)

    # -- parameters ----------------------------------------------------------------------

    def local_params(self, full: np.ndarray) -> np.ndarray:
        """This partition's pieces of a whole-model vector, back to back (a new array)."""
        return np.concatenate([full[a:b] for a, b in self.pieces]).astype(DTYPE, copy=False)

    def init_params(self, seed: int) -> np.ndarray:
        """This partition's slice of `network.init_params(seed)` (the same on every P; it
        draws the whole vector once, as the random stream runs through every layer)."""
        return self.local_params(self.network.init_params(seed))

    def _shapes(self, i: int) -> list[tuple[int, ...]]:
        count = self.parts[i].units[1] - self.parts[i].units[0]
        return [(count, *shape[1:]) for _, shape in self.layers[i].param_shapes()]

    def _views(self, flat: np.ndarray, what: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """(weights, bias) of this partition's units per layer, as views of `flat`."""
        cached = self._view_cache.get(what)
        if cached is not None and cached[0] is flat:
            return cached[1]
        if not isinstance(flat, np.ndarray) or flat.dtype != DTYPE or not flat.flags.c_contiguous:
            raise ValueError(f"{what} must be a contiguous float32 vector")
        if flat.shape == (self.local_size,):
            offset, local = 0, True
        elif flat.shape == (self.network.layout.size,):
            offset, local = 0, False
        else:
            raise ValueError(f"{what} must have this partition's {self.local_size} or the "
                             f"model's {self.network.layout.size} elements, got {flat.shape}")
        views = []
        for i, part in enumerate(self.parts):
            arrays = []
            for (start, stop), shape in zip(part.pieces, self._shapes(i)):
                lo = offset if local else start
                arrays.append(flat[lo:lo + stop - start].reshape(shape))
                offset += stop - start
            views.append((arrays[0], arrays[1]) if arrays else (NO_PARAMS, NO_PARAMS))
        self._view_cache[what] = (flat, views)
        return views

    def _buffers_for(self, n: int) -> list[_LayerBuffers]:
        if n not in self._buffers:
            if len(self._buffers) > 4:
                self._buffers.clear()
            self._buffers[n] = [_LayerBuffers(
                window=np.zeros((n, part.window[1] - part.window[0]), dtype=DTYPE),
                out=np.zeros((n, part.outputs[1] - part.outputs[0]), dtype=DTYPE),
                dout=np.zeros((n, part.outputs[1] - part.outputs[0]), dtype=DTYPE),
                dwindow=np.zeros((n, part.window[1] - part.window[0]), dtype=DTYPE),
                saved=np.zeros((n, layer.saved_per_output
                                * (part.outputs[1] - part.outputs[0])), dtype=SAVED_DTYPE),
                recv=[np.empty((n, m.size), dtype=DTYPE) for m in part.recv],
                send=[np.empty((n, m.size), dtype=DTYPE) for m in part.send])
                for part, layer in zip(self.parts, self.layers)]
        return self._buffers[n]

    # -- forward ---------------------------------------------------------------------------

    def _forward(self, views: list, x: np.ndarray, training: bool) -> list[_LayerBuffers]:
        inputs = self.network._flat_input(x)
        buffers = self._buffers_for(inputs.shape[0])
        below = inputs
        for i in range(len(self.layers)):
            self._forward_layer(i, views[i], below, buffers[i], training)
            below = buffers[i].out
        return buffers

    def _forward_layer(self, i: int, params: tuple[np.ndarray, np.ndarray],
                       below: np.ndarray, lb: _LayerBuffers, training: bool) -> None:
        """Layer i's activations from `below` (layer i-1's own outputs, or the input).
        Training: a backward follows, so the bytes sent are counted and the layer keeps
        what its backward needs in lb.saved."""
        part, tag = self.parts[i], _tag(i, FORWARD)
        recvs = [self.comm.Irecv(buf, source=m.peer, tag=tag)
                 for m, buf in zip(part.recv, lb.recv)]
        origin = self.parts[i - 1].outputs[0] if i > 0 else 0
        sends = []
        for m, buf in zip(part.send, lb.send):
            _gather_columns(below, m.columns(origin), buf)
            sends.append(self.comm.Isend(buf, dest=m.peer, tag=tag))
            if training:
                self.traffic.forward[i] += buf.nbytes
        lo = part.window[0]
        a, b = part.own_inputs
        if b > a:
            lb.window[:, a - lo:b - lo] = below[:, a - origin:b - origin]
        if not part.empty:
            if isinstance(self.layers[i], Dense):
                self._dense_forward(part, params, lb, recvs)
            elif isinstance(self.layers[i], (Pool, Lcn)):
                self._pool_lcn_forward(part, lb, recvs, training)
            else:
                self._local_forward(part, params, lb, recvs)
        self._wait(recvs)
        self._wait(sends)

    def _dense_forward(self, part: LayerPart, params: tuple[np.ndarray, np.ndarray],
                       lb: _LayerBuffers, recvs: list[MPI.Request]) -> None:
        layer = self.layers[part.layer]
        weights, bias = params
        if not recvs:
            layer.forward(lb.window, weights, bias, lb.out)
            return
        a, b = part.own_inputs
        if b > a:
            np.matmul(lb.window[:, a:b], weights[:, a:b].T, out=lb.out)
        else:
            lb.out.fill(0.0)
        # In peer order, not arrival order: the sum's rounding is then the same every
        # step and every run (GEMMs of early messages still overlap later ones).
        for m, buf, request in zip(part.recv, lb.recv, recvs):
            self._wait([request])
            columns = m.columns(0)
            lb.window[:, columns] = buf
            lb.out += buf @ weights[:, columns].T
        kernels.bias_activation(lb.out, bias, layer.kernel_activation)

    def _local_geometry(self, part: LayerPart, lb: _LayerBuffers) -> tuple:
        layer = self.layers[part.layer]
        _, width, channels = layer.in_shape
        row = width * channels
        n = lb.window.shape[0]
        window4 = lb.window.reshape(n, -1, width, channels)
        return layer, part.window[0] // row, window4, row

    def _row_blocks(self, part: LayerPart, row: int) -> tuple[list, tuple[int, int] | None]:
        """(boundary row blocks, interior row block or None) of a local layer's block: the
        interior rows' windows lie inside the input rows this partition owns."""
        layer = self.layers[part.layer]
        r0, r1 = part.units
        own0, own1 = part.own_inputs[0] // row, part.own_inputs[1] // row
        t = max(r0, -(-own0 // layer.stride))
        u = min(r1, (own1 - layer.kernel) // layer.stride + 1) if own1 > own0 else t
        if u <= t:
            return [(r0, r1)], None
        return [blk for blk in ((r0, t), (u, r1)) if blk[1] > blk[0]], (t, u)

    def _local_forward(self, part: LayerPart, params: tuple[np.ndarray, np.ndarray],
                       lb: _LayerBuffers, recvs: list[MPI.Request]) -> None:
        layer, row0, window4, row = self._local_geometry(part, lb)
        weights, bias = params
        out4 = lb.out.reshape(window4.shape[0], -1, *layer.out_shape[1:])
        if not recvs:
            kernels.local_forward(window4, weights, out4, layer.kernel, layer.stride)
        else:
            boundary, interior = self._row_blocks(part, row)
            if interior:
                self._local_rows_forward(part, layer, row0, window4, weights, out4, *interior)
            self._wait(recvs)
            lo = part.window[0]
            for m, buf in zip(part.recv, lb.recv):
                lb.window[:, m.columns(lo)] = buf
            for block in boundary:
                self._local_rows_forward(part, layer, row0, window4, weights, out4, *block)
        kernels.bias_activation(lb.out, bias.reshape(-1), layer.kernel_activation)

    def _pool_lcn_forward(self, part: LayerPart, lb: _LayerBuffers,
                          recvs: list[MPI.Request], training: bool) -> None:
        """A pool or lcn layer's band of output rows, once its halo rows are in. Max
        pooling's argmax (offsets into the band's window) goes to lb.saved if training."""
        self._wait(recvs)
        lo = part.window[0]
        for m, buf in zip(part.recv, lb.recv):
            lb.window[:, m.columns(lo)] = buf
        layer, row0, window4, _ = self._local_geometry(part, lb)
        out4 = lb.out.reshape(window4.shape[0], -1, *layer.out_shape[1:])
        if isinstance(layer, Pool):
            kernels.pool_forward(window4, out4, layer.kernel, layer.stride, layer.mode,
                                 self._argmax(layer, lb, out4.shape) if training else None)
        else:
            # The window holds out's rows widened by the LCN's reach (clipped to the
            # image): exactly what kernels.lcn_forward wants for a band.
            kernels.lcn_forward(window4, out4, layer.kernel, layer.floor,
                                part.units[0] - row0)

    @staticmethod
    def _input_rows(layer: Any, row0: int, first: int, stop: int) -> slice:
        """Rows of the window (which starts at input row row0) that output rows
        [first, stop) read."""
        return slice(first * layer.stride - row0, (stop - 1) * layer.stride + layer.kernel - row0)

    def _local_rows_forward(self, part: LayerPart, layer: Any, row0: int,
                            window4: np.ndarray, weights: np.ndarray, out4: np.ndarray,
                            first: int, stop: int) -> None:
        """Output rows [first, stop) of a local layer's block (the kernel wants contiguous
        arrays, so the rows' input and output are copied through)."""
        x = np.ascontiguousarray(window4[:, self._input_rows(layer, row0, first, stop)])
        out = np.empty((x.shape[0], stop - first, *layer.out_shape[1:]), dtype=DTYPE)
        r0 = part.units[0]
        kernels.local_forward(x, weights[first - r0:stop - r0], out, layer.kernel,
                              layer.stride)
        out4[:, first - r0:stop - r0] = out

    # -- loss ------------------------------------------------------------------------------

    def _softmax(self, logits: np.ndarray, labels: np.ndarray,
                 grad: np.ndarray | None) -> tuple[float, int]:
        """(sum of the batch's losses, hits) from this partition's logit columns; writes
        d(mean loss)/d(logits) into `grad` unless None. Collective: three Allreduces over
        `comm` (row maxima, row sums of exponentials, the loss and hit counts)."""
        n = logits.shape[0]
        c0, c1 = self.parts[-1].outputs
        row_max = logits.max(axis=1) if c1 > c0 else np.full(n, -np.inf, dtype=DTYPE)
        peak = np.empty(n, dtype=DTYPE)
        self._wait([self.comm.Iallreduce(row_max, peak, op=MPI.MAX)])
        shifted = np.exp(logits - peak[:, None])
        total = np.empty(n, dtype=DTYPE)
        # A nonblocking operation's send buffer must live until its wait returns: held by
        # a name, not passed as a temporary. Open MPI 5 reads a buffer of 1 KB or more (256
        # rows) after Iallreduce has returned; a temporary is freed by then, and the sums
        # came out wrong (NaN at times) for every batch or evaluation chunk that size
        # (MPICH read it at once and hid the bug). mp_gradients.py's large batch checks it.
        row_sums = shifted.sum(axis=1, dtype=DTYPE)
        self._wait([self.comm.Iallreduce(row_sums, total, op=MPI.SUM)])
        rows = np.flatnonzero((labels >= c0) & (labels < c1))
        cols = labels[rows] - c0
        mine = logits[rows, cols]
        sums = np.array([np.sum(np.log(total[rows], dtype=np.float64) + peak[rows] - mine),
                         np.count_nonzero(mine >= peak[rows])], dtype=np.float64)
        self._wait([self.comm.Iallreduce(MPI.IN_PLACE, sums, op=MPI.SUM)])
        if grad is not None:
            np.divide(shifted, total[:, None], out=grad)
            grad[rows, cols] -= 1.0
            grad *= np.float32(1.0 / n)
            self.traffic.loss += 2 * n * 4 + sums.nbytes
        return float(sums[0]), int(sums[1])

    # -- backward --------------------------------------------------------------------------

    def touched(self) -> None:
        """A step's gradient may be non-zero anywhere (model parallelism is dense only)."""

    def loss_and_grad(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                      grad: np.ndarray) -> float:
        """Mean loss over the batch (the same on every partition); writes this partition's
        gradient into `grad` (its own size, or the model's: then only its pieces).
        Collective over `comm`."""
        views = self._views(params, "params")
        grad_views = self._views(grad, "grad")
        if np.may_share_memory(params, grad):
            raise ValueError("grad must not overlap params")
        buffers = self._forward(views, x, training=True)
        labels = self._labels(y, x)
        loss_sum, _ = self._softmax(buffers[-1].out, labels, buffers[-1].dout)
        inputs = self.network._flat_input(x)
        for i in reversed(range(len(self.layers))):
            below = buffers[i - 1] if i > 0 else None
            self._backward_layer(i, views[i], grad_views[i], buffers[i], below, inputs)
        self.traffic.steps += 1
        return loss_sum / len(labels)

    def _backward_layer(self, i: int, params: tuple, grads: tuple, lb: _LayerBuffers,
                        below: _LayerBuffers | None, inputs: np.ndarray) -> None:
        """Weight and bias gradients of layer i; the input gradient into below.dout
        (summed with the peers' contributions)."""
        part, layer, tag = self.parts[i], self.layers[i], _tag(i, BACKWARD)
        dweights, dbias = grads
        if not part.empty and layer.num_params:
            kernels.activation_backward(lb.out, lb.dout, layer.kernel_activation, lb.dout,
                                        dbias.reshape(-1))
        if below is None:  # layer 0: the input needs no gradient
            if not part.empty and layer.num_params:
                self._weight_grads_only(part, params[0], dweights, lb)
            return
        # Backward messages mirror the forward ones: gradients of what we sent come back
        # into the forward send buffers, what we received goes back from the recv buffers.
        recvs = [self.comm.Irecv(buf, source=m.peer, tag=tag)
                 for m, buf in zip(part.send, lb.send)]
        sends: list[MPI.Request] = []
        if not part.empty:
            if isinstance(layer, Dense):
                self._dense_backward(part, params[0], dweights, lb, sends, tag)
            elif isinstance(layer, (Pool, Lcn)):
                self._pool_lcn_backward(part, lb, sends, tag)
            else:
                self._local_backward(part, params[0], dweights, lb, sends, tag)
        origin, lo = self.parts[i - 1].outputs[0], part.window[0]
        a, b = part.own_inputs
        dbelow = below.dout
        if b - a != dbelow.shape[1]:
            dbelow.fill(0.0)
        if b > a:
            dbelow[:, a - origin:b - origin] = lb.dwindow[:, a - lo:b - lo]
        for m, buf, request in zip(part.send, lb.send, recvs):  # peer order, as forward
            self._wait([request])
            dbelow[:, m.columns(origin)] += buf
        self._wait(sends)

    def _send_back(self, part: LayerPart, lb: _LayerBuffers, sends: list, tag: int) -> None:
        """Isend the input gradients of the values received from peers (already in
        lb.recv's buffers)."""
        for m, buf in zip(part.recv, lb.recv):
            sends.append(self.comm.Isend(buf, dest=m.peer, tag=tag))
            self.traffic.backward[part.layer] += buf.nbytes

    def _dense_backward(self, part: LayerPart, weights: np.ndarray, dweights: np.ndarray,
                        lb: _LayerBuffers, sends: list, tag: int) -> None:
        dz = lb.dout
        for m, buf in zip(part.recv, lb.recv):
            np.matmul(dz, weights[:, m.columns(0)], out=buf)
        self._send_back(part, lb, sends, tag)
        a, b = part.own_inputs
        if (a, b) == (0, lb.dwindow.shape[1]):
            np.matmul(dz, weights, out=lb.dwindow)
        elif b > a:
            lb.dwindow[:, a:b] = dz @ weights[:, a:b]
        np.matmul(dz.T, lb.window, out=dweights)

    def _local_backward(self, part: LayerPart, weights: np.ndarray, dweights: np.ndarray,
                        lb: _LayerBuffers, sends: list, tag: int) -> None:
        layer, row0, window4, row = self._local_geometry(part, lb)
        n = window4.shape[0]
        dz4 = lb.dout.reshape(n, -1, *layer.out_shape[1:])
        dwindow4 = lb.dwindow.reshape(window4.shape)
        if not part.recv:
            kernels.local_backward(window4, weights, dz4, dweights, dwindow4, layer.kernel,
                                   layer.stride)
            return
        boundary, interior = self._row_blocks(part, row)
        lb.dwindow.fill(0.0)
        for block in boundary:
            self._local_rows_backward(part, layer, row0, window4, weights, dz4, dweights,
                                      dwindow4, *block)
        lo = part.window[0]
        for m, buf in zip(part.recv, lb.recv):
            _gather_columns(lb.dwindow, m.columns(lo), buf)
        self._send_back(part, lb, sends, tag)
        if interior:
            self._local_rows_backward(part, layer, row0, window4, weights, dz4, dweights,
                                      dwindow4, *interior)

    def _pool_lcn_backward(self, part: LayerPart, lb: _LayerBuffers, sends: list,
                           tag: int) -> None:
        """The input gradient of a pool or lcn layer's band, halo rows included; the halo's
        share goes back to its owners."""
        layer, row0, window4, _ = self._local_geometry(part, lb)
        n = window4.shape[0]
        out4 = lb.out.reshape(n, -1, *layer.out_shape[1:])
        dout4 = lb.dout.reshape(out4.shape)
        dwindow4 = lb.dwindow.reshape(window4.shape)
        if isinstance(layer, Pool):
            kernels.pool_backward(window4, out4, dout4, dwindow4, layer.kernel, layer.stride,
                                  layer.mode, self._argmax(layer, lb, out4.shape))
        else:
            kernels.lcn_backward(window4, dout4, dwindow4, layer.kernel, layer.floor,
                                 part.units[0] - row0)
        lo = part.window[0]
        for m, buf in zip(part.recv, lb.recv):
            _gather_columns(lb.dwindow, m.columns(lo), buf)
        self._send_back(part, lb, sends, tag)

    @staticmethod
    def _argmax(layer: Pool, lb: _LayerBuffers, shape: tuple[int, ...]) -> np.ndarray | None:
        """lb.saved as the band's (N, rows, Wo, C) argmax; None for L2 pooling."""
        return lb.saved.reshape(shape) if layer.saved_per_output else None

    def _local_rows_backward(self, part: LayerPart, layer: Any, row0: int,
                             window4: np.ndarray, weights: np.ndarray, dz4: np.ndarray,
                             dweights: np.ndarray, dwindow4: np.ndarray, first: int,
                             stop: int) -> None:
        """Gradients of output rows [first, stop): their weight rows are overwritten, their
        input gradient is added into dwindow4."""
        rows = self._input_rows(layer, row0, first, stop)
        r0 = part.units[0]
        x = np.ascontiguousarray(window4[:, rows])
        dz = np.ascontiguousarray(dz4[:, first - r0:stop - r0])
        dx = np.empty_like(x)
        kernels.local_backward(x, weights[first - r0:stop - r0], dz,
                               dweights[first - r0:stop - r0], dx, layer.kernel, layer.stride)
        dwindow4[:, rows] += dx

    def _weight_grads_only(self, part: LayerPart, weights: np.ndarray,
                           dweights: np.ndarray, lb: _LayerBuffers) -> None:
        layer = self.layers[part.layer]
        if isinstance(layer, Dense):
            np.matmul(lb.dout.T, lb.window, out=dweights)
            return
        _, _, window4, _ = self._local_geometry(part, lb)
        dz4 = lb.dout.reshape(window4.shape[0], -1, *layer.out_shape[1:])
        kernels.local_backward(window4, weights, dz4, dweights, None, layer.kernel,
                               layer.stride)

    # -- evaluation --------------------------------------------------------------------------

    def loss(self, params: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        """Mean loss over the batch. Collective over `comm`."""
        buffers = self._forward(self._views(params, "params"), x, training=False)
        loss_sum, _ = self._softmax(buffers[-1].out, self._labels(y, x), None)
        return loss_sum / len(y)

    def evaluate(self, params: np.ndarray, x: np.ndarray, y: np.ndarray,
                 batch_size: int = 1000) -> Evaluation:
        """The loss and accuracy over all of x, y in batches, as Network.evaluate.
        Collective over `comm`: every partition passes the same x and y."""
        total = evaluation_size(x, y, batch_size)
        views = self._views(params, "params")
        loss_sum, hits = 0.0, 0
        for start in range(0, total, batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            buffers = self._forward(views, xb, training=False)
            batch_loss, batch_hits = self._softmax(buffers[-1].out, self._labels(yb, xb), None)
            loss_sum += batch_loss
            hits += batch_hits
        return self.network.loss_fn.evaluation(
            np.array([total, loss_sum, hits], dtype=np.float64))

    def _labels(self, y: np.ndarray, x: np.ndarray) -> np.ndarray:
        y = np.asarray(y)
        if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"labels must be integers of shape ({len(x)},), "
                            f"got {y.dtype} {y.shape}")
        return y

    def describe(self) -> str:
        return self.plan.describe()
