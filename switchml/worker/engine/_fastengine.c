/*
 * switchml.worker.engine._fastengine: the worker's allreduce state machine in C, as a
 * Python type (DenseCore) and the test entry points of its kernels.
 *
 * A transcription of the Python reference (stream.py: Stream; dense.py:
 * DenseAllreduce; sparse.py: SparseAllreduce; recovery.py: RttEstimator,
 * CongestionWindow; quant.py's kernels) that must stay bit-identical to it: the
 * same datagrams in the same order, the same results, the same counters.
 * tests/test_fastengine.py and tests/test_fastsparse.py check that differentially.
 *
 * Why the whole state machine and not per-packet kernels: with frame-sized
 * packets a 64 MiB allreduce is 8192 results per worker, and the interpreter's
 * per-packet bookkeeping (window heaps, timers, validation) costs as much as the
 * arithmetic.  Only a state machine in C lets run_io() receive with recvmmsg,
 * absorb, quantise and send with sendmmsg without the GIL, so that training
 * threads keep running; Python is back every few ms for the control socket.
 *
 * This file is the binding only; the engine is Python-free, in the files
 * stream.h lists, included here as one translation unit.  The engine is sans-IO
 * like the reference (receive_datagram, datagrams_to_send, get_timer,
 * handle_timer, pending); run_io() is its socket driver (stream_io.c).  State
 * the Membership keeps across calls (message numbers, RTT, window) is passed in at
 * construction and read back with export_state(), the RTT estimator's and the
 * window's by recovery.py's field names.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "stream.h"

#include "quant.c"
#include "recovery.c"
#include "stream.c"
#include "dense.c"
#include "sparse.c"
#include "stream_io.c"

/* The Python object: the buffers it holds for the call, and the call. */
typedef struct {
    PyObject_HEAD
    Py_buffer src, out;
    int have_src, have_out;
    StreamCore core;
} DenseCore;

/* ------------------------------------------------------------ state by name
 * The Membership's RTT estimator and window cross the binding as dicts keyed by
 * their Python attribute names (recovery.RttEstimator.STATE,
 * CongestionWindow.STATE): a missing one is a KeyError naming it. */
static PyObject *state_item(PyObject *state, const char *name) {
    PyObject *v = PyDict_Check(state) ? PyDict_GetItemString(state, name) : NULL;
    if (!v && !PyErr_Occurred())
        PyErr_Format(PyDict_Check(state) ? PyExc_KeyError : PyExc_TypeError,
                     "engine state: no field %s (a dict of recovery.py's fields)", name);
    return v; /* borrowed */
}

