/* switchml.switch._fastpath: the C data plane (fastpath_core.c) as a Python type,
 * and the switch's batched UDP loop, which runs without the GIL.
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

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <stdlib.h>
#include <sys/socket.h>

#include "fastpath.h"

/* Datagrams taken from the socket per recvmmsg call. */
#define RECV_BATCH 64
/* Datagrams queued for one sendmmsg call at most; every result fits beside them. */
#define SEND_QUEUE (RECV_BATCH * FP_MAX_WORKERS)
/* An IPv4 UDP datagram is at most 65507 bytes. */
#define RECV_BUFFER 65536
/* recvmmsg errors (ICMP errors surfacing, say) tolerated in one drain call. */
#define MAX_RECV_ERRORS 16
/* Address keys with this bit are not IPv4 addresses (set by FastPipeline). */
#define KEY_NOT_IPV4 ((uint64_t)1 << 48)
/* UDP GSO: at most this many segments, of at most this many bytes in all, a send. */
#define GSO_MAX_SEGMENTS 64
#define GSO_MAX_BYTES 65000
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#define CONTROL_SIZE 32 /* >= CMSG_SPACE(sizeof(uint16_t)) */

typedef struct {
    PyObject_HEAD
    fp_core core;
    Py_buffer rows;
    int has_rows, busy;
    /* the socket loop's buffers, allocated with the core */
    uint8_t *recv_buffers;
    struct mmsghdr *recv_msgs;
    struct iovec *recv_iov;
    struct sockaddr_in *recv_addrs;
    fp_out *send_queue;
    struct mmsghdr *send_msgs;
    struct iovec *send_iov;
    struct sockaddr_in *send_addrs;
    uint64_t (*order)[2];       /* (destination key, queue index) */
    uint32_t *msg_first;        /* per message: its first item in order */
    uint32_t *msg_segments;     /* per message: datagrams in it */
    uint8_t (*control)[CONTROL_SIZE];
    uint32_t queued;
    int fd;
    int gso;         /* this drain call may send GSO messages */
    int gso_refused; /* the kernel refused one: never again */
    uint64_t sent;
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
    if (slots < 1 || row_size < FP_HEADER_SIZE || row_size % 4 ||
        (size_t)self->rows.len != 2 * (size_t)slots * row_size || member_limit < 1) {
        PyErr_SetString(PyExc_ValueError, "rows must be 2 * slots * row_size bytes");
        return -1;
    }
    if (fp_core_init(&self->core, slots, row_size, self->rows.buf, member_limit) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    self->recv_buffers = PyMem_RawMalloc((size_t)RECV_BATCH * RECV_BUFFER);
    self->recv_msgs = PyMem_RawCalloc(RECV_BATCH, sizeof(struct mmsghdr));
    self->recv_iov = PyMem_RawCalloc(RECV_BATCH, sizeof(struct iovec));
    self->recv_addrs = PyMem_RawCalloc(RECV_BATCH, sizeof(struct sockaddr_in));
    self->send_queue = PyMem_RawCalloc(SEND_QUEUE, sizeof(fp_out));
    self->send_msgs = PyMem_RawCalloc(SEND_QUEUE, sizeof(struct mmsghdr));
    self->send_iov = PyMem_RawCalloc(SEND_QUEUE, sizeof(struct iovec));
    self->send_addrs = PyMem_RawCalloc(SEND_QUEUE, sizeof(struct sockaddr_in));
    self->order = PyMem_RawCalloc(SEND_QUEUE, sizeof *self->order);
    self->msg_first = PyMem_RawCalloc(SEND_QUEUE, sizeof *self->msg_first);
    self->msg_segments = PyMem_RawCalloc(SEND_QUEUE, sizeof *self->msg_segments);
    self->control = PyMem_RawCalloc(SEND_QUEUE, sizeof *self->control);
    if (!self->recv_buffers || !self->recv_msgs || !self->recv_iov || !self->recv_addrs ||
        !self->send_queue || !self->send_msgs || !self->send_iov || !self->send_addrs ||
        !self->order || !self->msg_first || !self->msg_segments || !self->control) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Core_dealloc(CoreObject *self)
{
    fp_core_free(&self->core);
    PyMem_RawFree(self->recv_buffers);
    PyMem_RawFree(self->recv_msgs);
    PyMem_RawFree(self->recv_iov);
    PyMem_RawFree(self->recv_addrs);
    PyMem_RawFree(self->send_queue);
    PyMem_RawFree(self->send_msgs);
    PyMem_RawFree(self->send_iov);
    PyMem_RawFree(self->send_addrs);
    PyMem_RawFree(self->order);
    PyMem_RawFree(self->msg_first);
    PyMem_RawFree(self->msg_segments);
    PyMem_RawFree(self->control);
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
    PyObject *keys;
    Py_ssize_t i, n;
    memset(&job, 0, sizeof job);
    if (!PyArg_ParseTuple(args, "IIIIIIO", &job.slot_base, &job.slot_count, &job.session,
                          &job.lanes, &job.packet_elements, &job.block_elements, &keys) ||
        check_idle(self) < 0)
        return NULL;
    keys = PySequence_Fast(keys, "members must be a sequence of address keys");
    if (!keys)
        return NULL;
    n = PySequence_Fast_GET_SIZE(keys);
    /* the Python pipeline checked these; the core relies on them for memory safety */
    if (n < 1 || n > FP_MAX_WORKERS || job.session == 0 || job.slot_count < 1 ||
        job.slot_base >= self->core.slots ||
        job.slot_count > self->core.slots - job.slot_base || job.block_elements < 1 ||
        job.lanes != job.packet_elements / job.block_elements ||
        job.packet_elements % job.block_elements ||
        FP_HEADER_SIZE + (size_t)FP_LANE_SIZE * job.lanes + 4 * (size_t)job.packet_elements >
            self->core.row_size ||
        self->core.jobs[job.slot_base].session != 0) {
        Py_DECREF(keys);
        PyErr_SetString(PyExc_ValueError, "job does not fit the switch core");
        return NULL;
    }
    job.world = (uint32_t)n;
    for (i = 0; i < n; i++) {
        job.members[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(keys, i));
        if (PyErr_Occurred()) {
            Py_DECREF(keys);
            return NULL;
        }
    }
    Py_DECREF(keys);
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

/* ------------------------------------------------------------ the socket loop */
/* Results to one destination of the same size leave in one sendmsg as UDP GSO
 * segments (the kernel cuts them into datagrams): one pass through the stack for
 * up to GSO_MAX_SEGMENTS datagrams instead of one each. */
static int sort_by_destination(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b; /* (key, queue index): stable by destination */
    return x[0] != y[0] ? (x[0] < y[0] ? -1 : 1) : (x[1] < y[1] ? -1 : x[1] > y[1]);
}

/* Build sendmmsg messages from the sorted items [from, n): consecutive datagrams
 * to one destination, all of one size but the last (which may be smaller), form
 * one message when GSO is on.  Returns the number of messages. */
static uint32_t build_messages(CoreObject *self, uint32_t from, uint32_t n)
{
    uint32_t m = 0, i = from;
    while (i < n) {
        fp_out *first = &self->send_queue[self->order[i][1]];
        uint64_t key = self->order[i][0];
        uint32_t segs = 0, bytes = 0, seg_len = first->len;
        struct sockaddr_in *sa = &self->send_addrs[m];
        struct msghdr *h = &self->send_msgs[m].msg_hdr;
        memset(h, 0, sizeof *h);
        sa->sin_family = AF_INET;
        sa->sin_addr.s_addr = htonl((uint32_t)(key >> 16));
        sa->sin_port = htons((uint16_t)key);
        h->msg_name = sa;
        h->msg_namelen = sizeof *sa;
        h->msg_iov = &self->send_iov[i];
        self->msg_first[m] = i;
        do {
            fp_out *o = &self->send_queue[self->order[i][1]];
            self->send_iov[i].iov_base = (void *)o->data;
            self->send_iov[i].iov_len = o->len;
            segs++;
            bytes += o->len;
            i++;
            if (o->len < seg_len)
                break; /* a shorter segment ends a GSO message */
        } while (self->gso && i < n && self->order[i][0] == key && segs < GSO_MAX_SEGMENTS &&
                 self->send_queue[self->order[i][1]].len <= seg_len &&
                 bytes + self->send_queue[self->order[i][1]].len <= GSO_MAX_BYTES);
        h->msg_iovlen = segs;
        self->msg_segments[m] = segs;
        if (segs > 1) {
            struct cmsghdr *cm = (struct cmsghdr *)self->control[m];
            uint16_t size = (uint16_t)seg_len;
            h->msg_control = cm;
            h->msg_controllen = CMSG_SPACE(sizeof size);
            cm->cmsg_level = SOL_UDP;
            cm->cmsg_type = UDP_SEGMENT;
            cm->cmsg_len = CMSG_LEN(sizeof size);
            memcpy(CMSG_DATA(cm), &size, sizeof size);
        }
        m++;
    }
    return m;
}

/* Datagrams larger than the path MTU, which the socket's IP_PMTUDISC_DO refuses:
 * the results of a job whose workers did not ask for frame-sized packets.  They
 * go out fragmented, one by one, counted (send_fragmented), so that such a job
 * still works; with frame-sized packets this never runs. */
static void send_fragmented(CoreObject *self, struct msghdr *h)
{
    int dont = IP_PMTUDISC_DONT, do_ = IP_PMTUDISC_DO;
    size_t i;
    setsockopt(self->fd, IPPROTO_IP, IP_MTU_DISCOVER, &dont, sizeof dont);
    for (i = 0; i < h->msg_iovlen; i++) {
        ssize_t n;
        do
            n = sendto(self->fd, h->msg_iov[i].iov_base, h->msg_iov[i].iov_len, MSG_DONTWAIT,
                       h->msg_name, h->msg_namelen);
        while (n < 0 && errno == EINTR);
        fp_count(&self->core.counters, n < 0 ? C_SEND_ERRORS : C_SEND_FRAGMENTED, 1);
        self->sent += n >= 0;
    }
    setsockopt(self->fd, IPPROTO_IP, IP_MTU_DISCOVER, &do_, sizeof do_);
}

/* Send every queued result, then let the rows change again. */
static void flush_queue(fp_core *core, void *ctx)
{
    CoreObject *self = ctx;
    uint32_t i, n = 0, from = 0;
    for (i = 0; i < self->queued; i++) {
        fp_out *o = &self->send_queue[i];
        uint64_t key = core->jobs[o->job].members[o->rank];
        if (key & KEY_NOT_IPV4) { /* an address no socket can reach */
            fp_count(&core->counters, C_SEND_ERRORS, 1);
            continue;
        }
        self->order[n][0] = key;
        self->order[n][1] = i;
        n++;
    }
    if (self->gso)
        qsort(self->order, n, sizeof self->order[0], sort_by_destination);
    while (from < n) {
        uint32_t count = build_messages(self, from, n), done = 0;
        from = n;
        while (done < count) {
            int sent = sendmmsg(self->fd, self->send_msgs + done, count - done, MSG_DONTWAIT);
            if (sent >= 0) {
                for (i = done; i < done + (uint32_t)sent; i++)
                    self->sent += self->msg_segments[i];
                done += (uint32_t)sent;
                continue;
            }
            if (errno == EINTR)
                continue;
            if (self->msg_segments[done] > 1 &&
                (errno == EIO || errno == ENOPROTOOPT || errno == EOPNOTSUPP)) {
                self->gso = 0; /* no GSO here: the rest one datagram each */
                self->gso_refused = 1;
                from = self->msg_first[done];
                break;
            }
            if (errno == EMSGSIZE || (errno == EINVAL && self->msg_segments[done] > 1)) {
                /* larger than the path MTU (GSO says EINVAL): a job whose packets
                 * are not frame-sized */
                send_fragmented(self, &self->send_msgs[done].msg_hdr);
                done++;
                continue;
            }
            /* lost (a full socket buffer, say), as with sendto */
            fp_count(&core->counters, C_SEND_ERRORS, self->msg_segments[done]);
            done++;
        }
    }
    self->queued = 0;
    core->epoch++; /* no row holds a datagram waiting to be sent */
}

static uint32_t drain(CoreObject *self, uint32_t limit)
{
    fp_core *core = &self->core;
    fp_out out[FP_MAX_WORKERS];
    uint32_t received = 0, errors = 0, i;
    for (i = 0; i < RECV_BATCH; i++) {
        self->recv_iov[i].iov_base = self->recv_buffers + (size_t)i * RECV_BUFFER;
        self->recv_iov[i].iov_len = RECV_BUFFER;
    }
    while (received < limit) {
        uint32_t want = limit - received < RECV_BATCH ? limit - received : RECV_BATCH;
        for (i = 0; i < want; i++) {
            struct msghdr *h = &self->recv_msgs[i].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_name = &self->recv_addrs[i];
            h->msg_namelen = sizeof self->recv_addrs[i];
            h->msg_iov = &self->recv_iov[i];
            h->msg_iovlen = 1;
        }
        int got = recvmmsg(self->fd, self->recv_msgs, want, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            if (errno != EINTR) { /* e.g. an ICMP error surfacing on Linux */
                fp_count(&core->counters, C_SOCKET_ERRORS, 1);
                if (++errors >= MAX_RECV_ERRORS)
                    break;
            }
            continue;
        }
        for (i = 0; i < (uint32_t)got; i++) {
            struct sockaddr_in *sa = &self->recv_addrs[i];
            uint64_t key = FP_KEY_NONE;
            if (self->recv_msgs[i].msg_hdr.msg_namelen >= sizeof *sa &&
                sa->sin_family == AF_INET)
                key = (uint64_t)ntohl(sa->sin_addr.s_addr) << 16 | ntohs(sa->sin_port);
            if (self->queued + FP_MAX_WORKERS > SEND_QUEUE)
                flush_queue(core, self);
            int n = fp_receive(core, self->recv_iov[i].iov_base, self->recv_msgs[i].msg_len,
                               key, out);
            memcpy(self->send_queue + self->queued, out, (size_t)n * sizeof *out);
            self->queued += (uint32_t)n;
        }
        received += (uint32_t)got;
        flush_queue(core, self);
        if ((uint32_t)got < want)
            break; /* the socket is empty */
    }
    return received;
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
    self->gso = gso && !self->gso_refused;
    self->busy = 1;
    self->fd = fd;
    self->sent = 0;
    self->queued = 0;
    self->core.flush = flush_queue;
    self->core.flush_ctx = self;
    Py_BEGIN_ALLOW_THREADS
    received = drain(self, limit);
    Py_END_ALLOW_THREADS
    self->core.flush = NULL;
    self->busy = 0;
    return Py_BuildValue("(IK)", received, (unsigned long long)self->sent);
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
     "install(slot_base, slot_count, session, lanes, packet_elements, block_elements, keys)"},
    {"remove", (PyCFunction)Core_remove, METH_VARARGS, "remove(slot_base)"},
    {"take_counters", (PyCFunction)Core_take_counters, METH_NOARGS,
     "take_counters() -> [(slot_base or -1, {name: increment})], then zero them"},
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
    {"gso_refused", T_INT, offsetof(CoreObject, gso_refused), READONLY,
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
        PyModule_AddIntConstant(m, "KEY_NOT_IPV4", (long long)KEY_NOT_IPV4) < 0 ||
        PyModule_AddIntConstant(m, "RECV_BATCH", RECV_BATCH) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
