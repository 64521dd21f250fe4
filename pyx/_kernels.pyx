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

from libc.math cimport expf, log, log1pf, sqrtf, tanhf
from libc.stdlib cimport free, malloc
from libc.string cimport memset

cdef extern from *:
    const char* DISTBELIEF_SOURCE_HASH
    # Pointers the caller promises do not alias (kernels.py checks it): with seven arrays
    # gcc would otherwise need more runtime overlap checks than it makes, and not vectorise.
    ctypedef float* float_rp "float * __restrict__"
    ctypedef const float* cfloat_rp "const float * __restrict__"
SOURCE_HASH = DISTBELIEF_SOURCE_HASH.decode()

# ---------------------------------------------------------------------------------------
# Subnormal floats: flushed to zero (FTZ) and read as zero (DAZ), per thread. A model whose
# gradients fill with subnormals runs its GEMMs 16-27x slower (issue 31); threads inherit
# the mode from the thread that creates them, so it is set before numpy starts its BLAS.

cdef extern from *:
    """
    #if defined(__x86_64__) || defined(__i386__)
    #include <xmmintrin.h>
    #define DB_FTZ_DAZ 0x8040u
    static int db_flushes_subnormals(void) {
        return (_mm_getcsr() & DB_FTZ_DAZ) == DB_FTZ_DAZ;
    }
    static int db_flush_subnormals(int on) {
        unsigned int csr = _mm_getcsr();
        _mm_setcsr(on ? (csr | DB_FTZ_DAZ) : (csr & ~DB_FTZ_DAZ));
        return 1;
    }
    #elif defined(__aarch64__)
    #define DB_FZ (1ul << 24)
    static int db_flushes_subnormals(void) {
        unsigned long fpcr;
        __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
        return (fpcr & DB_FZ) != 0;
    }
    static int db_flush_subnormals(int on) {
        unsigned long fpcr;
        __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
        fpcr = on ? (fpcr | DB_FZ) : (fpcr & ~DB_FZ);
        __asm__ volatile("msr fpcr, %0" : : "r"(fpcr));
        return 1;
    }
    #else
    static int db_flushes_subnormals(void) { return 0; }
    static int db_flush_subnormals(int on) { (void)on; return 0; }
    #endif
    """
    int db_flushes_subnormals() noexcept nogil
    int db_flush_subnormals(int on) noexcept nogil


def flush_subnormals(bint on):
    """Flush subnormal floats to zero in this thread (and the threads it creates from now
    on), or stop; False when this CPU type has no such mode here."""
    return bool(db_flush_subnormals(on))


def flushes_subnormals():
    """Whether this thread flushes subnormal floats to zero."""
    return bool(db_flushes_subnormals())


