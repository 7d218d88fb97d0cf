/* switchml.switch.dataplane._fastpath: the C data plane (fastpath_core.c) and the switch's
 * batched UDP loop (fastpath_io.c) as a Python type; the loop runs without the GIL.
 *
 * Core is driven by switch/dataplane/fastpipeline.py (FastPipeline), which keeps the
 * control plane (jobs, slot allocation, counters by name) in Python and hands
 * the per-packet work here.  Its methods must not be called concurrently; the
 * switch calls them under its lock, and a call during drain() raises.
 *
 * A core of several threads (Core(..., threads=N)) is served by its own data
 * threads (serve(): pthreads, no Python), each on its own socket; then the
 * control methods take the tables' write lock (lock_tables), which waits for
 * the batch each thread is in, and drain() and receive() are refused.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <string.h>

#include "fastpath_io.h"

typedef struct {
    PyObject_HEAD
    fp_core core;
    fp_io *io; /* [core.thread_count] */
    fp_serving serving;
    Py_buffer rows;
    int has_rows, has_serving, busy;
} CoreObject;

static int check_idle(CoreObject *self)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the switch core is draining its socket");
        return -1;
    }
    return 0;
}

/* drain() and receive() run the pipeline on the caller's thread: not while the
 * core's own data threads do. */
static int check_not_serving(CoreObject *self)
{
    if (self->serving.started) {
        PyErr_SetString(PyExc_RuntimeError, "the switch core's data threads are serving");
        return -1;
    }
    return check_idle(self);
}

/* The job and member tables, registers and counters, for the control plane: while
 * data threads serve, once each is between two batches. */
static void lock_tables(CoreObject *self)
{
    if (self->serving.started)
        pthread_rwlock_wrlock(&self->serving.tables);
}

static void unlock_tables(CoreObject *self)
{
    if (self->serving.started)
        pthread_rwlock_unlock(&self->serving.tables);
}

/* ------------------------------------------------------------ life cycle */
static int Core_init(CoreObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"rows", "slots", "row_size", "member_limit", "threads", NULL};
    unsigned int slots, row_size, member_limit, threads = 1, i;
    if (self->has_rows) {
        PyErr_SetString(PyExc_RuntimeError, "Core is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*III|I", kwlist, &self->rows, &slots,
                                     &row_size, &member_limit, &threads))
        return -1;
    self->has_rows = 1;
    if (slots < 1 || row_size < 2 * WIRE_HEADER_SIZE || row_size % 4 ||
        (size_t)self->rows.len != 2 * (size_t)slots * row_size || member_limit < 1) {
        PyErr_SetString(PyExc_ValueError, "rows must be 2 * slots * row_size bytes");
        return -1;
    }
    if (threads < 1 || threads > FP_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be 1 to %d", FP_MAX_THREADS);
        return -1;
    }
    if (fp_core_init(&self->core, slots, row_size, self->rows.buf, member_limit, threads) < 0 ||
        !(self->io = PyMem_Calloc(threads, sizeof *self->io))) {
        PyErr_NoMemory();
        return -1;
    }
    for (i = 0; i < threads; i++)
        if (fp_io_init(&self->io[i], &self->core, &self->core.threads[i]) < 0) {
            PyErr_NoMemory();
            return -1;
        }
    if ((errno = fp_serving_init(&self->serving))) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->has_serving = 1;
    return 0;
}

static void Core_dealloc(CoreObject *self)
{
    uint32_t i;
    if (self->serving.started) { /* never left running on freed memory */
        Py_BEGIN_ALLOW_THREADS
        fp_serve_stop(&self->serving, self->io, self->core.thread_count);
        Py_END_ALLOW_THREADS
    }
    if (self->has_serving)
        fp_serving_free(&self->serving);
    for (i = 0; self->io && i < self->core.thread_count; i++)
        fp_io_free(&self->io[i]);
    PyMem_Free(self->io);
    fp_core_free(&self->core);
    if (self->has_rows)
        PyBuffer_Release(&self->rows);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* ------------------------------------------------------------ control */
static PyObject *Core_set_drop_rates(CoreObject *self, PyObject *args)
{
    double ingress, egress;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "ddK", &ingress, &egress, &seed) || check_idle(self) < 0)
        return NULL;
    lock_tables(self);
    self->core.ingress_drop_rate = ingress;
    self->core.egress_drop_rate = egress;
    fp_seed(&self->core, seed);
    unlock_tables(self);
    Py_RETURN_NONE;
}

