"""Compiled kernels: the loops numpy cannot do in one pass over memory.

Design note
-----------
Two layers, as in h5py (h5d.pyx under _hl/) and scikit-learn's _loss:

* This file is the thin compiled layer. Each `def` takes typed C-contiguous memoryviews
  (`float[:, ::1]`), marked `# IN` / `# OUT` / `# IN/OUT`; outputs are allocated by the
  caller and written in place; the body runs under `with nogil:` and checks nothing.
  Bounds and wraparound checks are off (directives set once in setup.py;
  DISTBELIEF_DEBUG_KERNELS=1 builds them back in).
* src/distbelief/kernels.py is the Python layer that checks dtypes, contiguity, shapes,
  activation names, label ranges and aliasing, then calls in here. Call that, not this.

Inside, each `def` hands raw pointers to small `cdef inline` loops whose innermost loop
runs over a contiguous float32 axis (parameters, units, output channels), so gcc -O3
vectorises it. Float32 stays float32: constants are typed `float` locals and the math is
libc's float functions (sqrtf, expf, tanhf), because a double literal would promote the
whole expression to double and halve the vector width. -fno-math-errno (setup.py) lets
sqrtf become one vector instruction.

The kernels are single-threaded on purpose: an MPI job already runs one rank per core, and
a thread pool per rank would oversubscribe the cores.
"""

from libc.math cimport expf, log, sqrtf, tanhf
from libc.stdlib cimport free, malloc
from libc.string cimport memset

cdef extern from *:
    const char* DISTBELIEF_SOURCE_HASH
SOURCE_HASH = DISTBELIEF_SOURCE_HASH.decode()

cdef enum Activation:
    LINEAR = 0
    RELU = 1
    SIGMOID = 2
    TANH = 3

# kernels.py maps the contract's activation names through this table.
ACTIVATION_CODES = {"linear": LINEAR, "relu": RELU, "sigmoid": SIGMOID, "tanh": TANH}


# ---------------------------------------------------------------------------------------
# Optimizer updates: one pass over params, accumulator and gradient.

cdef inline void _adagrad(float* params, float* accum, const float* grad, Py_ssize_t size,
                          float lr, float eps) noexcept nogil:
    cdef Py_ssize_t i
    cdef float g, a
    for i in range(size):
        g = grad[i]
        a = accum[i] + g * g
        accum[i] = a
        # (lr * g) / std in this order, as torch's addcdiv_ computes it.
        params[i] = params[i] - lr * g / (sqrtf(a) + eps)


cdef inline void _sgd(float* params, const float* grad, Py_ssize_t size,
                      float lr) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(size):
        params[i] = params[i] - lr * grad[i]


def adagrad_update(float[::1] params,        # IN/OUT (P,)
                   float[::1] accum,         # IN/OUT (P,) sum of squared gradients
                   const float[::1] grad,    # IN (P,)
                   float lr,
                   float eps):
    cdef Py_ssize_t size = params.shape[0]
    if size == 0:
        return
    with nogil:
        _adagrad(&params[0], &accum[0], &grad[0], size, lr, eps)


def sgd_update(float[::1] params,            # IN/OUT (P,)
               const float[::1] grad,        # IN (P,)
               float lr):
    cdef Py_ssize_t size = params.shape[0]
    if size == 0:
        return
    with nogil:
        _sgd(&params[0], &grad[0], size, lr)


# ---------------------------------------------------------------------------------------
# Bias + activation and its derivative: one pass over an (N, U) batch.

cdef inline void _bias_act_row(float* z, const float* bias, Py_ssize_t units,
                               int activation) noexcept nogil:
    cdef Py_ssize_t u
    cdef float v
    cdef float zero = 0.0
    cdef float one = 1.0
    # One loop per activation, so each inner loop is branch-free.
    if activation == RELU:
        for u in range(units):
            v = z[u] + bias[u]
            z[u] = v if v > zero else zero
    elif activation == SIGMOID:
        for u in range(units):
            z[u] = one / (one + expf(-(z[u] + bias[u])))
    elif activation == TANH:
        for u in range(units):
            z[u] = tanhf(z[u] + bias[u])
    else:
        for u in range(units):
            z[u] = z[u] + bias[u]