# ---------------------------------------------------------------------------------------
# bfloat16 (issue 28: narrowed Downpour pushes): the upper 16 bits of a float32 (sign, the
# 8 exponent bits, 7 mantissa bits), stored as uint16 since numpy has no bfloat16. Narrowing
# rounds to nearest, ties to even (add 0x7fff plus the lowest kept bit, then truncate;
# overflow rounds to infinity, subnormals round as any other value); a NaN stays a NaN of
# the same sign with its quiet bit set (the rounding add could carry a NaN's payload into
# the exponent and make it infinity). Widening is exact: the 16 bits shifted back up.
# memcpy is the portable type pun; gcc turns it into a register move and vectorises.

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    static inline uint16_t db_bf16_from_float(float f) {
        uint32_t u;
        memcpy(&u, &f, 4);
        uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        uint32_t nan = (u >> 16) | 0x0040u;
        /* both computed, one selected: no branch, so the loop vectorises */
        return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
    }
    /* gcc vectorises db_bf16_from_float's loop, but with x86-64's baseline SSE2 the
       32 -> 16 bit narrowing becomes a chain of shuffles (190 us for 670k floats, 4x a
       copy). The same rule on 4 lanes, then an arithmetic shift and a signed saturating
       pack, which cannot saturate: each lane holds a sign-extended 16-bit value. */
    #if defined(__SSE2__)
    #include <emmintrin.h>
    static inline __m128i db_bf16_round4(__m128i u) {
        const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
        const __m128i rounded = _mm_add_epi32(u, _mm_add_epi32(_mm_set1_epi32(0x7fff), lsb));
        /* signed compare is right: the masked value and 0x7f800000 are both positive */
        const __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)),
                                            _mm_set1_epi32(0x7f800000));
        const __m128i quiet = _mm_or_si128(u, _mm_set1_epi32(0x00400000));
        return _mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, rounded));
    }
    #endif
    static void db_bf16_narrow(const float* src, uint16_t* out, Py_ssize_t size) {
        Py_ssize_t i = 0;
    #if defined(__SSE2__)
        for (; i + 8 <= size; i += 8) {
            __m128i a = db_bf16_round4(_mm_castps_si128(_mm_loadu_ps(src + i)));
            __m128i b = db_bf16_round4(_mm_castps_si128(_mm_loadu_ps(src + i + 4)));
            _mm_storeu_si128((__m128i*)(out + i),
                             _mm_packs_epi32(_mm_srai_epi32(a, 16), _mm_srai_epi32(b, 16)));
        }
    #endif
        for (; i < size; i++)
            out[i] = db_bf16_from_float(src[i]);
    }
    static inline float db_float_from_bf16(uint16_t h) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    """
    unsigned short db_bf16_from_float(float f) noexcept nogil
    void db_bf16_narrow(const float* src, unsigned short* out, Py_ssize_t size) noexcept nogil
    float db_float_from_bf16(unsigned short h) noexcept nogil


def bf16_narrow(const float[::1] src,           # IN (P,)
                unsigned short[::1] out):       # OUT (P,) bfloat16 bits
    cdef Py_ssize_t size = src.shape[0]
    if size == 0:
        return
    with nogil:
        db_bf16_narrow(&src[0], &out[0], size)


def bf16_widen(const unsigned short[::1] src,   # IN (P,) bfloat16 bits
               float[::1] out,                   # OUT (P,), or IN/OUT with accumulate
               bint accumulate):
    cdef Py_ssize_t i, size = src.shape[0]
    if size == 0:
        return
    cdef const unsigned short* s = &src[0]
    cdef float* o = &out[0]
    with nogil:
        if accumulate:
            for i in range(size):
                o[i] = o[i] + db_float_from_bf16(s[i])
        else:
            for i in range(size):
                o[i] = db_float_from_bf16(s[i])


def bf16_round(const float[::1] src,            # IN (P,)
               float[::1] out):                 # OUT (P,), may be src itself
    cdef Py_ssize_t i, size = src.shape[0]
    if size == 0:
        return
    cdef const float* s = &src[0]
    cdef float* o = &out[0]
    with nogil:
        for i in range(size):
            o[i] = db_float_from_bf16(db_bf16_from_float(s[i]))


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


cdef inline void _adagrad_copy(float* params, float* accum, const float* grad,
                               float* copy, Py_ssize_t size, float lr,
                               float eps) noexcept nogil:
    # _adagrad that also stores each new parameter into `copy`: a reader of the result
    # (a Downpour replica's push_pull) saves a second pass over the parameters.
    cdef Py_ssize_t i
    cdef float g, a, p
    for i in range(size):
        g = grad[i]
        a = accum[i] + g * g
        accum[i] = a
        p = params[i] - lr * g / (sqrtf(a) + eps)
        params[i] = p
        copy[i] = p


cdef inline void _sgd(float* params, const float* grad, Py_ssize_t size,
                      float lr) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(size):
        params[i] = params[i] - lr * grad[i]


cdef inline void _sgd_copy(float* params, const float* grad, float* copy, Py_ssize_t size,
                           float lr) noexcept nogil:
    cdef Py_ssize_t i
    cdef float p
    for i in range(size):
        p = params[i] - lr * grad[i]
        params[i] = p
        copy[i] = p


cdef inline void _adarevision(float_rp params, float_rp gsum, float_rp z, float_rp zmax,
                              cfloat_rp fetched, cfloat_rp grad, float_rp copy,
                              Py_ssize_t size, float lr, float eps) noexcept nogil:
    # AdaRevision (model/optimizers.py AdaRevision has the rule), one pass; `copy` NULL or
    # the new params again. Branchless: with no backlog (b == 0) every term in b adds
    # exactly 0, so the result is Adagrad's to the bit (same operations, same order).
    # Float constants keep the arithmetic in float32 (a double literal would promote it).
    cdef Py_ssize_t i
    cdef float g, s, b, zm, zz, eta_old, d, p
    cdef float two = 2.0
    for i in range(size):
        g = grad[i]
        s = gsum[i]
        b = s - fetched[i]
        zm = zmax[i]
        eta_old = lr / (sqrtf(zm) + eps)
        zz = z[i] + g * g + two * g * b
        z[i] = zz
        zm = zz if zz > zm else zm  # a select, vectorised (setup.py: -fno-trapping-math)
        zmax[i] = zm
        d = sqrtf(zm) + eps
        p = params[i] - lr * g / d + (eta_old - lr / d) * b
        params[i] = p
        gsum[i] = s + g
        if copy != NULL:
            copy[i] = p


def adarevision_update(float[::1] params,        # IN/OUT (P,)
                       float[::1] gsum,          # IN/OUT (P,) sum of gradients applied
                       float[::1] z,             # IN/OUT (P,) delay-adjusted sum of squares
                       float[::1] zmax,          # IN/OUT (P,) running max of z
                       const float[::1] fetched, # IN (P,) gsum when the grad's params were
                       const float[::1] grad,    # IN (P,)                     fetched
                       float lr,
                       float eps,
                       float[::1] copy=None):    # OUT (P,) or None: the new params again
    cdef Py_ssize_t size = params.shape[0]
    cdef float* out = NULL
    if size == 0:
        return
    if copy is not None:
        out = &copy[0]
    with nogil:
        _adarevision(&params[0], &gsum[0], &z[0], &zmax[0], &fetched[0], &grad[0], out,
                     size, lr, eps)


def adagrad_update(float[::1] params,        # IN/OUT (P,)
                   float[::1] accum,         # IN/OUT (P,) sum of squared gradients
                   const float[::1] grad,    # IN (P,)
                   float lr,
                   float eps,
                   float[::1] copy=None):    # OUT (P,) or None: the new params again
    cdef Py_ssize_t size = params.shape[0]
    if size == 0:
        return
    with nogil:
        if copy is None:
            _adagrad(&params[0], &accum[0], &grad[0], size, lr, eps)
        else:
            _adagrad_copy(&params[0], &accum[0], &grad[0], &copy[0], size, lr, eps)


def sgd_update(float[::1] params,            # IN/OUT (P,)
               const float[::1] grad,        # IN (P,)
               float lr,
               float[::1] copy=None):        # OUT (P,) or None: the new params again
    cdef Py_ssize_t size = params.shape[0]
    if size == 0:
        return
    with nogil:
        if copy is None:
            _sgd(&params[0], &grad[0], size, lr)
        else:
            _sgd_copy(&params[0], &grad[0], &copy[0], size, lr)


cdef inline void _momentum(float_rp params, float_rp buf, cfloat_rp grad, float_rp copy,
                           Py_ssize_t size, float lr, float mu, bint nesterov) noexcept nogil:
    # SGD with momentum in torch.optim.SGD's order (dampening 0): buf = buf * mu + g;
    # the step is buf, or g + mu * buf (Nesterov); params += -lr * step. buf starts at
    # zero, so the first update is torch's buf = g.
    cdef Py_ssize_t i
    cdef float g, b, d, p
    cdef float neg_lr = -lr
    for i in range(size):
        g = grad[i]
        b = buf[i] * mu + g
        buf[i] = b
        d = g + mu * b if nesterov else b
        p = params[i] + neg_lr * d
        params[i] = p
        if copy != NULL:
            copy[i] = p


cdef inline void _adam(float_rp params, float_rp m, float_rp v, cfloat_rp grad,
                       float_rp copy, Py_ssize_t size, float step_size, float w1,
                       bint low_weight, float beta2, float w2, float bc2_sqrt,
                       float eps) noexcept nogil:
    # Adam in torch.optim.Adam's order (single-tensor path, no weight decay): m moves
    # toward g by lerp weight w1 = 1 - beta1 (torch's lerp formula for its weight's side
    # of 0.5), v = v * beta2 + w2 * g * g with w2 = 1 - beta2, then
    # params += (-step_size * m) / (sqrt(v) / bc2_sqrt + eps), step_size = lr / bc1.
    cdef Py_ssize_t i
    cdef float g, mm, vv, p
    cdef float neg_step = -step_size
    cdef float one = 1.0
    for i in range(size):
        g = grad[i]
        mm = m[i]
        mm = mm + w1 * (g - mm) if low_weight else g - (g - mm) * (one - w1)
        m[i] = mm
        vv = v[i] * beta2 + w2 * g * g
        v[i] = vv
        p = params[i] + neg_step * mm / (sqrtf(vv) / bc2_sqrt + eps)
        params[i] = p
        if copy != NULL:
            copy[i] = p


def momentum_update(float[::1] params,       # IN/OUT (P,)
                    float[::1] buf,          # IN/OUT (P,) the momentum buffer
                    const float[::1] grad,   # IN (P,)
                    float lr,
                    float mu,
                    bint nesterov,
                    float[::1] copy=None):   # OUT (P,) or None: the new params again
    cdef Py_ssize_t size = params.shape[0]
    cdef float* out = NULL
    if size == 0:
        return
    if copy is not None:
        out = &copy[0]
    with nogil:
        _momentum(&params[0], &buf[0], &grad[0], out, size, lr, mu, nesterov)


def adam_update(float[::1] params,           # IN/OUT (P,)
                float[::1] m,                # IN/OUT (P,) first moment
                float[::1] v,                # IN/OUT (P,) second moment
                const float[::1] grad,       # IN (P,)
                float step_size,             # lr / (1 - beta1 ** t)
                float w1,                    # 1 - beta1
                float beta2,
                float w2,                    # 1 - beta2
                float bc2_sqrt,              # sqrt(1 - beta2 ** t)
                float eps,
                float[::1] copy=None):       # OUT (P,) or None: the new params again
    cdef Py_ssize_t size = params.shape[0]
    cdef float* out = NULL
    if size == 0:
        return
    if copy is not None:
        out = &copy[0]
    with nogil:
        _adam(&params[0], &m[0], &v[0], &grad[0], out, size, step_size, w1, w1 < 0.5,
              beta2, w2, bc2_sqrt, eps)


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


def squared_error(const float[:, ::1] outputs,  # IN (N, K)
                  const float[:, ::1] targets,  # IN (N, K)
                  float[:, ::1] grad):          # OUT (N, K), may be outputs itself
    """Returns the mean over rows and outputs of (output - target)^2 as a Python float;
    grad = d(that mean)/d(outputs) = 2 (output - target) / (N K)."""
    cdef Py_ssize_t n, k, rows = outputs.shape[0], width = outputs.shape[1]
    cdef float d, scale
    cdef double total = 0.0
    if rows == 0 or width == 0:
        return 0.0
    scale = <float>(2.0 / (rows * width))
    with nogil:
        for n in range(rows):
            for k in range(width):
                d = outputs[n, k] - targets[n, k]
                total += d * d
                grad[n, k] = d * scale
    return total / (rows * width)


def sigmoid_binary_cross_entropy(const float[:, ::1] logits,   # IN (N, K)
                                 const float[:, ::1] targets,  # IN (N, K), each in [0, 1]
                                 float[:, ::1] grad):          # OUT (N, K), may be logits
    """Returns the mean over rows and outputs of the binary cross-entropy of
    sigmoid(logits) against targets, as a Python float; grad = (sigmoid - target) / (N K).
    Stable at any logit: max(z, 0) - z t + log(1 + exp(-|z|))."""
    cdef Py_ssize_t n, k, rows = logits.shape[0], width = logits.shape[1]
    cdef float z, t, e, p, scale
    cdef double total = 0.0
    if rows == 0 or width == 0:
        return 0.0
    scale = <float>(1.0 / (rows * width))
    with nogil:
        for n in range(rows):
            for k in range(width):
                z = logits[n, k]
                t = targets[n, k]
                e = expf(-z if z >= 0 else z)  # exp(-|z|), never overflows
                total += (z if z > 0 else 0) - z * t + log1pf(e)
                p = 1 / (1 + e) if z >= 0 else e / (1 + e)
                grad[n, k] = (p - t) * scale
    return total / (rows * width)


# ---------------------------------------------------------------------------------------
# Locally connected 2-D layer (untied weights), NHWC.
#
# At one output position (i, j) the layer is three small matrix products, with
# R = K*K*Cin, P_ij (N x R) the batch's patches and G_ij (N x Cout) = dout[:, i, j, :]:
#     forward    out_ij (N x Cout) = P_ij   @ W_ij  (R x Cout)
#     dweights   dW_ij  (R x Cout) = P_ij^T @ G_ij
#     dx         dP_ij  (N x R)    = G_ij   @ W_ij^T, then added back into dx's patches
# Positions are the outer loop and the batch is inside, so each position's weight block is
# read once per call while every sample uses it, and dW_ij is summed over the batch in
# registers and stored once (no scratch buffer per sample).
#
# _matmul computes out = A @ B in TILE_ROWS x TILE_COLS blocks held in registers over the
# whole inner dimension (4x faster than accumulating in memory). Its innermost loop runs
# over TILE_COLS contiguous floats of a row of B (output channels, for forward and
# dweights), which gcc vectorises. It takes A transposed (At, k-major), so the tile's rows
# of A are TILE_ROWS adjacent floats at each step k: given A row-major with a stride, gcc -O3
# built a shuffle-heavy loop that ran 2x slower. (The same tile in C with vector extensions
# was only 5-10% faster, not worth the C.)
#
# So each product first copies its operands into small packed blocks: P_ij or P_ij^T,
# G_ij, G_ij^T, W_ij^T. The copies cost O(N*R) against O(N*R*Cout) arithmetic, and they fix
# a cache problem too: samples lie H*W*Cin floats apart in x, and when that is a multiple
# of 4 KiB (24x24x16, say) every sample maps to the same L1 set and the loop over the
# batch thrashed the cache (measured 2x slower). Packed blocks get a row length of an odd
# number of cache lines, which spreads any column over all sets.

cdef enum:
    TILE_ROWS = 4   # 4 x 8 floats = 8 SSE registers of accumulators, of 16
    TILE_COLS = 8
    LINE_FLOATS = 16  # one 64-byte cache line


cdef inline void _tile_full(float* tile, const float* at, Py_ssize_t lda, const float* b,
                            Py_ssize_t ldb, Py_ssize_t depth) noexcept nogil:
    """tile[r, c] = sum_k at[k*lda + r] * b[k*ldb + c], for a full tile."""
    cdef float acc[TILE_ROWS][TILE_COLS]
    cdef Py_ssize_t k, r, c
    cdef const float* a_k
    cdef const float* b_k
    cdef float av
    # Fixed trip counts: gcc unrolls these loops and keeps acc in registers.
    for r in range(TILE_ROWS):
        for c in range(TILE_COLS):
            acc[r][c] = 0.0
    for k in range(depth):
        a_k = at + k * lda
        b_k = b + k * ldb
        for r in range(TILE_ROWS):
            av = a_k[r]
            for c in range(TILE_COLS):
                acc[r][c] = acc[r][c] + av * b_k[c]
    for r in range(TILE_ROWS):
        for c in range(TILE_COLS):
            tile[r * TILE_COLS + c] = acc[r][c]


cdef inline void _tile_edge(float* tile, const float* at, Py_ssize_t lda, const float* b,
                            Py_ssize_t ldb, Py_ssize_t depth, Py_ssize_t rows,
                            Py_ssize_t cols) noexcept nogil:
    """_tile_full for the rows x cols corner of a tile at a matrix's edge."""
    cdef Py_ssize_t k, r, c
    cdef const float* a_k
    cdef const float* b_k
    cdef float av
    for r in range(rows):
        for c in range(cols):
            tile[r * TILE_COLS + c] = 0.0
    for k in range(depth):
        a_k = at + k * lda
        b_k = b + k * ldb
        for r in range(rows):
            av = a_k[r]
            for c in range(cols):
                tile[r * TILE_COLS + c] = tile[r * TILE_COLS + c] + av * b_k[c]