static int state_double(PyObject *state, const char *name, double *out) {
    PyObject *v = state_item(state, name);
    if (!v)
        return -1;
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

static int state_long(PyObject *state, const char *name, long long *out) {
    PyObject *v = state_item(state, name);
    if (!v)
        return -1;
    long long x = PyLong_AsLongLong(v);
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = x;
    return 0;
}

/* RttEstimator.state(): srtt (None before the first sample), rttvar, min_rtt, _rto,
 * min_rto, max_rto, kept_backoff, _kept_since */
static int read_rtt_state(StreamCore *c, PyObject *state) {
    PyObject *srtt = state_item(state, "srtt");
    long long kept_backoff;
    if (!srtt)
        return -1;
    c->have_srtt = srtt != Py_None;
    c->srtt = 0.0;
    if (c->have_srtt && state_double(state, "srtt", &c->srtt) < 0)
        return -1;
    if (state_double(state, "rttvar", &c->rttvar) < 0 ||
        state_double(state, "min_rtt", &c->min_rtt) < 0 ||
        state_double(state, "_rto", &c->rto_value) < 0 ||
        state_double(state, "min_rto", &c->min_rto) < 0 ||
        state_double(state, "max_rto", &c->max_rto) < 0 ||
        state_long(state, "kept_backoff", &kept_backoff) < 0 ||
        state_double(state, "_kept_since", &c->kept_since) < 0)
        return -1;
    c->kept_backoff = (int)kept_backoff;
    return 0;
}

/* CongestionWindow.state(): cwnd, ssthresh, _last_decrease, limit, _undo (None or
 * (time, cwnd, ssthresh)), _epoch_start, _epoch_min, _queue_at, _clear_at,
 * DELAY_MARGIN, QUEUE_MARGIN */
static int read_window_state(StreamCore *c, PyObject *state) {
    long long limit;
    if (state_double(state, "cwnd", &c->cwnd) < 0 ||
        state_double(state, "ssthresh", &c->ssthresh) < 0 ||
        state_double(state, "_last_decrease", &c->last_decrease) < 0 ||
        state_long(state, "limit", &limit) < 0 ||
        state_double(state, "_epoch_start", &c->epoch_start) < 0 ||
        state_double(state, "_epoch_min", &c->epoch_min) < 0 ||
        state_double(state, "_queue_at", &c->queue_at) < 0 ||
        state_double(state, "_clear_at", &c->clear_at) < 0 ||
        state_double(state, "DELAY_MARGIN", &c->delay_margin) < 0 ||
        state_double(state, "QUEUE_MARGIN", &c->queue_margin) < 0)
        return -1;
    c->window_limit = limit;
    PyObject *undo = state_item(state, "_undo");
    if (!undo)
        return -1;
    c->has_undo = undo != Py_None;
    c->undo_at = c->undo_cwnd = c->undo_ssthresh = 0.0;
    if (c->has_undo && !PyArg_ParseTuple(undo, "ddd;_undo: (time, cwnd, ssthresh)",
                                         &c->undo_at, &c->undo_cwnd, &c->undo_ssthresh))
        return -1;
    return 0;
}

/* What export_state gives back of each, by the same names (the rest does not change). */
static PyObject *rtt_state(StreamCore *c) {
    PyObject *srtt = c->have_srtt ? PyFloat_FromDouble(c->srtt) : Py_NewRef(Py_None);
    if (!srtt)
        return NULL;
    return Py_BuildValue("{s:N,s:d,s:d,s:d,s:i,s:d}", "srtt", srtt, "rttvar", c->rttvar,
                         "min_rtt", c->min_rtt, "_rto", c->rto_value,
                         "kept_backoff", c->kept_backoff, "_kept_since", c->kept_since);
}

static PyObject *window_state(StreamCore *c) {
    PyObject *undo = c->has_undo
                         ? Py_BuildValue("(ddd)", c->undo_at, c->undo_cwnd, c->undo_ssthresh)
                         : Py_NewRef(Py_None);
    if (!undo)
        return NULL;
    return Py_BuildValue("{s:d,s:d,s:d,s:N,s:d,s:d,s:d,s:d}", "cwnd", c->cwnd,
                         "ssthresh", c->ssthresh, "_last_decrease", c->last_decrease,
                         "_undo", undo, "_epoch_start", c->epoch_start,
                         "_epoch_min", c->epoch_min, "_queue_at", c->queue_at,
                         "_clear_at", c->clear_at);
}

static void core_dealloc(DenseCore *self) {
    if (self->have_src)
        PyBuffer_Release(&self->src);
    if (self->have_out)
        PyBuffer_Release(&self->out);
    stream_free(&self->core);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int core_init(DenseCore *self, PyObject *args, PyObject *kwds) {
    StreamCore *c = &self->core;
    static char *kwlist[] = {"src", "out", "is_float", "session", "slot_base", "width",
                             "packet_elements", "lanes", "bits", "seq", "slot_msgs", "now",
                             "progress_timeout", "rtt", "window", "wire_bits", "world_size",
                             "sparse", "block_elements", "reordering", "token",
                             "data_threads", NULL};
    PyObject *src, *out, *slot_msgs, *rtt_arg, *window_arg;
    int is_float, wire_bits = 32;
    unsigned int session, seq, token = 0;
    long long k;
    double now;
    int sparse = 0;
    long long block_elements = 0;
    c->world_size = 1;
    c->reordering = FAST_RETRANSMIT_THRESHOLD;
    c->data_threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOpIiiLiiIOddOO|iipLiIi", kwlist, &src, &out,
                                     &is_float, &session, &c->slot_base, &c->width, &k,
                                     &c->lanes, &c->bits, &seq, &slot_msgs, &now,
                                     &c->progress_timeout, &rtt_arg, &window_arg,
                                     &wire_bits, &c->world_size, &sparse, &block_elements,
                                     &c->reordering, &token, &c->data_threads))
        return -1;
    if (c->data_threads < 1 || c->data_threads > MAX_DATA_THREADS) {
        PyErr_SetString(PyExc_ValueError, "data_threads: 1 to MAX_DATA_THREADS");
        return -1;
    }
    if (c->reordering < 1 || c->reordering > MAX_REORDERING) {
        PyErr_SetString(PyExc_ValueError, "reordering: 1 to MAX_REORDERING");
        return -1;
    }
    if ((wire_bits != 32 && wire_bits != 16) || (wire_bits == 16 && (!is_float || sparse)) ||
        c->world_size < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "wire_bits: 32, or 16 for dense floats; world_size >= 1");
        return -1;
    }
    c->per_word = wire_bits == 16 ? 2 : 1;
    if (self->have_src || self->have_out) {
        PyErr_SetString(PyExc_RuntimeError, "DenseCore is initialised once");
        return -1;
    }
    if (PyObject_GetBuffer(src, &self->src, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    self->have_src = 1;
    if (PyObject_GetBuffer(out, &self->out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return -1;
    self->have_out = 1;
    if (self->src.len != self->out.len || self->src.len % 4 || k < 1 || c->width < 0 || c->lanes < 1) {
        PyErr_SetString(PyExc_ValueError, "src and out: buffers of the same size, of 4-byte values");
        return -1;
    }
    /* sparse: chunk c is blocks c*lanes .. c*lanes + lanes - 1 (sparse.py) */
    if (sparse && (block_elements < 1 || block_elements * c->lanes != k)) {
        PyErr_SetString(PyExc_ValueError, "sparse: packet_elements must be lanes * block_elements");
        return -1;
    }
    c->is_float = is_float;
    c->dtype_code = c->per_word == 2 ? WIRE_DTYPE_FLOAT16_WIRE : is_float ? WIRE_DTYPE_FLOAT32 : WIRE_DTYPE_INT32;
    c->lag = is_float ? 1 : 0;
    c->session = session;
    c->token = token ? token : session;
    c->seq = seq;
    c->k = k * c->per_word; /* values a chunk; a packet holds k words */
    c->src = self->src.buf;
    c->out = self->out.buf;
    c->size = self->src.len / 4;
    c->chunks = (c->size + c->k - 1) / c->k;
    int W = c->width;
    if (!PyList_Check(slot_msgs) || PyList_GET_SIZE(slot_msgs) < W) {
        PyErr_SetString(PyExc_ValueError, "slot_msgs: a list of at least width numbers");
        return -1;
    }
    if (read_rtt_state(c, rtt_arg) < 0 || read_window_state(c, window_arg) < 0)
        return -1;
    if (stream_allocate(c, k) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    for (int j = 0; j < W; j++) {
        unsigned long v = PyLong_AsUnsignedLong(PyList_GET_ITEM(slot_msgs, j));
        if (v == (unsigned long)-1 && PyErr_Occurred())
            return -1;
        c->slot_msgs[j] = (uint32_t)v;
    }
    if (stream_start(c, now, sparse ? &SPARSE_CALL : &DENSE_CALL, block_elements) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static PyObject *core_receive_datagram(DenseCore *self, PyObject *args) {
    StreamCore *c = &self->core;
    Py_buffer data;
    double now;
    if (!PyArg_ParseTuple(args, "y*d", &data, &now))
        return NULL;
    int rc = receive(c, data.buf, data.len, now);
    PyBuffer_Release(&data);
    if (rc < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *core_datagrams_to_send(DenseCore *self, PyObject *unused) {
    StreamCore *c = &self->core;
    PyObject *list = PyList_New(c->outbox_len);
    if (!list)
        return NULL;
    for (Py_ssize_t i = 0; i < c->outbox_len; i++) {
        PyObject *b = PyBytes_FromStringAndSize(
            (const char *)outbox_bytes(c, i),
            c->outbox[i].len);
        if (!b) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, b);
    }
    c->outbox_len = 0;
    return list;
}

static PyObject *core_get_timer(DenseCore *self, PyObject *unused) {
    StreamCore *c = &self->core;
    double timer = get_timer(c);
    if (isnan(timer))
        Py_RETURN_NONE;
    return PyFloat_FromDouble(timer);
}

static PyObject *core_handle_timer(DenseCore *self, PyObject *arg) {
    StreamCore *c = &self->core;
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (handle_timer(c, now) < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *core_pending(DenseCore *self, PyObject *unused) {
    StreamCore *c = &self->core;
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    for (int j = 0; j < c->width; j++) {
        if (!c->inflight[j])
            continue;
        PyObject *item = Py_BuildValue("(ik)", c->slot_base + j, (unsigned long)c->slot_msgs[j]);
        if (!item || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
    }
    return list;
}

/* {"slot_msgs", "rtt", "window", "counters", "reordering"}: what the Membership
 * keeps, the RTT estimator's and window's fields by their recovery.py names; counters
 * since the last call. */
static PyObject *core_export_state(DenseCore *self, PyObject *unused) {
    StreamCore *c = &self->core;
    PyObject *msgs = PyList_New(c->width);
    if (!msgs)
        return NULL;
    for (int j = 0; j < c->width; j++) {
        PyObject *v = PyLong_FromUnsignedLong(c->slot_msgs[j]);
        if (!v) {
            Py_DECREF(msgs);
            return NULL;
        }
        PyList_SET_ITEM(msgs, j, v);
    }
    PyObject *counters = PyDict_New();
    if (!counters) {
        Py_DECREF(msgs);
        return NULL;
    }
    for (int i = 0; i < COUNTER_COUNT; i++) {
        PyObject *v = PyLong_FromLongLong(c->counters[i]);
        if (!v || PyDict_SetItemString(counters, counter_names[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(msgs);
            Py_DECREF(counters);
            return NULL;
        }
        Py_DECREF(v);
        c->counters[i] = 0;
    }
    PyObject *rtt = rtt_state(c), *window = rtt ? window_state(c) : NULL;
    if (!window) {
        Py_XDECREF(rtt);
        Py_DECREF(msgs);
        Py_DECREF(counters);
        return NULL;
    }
    return Py_BuildValue("{s:N,s:N,s:N,s:N,s:i}", "slot_msgs", msgs, "rtt", rtt,
                         "window", window, "counters", counters, "reordering", c->reordering);
}

static PyObject *core_run_io(DenseCore *self, PyObject *args) {
    StreamCore *c = &self->core;
    int fd, control_fd;
    const char *host;
    int port;
    double slice;
    int gso = 1;
    if (!PyArg_ParseTuple(args, "i(si)id|p", &fd, &host, &port, &control_fd, &slice, &gso))
        return NULL;
    struct sockaddr_in dst;
    memset(&dst, 0, sizeof(dst));
    dst.sin_family = AF_INET;
    dst.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &dst.sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "run_io needs an IPv4 address, not %s", host);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = stream_run_io(c, fd, dst, control_fd, slice, gso);
    Py_END_ALLOW_THREADS
    if (status == IO_TOO_BIG) { /* as driver.send_waiting raises it */
        errno = EMSGSIZE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (status < 0)
        return PyErr_NoMemory();
    return PyLong_FromLong(status);
}

static PyObject *core_nonfinite_chunks(DenseCore *self, PyObject *unused) {
    StreamCore *c = &self->core;
    PyObject *out = PyList_New(0);
    for (int64_t chunk = 0; out && chunk < c->chunks; chunk++) {
        if (!c->nonfinite[chunk])
            continue;
        PyObject *item = PyLong_FromLongLong(chunk);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(item);
    }
    return out;
}

static PyObject *core_get_done(DenseCore *self, void *unused) {
    return PyBool_FromLong(self->core.remaining == 0);
}

static PyObject *core_get_error(DenseCore *self, void *unused) {
    StreamCore *c = &self->core;
    if (c->stalled)
        return PyUnicode_FromString("stalled");
    Py_RETURN_NONE;
}

static PyObject *core_get_width(DenseCore *self, void *unused) {
    return PyLong_FromLong(self->core.width);
}

static PyObject *core_get_inflight_count(DenseCore *self, void *unused) {
    StreamCore *c = &self->core;
    return PyLong_FromLongLong(c->inflight_count);
}

static PyObject *core_get_last_progress(DenseCore *self, void *unused) {
    StreamCore *c = &self->core;
    return PyFloat_FromDouble(c->last_progress);
}

static PyObject *core_send_refused(DenseCore *self, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    send_refused(&self->core, now);
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"receive_datagram", (PyCFunction)core_receive_datagram, METH_VARARGS,
     "receive_datagram(data, now): take one datagram from the switch."},
    {"datagrams_to_send", (PyCFunction)core_datagrams_to_send, METH_NOARGS,
     "Datagrams to send to the switch now (bytes)."},
    {"get_timer", (PyCFunction)core_get_timer, METH_NOARGS,
     "Earliest time at which handle_timer must run, or None."},
    {"handle_timer", (PyCFunction)core_handle_timer, METH_O,
     "handle_timer(now): presume lost what timed out, resend what the window allows."},
    {"send_refused", (PyCFunction)core_send_refused, METH_O,
     "send_refused(now): this host's queue refused a datagram (ENOBUFS)."},
    {"pending", (PyCFunction)core_pending, METH_NOARGS,
     "(absolute slot, message number) of every message awaiting its result."},
    {"nonfinite_chunks", (PyCFunction)core_nonfinite_chunks, METH_NOARGS,
     "Chunks left as they were for the follow-up exchange (worker/engine/nonfinite.py)."},
    {"export_state", (PyCFunction)core_export_state, METH_NOARGS,
     "{slot_msgs, rtt, window, counters since the last call, reordering}: rtt and window "
     "by recovery.py's field names."},
    {"run_io", (PyCFunction)core_run_io, METH_VARARGS,
     "run_io(fd, (host, port), control_fd, slice, gso=True): drive the call on a "
     "non-blocking UDP socket without the GIL for up to slice seconds (gso: whether the "
     "switch takes runs of UDP GSO segments); 0 done, 1 stalled, 2 control readable, "
     "3 slice over."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef core_getset[] = {
    {"done", (getter)core_get_done, NULL, "Whether every result came.", NULL},
    {"error", (getter)core_get_error, NULL, "'stalled' or None.", NULL},
    {"width", (getter)core_get_width, NULL, "Slots of the call.", NULL},
    {"inflight_count", (getter)core_get_inflight_count, NULL, "Messages in flight.", NULL},
    {"last_progress", (getter)core_get_last_progress, NULL, "Time of the last result.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject DenseCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "switchml.worker.engine._fastengine.DenseCore",
    .tp_doc = "The allreduce state machine of engine.DenseAllreduce, in C; with sparse=True "
              "sparse.SparseAllreduce's.",
    .tp_basicsize = sizeof(DenseCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)core_init,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
    .tp_getset = core_getset,
};

/* (src, exponent, bits, dst) from Python to one of the two kernels (tests). */
static PyObject *call_kernel(PyObject *args, int quantize) {
    Py_buffer src, dst;
    int exponent, bits;
    if (!PyArg_ParseTuple(args, "y*iiw*", &src, &exponent, &bits, &dst))
        return NULL;
    if (dst.len < src.len)
        PyErr_SetString(PyExc_ValueError, "dst shorter than src");
    else if (quantize)
        quantize_into(src.buf, src.len / 4, exponent, bits, dst.buf);
    else
        dequantize_into(src.buf, src.len / 4, exponent, bits, dst.buf);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_quantize(PyObject *self, PyObject *args) { return call_kernel(args, 1); }

static PyObject *py_dequantize(PyObject *self, PyObject *args) { return call_kernel(args, 0); }

static PyObject *py_chunk_exponent(PyObject *self, PyObject *arg) {
    Py_buffer src;
    if (PyObject_GetBuffer(arg, &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    int16_t e = chunk_exponent(src.buf, src.len / 4);
    PyBuffer_Release(&src);
    return PyLong_FromLong(e);
}

static PyObject *py_blocks_allocated(PyObject *self, PyObject *unused) {
    return PyLong_FromLongLong(__atomic_load_n(&blocks_allocated, __ATOMIC_RELAXED));
}

/* magnitude_peak(values, build): one build's result ("baseline" or "avx2"), or
 * None where the CPU or compiler lacks it (tests compare both with quant.py). */
static PyObject *py_magnitude_peak(PyObject *self, PyObject *args) {
    Py_buffer src;
    const char *build;
    if (!PyArg_ParseTuple(args, "y*s", &src, &build))
        return NULL;
    int32_t (*peak)(const int32_t *, int64_t) = NULL;
    if (strcmp(build, "baseline") == 0)
        peak = magnitude_peak_baseline;
#ifdef HAVE_AVX2_BUILD
    else if (strcmp(build, "avx2") == 0 && __builtin_cpu_supports("avx2"))
        peak = magnitude_peak_avx2;
#endif
    if (!peak) {
        PyBuffer_Release(&src);
        Py_RETURN_NONE;
    }
    int32_t result = peak(src.buf, src.len / 4);
    PyBuffer_Release(&src);
    return PyLong_FromLong(result);
}

static PyMethodDef module_methods[] = {
    {"quantize_into", py_quantize, METH_VARARGS,
     "quantize_into(src, exponent, bits, dst): quant.quantize_into's arithmetic (tests)."},
    {"dequantize_into", py_dequantize, METH_VARARGS,
     "dequantize_into(src, exponent, bits, dst): quant.dequantize_into's arithmetic (tests)."},
    {"chunk_exponent", py_chunk_exponent, METH_O,
     "chunk_exponent(values): quant.chunk_exponents of one chunk (tests)."},
    {"blocks_allocated", py_blocks_allocated, METH_NOARGS,
     "blocks_allocated(): the calls' large blocks (packets, receive buffers) allocated so "
     "far, not taken again from the ones earlier calls kept (tests)."},
    {"magnitude_peak", py_magnitude_peak, METH_VARARGS,
     "magnitude_peak(values, build): the greatest magnitude's bits by one build, or None "
     "(tests)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastengine",
                                    "The worker's dense allreduce in C.", -1, module_methods};

PyMODINIT_FUNC PyInit__fastengine(void) {
    const char *gso = getenv("SWITCHML_WORKER_GSO");
    gso_wanted = !(gso && strcmp(gso, "0") == 0);
    const char *gro = getenv("SWITCHML_WORKER_GRO");
    gro_wanted = !(gro && strcmp(gro, "0") == 0);
#ifdef HAVE_AVX2_BUILD
    if (__builtin_cpu_supports("avx2"))
        magnitude_peak = magnitude_peak_avx2;
#endif
    if (PyType_Ready(&DenseCoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&DenseCoreType);
    if (PyModule_AddObject(m, "DenseCore", (PyObject *)&DenseCoreType) < 0) {
        Py_DECREF(&DenseCoreType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "FAST_RETRANSMIT_THRESHOLD", FAST_RETRANSMIT_THRESHOLD) < 0 ||
        PyModule_AddIntConstant(m, "MAX_REORDERING", MAX_REORDERING) < 0 ||
        PyModule_AddIntConstant(m, "MAX_DATA_THREADS", MAX_DATA_THREADS) < 0 ||
        PyModule_AddIntConstant(m, "TAIL_PROBE_ROUND_TRIPS", TAIL_PROBE_ROUND_TRIPS) < 0 ||
        PyModule_AddIntConstant(m, "COPY_PROBE_ROUND_TRIPS", COPY_PROBE_ROUND_TRIPS) < 0 ||
        PyModule_AddObject(m, "TAIL_PROBE_MARGIN", PyFloat_FromDouble(TAIL_PROBE_MARGIN)) < 0 ||
        PyModule_AddObject(m, "QUEUE_FACTOR", PyFloat_FromDouble(QUEUE_FACTOR)) < 0 ||
        PyModule_AddIntConstant(m, "MAX_KEPT_BACKOFF", MAX_KEPT_BACKOFF) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