static PyObject *Core_install(CoreObject *self, PyObject *args)
{
    fp_job job;
    PyObject *keys, *tokens;
    Py_ssize_t i, n;
    memset(&job, 0, sizeof job);
    if (!PyArg_ParseTuple(args, "IIIIIIOO", &job.slot_base, &job.slot_count, &job.session,
                          &job.lanes, &job.packet_elements, &job.block_elements, &keys,
                          &tokens) ||
        check_idle(self) < 0)
        return NULL;
    keys = PySequence_Fast(keys, "members must be a sequence of address keys");
    if (!keys)
        return NULL;
    tokens = PySequence_Fast(tokens, "tokens must be a sequence of integers");
    if (!tokens) {
        Py_DECREF(keys);
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(keys);
    /* the Python pipeline checked these; the core relies on them for memory safety */
    if (n < 1 || n > FP_MAX_WORKERS || PySequence_Fast_GET_SIZE(tokens) != n ||
        job.session == 0 || job.slot_count < 1 || job.slot_base >= self->core.slots ||
        job.slot_count > self->core.slots - job.slot_base || job.block_elements < 1 ||
        job.lanes != job.packet_elements / job.block_elements ||
        job.packet_elements % job.block_elements ||
        /* a row: the datagram, then a resend's header (fastpath_core.c answer_probe) */
        2 * WIRE_HEADER_SIZE + (size_t)WIRE_LANE_SIZE * job.lanes + 4 * (size_t)job.packet_elements >
            self->core.row_size ||
        self->core.jobs[job.slot_base].session != 0) {
        Py_DECREF(keys);
        Py_DECREF(tokens);
        PyErr_SetString(PyExc_ValueError, "job does not fit the switch core");
        return NULL;
    }
    job.world = (uint32_t)n;
    for (i = 0; i < n && !PyErr_Occurred(); i++) {
        job.members[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(keys, i));
        job.tokens[i] = (uint32_t)PyLong_AsUnsignedLong(PySequence_Fast_GET_ITEM(tokens, i));
    }
    Py_DECREF(keys);
    Py_DECREF(tokens);
    if (PyErr_Occurred())
        return NULL;
    lock_tables(self);
    int installed = fp_install(&self->core, &job);
    unlock_tables(self);
    if (installed < 0) {
        PyErr_Format(PyExc_ValueError, "the switch core's member table is full (%u addresses)",
                     self->core.member_limit);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Core_remove(CoreObject *self, PyObject *args)
{
    unsigned int base;
    if (!PyArg_ParseTuple(args, "I", &base) || check_idle(self) < 0)
        return NULL;
    if (base >= self->core.slots || self->core.jobs[base].session == 0) {
        PyErr_SetString(PyExc_KeyError, "no job starts at that slot");
        return NULL;
    }
    lock_tables(self);
    fp_remove(&self->core, base);
    unlock_tables(self);
    Py_RETURN_NONE;
}

static PyObject *counters_dict(fp_counters *c)
{
    PyObject *d = PyDict_New();
    int i;
    if (!d)
        return NULL;
    for (i = 0; i < FP_NCOUNTERS; i++) {
        if (!(c->touched >> i & 1))
            continue;
        PyObject *value = PyLong_FromLongLong(c->value[i]);
        if (!value || PyDict_SetItemString(d, FP_COUNTER_NAMES[i], value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(value);
    }
    memset(c, 0, sizeof *c);
    return d;
}

/* One counter set summed over the data threads (each counts its own), and zeroed. */
static void take_sum(fp_core *core, uint32_t s, fp_counters *sum)
{
    uint32_t i, k;
    memset(sum, 0, sizeof *sum);
    for (i = 0; i < core->thread_count; i++) {
        fp_thread *t = &core->threads[i];
        fp_counters *c = s < core->slots ? &t->job_counters[s] : &t->counters;
        if (!c->touched)
            continue;
        for (k = 0; k < FP_NCOUNTERS; k++)
            sum->value[k] += c->value[k];
        sum->touched |= c->touched;
        memset(c, 0, sizeof *c);
    }
}

/* take_counters() -> [(slot_base or -1, {name: increment})]: what was counted since
 * the last call (a key for every counter incremented, even by 0), then zero. */
static PyObject *Core_take_counters(CoreObject *self, PyObject *unused)
{
    PyObject *out = NULL, *d, *item;
    fp_counters *sums;
    uint32_t s;
    if (check_idle(self) < 0)
        return NULL;
    if (!(sums = PyMem_Malloc((self->core.slots + 1) * sizeof *sums)))
        return PyErr_NoMemory();
    lock_tables(self); /* summed at once, then the dicts built: threads wait for no dict */
    for (s = 0; s <= self->core.slots; s++)
        take_sum(&self->core, s, &sums[s]);
    unlock_tables(self);
    if (!(out = PyList_New(0)))
        goto fail;
    for (s = 0; s <= self->core.slots; s++) {
        if (!sums[s].touched)
            continue;
        if (!(d = counters_dict(&sums[s])))
            goto fail;
        item = Py_BuildValue("(iN)", s < self->core.slots ? (int)s : -1, d);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            goto fail;
        }
        Py_DECREF(item);
    }
    PyMem_Free(sums);
    return out;
fail:
    PyMem_Free(sums);
    Py_XDECREF(out);
    return NULL;
}

/* take_mismatches() -> [(slot_base, bitmap, seq, call, dtype, rank, seq, call, dtype)]:
 * the jobs' first disagreements between ranks not taken yet (pipeline.Mismatch). */
static PyObject *Core_take_mismatches(CoreObject *self, PyObject *unused)
{
    PyObject *out, *item;
    uint32_t s;
    if (check_idle(self) < 0 || !(out = PyList_New(0)))
        return NULL;
    lock_tables(self); /* a record is whole once its thread's batch ended */
    for (s = 0; self->core.mismatches && s < self->core.slots; s++) {
        fp_job *job = &self->core.jobs[s];
        const uint32_t *m = job->mismatch;
        if (!job->session || job->mismatch_state != 1)
            continue;
        item = Py_BuildValue("(IIIIIIIII)", s, m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]);
        if (!item || PyList_Append(out, item) < 0) {
            unlock_tables(self);
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
        job->mismatch_state = 2;
        __atomic_fetch_sub(&self->core.mismatches, 1, __ATOMIC_RELAXED);
    }
    unlock_tables(self);
    return out;
}

static PyObject *Core_slot_state(CoreObject *self, PyObject *args)
{
    unsigned int slot;
    unsigned long long msg;
    if (!PyArg_ParseTuple(args, "IK", &slot, &msg) || check_idle(self) < 0)
        return NULL;
    if (slot >= self->core.slots) {
        PyErr_SetString(PyExc_IndexError, "slot out of range");
        return NULL;
    }
    lock_tables(self);
    fp_set *set = &self->core.sets[(msg & 1) * self->core.slots + slot];
    int holds = set->valid && set->msg == msg;
    uint32_t bitmap = holds ? set->bitmap : 0;
    unlock_tables(self);
    return Py_BuildValue("(OI)", holds ? Py_True : Py_False, bitmap);
}

/* receive(datagram, key) -> [(offset in rows, length, rank)]: one datagram from the
 * member with that address key; the results are rows of the pool. */
static PyObject *Core_receive(CoreObject *self, PyObject *args)
{
    Py_buffer data;
    unsigned long long key;
    fp_out out[FP_MAX_WORKERS];
    int n, i;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "y*K", &data, &key))
        return NULL;
    if (check_not_serving(self) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    /* the thread the socket steering would pick (fp_steer_by_slot) */
    uint32_t slot = data.len >= 8 ? ((const uint8_t *)data.buf)[6] |
                                        ((const uint8_t *)data.buf)[7] << 8 : 0;
    fp_thread *thread = &self->core.threads[slot % self->core.thread_count];
    n = fp_receive(&self->core, thread, data.buf, (size_t)data.len, key, out);
    PyBuffer_Release(&data);
    if (n == FP_OTHER_THREAD) /* never: the thread is the slot's owner */
        n = 0;
    if (!(list = PyList_New(n)))
        return NULL;
    for (i = 0; i < n; i++) {
        PyObject *item = Py_BuildValue("(nII)", (Py_ssize_t)(out[i].data - self->core.rows),
                                       out[i].len, out[i].rank);
        if (!item) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

/* drain(fd, limit, gso=True) -> (received, sent): handle up to `limit` datagrams
 * waiting on the UDP socket `fd`, without the GIL; results to one destination
 * leave as UDP GSO segments when `gso` (and the kernel takes them). */
static PyObject *Core_drain(CoreObject *self, PyObject *args)
{
    int fd, gso = 1;
    unsigned int limit;
    uint32_t received;
    if (!PyArg_ParseTuple(args, "iI|p", &fd, &limit, &gso) || check_not_serving(self) < 0)
        return NULL;
    if (self->core.thread_count > 1) {
        PyErr_SetString(PyExc_RuntimeError, "a core of several threads is drained by its own "
                                            "data threads: serve()");
        return NULL;
    }
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    received = fp_io_drain(&self->io[0], fd, limit, gso);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    return Py_BuildValue("(IK)", received, (unsigned long long)self->io[0].sent);
}

/* serve(fds, notify_fd, gso): a data thread per socket, thread i on fds[i] (the
 * sockets of the port's SO_REUSEPORT group, in the order they were bound), until
 * stop(); notify_fd gets a byte when a thread recorded a mismatch (-1: none). */
static PyObject *Core_serve(CoreObject *self, PyObject *args)
{
    PyObject *list;
    int fds[FP_MAX_THREADS], notify_fd, gso, error;
    Py_ssize_t i, n;
    if (!PyArg_ParseTuple(args, "Oip", &list, &notify_fd, &gso) || check_not_serving(self) < 0)
        return NULL;
    if (!(list = PySequence_Fast(list, "fds must be a sequence of file descriptors")))
        return NULL;
    n = PySequence_Fast_GET_SIZE(list);
    for (i = 0; i < n && i < FP_MAX_THREADS; i++)
        fds[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(list, i));
    Py_DECREF(list);
    if (PyErr_Occurred())
        return NULL;
    if (n != (Py_ssize_t)self->core.thread_count) {
        PyErr_Format(PyExc_ValueError, "a socket per data thread: %u, got %zd",
                     self->core.thread_count, n);
        return NULL;
    }
    if ((error = fp_serve_start(&self->serving, self->io, fds, (uint32_t)n, notify_fd, gso))) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* stop(): tell the data threads to stop, and join them. */
static PyObject *Core_stop(CoreObject *self, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    fp_serve_stop(&self->serving, self->io, self->core.thread_count);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* failures() -> [(thread, errno)]: data threads that ended without being told. */
static PyObject *Core_failures(CoreObject *self, PyObject *unused)
{
    PyObject *out = PyList_New(0), *item;
    uint32_t i;
    for (i = 0; out && i < self->core.thread_count; i++) {
        fp_io *io = &self->io[i];
        if (!__atomic_load_n(&io->exited, __ATOMIC_ACQUIRE) || !io->failure)
            continue;
        item = Py_BuildValue("(Ii)", i, io->failure);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(out);
        }
        Py_XDECREF(item);
    }
    return out;
}

/* cpu_seconds() -> the data threads' CPU time together (0 when it never served). */
static PyObject *Core_cpu_seconds(CoreObject *self, PyObject *unused)
{
    double total = 0.0;
    uint32_t i;
    for (i = 0; self->io[0].serving && i < self->core.thread_count; i++)
        total += fp_io_cpu_seconds(&self->io[i]);
    return PyFloat_FromDouble(total);
}

static PyObject *Core_get_gso_refused(CoreObject *self, void *unused)
{
    uint32_t i;
    for (i = 0; i < self->core.thread_count; i++)
        if (__atomic_load_n(&self->io[i].gso_refused, __ATOMIC_RELAXED))
            Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* steer_by_slot(fd, n): the kernel gives each datagram of the SO_REUSEPORT group
 * of fd to its socket slot % n (fastpath_io.c fp_steer_by_slot). */
static PyObject *steer_by_slot(PyObject *module, PyObject *args)
{
    int fd, error;
    unsigned int n;
    if (!PyArg_ParseTuple(args, "iI", &fd, &n))
        return NULL;
    if ((error = fp_steer_by_slot(fd, n))) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *Core_counter_names(PyObject *cls, PyObject *unused)
{
    PyObject *t = PyTuple_New(FP_NCOUNTERS);
    int i;
    if (!t)
        return NULL;
    for (i = 0; i < FP_NCOUNTERS; i++) {
        PyObject *s = PyUnicode_FromString(FP_COUNTER_NAMES[i]);
        if (!s) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

static PyMethodDef Core_methods[] = {
    {"set_drop_rates", (PyCFunction)Core_set_drop_rates, METH_VARARGS,
     "set_drop_rates(ingress, egress, seed): simulated drop probabilities"},
    {"install", (PyCFunction)Core_install, METH_VARARGS,
     "install(slot_base, slot_count, session, lanes, packet_elements, block_elements, keys, tokens)"},
    {"remove", (PyCFunction)Core_remove, METH_VARARGS, "remove(slot_base)"},
    {"take_counters", (PyCFunction)Core_take_counters, METH_NOARGS,
     "take_counters() -> [(slot_base or -1, {name: increment})], then zero them"},
    {"take_mismatches", (PyCFunction)Core_take_mismatches, METH_NOARGS,
     "take_mismatches() -> [(slot_base, bitmap, seq, call, dtype, rank, seq, call, dtype)]"},
    {"slot_state", (PyCFunction)Core_slot_state, METH_VARARGS,
     "slot_state(slot, msg) -> (holds msg, contributor bitmap)"},
    {"receive", (PyCFunction)Core_receive, METH_VARARGS,
     "receive(datagram, key) -> [(offset, length, rank)]"},
    {"drain", (PyCFunction)Core_drain, METH_VARARGS,
     "drain(fd, limit) -> (received, sent), with the GIL released"},
    {"serve", (PyCFunction)Core_serve, METH_VARARGS,
     "serve(fds, notify_fd, gso): a data thread per socket, until stop()"},
    {"stop", (PyCFunction)Core_stop, METH_NOARGS, "stop(): stop the data threads, join them"},
    {"failures", (PyCFunction)Core_failures, METH_NOARGS,
     "failures() -> [(thread, errno)] of data threads that ended by themselves"},
    {"cpu_seconds", (PyCFunction)Core_cpu_seconds, METH_NOARGS,
     "cpu_seconds() -> the data threads' CPU time together"},
    {"counter_names", (PyCFunction)Core_counter_names, METH_NOARGS | METH_CLASS,
     "the names of the counters the core keeps"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Core_members[] = {
    {"mismatches", T_UINT, offsetof(CoreObject, core.mismatches), READONLY,
     "jobs with a disagreement between ranks that take_mismatches() has not returned"},
    {"thread_count", T_UINT, offsetof(CoreObject, core.thread_count), READONLY,
     "the data threads it has (each owns the slots s with s % thread_count == its index)"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"gso_refused", (getter)Core_get_gso_refused, NULL,
     "true once the kernel refused a UDP GSO send (then results go one per datagram)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef module_methods[] = {
    {"steer_by_slot", steer_by_slot, METH_VARARGS,
     "steer_by_slot(fd, n): each datagram to the SO_REUSEPORT group's socket slot % n"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "switchml.switch.dataplane._fastpath.Core",
    .tp_basicsize = sizeof(CoreObject),
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Core(rows, slots, row_size, member_limit): the switch's data plane in C",
    .tp_methods = Core_methods,
    .tp_members = Core_members,
    .tp_getset = Core_getset,
    .tp_init = (initproc)Core_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT, "switchml.switch.dataplane._fastpath",
    "The switch's data plane in C, and its batched UDP loop.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__fastpath(void)
{
    PyObject *m;
    if (PyType_Ready(&CoreType) < 0)
        return NULL;
    if (!(m = PyModule_Create(&fastpath_module)))
        return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0 ||
        PyModule_AddIntConstant(m, "KEY_NOT_IPV4", (long long)FP_KEY_NOT_IPV4) < 0 ||
        PyModule_AddIntConstant(m, "RECV_BATCH", FP_RECV_BATCH) < 0 ||
        PyModule_AddIntConstant(m, "MAX_THREADS", FP_MAX_THREADS) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