cdef void _matmul(float* out, Py_ssize_t ldo, const float* at, Py_ssize_t lda,
                  const float* b, Py_ssize_t ldb, Py_ssize_t rows, Py_ssize_t cols,
                  Py_ssize_t depth) noexcept nogil:
    """out (rows x cols, rows ldo apart) = At^T @ B; At is (depth x rows), B (depth x cols)."""
    cdef float tile[TILE_ROWS * TILE_COLS]
    cdef Py_ssize_t r0, c0, r, c, tile_rows, tile_cols
    for c0 in range(0, cols, 8):  # TILE_COLS; Cython needs a literal step
        tile_cols = min(TILE_COLS, cols - c0)
        for r0 in range(0, rows, 4):  # TILE_ROWS
            tile_rows = min(TILE_ROWS, rows - r0)
            if tile_rows == TILE_ROWS and tile_cols == TILE_COLS:
                _tile_full(tile, at + r0, lda, b + c0, ldb, depth)
            else:
                _tile_edge(tile, at + r0, lda, b + c0, ldb, depth, tile_rows, tile_cols)
            for r in range(tile_rows):
                for c in range(tile_cols):
                    out[(r0 + r) * ldo + c0 + c] = tile[r * TILE_COLS + c]


cdef inline Py_ssize_t _padded(Py_ssize_t count) noexcept nogil:
    """A packed block's row length for rows of count floats: an odd number of lines."""
    cdef Py_ssize_t lines = (count + LINE_FLOATS - 1) // LINE_FLOATS
    return (lines + 1 - lines % 2) * LINE_FLOATS


cdef struct Patches:
    # Where one position's patches lie in x (N, H, W, Cin).
    Py_ssize_t batch, kernel, row_len   # N, K, K*Cin (one patch row, contiguous in x)
    Py_ssize_t x_sample, x_row          # floats between samples, between image rows
    Py_ssize_t size                     # R = K*K*Cin


cdef Patches _patches(Py_ssize_t* x_shape, int kernel) noexcept:
    cdef Patches p
    p.batch, p.kernel, p.row_len = x_shape[0], kernel, kernel * x_shape[3]
    p.x_row = x_shape[2] * x_shape[3]
    p.x_sample = x_shape[1] * p.x_row
    p.size = kernel * p.row_len
    return p


