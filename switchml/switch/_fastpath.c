/* switchml.switch._fastpath: the C data plane (fastpath_core.c) and the switch's
 * batched UDP loop (fastpath_io.c) as a Python type; the loop runs without the GIL.
 *
 * Core is driven by switch/fastpipeline.py (FastPipeline), which keeps the
 * control plane (jobs, slot allocation, counters by name) in Python and hands
 * the per-packet work here.  Its methods must not be called concurrently; the
 * switch calls them under its lock, and a call during drain() raises.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <string.h>

#include "fastpath_io.h"

typedef struct {
    PyObject_HEAD
    fp_core core;
    fp_io io;
    Py_buffer rows;
    int has_rows, busy;
} CoreObject;

static int check_idle(CoreObject *self)
{
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the switch core is draining its socket");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------ life cycle */
static int Core_init(CoreObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"rows", "slots", "row_size", "member_limit", NULL};
    unsigned int slots, row_size, member_limit;
    if (self->has_rows) {
        PyErr_SetString(PyExc_RuntimeError, "Core is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "w*III", kwlist, &self->rows, &slots,
                                     &row_size, &member_limit))
        return -1;
    self->has_rows = 1;
    if (slots < 1 || row_size < 2 * WIRE_HEADER_SIZE || row_size % 4 ||
        (size_t)self->rows.len != 2 * (size_t)slots * row_size || member_limit < 1) {
        PyErr_SetString(PyExc_ValueError, "rows must be 2 * slots * row_size bytes");
        return -1;
    }
    if (fp_core_init(&self->core, slots, row_size, self->rows.buf, member_limit) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    if (fp_io_init(&self->io, &self->core) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Core_dealloc(CoreObject *self)
{
    fp_core_free(&self->core);
    fp_io_free(&self->io);
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
    self->core.ingress_drop_rate = ingress;
    self->core.egress_drop_rate = egress;
    self->core.rng = seed;
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
    if (fp_install(&self->core, &job) < 0) {
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
    fp_remove(&self->core, base);
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

/* take_counters() -> [(slot_base or -1, {name: increment})]: what was counted since
 * the last call (a key for every counter incremented, even by 0), then zero. */
static PyObject *Core_take_counters(CoreObject *self, PyObject *unused)
{
    PyObject *out, *d, *item;
    uint32_t s;
    if (check_idle(self) < 0 || !(out = PyList_New(0)))
        return NULL;
    for (s = 0; s <= self->core.slots; s++) {
        fp_counters *c = s < self->core.slots ? &self->core.jobs[s].counters
                                              : &self->core.counters;
        if (!c->touched)
            continue;
        if (!(d = counters_dict(c)))
            goto fail;
        item = Py_BuildValue("(iN)", s < self->core.slots ? (int)s : -1, d);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            goto fail;
        }
        Py_DECREF(item);
    }
    return out;
fail:
    Py_DECREF(out);
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
    for (s = 0; self->core.mismatches && s < self->core.slots; s++) {
        fp_job *job = &self->core.jobs[s];
        const uint32_t *m = job->mismatch;
        if (!job->session || job->mismatch_state != 1)
            continue;
        item = Py_BuildValue("(IIIIIIIII)", s, m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
        job->mismatch_state = 2;
        self->core.mismatches--;
    }
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
    fp_set *set = &self->core.sets[(msg & 1) * self->core.slots + slot];
    int holds = set->valid && set->msg == msg;
    return Py_BuildValue("(OI)", holds ? Py_True : Py_False, holds ? set->bitmap : 0);
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
    if (check_idle(self) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    n = fp_receive(&self->core, data.buf, (size_t)data.len, key, out);
    PyBuffer_Release(&data);
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
    if (!PyArg_ParseTuple(args, "iI|p", &fd, &limit, &gso) || check_idle(self) < 0)
        return NULL;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    received = fp_io_drain(&self->io, fd, limit, gso);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    return Py_BuildValue("(IK)", received, (unsigned long long)self->io.sent);
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
    {"counter_names", (PyCFunction)Core_counter_names, METH_NOARGS | METH_CLASS,
     "the names of the counters the core keeps"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Core_members[] = {
    {"mismatches", T_UINT, offsetof(CoreObject, core.mismatches), READONLY,
     "jobs with a disagreement between ranks that take_mismatches() has not returned"},
    {"gso_refused", T_INT, offsetof(CoreObject, io.gso_refused), READONLY,
     "true once the kernel refused a UDP GSO send (then results go one per datagram)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "switchml.switch._fastpath.Core",
    .tp_basicsize = sizeof(CoreObject),
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Core(rows, slots, row_size, member_limit): the switch's data plane in C",
    .tp_methods = Core_methods,
    .tp_members = Core_members,
    .tp_init = (initproc)Core_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT, "switchml.switch._fastpath",
    "The switch's data plane in C, and its batched UDP loop.", -1, NULL,
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
        PyModule_AddIntConstant(m, "RECV_BATCH", FP_RECV_BATCH) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