cdef inline void _act_backward_row(const float* out, const float* dout, float* dz,
                                   Py_ssize_t units, int activation) noexcept nogil:
    cdef Py_ssize_t u
    cdef float zero = 0.0
    cdef float one = 1.0
    cdef float o, d
    if activation == RELU:
        for u in range(units):
            # Load unconditionally: a load under the condition stops gcc vectorising.
            d = dout[u]
            dz[u] = d if out[u] > zero else zero
    elif activation == SIGMOID:
        for u in range(units):
            o = out[u]
            dz[u] = dout[u] * (o * (one - o))
    elif activation == TANH:
        for u in range(units):
            o = out[u]
            dz[u] = dout[u] * (one - o * o)
    else:
        for u in range(units):
            dz[u] = dout[u]


cdef inline void _add_row(float* acc, const float* row, Py_ssize_t units) noexcept nogil:
    cdef Py_ssize_t u
    for u in range(units):
        acc[u] = acc[u] + row[u]


def bias_activation(float[:, ::1] z,         # IN/OUT (N, U): pre-activation -> activation
                    const float[::1] bias,   # IN (U,)
                    int activation):
    cdef Py_ssize_t n, rows = z.shape[0], units = z.shape[1]
    if rows == 0 or units == 0:
        return
    with nogil:
        for n in range(rows):
            _bias_act_row(&z[n, 0], &bias[0], units, activation)


def activation_backward(const float[:, ::1] out,    # IN (N, U) activation output
                        const float[:, ::1] dout,   # IN (N, U) gradient w.r.t. out
                        int activation,
                        float[:, ::1] dz,           # OUT (N, U), may be dout itself
                        float[::1] dbias):          # OUT (U,) or None: sum of dz over N
    cdef Py_ssize_t n, rows = out.shape[0], units = out.shape[1]
    cdef bint want_bias = dbias is not None
    if units == 0:
        return
    with nogil:
        if want_bias:
            memset(&dbias[0], 0, units * sizeof(float))
        for n in range(rows):
            _act_backward_row(&out[n, 0], &dout[n, 0], &dz[n, 0], units, activation)
            if want_bias:
                # The row was just written, so it is still in L1: summing it here keeps
                # the whole backward to one pass over memory.
                _add_row(&dbias[0], &dz[n, 0], units)


# ---------------------------------------------------------------------------------------
# Softmax cross-entropy: loss and gradient in one pass per row.

def softmax_cross_entropy(const float[:, ::1] logits,  # IN (N, C)
                          const int[::1] labels,       # IN (N,) each in [0, C)
                          float[:, ::1] grad):         # OUT (N, C), may be logits itself
    """Returns the mean loss as a Python float."""
    cdef Py_ssize_t n, c, rows = logits.shape[0], classes = logits.shape[1]
    cdef float row_max, target_logit, e, scale
    cdef float inv_rows = 1.0 / rows if rows > 0 else 0.0
    cdef double row_sum, total = 0.0
    cdef int label
    if rows == 0:
        return 0.0
    with nogil:
        for n in range(rows):
            row_max = logits[n, 0]
            for c in range(1, classes):
                if logits[n, c] > row_max:
                    row_max = logits[n, c]
            label = labels[n]
            # Read before the row is overwritten: grad may be logits.
            target_logit = logits[n, label]
            row_sum = 0.0
            for c in range(classes):
                e = expf(logits[n, c] - row_max)
                grad[n, c] = e
                row_sum += e
            total += log(row_sum) + row_max - target_logit
            scale = <float>(1.0 / (row_sum * rows))
            for c in range(classes):
                grad[n, c] = grad[n, c] * scale
            grad[n, label] = grad[n, label] - inv_rows
    return total / rows


# ---------------------------------------------------------------------------------------
# Locally connected 2-D layer (untied weights), NHWC.
#
# A patch row x[n, i*s+ky, j*s : j*s+K, :] is K*Cin contiguous floats, and the matching
# weight rows weights[i, j, ky*K*Cin : (ky+1)*K*Cin, :] are contiguous too. Output
# positions (i, j) are the outer loops and the batch the inner one, so the position's
# weight block (K*K*Cin x Cout floats) stays in L1/L2 while every sample uses it.

cdef inline void _rows_times_block(float* acc, const float* x_row, const float* w_rows,
                                   Py_ssize_t row_len, Py_ssize_t cout) noexcept nogil:
    """acc[:cout] += x_row[:row_len] @ w_rows[:row_len, :cout]; inner loop over cout."""
    cdef Py_ssize_t t, o
    cdef float xv
    cdef const float* w
    for t in range(row_len):
        xv = x_row[t]
        w = w_rows + t * cout
        for o in range(cout):
            acc[o] = acc[o] + xv * w[o]