cdef void _pack_patches(const Patches* p, const float* x_ij, float* block, Py_ssize_t ld,
                        bint transposed) noexcept nogil:
    """block = P_ij (N x R), or P_ij^T (R x N) if transposed; rows ld apart.

    Sample n's patch has its origin at x_ij + n * x_sample.
    """
    cdef Py_ssize_t n, ky, t, r0
    cdef const float* src
    for n in range(p.batch):
        for ky in range(p.kernel):
            src = x_ij + n * p.x_sample + ky * p.x_row
            r0 = ky * p.row_len
            # Loops, not memcpy: rows are a few floats, and a call per row cost more than
            # the arithmetic on a 28x28x1 layer.
            if transposed:
                for t in range(p.row_len):
                    block[(r0 + t) * ld + n] = src[t]
            else:
                for t in range(p.row_len):
                    block[n * ld + r0 + t] = src[t]


cdef void _scatter_add_patches(const Patches* p, const float* block, Py_ssize_t ld,
                               float* dx_ij) noexcept nogil:
    """Add block (N x R, rows ld apart) into the patches of dx; overlapping patches sum."""
    cdef Py_ssize_t n, ky, t
    cdef float* dst
    cdef const float* src
    for n in range(p.batch):
        for ky in range(p.kernel):
            dst = dx_ij + n * p.x_sample + ky * p.x_row
            src = block + n * ld + ky * p.row_len
            for t in range(p.row_len):
                dst[t] = dst[t] + src[t]


cdef void _pack_rows(float* block, Py_ssize_t ld, const float* src, Py_ssize_t src_step,
                     Py_ssize_t rows, Py_ssize_t cols, bint transposed) noexcept nogil:
    """block = the (rows x cols) matrix whose rows are src_step apart in src, or its
    transpose (cols x rows) if transposed; block's rows are ld apart."""
    cdef Py_ssize_t r, c
    for r in range(rows):
        if transposed:
            for c in range(cols):
                block[c * ld + r] = src[r * src_step + c]
        else:
            for c in range(cols):
                block[r * ld + c] = src[r * src_step + c]


cdef float* _scratch(Py_ssize_t count) except NULL:
    cdef float* block = <float*>malloc(max(count, 1) * sizeof(float))
    if block == NULL:
        raise MemoryError("locally connected layer: no memory for a scratch block")
    return block


cdef inline Py_ssize_t _size4(Py_ssize_t* shape) noexcept nogil:
    return shape[0] * shape[1] * shape[2] * shape[3]


def local_forward(const float[:, :, :, ::1] x,        # IN (N, H, W, Cin)
                  const float[:, :, :, ::1] weights,  # IN (Ho, Wo, K*K*Cin, Cout)
                  float[:, :, :, ::1] out,            # OUT (N, Ho, Wo, Cout)
                  int kernel,
                  int stride):
    cdef Patches p = _patches(x.shape, kernel)
    cdef Py_ssize_t i, j, cout = out.shape[3]
    cdef Py_ssize_t out_sample = out.shape[1] * out.shape[2] * cout
    cdef Py_ssize_t ld_n = _padded(p.batch)
    cdef float* patches_t   # P_ij^T (R x N)
    if _size4(out.shape) == 0:
        return
    patches_t = _scratch(p.size * ld_n)
    try:
        with nogil:
            for i in range(out.shape[1]):
                for j in range(out.shape[2]):
                    _pack_patches(&p, &x[0, i * stride, j * stride, 0], patches_t, ld_n, True)
                    # out_ij = P_ij @ W_ij, written straight into out[:, i, j, :].
                    _matmul(&out[0, i, j, 0], out_sample, patches_t, ld_n,
                            &weights[i, j, 0, 0], cout, p.batch, cout, p.size)
    finally:
        free(patches_t)


def local_backward(const float[:, :, :, ::1] x,        # IN (N, H, W, Cin)
                   const float[:, :, :, ::1] weights,  # IN (Ho, Wo, K*K*Cin, Cout)
                   const float[:, :, :, ::1] dout,     # IN (N, Ho, Wo, Cout)
                   float[:, :, :, ::1] dweights,       # OUT like weights
                   float[:, :, :, ::1] dx,             # OUT like x, or None to skip
                   int kernel,
                   int stride):
    cdef Patches p = _patches(x.shape, kernel)
    cdef Py_ssize_t i, j, cout = dout.shape[3]
    cdef Py_ssize_t out_sample = dout.shape[1] * dout.shape[2] * cout
    cdef Py_ssize_t ld_r = _padded(p.size), ld_n = _padded(p.batch), ld_o = _padded(cout)
    cdef Py_ssize_t dx_size = _size4(dx.shape) if dx is not None else 0
    cdef bint want_dx = dx_size > 0
    cdef float* patches = NULL   # P_ij (N x R)
    cdef float* grads = NULL     # G_ij (N x Cout)
    cdef float* grads_t = NULL   # G_ij^T (Cout x N)
    cdef float* w_t = NULL       # W_ij^T (Cout x R)
    cdef float* dpatches = NULL  # dP_ij (N x R)
    if want_dx:
        with nogil:
            memset(&dx[0, 0, 0, 0], 0, dx_size * sizeof(float))
    if _size4(dweights.shape) == 0:
        return
    if p.batch == 0:
        # No samples: the gradient is an empty sum (and x has no sample 0 to point at).
        with nogil:
            memset(&dweights[0, 0, 0, 0], 0, _size4(dweights.shape) * sizeof(float))
        return
    try:
        patches = _scratch(p.batch * ld_r)
        grads = _scratch(p.batch * ld_o)
        if want_dx:
            grads_t = _scratch(cout * ld_n)
            w_t = _scratch(cout * ld_r)
            dpatches = _scratch(p.batch * ld_r)
        with nogil:
            for i in range(dout.shape[1]):
                for j in range(dout.shape[2]):
                    _pack_patches(&p, &x[0, i * stride, j * stride, 0], patches, ld_r, False)
                    _pack_rows(grads, ld_o, &dout[0, i, j, 0], out_sample, p.batch, cout,
                               False)
                    # dW_ij = P_ij^T @ G_ij; At = P_ij.
                    _matmul(&dweights[i, j, 0, 0], cout, patches, ld_r, grads, ld_o,
                            p.size, cout, p.batch)
                    if not want_dx:
                        continue
                    _pack_rows(grads_t, ld_n, &dout[0, i, j, 0], out_sample, p.batch, cout,
                               True)
                    _pack_rows(w_t, ld_r, &weights[i, j, 0, 0], cout, p.size, cout, True)
                    # dP_ij = G_ij @ W_ij^T; At = G_ij^T.
                    _matmul(dpatches, ld_r, grads_t, ld_n, w_t, ld_r, p.batch, p.size, cout)
                    _scatter_add_patches(&p, dpatches, ld_r, &dx[0, i * stride, j * stride, 0])
    finally:
        free(patches)
        free(grads)
        free(grads_t)
        free(w_t)
        free(dpatches)


# ---------------------------------------------------------------------------------------
# Convolution (tied weights), NHWC, by im2col. The layer (layers.Conv) copies each output
# position's patch into one row of a columns matrix (N*Ho*Wo x K*K*Cin, the patch in
# (row, column, channel) order, as the local layer's) and multiplies it with the filters
# by BLAS through numpy; these two kernels are that copy and its adjoint, which adds each
# row's gradient back into its patch. Zero padding: taps outside the image are 0 in the
# row (im2col) and dropped (col2im). In NHWC a patch's row of taps is K*Cin contiguous
# floats of x, so each copy is a run of that length (shorter at the image's edges).

cdef inline void _taps_inside(Py_ssize_t origin, int kernel, Py_ssize_t size,
                              Py_ssize_t* lo, Py_ssize_t* hi) noexcept nogil:
    """Taps [lo, hi) of a window of `kernel` taps from `origin` lie inside [0, size)."""
    lo[0] = -origin if origin < 0 else 0
    hi[0] = size - origin if origin + kernel > size else kernel
    if hi[0] < lo[0]:
        hi[0] = lo[0]


def im2col(const float[:, :, :, ::1] x,   # IN (N, H, W, C)
           float[:, ::1] columns,         # OUT (N*Ho*Wo, K*K*C)
           int kernel,
           int stride,
           int pad_top,
           int pad_left,
           int out_h,
           int out_w):
    cdef Py_ssize_t n, i, j, ky, t, y0, x0, ky_lo, ky_hi, kx_lo, kx_hi, a, b
    cdef Py_ssize_t channels = x.shape[3]
    cdef Py_ssize_t x_row = x.shape[2] * channels
    cdef Py_ssize_t x_sample = x.shape[1] * x_row
    cdef Py_ssize_t row_len = kernel * channels
    cdef const float* src
    cdef float* dst
    if columns.shape[0] == 0 or columns.shape[1] == 0:
        return
    with nogil:
        for n in range(x.shape[0]):
            for i in range(out_h):
                y0 = i * stride - pad_top
                _taps_inside(y0, kernel, x.shape[1], &ky_lo, &ky_hi)
                for j in range(out_w):
                    x0 = j * stride - pad_left
                    _taps_inside(x0, kernel, x.shape[2], &kx_lo, &kx_hi)
                    a, b = kx_lo * channels, kx_hi * channels
                    for ky in range(kernel):
                        dst = &columns[(n * out_h + i) * out_w + j, 0] + ky * row_len
                        if ky < ky_lo or ky >= ky_hi:
                            for t in range(row_len):
                                dst[t] = 0.0
                            continue
                        # Loops, not memcpy: a run is often a few floats (K*C, C = 1).
                        src = (&x[0, 0, 0, 0] + n * x_sample + (y0 + ky) * x_row
                               + (x0 + kx_lo) * channels)
                        for t in range(a):
                            dst[t] = 0.0
                        for t in range(b - a):
                            dst[a + t] = src[t]
                        for t in range(b, row_len):
                            dst[t] = 0.0


def col2im(const float[:, ::1] columns,   # IN (N*Ho*Wo, K*K*C)
           float[:, :, :, ::1] dx,        # OUT (N, H, W, C)
           int kernel,
           int stride,
           int pad_top,
           int pad_left,
           int out_h,
           int out_w):
    """dx = 0, then each row of columns added into its patch of dx (overlaps sum)."""
    cdef Py_ssize_t n, i, j, ky, t, y0, x0, ky_lo, ky_hi, kx_lo, kx_hi, a, b
    cdef Py_ssize_t channels = dx.shape[3]
    cdef Py_ssize_t x_row = dx.shape[2] * channels
    cdef Py_ssize_t x_sample = dx.shape[1] * x_row
    cdef Py_ssize_t row_len = kernel * channels
    cdef const float* src
    cdef float* dst
    if _size4(dx.shape) == 0:
        return
    with nogil:
        memset(&dx[0, 0, 0, 0], 0, _size4(dx.shape) * sizeof(float))
    if columns.shape[0] == 0:
        return
    with nogil:
        for n in range(dx.shape[0]):
            for i in range(out_h):
                y0 = i * stride - pad_top
                _taps_inside(y0, kernel, dx.shape[1], &ky_lo, &ky_hi)
                for j in range(out_w):
                    x0 = j * stride - pad_left
                    _taps_inside(x0, kernel, dx.shape[2], &kx_lo, &kx_hi)
                    a, b = kx_lo * channels, kx_hi * channels
                    for ky in range(ky_lo, ky_hi):
                        src = &columns[(n * out_h + i) * out_w + j, 0] + ky * row_len + a
                        dst = (&dx[0, 0, 0, 0] + n * x_sample + (y0 + ky) * x_row
                               + (x0 + kx_lo) * channels)
                        for t in range(b - a):
                            dst[t] = dst[t] + src[t]


# ---------------------------------------------------------------------------------------
# Pooling over k x k windows with a stride, per channel, NHWC, valid windows (like the
# locally connected layer): max, or L2 (the square root of the sum of squares, as in the
# paper's image model). Channels are the innermost loop, contiguous in x and out, so each
# window position is one vector operation over the channels. A window's running values
# live in small local arrays of up to POOL_CHUNK channels (wider maps go chunk by chunk):
# gcc then knows they alias nothing and vectorises without run-time overlap checks, which
# cost more than the arithmetic when a window has few channels.
#
# Max pooling's training forward also writes each maximum's offset in its sample (an int32
# per output, as PyTorch keeps its indices), so that its backward is a scatter through
# them: finding the maximum again from x cost 1.2-3x PyTorch's backward.

cdef enum PoolMode:
    POOL_MAX = 0
    POOL_L2 = 1

POOL_MODES = {"max": POOL_MAX, "l2": POOL_L2}

cdef enum:
    POOL_CHUNK = 64


cdef inline void _pool_window(const float* x0, Py_ssize_t x_row, Py_ssize_t channels,
                              int kernel, int mode, float* dst) noexcept nogil:
    """dst[c] = the window's max or L2 norm; the window's corner is x0."""
    cdef float acc[POOL_CHUNK]
    cdef Py_ssize_t c0, c, cc, ky, kx
    cdef const float* src
    cdef float v
    for c0 in range(0, channels, 64):  # POOL_CHUNK; Cython needs a literal step
        cc = min(<Py_ssize_t>POOL_CHUNK, channels - c0)
        if mode == POOL_MAX:
            src = x0 + c0
            for c in range(cc):
                acc[c] = src[c]
            for ky in range(kernel):
                for kx in range(kernel):
                    src = x0 + ky * x_row + kx * channels + c0
                    for c in range(cc):
                        v = src[c]
                        acc[c] = v if v > acc[c] else acc[c]
        else:
            for c in range(cc):
                acc[c] = 0.0
            for ky in range(kernel):
                for kx in range(kernel):
                    src = x0 + ky * x_row + kx * channels + c0
                    for c in range(cc):
                        v = src[c]
                        acc[c] = acc[c] + v * v
            for c in range(cc):
                acc[c] = sqrtf(acc[c])
        for c in range(cc):
            dst[c0 + c] = acc[c]