cdef inline void _outer_add(float* dw_rows, const float* x_row, const float* g,
                            Py_ssize_t row_len, Py_ssize_t cout) noexcept nogil:
    """dw_rows[:row_len, :cout] += outer(x_row, g); inner loop over cout."""
    cdef Py_ssize_t t, o
    cdef float xv
    cdef float* dw
    for t in range(row_len):
        xv = x_row[t]
        dw = dw_rows + t * cout
        for o in range(cout):
            dw[o] = dw[o] + xv * g[o]


cdef inline void _axpy(float* y, const float* x, float a, Py_ssize_t size) noexcept nogil:
    cdef Py_ssize_t t
    for t in range(size):
        y[t] = y[t] + a * x[t]


def local_forward(const float[:, :, :, ::1] x,        # IN (N, H, W, Cin)
                  const float[:, :, :, ::1] weights,  # IN (Ho, Wo, K*K*Cin, Cout)
                  float[:, :, :, ::1] out,            # OUT (N, Ho, Wo, Cout)
                  int kernel,
                  int stride):
    cdef Py_ssize_t batch = x.shape[0], cin = x.shape[3]
    cdef Py_ssize_t out_h = out.shape[1], out_w = out.shape[2], cout = out.shape[3]
    cdef Py_ssize_t row_len = kernel * cin
    cdef Py_ssize_t i, j, n, ky
    cdef const float* w_ij
    cdef float* acc
    if batch == 0 or out_h == 0 or out_w == 0 or cout == 0:
        return
    with nogil:
        for i in range(out_h):
            for j in range(out_w):
                w_ij = &weights[i, j, 0, 0]
                for n in range(batch):
                    acc = &out[n, i, j, 0]
                    memset(acc, 0, cout * sizeof(float))
                    for ky in range(kernel):
                        _rows_times_block(acc, &x[n, i * stride + ky, j * stride, 0],
                                          w_ij + ky * row_len * cout, row_len, cout)


def local_backward(const float[:, :, :, ::1] x,        # IN (N, H, W, Cin)
                   const float[:, :, :, ::1] weights,  # IN (Ho, Wo, K*K*Cin, Cout)
                   const float[:, :, :, ::1] dout,     # IN (N, Ho, Wo, Cout)
                   float[:, :, :, ::1] dweights,       # OUT like weights
                   float[:, :, :, ::1] dx,             # OUT like x, or None to skip
                   int kernel,
                   int stride):
    cdef Py_ssize_t batch = x.shape[0], cin = x.shape[3]
    cdef Py_ssize_t out_h = dout.shape[1], out_w = dout.shape[2], cout = dout.shape[3]
    cdef Py_ssize_t row_len = kernel * cin
    cdef Py_ssize_t patch = kernel * row_len
    cdef Py_ssize_t i, j, n, ky, r, o
    cdef bint want_dx = dx is not None
    cdef const float* w_ij
    cdef const float* g
    cdef float* dw_ij
    cdef float* w_t = NULL
    cdef float gv
    if want_dx and dx.shape[0] * dx.shape[1] * dx.shape[2] * dx.shape[3] > 0:
        with nogil:
            memset(&dx[0, 0, 0, 0], 0, dx.shape[0] * dx.shape[1] * dx.shape[2]
                   * dx.shape[3] * sizeof(float))
    if out_h == 0 or out_w == 0 or cout == 0 or patch == 0:
        return
    if want_dx:
        # One position's weight block, transposed to (Cout, K*K*Cin): the input gradient is
        # then a sum of contiguous axpys instead of dot products, which gcc cannot
        # vectorise without reassociating float sums.
        w_t = <float*>malloc(patch * cout * sizeof(float))
        if w_t == NULL:
            raise MemoryError("local_backward: no memory for a weight block")
    try:
        with nogil:
            for i in range(out_h):
                for j in range(out_w):
                    w_ij = &weights[i, j, 0, 0]
                    dw_ij = &dweights[i, j, 0, 0]
                    memset(dw_ij, 0, patch * cout * sizeof(float))
                    for n in range(batch):
                        g = &dout[n, i, j, 0]
                        for ky in range(kernel):
                            _outer_add(dw_ij + ky * row_len * cout,
                                       &x[n, i * stride + ky, j * stride, 0],
                                       g, row_len, cout)
                    if not want_dx:
                        continue
                    for r in range(patch):
                        for o in range(cout):
                            w_t[o * patch + r] = w_ij[r * cout + o]
                    for n in range(batch):
                        g = &dout[n, i, j, 0]
                        for o in range(cout):
                            gv = g[o]
                            for ky in range(kernel):
                                _axpy(&dx[n, i * stride + ky, j * stride, 0],
                                      w_t + o * patch + ky * row_len, gv, row_len)
    finally:
        free(w_t)