# Max pooling's forward with argmax is written in C with gcc's vector extensions (gcc and
# clang, any target; 4 floats or ints to a vector). Auto-vectorised from Cython loops, the
# select of each channel's offset came out 1.6x slower than the max alone (bit masks over
# a runtime channel count) or as a branch (5x); with two explicit vectors of 4 channels in
# registers per window it costs less than the plain max loop.
cdef extern from *:
    """
    typedef float distbelief_f4 __attribute__((vector_size(16)));
    typedef int distbelief_i4 __attribute__((vector_size(16)));

    /* Channels [c0, c0 + 4 * nb) of one window (nb is 1 or 2, a constant once inlined,
       so acc and arg live in registers). The mask m is all ones where v is strictly
       greater: a later equal value never displaces the first maximum. */
    static inline void distbelief_max_argmax_vectors(
            const float* x0, int corner, Py_ssize_t x_row, Py_ssize_t channels,
            int kernel, Py_ssize_t c0, int nb, float* dst, int* arg_dst) {
        distbelief_f4 acc[2], v;
        distbelief_i4 arg[2], m, at4;
        const distbelief_i4 lane = {0, 1, 2, 3};
        int b, ky, kx, at;
        for (b = 0; b < nb; b++) {
            memcpy(&acc[b], x0 + c0 + 4 * b, sizeof(acc[b]));
            arg[b] = lane - lane;
        }
        for (ky = 0; ky < kernel; ky++) {
            for (kx = 0; kx < kernel; kx++) {
                at = (int)(ky * x_row + kx * channels);
                at4 = lane - lane + at;
                for (b = 0; b < nb; b++) {
                    memcpy(&v, x0 + at + c0 + 4 * b, sizeof(v));
                    m = v > acc[b];
                    arg[b] = (arg[b] & ~m) | (at4 & m);
                    acc[b] = (distbelief_f4)(((distbelief_i4)v & m)
                                             | ((distbelief_i4)acc[b] & ~m));
                }
            }
        }
        for (b = 0; b < nb; b++) {
            arg[b] += lane + (int)(corner + c0 + 4 * b);
            memcpy(dst + c0 + 4 * b, &acc[b], sizeof(acc[b]));
            memcpy(arg_dst + c0 + 4 * b, &arg[b], sizeof(arg[b]));
        }
    }

    /* dst[c] = the window's maximum and arg_dst[c] = where it lies, as an offset from the
       sample's first float (x0 is the window's corner, `corner` its offset): eight
       channels at a time, then four, then one by one. */
    static inline void distbelief_max_window_argmax(
            const float* x0, int corner, Py_ssize_t x_row, Py_ssize_t channels,
            int kernel, float* dst, int* arg_dst) {
        Py_ssize_t c0 = 0, c;
        int ky, kx, at, best;
        float acc, v;
        for (; c0 + 8 <= channels; c0 += 8)
            distbelief_max_argmax_vectors(x0, corner, x_row, channels, kernel, c0, 2,
                                          dst, arg_dst);
        if (c0 + 4 <= channels) {
            distbelief_max_argmax_vectors(x0, corner, x_row, channels, kernel, c0, 1,
                                          dst, arg_dst);
            c0 += 4;
        }
        for (c = c0; c < channels; c++) {
            acc = x0[c];
            best = 0;
            for (ky = 0; ky < kernel; ky++) {
                for (kx = 0; kx < kernel; kx++) {
                    at = (int)(ky * x_row + kx * channels);
                    v = x0[at + c];
                    if (v > acc) {
                        acc = v;
                        best = at;
                    }
                }
            }
            dst[c] = acc;
            arg_dst[c] = corner + best + (int)c;
        }
    }
    """
    void _max_window_argmax "distbelief_max_window_argmax" (
        const float* x0, int corner, Py_ssize_t x_row, Py_ssize_t channels, int kernel,
        float* dst, int* arg_dst) noexcept nogil


cdef inline void _l2_window_backward(const float* x0, float* dx0, const float* o,
                                     const float* g, Py_ssize_t x_row,
                                     Py_ssize_t channels, int kernel) noexcept nogil:
    """dx0's window += g * x / o, 0 where o is 0 (the L2 norm's gradient)."""
    cdef float factor[POOL_CHUNK]
    cdef Py_ssize_t c0, c, cc, ky, kx
    cdef const float* src
    cdef float* dst
    cdef float v
    cdef float zero = 0.0
    for c0 in range(0, channels, 64):  # POOL_CHUNK
        cc = min(<Py_ssize_t>POOL_CHUNK, channels - c0)
        for c in range(cc):
            v = o[c0 + c]
            factor[c] = g[c0 + c] / v if v > zero else zero
        for ky in range(kernel):
            for kx in range(kernel):
                src = x0 + ky * x_row + kx * channels + c0
                dst = dx0 + ky * x_row + kx * channels + c0
                for c in range(cc):
                    dst[c] = dst[c] + src[c] * factor[c]


def pool_forward(const float[:, :, :, ::1] x,   # IN (N, H, W, C)
                 float[:, :, :, ::1] out,       # OUT (N, Ho, Wo, C)
                 int kernel,
                 int stride,
                 int mode):
    cdef Py_ssize_t n, i, j
    cdef Py_ssize_t channels = x.shape[3]
    cdef Py_ssize_t x_row = x.shape[2] * channels
    if _size4(out.shape) == 0:
        return
    with nogil:
        for n in range(x.shape[0]):
            for i in range(out.shape[1]):
                for j in range(out.shape[2]):
                    _pool_window(&x[n, i * stride, j * stride, 0], x_row, channels, kernel,
                                 mode, &out[n, i, j, 0])


def max_pool_forward_argmax(const float[:, :, :, ::1] x,   # IN (N, H, W, C), H*W*C < 2^31
                            float[:, :, :, ::1] out,       # OUT (N, Ho, Wo, C)
                            int[:, :, :, ::1] argmax,      # OUT (N, Ho, Wo, C)
                            int kernel,
                            int stride):
    """Max pooling that also records each maximum's offset in its sample of x."""
    cdef Py_ssize_t n, i, j
    cdef Py_ssize_t channels = x.shape[3]
    cdef Py_ssize_t x_row = x.shape[2] * channels
    if _size4(out.shape) == 0:
        return
    with nogil:
        for n in range(x.shape[0]):
            for i in range(out.shape[1]):
                for j in range(out.shape[2]):
                    _max_window_argmax(&x[n, i * stride, j * stride, 0],
                                       <int>(i * stride * x_row + j * stride * channels),
                                       x_row, channels, kernel, &out[n, i, j, 0],
                                       &argmax[n, i, j, 0])


def max_pool_backward(const int[:, ::1] argmax,   # IN (N, outputs) offsets in a sample
                      const float[:, ::1] dout,   # IN (N, outputs)
                      float[:, ::1] dx):          # OUT (N, inputs)
    """dx = 0, then dx[n, argmax[n, o]] += dout[n, o]: a scatter, nothing recomputed.
    Returns the number of offsets outside [0, inputs) (skipped), so that the wrapper can
    refuse an argmax that was not written for this x."""
    cdef Py_ssize_t n, o
    cdef Py_ssize_t outputs = dout.shape[1]
    cdef Py_ssize_t inputs = dx.shape[1]
    cdef Py_ssize_t bad = 0
    cdef int at
    cdef const int* arg
    cdef const float* g
    cdef float* d
    if dx.shape[0] == 0 or inputs == 0:
        return 0
    with nogil:
        memset(&dx[0, 0], 0, dx.shape[0] * inputs * sizeof(float))
        if outputs > 0:
            for n in range(dx.shape[0]):
                arg = &argmax[n, 0]
                g = &dout[n, 0]
                d = &dx[n, 0]
                for o in range(outputs):
                    at = arg[o]
                    # One unsigned comparison, always predicted: a bad offset cannot
                    # write outside the sample.
                    if <size_t>at < <size_t>inputs:
                        d[at] += g[o]
                    else:
                        bad += 1
    return bad


def l2_pool_backward(const float[:, :, :, ::1] x,     # IN (N, H, W, C)
                     const float[:, :, :, ::1] out,   # IN (N, Ho, Wo, C) pool_forward's
                     const float[:, :, :, ::1] dout,  # IN (N, Ho, Wo, C)
                     float[:, :, :, ::1] dx,          # OUT (N, H, W, C)
                     int kernel,
                     int stride):
    cdef Py_ssize_t n, i, j
    cdef Py_ssize_t channels = x.shape[3]
    cdef Py_ssize_t x_row = x.shape[2] * channels
    if _size4(dx.shape) == 0:
        return
    with nogil:
        memset(&dx[0, 0, 0, 0], 0, _size4(dx.shape) * sizeof(float))
    if _size4(out.shape) == 0:
        return
    with nogil:
        for n in range(x.shape[0]):
            for i in range(out.shape[1]):
                for j in range(out.shape[2]):
                    _l2_window_backward(&x[n, i * stride, j * stride, 0],
                                        &dx[n, i * stride, j * stride, 0], &out[n, i, j, 0],
                                        &dout[n, i, j, 0], x_row, channels, kernel)


# ---------------------------------------------------------------------------------------
# Local contrast normalization (Jarrett et al. 2009; Le et al. 2012), NHWC, same size out:
#     mean(i,j)  = sum_{p,q,c} w_pq x_c(i+p, j+q) / C         w: a k x k Gaussian, sum 1
#     v_c        = x_c - mean
#     s(i,j)     = sum_{p,q,c} w_pq v_c(i+p, j+q)^2 / C
#     y_c        = v_c / max(sqrt(s), floor)
# with zero padding outside the image. The Gaussian is separable (w = g g^T), so each
# weighted sum is a channel sum followed by two 1-D passes of k taps over one H x W map:
# O(H*W*(C + 4k)) per sample instead of a k x k x C convolution's O(H*W*C*k*k).
#
# Row bands (model parallelism): x may be a band of image rows and out a band of rows
# inside it, `off` rows below x's first. The caller passes exactly the rows the output
# band reads (out's rows widened by k-1 each side, clipped to the image), so every row
# outside x is padding and the kernels treat it as zero; the mean and v are computed for
# out's rows widened by k//2 (the rows s reads), clipped to x. For a whole image, off = 0
# and x and out have the same rows.

cdef void _blur(const float* src, Py_ssize_t s0, Py_ssize_t s1, float* dst,
                Py_ssize_t d0, Py_ssize_t d1, float* tmp, const float* g, int kernel,
                Py_ssize_t width) noexcept nogil:
    """dst rows [d0, d1) = the Gaussian w = g g^T applied to src rows [s0, s1) (every other
    row, and every column outside the map, is zero). Maps are (rows, width) with rows
    width apart; tmp is scratch as large as src. w is symmetric, so this is its own
    transpose: the backward passes call it too."""
    cdef Py_ssize_t r, j, q, p, lo, hi, row
    cdef int pad = kernel // 2
    cdef float wq
    cdef float* t
    cdef const float* s
    cdef float* d
    for r in range(s0, s1):
        t = tmp + r * width
        s = src + r * width
        for j in range(width):
            t[j] = 0.0
        for q in range(kernel):
            wq = g[q]
            # t[j] += wq * s[j + q - pad] for the j whose column is inside the map.
            lo = pad - q if q < pad else 0
            hi = width + pad - q if q > pad else width
            for j in range(lo, hi):
                t[j] = t[j] + wq * s[j + q - pad]
    for r in range(d0, d1):
        d = dst + r * width
        for j in range(width):
            d[j] = 0.0
        for p in range(kernel):
            row = r + p - pad
            if row < s0 or row >= s1:
                continue
            wq = g[p]
            t = tmp + row * width
            for j in range(width):
                d[j] = d[j] + wq * t[j]


cdef struct LcnMaps:
    # Per-sample scratch maps, each (rows of x) x W floats, in x's row coordinates.
    float* chan     # channel mean of x; backward: the gradient w.r.t. mean
    float* mean     # the Gaussian-weighted local mean
    float* sq       # channel mean of v^2; backward: its gradient
    float* s        # the weighted local variance (out's rows)
    float* tmp      # _blur's scratch


cdef void _lcn_statistics(const float* x, LcnMaps* maps, const float* g, int kernel,
                          Py_ssize_t rows, Py_ssize_t width, Py_ssize_t channels,
                          Py_ssize_t m0, Py_ssize_t m1, Py_ssize_t o0,
                          Py_ssize_t o1) noexcept nogil:
    """maps.mean on rows [m0, m1) and maps.s on rows [o0, o1) of one sample."""
    cdef Py_ssize_t r, j, c
    cdef const float* px
    cdef float acc, dv
    cdef float inv_c = 1.0 / channels
    for r in range(rows):
        for j in range(width):
            px = x + (r * width + j) * channels
            acc = 0.0
            for c in range(channels):
                acc = acc + px[c]
            maps.chan[r * width + j] = acc * inv_c
    _blur(maps.chan, 0, rows, maps.mean, m0, m1, maps.tmp, g, kernel, width)
    for r in range(m0, m1):
        for j in range(width):
            px = x + (r * width + j) * channels
            acc = 0.0
            for c in range(channels):
                dv = px[c] - maps.mean[r * width + j]
                acc = acc + dv * dv
            maps.sq[r * width + j] = acc * inv_c
    _blur(maps.sq, m0, m1, maps.s, o0, o1, maps.tmp, g, kernel, width)


cdef LcnMaps _lcn_maps(Py_ssize_t count) except *:
    cdef LcnMaps maps
    maps.chan = maps.mean = maps.sq = maps.s = maps.tmp = NULL
    try:
        maps.chan = _scratch(count)
        maps.mean = _scratch(count)
        maps.sq = _scratch(count)
        maps.s = _scratch(count)
        maps.tmp = _scratch(count)
    except MemoryError:
        _free_lcn_maps(&maps)
        raise
    return maps


cdef void _free_lcn_maps(LcnMaps* maps) noexcept:
    free(maps.chan)
    free(maps.mean)
    free(maps.sq)
    free(maps.s)
    free(maps.tmp)


def lcn_forward(const float[:, :, :, ::1] x,   # IN (N, Hx, W, C) a band of image rows
                float[:, :, :, ::1] out,       # OUT (N, Ho, W, C): x's rows off .. off+Ho-1
                const float[::1] g,            # IN (k,) the 1-D Gaussian, sum 1
                float floor,
                int off):
    cdef Py_ssize_t n, r, j, c
    cdef Py_ssize_t rows = x.shape[1], width = x.shape[2], channels = x.shape[3]
    cdef Py_ssize_t out_rows = out.shape[1]
    cdef int kernel = g.shape[0]
    cdef int pad = kernel // 2
    cdef Py_ssize_t m0 = max(0, off - pad), m1 = min(rows, off + out_rows + pad)
    cdef Py_ssize_t x_sample = rows * width * channels
    cdef Py_ssize_t out_sample = out_rows * width * channels
    cdef const float* px
    cdef float* po
    cdef float mu, inv_d, sigma
    cdef LcnMaps maps
    if _size4(out.shape) == 0:
        return
    maps = _lcn_maps(rows * width)
    try:
        with nogil:
            for n in range(x.shape[0]):
                _lcn_statistics(&x[0, 0, 0, 0] + n * x_sample, &maps, &g[0], kernel, rows,
                                width, channels, m0, m1, off, off + out_rows)
                for r in range(out_rows):
                    for j in range(width):
                        px = &x[0, 0, 0, 0] + n * x_sample + ((r + off) * width + j) * channels
                        po = &out[0, 0, 0, 0] + n * out_sample + (r * width + j) * channels
                        mu = maps.mean[(r + off) * width + j]
                        sigma = sqrtf(maps.s[(r + off) * width + j])
                        inv_d = 1.0 / (sigma if sigma > floor else floor)
                        for c in range(channels):
                            po[c] = (px[c] - mu) * inv_d
    finally:
        _free_lcn_maps(&maps)


def lcn_backward(const float[:, :, :, ::1] x,      # IN (N, Hx, W, C)
                 const float[:, :, :, ::1] dout,   # IN (N, Ho, W, C)
                 float[:, :, :, ::1] dx,           # OUT (N, Hx, W, C)
                 const float[::1] g,               # IN (k,)
                 float floor,
                 int off):
    """dx = the gradient of lcn_forward, recomputing its statistics from x (cheaper than
    keeping them: they are a few H x W maps per sample, one pass)."""
    cdef Py_ssize_t n, r, j, c, at
    cdef Py_ssize_t rows = x.shape[1], width = x.shape[2], channels = x.shape[3]
    cdef Py_ssize_t out_rows = dout.shape[1]
    cdef int kernel = g.shape[0]
    cdef int pad = kernel // 2
    cdef Py_ssize_t m0 = max(0, off - pad), m1 = min(rows, off + out_rows + pad)
    cdef Py_ssize_t x_sample = rows * width * channels
    cdef Py_ssize_t out_sample = out_rows * width * channels
    cdef const float* px
    cdef const float* pg
    cdef float* pdx
    cdef float mu, sigma, d, inv_d, dot, two_dsq, dmean
    cdef float inv_c = 1.0 / channels
    cdef LcnMaps maps
    if _size4(dx.shape) == 0:
        return
    with nogil:
        memset(&dx[0, 0, 0, 0], 0, _size4(dx.shape) * sizeof(float))
    if out_sample == 0:
        return
    maps = _lcn_maps(rows * width)
    try:
        with nogil:
            for n in range(x.shape[0]):
                px = &x[0, 0, 0, 0] + n * x_sample
                pdx = &dx[0, 0, 0, 0] + n * x_sample
                _lcn_statistics(px, &maps, &g[0], kernel, rows, width, channels, m0, m1,
                                off, off + out_rows)
                # Out's rows: dv = dout / d into dx; the gradient w.r.t. s into maps.s.
                for r in range(off, off + out_rows):
                    for j in range(width):
                        at = r * width + j
                        pg = &dout[0, 0, 0, 0] + n * out_sample + ((r - off) * width + j) * channels
                        mu = maps.mean[at]
                        sigma = sqrtf(maps.s[at])
                        d = sigma if sigma > floor else floor
                        inv_d = 1.0 / d
                        dot = 0.0
                        for c in range(channels):
                            dot = dot + pg[c] * (px[at * channels + c] - mu)
                            pdx[at * channels + c] = pg[c] * inv_d
                        # ds = d(-dot/d)/dsigma * dsigma/ds, zero where the floor holds.
                        maps.s[at] = -dot * inv_d * inv_d * 0.5 / sigma if sigma > floor else 0.0
                # The gradient w.r.t. the channel mean of v^2 on the mean's rows.
                _blur(maps.s, off, off + out_rows, maps.sq, m0, m1, maps.tmp, &g[0], kernel,
                      width)
                # dv += 2 v dsq / C on the mean's rows; the gradient w.r.t. mean is -sum dv.
                for r in range(m0, m1):
                    for j in range(width):
                        at = r * width + j
                        mu = maps.mean[at]
                        two_dsq = 2.0 * maps.sq[at] * inv_c
                        dmean = 0.0
                        for c in range(channels):
                            pdx[at * channels + c] = (pdx[at * channels + c]
                                                      + two_dsq * (px[at * channels + c] - mu))
                            dmean = dmean + pdx[at * channels + c]
                        maps.chan[at] = -dmean
                # dx += (the Gaussian, transposed, of the mean's gradient) / C, on x's rows.
                _blur(maps.chan, m0, m1, maps.mean, 0, rows, maps.tmp, &g[0], kernel, width)
                for r in range(rows):
                    for j in range(width):
                        at = r * width + j
                        dmean = maps.mean[at] * inv_c
                        for c in range(channels):
                            pdx[at * channels + c] = pdx[at * channels + c] + dmean
    finally:
        _free_lcn_maps(&maps)


# ---------------------------------------------------------------------------------------
# Dropout (inverted): out = x * scale where the unit is kept (its uniform draw u in [0, 1)
# is at least `rate`), else 0, scale = 1 / (1 - rate). The backward is the same map on
# the output's gradient with the same draws, so one kernel serves both.

def dropout(const float[:, ::1] x,       # IN (N, U): the activations, or their gradient
            const float[:, ::1] draws,   # IN (N, U) uniform draws in [0, 1)
            float rate,
            float scale,
            float[:, ::1] out):          # OUT (N, U), may be x itself
    cdef Py_ssize_t i, size = x.shape[0] * x.shape[1]
    cdef const float* s
    cdef const float* u
    cdef float* o
    cdef float zero = 0.0
    cdef float v
    if size == 0:
        return
    s, u, o = &x[0, 0], &draws[0, 0], &out[0, 0]
    with nogil:
        for i in range(size):
            v = s[i] * scale
            o[i] = v if u[i] >= rate else zero  # a select: vectorised


# ---------------------------------------------------------------------------------------
# Layer normalization (Ba et al. 2016), per sample over its U features:
#     xhat = (x - mean) / sqrt(var + eps),   out = gain * xhat + bias
# with the (biased) variance over the sample's features. The backward recomputes the
# mean and the variance from x (two passes over a row, cheaper than keeping them):
#     dgain += dout * xhat,  dbias += dout,  g = dout * gain
#     dx = (g - mean(g) - xhat * mean(g * xhat)) / sqrt(var + eps)
# The sums over a row accumulate in double: they are reductions gcc cannot vectorise
# without reassociating, so double costs nothing and keeps a wide row's mean exact.

cdef inline void _row_moments(const float* x, Py_ssize_t units, float eps, float* mean,
                              float* rstd) noexcept nogil:
    cdef Py_ssize_t u
    cdef double acc = 0.0, d, var = 0.0
    cdef double m
    for u in range(units):
        acc += x[u]
    m = acc / units
    for u in range(units):
        d = x[u] - m
        var += d * d
    mean[0] = <float>m
    rstd[0] = 1.0 / sqrtf(<float>(var / units) + eps)


def layernorm_forward(const float[:, ::1] x,    # IN (N, U)
                      const float[::1] gain,    # IN (U,)
                      const float[::1] bias,    # IN (U,)
                      float eps,
                      float[:, ::1] out):       # OUT (N, U)
    cdef Py_ssize_t n, u, units = x.shape[1]
    cdef float mean, rstd
    cdef const float* px
    cdef float* po
    if x.shape[0] == 0 or units == 0:
        return
    with nogil:
        for n in range(x.shape[0]):
            px, po = &x[n, 0], &out[n, 0]
            _row_moments(px, units, eps, &mean, &rstd)
            for u in range(units):
                po[u] = (px[u] - mean) * rstd * gain[u] + bias[u]


def layernorm_backward(const float[:, ::1] x,      # IN (N, U)
                       const float[::1] gain,      # IN (U,)
                       const float[:, ::1] dout,   # IN (N, U)
                       float eps,
                       float[::1] dgain,           # OUT (U,)
                       float[::1] dbias,           # OUT (U,)
                       float[:, ::1] dx):          # OUT (N, U), or None to skip
    cdef Py_ssize_t n, u, units = x.shape[1]
    cdef float mean, rstd, xhat, g, mean_g, mean_gx
    cdef double sum_g, sum_gx
    cdef const float* px
    cdef const float* pd
    cdef float* pdx
    cdef bint want_dx = dx is not None
    if units == 0:
        return
    with nogil:
        memset(&dgain[0], 0, units * sizeof(float))
        memset(&dbias[0], 0, units * sizeof(float))
        for n in range(x.shape[0]):
            px, pd = &x[n, 0], &dout[n, 0]
            _row_moments(px, units, eps, &mean, &rstd)
            sum_g = 0.0
            sum_gx = 0.0
            for u in range(units):
                xhat = (px[u] - mean) * rstd
                g = pd[u] * gain[u]
                dgain[u] = dgain[u] + pd[u] * xhat
                dbias[u] = dbias[u] + pd[u]
                sum_g += g
                sum_gx += g * xhat
            if not want_dx:
                continue
            pdx = &dx[n, 0]
            mean_g = <float>(sum_g / units)
            mean_gx = <float>(sum_gx / units)
            for u in range(units):
                xhat = (px[u] - mean) * rstd
                pdx[u] = (pd[u] * gain[u] - mean_g - xhat * mean_gx) * rstd
