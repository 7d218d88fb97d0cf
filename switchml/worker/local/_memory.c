/* The local stage's operations on a host's shared memory: memory.py's
 * reduce_into, copy_into, publish, attach, fail and wait_for, under the same
 * names, with the same results (tests/test_local.py compares them).
 *
 * Why C: a reduction that reads every rank's input once and writes the sum
 * once (numpy needs a pass per rank and a float64 temporary), copies and sums
 * cut over threads, and waits that sleep in the kernel (a futex on the
 * header's generation word, shared between processes) and watch the peers'
 * processes (pidfds), all without the GIL, so that the worker's other threads,
 * and the training loop, run meanwhile.
 *
 * Memory order: a rank writes its data, then publishes a counter with a
 * release store; a waiter reads counters with acquire loads before it touches
 * the data they announce.  Publishing bumps the generation word and wakes the
 * waiters only when one is registered, so that an uncontended publish costs
 * no system call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Header offsets: memory.py's H_* and R_* constants. */
#define H_GENERATION 32
#define H_WAITERS 36
#define H_ATTACHED 40
#define H_CLAIM 44
#define H_FAILED 48
#define H_FAILED_RANK 52
#define H_REASON 64
#define REASON_BYTES 256
#define R_STATE 8
#define STATE_LEFT 2
/* wait_for's answers: memory.py's REACHED ... TIMED_OUT; INTERRUPTED: a signal's
 * handler raised (Ctrl-C), which the Python twin's sleep lets through. */
enum { REACHED, FAILED, EXITED, CLOSED, TIMED_OUT, INTERRUPTED };
/* Most peers a wait watches: memory.MAX_RANKS. */
#define MAX_RANKS 256
/* Seconds a futex sleep lasts before the peers' processes are looked at. */
#define SLICE 0.01
/* Polls of the counters before sleeping: a peer a few microseconds from
 * publishing costs no system call. */
#define SPINS 200

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline uint32_t *word32(char *base, Py_ssize_t offset) {
    return (uint32_t *)(base + offset);
}

static inline uint64_t *word64(char *base, Py_ssize_t offset) {
    return (uint64_t *)(base + offset);
}

static void wake_all(char *base) {
    __atomic_fetch_add(word32(base, H_GENERATION), 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(word32(base, H_WAITERS), __ATOMIC_SEQ_CST))
        syscall(SYS_futex, word32(base, H_GENERATION), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static int writable_header(PyObject *obj, Py_buffer *view, Py_ssize_t need) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len < need) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "header buffer too short");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ reduce_into */
/* Three ways to sum float32 arrays in float64, rounded once, each reading every
 * input once and writing the sum once, and giving the same bits:
 *
 * - reduce_pair (two sources): a float32 addition, which rounds a + b exactly as
 *   rounding the float64 sum does (float64 has more than twice float32's
 *   precision, plus two bits: double rounding is innocuous);
 * - reduce_lanes: four elements at a time, summed across every source in
 *   registers;
 * - reduce_blocks: a block of float64 partial sums, a source at a time.
 *
 * Which is fastest depends on the processor and the compiler more than one
 * would hope (on a 16-core Xeon VM a block of partial sums without `restrict`
 * was 6x slower than a copy; on an AMD EPYC the lanes were 2x slower than the
 * blocks at 8 sources), so the module times them once, on data in cache, and
 * takes the fastest for two sources and for more (`calibrate`).  Vector types
 * are GCC's (clang's too); each kernel gets an AVX2 clone the loader picks where
 * the processor has it. */
/* 4 floats widen to 32 bytes of doubles, one AVX2 register: 8 made GCC spill
 * them to the stack, 4x slower. */
#define LANES 4
typedef float v4f __attribute__((vector_size(LANES * sizeof(float))));
typedef double v4d __attribute__((vector_size(LANES * sizeof(double))));
#define INT_LANES 8
typedef uint32_t v8u __attribute__((vector_size(INT_LANES * sizeof(uint32_t))));
/* Partial sums a block: 8 KiB, not a multiple of 4 KiB ahead of the inputs' loads
 * at every offset. */
#define BLOCK 1000

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CLONED __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef CLONED
#define CLONED
#endif

typedef void (*float_kernel)(float *, float **, Py_ssize_t, Py_ssize_t);

CLONED static void reduce_lanes(float *dst, float **srcs, Py_ssize_t count, Py_ssize_t n) {
    Py_ssize_t e = 0;
    for (; e + LANES <= n; e += LANES) {
        v4f x;
        memcpy(&x, srcs[0] + e, sizeof x);  /* (unaligned loads) */
        v4d acc = __builtin_convertvector(x, v4d);
        for (Py_ssize_t j = 1; j < count; j++) {
            memcpy(&x, srcs[j] + e, sizeof x);
            acc += __builtin_convertvector(x, v4d);
        }
        x = __builtin_convertvector(acc, v4f);
        memcpy(dst + e, &x, sizeof x);
    }
    for (; e < n; e++) {
        double acc = srcs[0][e];
        for (Py_ssize_t j = 1; j < count; j++)
            acc += srcs[j][e];
        dst[e] = (float)acc;
    }
}

/* (restrict: the caller never hands these a destination that overlaps a source) */
CLONED static void reduce_blocks(float *dst, float **srcs, Py_ssize_t count, Py_ssize_t n) {
    double acc[BLOCK];
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        Py_ssize_t len = n - start < BLOCK ? n - start : BLOCK;
        const float *restrict first = srcs[0] + start;
        if (count == 1) {
            for (Py_ssize_t e = 0; e < len; e++)
                acc[e] = first[e];
        } else {
            const float *restrict second = srcs[1] + start;
            for (Py_ssize_t e = 0; e < len; e++)
                acc[e] = (double)first[e] + (double)second[e];
        }
        for (Py_ssize_t j = 2; j < count; j++) {
            const float *restrict src = srcs[j] + start;
            for (Py_ssize_t e = 0; e < len; e++)
                acc[e] += src[e];
        }
        float *restrict out = dst + start;
        for (Py_ssize_t e = 0; e < len; e++)
            out[e] = (float)acc[e];
    }
}

CLONED static void reduce_pair(float *dst, float **srcs, Py_ssize_t count, Py_ssize_t n) {
    float *restrict out = dst;
    const float *restrict a = srcs[0], *restrict b = srcs[1];
    (void)count;  /* two */
    for (Py_ssize_t e = 0; e < n; e++)
        out[e] = a[e] + b[e];
}

static const struct {
    const char *name;
    float_kernel kernel;
    int pair_only;
} float_kernels[] = {
    {"lanes", reduce_lanes, 0}, {"blocks", reduce_blocks, 0}, {"pair", reduce_pair, 1},
};
#define N_FLOAT_KERNELS ((int)(sizeof float_kernels / sizeof float_kernels[0]))
/* The fastest kernel (an index of float_kernels) for two sources, and for more. */
static int pair_choice, many_choice;

static double monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Time each kernel on 2 and on 4 sources of 64K elements (in cache: what differs
 * between them is the processor's work, not the memory's), the least of 5 runs. */
static void calibrate(void) {
    enum { N = 64 * 1024, SOURCES = 4, RUNS = 5 };
    float *buf = malloc(sizeof(float) * N * (SOURCES + 1));
    if (buf == NULL)
        return;  /* (the lanes, for both) */
    float *srcs[SOURCES];
    for (int j = 0; j < SOURCES; j++) {
        srcs[j] = buf + (Py_ssize_t)(j + 1) * N;
        for (int e = 0; e < N; e++)
            srcs[j][e] = (float)((e * 7 + j) % 1000) * 1e-3f;
    }
    for (int many = 0; many < 2; many++) {
        double best = 0;
        for (int k = 0; k < N_FLOAT_KERNELS; k++) {
            if (many && float_kernels[k].pair_only)
                continue;
            double least = 0;
            for (int run = 0; run <= RUNS; run++) {  /* (run 0 warms up) */
                double begun = monotonic();
                float_kernels[k].kernel(buf, srcs, many ? SOURCES : 2, N);
                double took = monotonic() - begun;
                if (run == 1 || (run > 1 && took < least))
                    least = took;
            }
            if (best == 0 || least < best) {
                best = least;
                *(many ? &many_choice : &pair_choice) = k;
            }
        }
    }
    free(buf);
}

/* The kernel for `count` sources into `dst`: the calibrated one, or the lanes
 * where dst overlaps a source (they read every source before writing). */
static float_kernel float_kernel_for(float *dst, float **srcs, Py_ssize_t count, Py_ssize_t n,
                                     int forced) {
    for (Py_ssize_t j = 0; j < count; j++)
        if (srcs[j] < dst + n && dst < srcs[j] + n)
            return reduce_lanes;
    if (forced >= 0 && !(float_kernels[forced].pair_only && count != 2))
        return float_kernels[forced].kernel;
    return float_kernels[count == 2 ? pair_choice : many_choice].kernel;
}

CLONED static void reduce_int(uint32_t *dst, uint32_t **srcs, Py_ssize_t count, Py_ssize_t n) {
    Py_ssize_t e = 0;
    for (; e + INT_LANES <= n; e += INT_LANES) {
        v8u acc, x;
        memcpy(&acc, srcs[0] + e, sizeof acc);
        for (Py_ssize_t j = 1; j < count; j++) {
            memcpy(&x, srcs[j] + e, sizeof x);
            acc += x;  /* unsigned: wraps modulo 2**32, as int32 sums do */
        }
        memcpy(dst + e, &acc, sizeof acc);
    }
    for (; e < n; e++) {
        uint32_t acc = srcs[0][e];
        for (Py_ssize_t j = 1; j < count; j++)
            acc += srcs[j][e];
        dst[e] = acc;
    }
}

/* ------------------------------------------------------------------ threads
 * A rank of a host with cores to spare cuts a copy or a sum over `threads`
 * threads: one core streams a few GB/s, and a host's memory takes several
 * times that.  The helpers are this module's own, started on first need and
 * kept (asleep on a condition) for the life of the process; a caller splits the
 * range, wakes them, does the first part itself and waits for the rest.  One
 * job at a time: a caller that finds the pool busy (another rank's thread in
 * this process) does its work alone.  Any split gives the same result, element
 * by element. */
#define MAX_HELPERS 31
/* Parts smaller than this are not worth a thread's wake-up. */
#define MIN_PART_BYTES (64 * 1024)
/* Part boundaries fall on whole cache lines (16 elements of 4 bytes). */
#define PART_ALIGN 16

enum { JOB_COPY, JOB_FLOAT, JOB_INT };

typedef struct {
    int kind;
    char *dst;
    void **srcs;
    Py_ssize_t count, n;  /* sources; elements (bytes for a copy) */
    int parts;
    float_kernel kernel;  /* JOB_FLOAT's */
} Job;

static struct {
    pthread_mutex_t dispatch;  /* held by the job's caller */
    pthread_mutex_t lock;      /* guards what follows */
    pthread_cond_t go, done;
    int helpers;
    unsigned long generation;
    int pending;
    Job job;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, 0, 0, 0, {0}};

static void run_part(const Job *job, int part) {
    Py_ssize_t unit = job->kind == JOB_COPY ? 4 : 1;  /* a copy counts bytes */
    Py_ssize_t total = job->n / unit;
    Py_ssize_t lo = total * part / job->parts / PART_ALIGN * PART_ALIGN;
    Py_ssize_t hi = part + 1 == job->parts ? total
                    : total * (part + 1) / job->parts / PART_ALIGN * PART_ALIGN;
    if (job->kind == JOB_COPY) {
        Py_ssize_t end = part + 1 == job->parts ? job->n : hi * 4;  /* (a last odd byte) */
        if (end > lo * 4)
            memcpy(job->dst + lo * 4, (char *)job->srcs[0] + lo * 4, (size_t)(end - lo * 4));
        return;
    }
    if (hi <= lo)
        return;
    void *srcs[MAX_RANKS];
    for (Py_ssize_t j = 0; j < job->count; j++)
        srcs[j] = (char *)job->srcs[j] + lo * 4;
    if (job->kind == JOB_FLOAT)
        job->kernel((float *)job->dst + lo, (float **)srcs, job->count, hi - lo);
    else
        reduce_int((uint32_t *)job->dst + lo, (uint32_t **)srcs, job->count, hi - lo);
}

static void *helper(void *arg) {
    int index = (int)(intptr_t)arg;  /* 1.. : the caller does part 0 */
    pthread_mutex_lock(&pool.lock);
    /* started while its first job was being posted: that job is the one to do */
    unsigned long seen = pool.generation - 1;
    for (;;) {
        while (pool.generation == seen)
            pthread_cond_wait(&pool.go, &pool.lock);
        seen = pool.generation;
        Job job = pool.job;
        pthread_mutex_unlock(&pool.lock);
        if (index < job.parts)
            run_part(&job, index);
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0)
            pthread_cond_signal(&pool.done);
    }
    return NULL;
}

/* Helpers started after a fork belong to the parent: the child starts its own. */
static void forget_helpers(void) {
    pthread_mutex_init(&pool.dispatch, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.go, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.helpers = 0;
    pool.pending = 0;
}

/* Run `job` over up to `threads` threads; without the GIL. */
static void run_job(Job *job, int threads) {
    Py_ssize_t bytes = job->kind == JOB_COPY ? job->n : job->n * 4;
    Py_ssize_t most = bytes / MIN_PART_BYTES;
    int parts = threads < most ? threads : (int)(most > 1 ? most : 1);
    if (parts > MAX_HELPERS + 1)
        parts = MAX_HELPERS + 1;
    if (parts < 2 || pthread_mutex_trylock(&pool.dispatch) != 0) {
        job->parts = 1;
        run_part(job, 0);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    while (pool.helpers < parts - 1) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&id, &attr, helper, (void *)(intptr_t)(pool.helpers + 1));
        pthread_attr_destroy(&attr);
        if (failed)
            break;
        pool.helpers++;
    }
    if (parts > pool.helpers + 1)
        parts = pool.helpers + 1;  /* (no more threads to be had: fewer parts) */
    job->parts = parts;
    pool.job = *job;
    pool.pending = pool.helpers;
    pool.generation++;  /* (before a helper started above reads it: the lock is held) */
    pthread_cond_broadcast(&pool.go);
    pthread_mutex_unlock(&pool.lock);
    run_part(job, 0);
    pthread_mutex_lock(&pool.lock);
    while (pool.pending)
        pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.dispatch);
}

static PyObject *copy_into(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OO|i:copy_into", &dst_obj, &src_obj, &threads))
        return NULL;
    Py_buffer dst, src;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    if (src.len != dst.len) {
        PyErr_SetString(PyExc_ValueError, "copy_into: the source and destination differ in size");
    } else {
        void *ptrs[1] = {src.buf};
        Job job = {JOB_COPY, dst.buf, ptrs, 1, dst.len, 1, NULL};
        Py_BEGIN_ALLOW_THREADS
        run_job(&job, threads);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyObject *reduce_into(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *srcs_obj;
    int threads = 1;
    const char *kernel_name = NULL;
    if (!PyArg_ParseTuple(args, "OO|iz:reduce_into", &dst_obj, &srcs_obj, &threads,
                          &kernel_name))
        return NULL;
    int forced = -1;
    if (kernel_name != NULL) {
        for (int k = 0; k < N_FLOAT_KERNELS; k++)
            if (strcmp(kernel_name, float_kernels[k].name) == 0)
                forced = k;
        if (forced < 0)
            return PyErr_Format(PyExc_ValueError, "reduce_into: no kernel named %s", kernel_name);
    }
    PyObject *seq = PySequence_Fast(srcs_obj, "srcs must be a sequence of arrays");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count < 1 || count > MAX_RANKS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "reduce_into takes 1 to %d sources", MAX_RANKS);
    }
    Py_buffer dst, views[MAX_RANKS];
    void *ptrs[MAX_RANKS];
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto out_seq;
    int is_float = dst.format && strcmp(dst.format, "f") == 0;
    int is_int = dst.format && (strcmp(dst.format, "i") == 0 || strcmp(dst.format, "l") == 0)
                 && dst.itemsize == 4;
    if (!is_float && !is_int) {
        PyErr_SetString(PyExc_TypeError, "reduce_into sums float32 or int32 arrays");
        goto out_dst;
    }
    for (; held < count; held++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, held);
        if (PyObject_GetBuffer(item, &views[held], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto out_views;
        if (views[held].len != dst.len || views[held].itemsize != 4
                || !views[held].format || strcmp(views[held].format, dst.format) != 0) {
            held++;
            PyErr_SetString(PyExc_ValueError,
                            "reduce_into: every source must match the destination's "
                            "dtype and size");
            goto out_views;
        }
        ptrs[held] = views[held].buf;
        /* the destination a source or apart from it: the kernels read and write in
           steps, which a partial overlap would read after they wrote (memory.py) */
        const char *d = dst.buf, *v = views[held].buf;
        if (v != d && v < d + dst.len && d < v + dst.len) {
            held++;
            PyErr_SetString(PyExc_ValueError, "reduce_into: the destination overlaps a "
                                              "source without being it");
            goto out_views;
        }
    }
    Py_ssize_t n = dst.len / 4;
    Job job = {is_float ? JOB_FLOAT : JOB_INT, dst.buf, ptrs, count, n, 1,
               is_float ? float_kernel_for((float *)dst.buf, (float **)ptrs, count, n, forced)
                        : NULL};
    Py_BEGIN_ALLOW_THREADS
    run_job(&job, threads);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
out_views:
    for (Py_ssize_t j = 0; j < held; j++)
        PyBuffer_Release(&views[j]);
out_dst:
    PyBuffer_Release(&dst);
out_seq:
    Py_DECREF(seq);
    return result;
}

/* ------------------------------------------------------------------ publish, attach, fail */
static PyObject *publish(PyObject *self, PyObject *args) {
    PyObject *header_obj;
    Py_ssize_t offset;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "OnK:publish", &header_obj, &offset, &value))
        return NULL;
    /* checked before any sum with it: offset + 8 must not wrap */
    if (offset < 0 || offset % 8 || offset > PY_SSIZE_T_MAX - 8)
        return PyErr_Format(PyExc_ValueError, "publish: offset %zd is not a counter's", offset);
    Py_buffer header;
    if (writable_header(header_obj, &header, offset + 8) < 0)
        return NULL;
    /* a counter only grows: an owner's last, empty shard is published by its serving
       thread while the switch worker's callbacks may still publish earlier segments */
    uint64_t *word = word64(header.buf, offset);
    uint64_t seen = __atomic_load_n(word, __ATOMIC_RELAXED);
    while (seen < value && !__atomic_compare_exchange_n(word, &seen, (uint64_t)value, 1,
                                                         __ATOMIC_RELEASE, __ATOMIC_RELAXED))
        ;
    wake_all(header.buf);
    PyBuffer_Release(&header);
    Py_RETURN_NONE;
}

static PyObject *attach(PyObject *self, PyObject *args) {
    PyObject *header_obj;
    if (!PyArg_ParseTuple(args, "O:attach", &header_obj))
        return NULL;
    Py_buffer header;
    if (writable_header(header_obj, &header, H_ATTACHED + 4) < 0)
        return NULL;
    uint32_t now = __atomic_add_fetch(word32(header.buf, H_ATTACHED), 1, __ATOMIC_SEQ_CST);
    wake_all(header.buf);
    PyBuffer_Release(&header);
    return PyLong_FromUnsignedLong(now);
}

static PyObject *fail(PyObject *self, PyObject *args) {
    PyObject *header_obj;
    unsigned int code;
    int rank;
    const char *reason;
    Py_ssize_t reason_len;
    if (!PyArg_ParseTuple(args, "OIiy#:fail", &header_obj, &code, &rank, &reason, &reason_len))
        return NULL;
    Py_buffer header;
    if (writable_header(header_obj, &header, H_REASON + REASON_BYTES) < 0)
        return NULL;
    char *base = header.buf;
    uint32_t unclaimed = 0;
    int won = __atomic_compare_exchange_n(word32(base, H_CLAIM), &unclaimed, 1, 0,
                                          __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    if (won) {
        size_t len = reason_len < REASON_BYTES ? (size_t)reason_len : REASON_BYTES;
        memset(base + H_REASON, 0, REASON_BYTES);
        memcpy(base + H_REASON, reason, len);
        __atomic_store_n((int32_t *)(base + H_FAILED_RANK), (int32_t)rank, __ATOMIC_RELAXED);
        __atomic_store_n(word32(base, H_FAILED), (uint32_t)code, __ATOMIC_RELEASE);
        wake_all(base);
    }
    PyBuffer_Release(&header);
    return PyBool_FromLong(won);
}

/* ------------------------------------------------------------------ wait_for */

/* REACHED, or the first awaited record short of the target in *short_index. */
static int check(char *base, const Py_ssize_t *records, Py_ssize_t count, Py_ssize_t field,
                 uint64_t target, Py_ssize_t *short_index, Py_ssize_t *left_index) {
    if (__atomic_load_n(word32(base, H_FAILED), __ATOMIC_ACQUIRE))
        return FAILED;
    *short_index = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (__atomic_load_n(word64(base, records[i] + field), __ATOMIC_ACQUIRE) < target) {
            if (*short_index < 0)
                *short_index = i;
        }
    }
    if (*short_index < 0)
        return REACHED;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (__atomic_load_n(word64(base, records[i] + R_STATE), __ATOMIC_ACQUIRE) == STATE_LEFT) {
            *left_index = i;
            return CLOSED;
        }
    }
    return -1;  /* not yet */
}

static PyObject *wait_for(PyObject *self, PyObject *args) {
    PyObject *header_obj, *records_obj, *pidfds_obj = NULL;
    Py_ssize_t field;
    unsigned long long target;
    double timeout;
    if (!PyArg_ParseTuple(args, "OOnKd|O:wait_for", &header_obj, &records_obj, &field, &target,
                          &timeout, &pidfds_obj))
        return NULL;
    Py_ssize_t records[MAX_RANKS];
    struct pollfd fds[MAX_RANKS];
    Py_ssize_t fd_index[MAX_RANKS];
    Py_ssize_t count = 0, nfds = 0;
    PyObject *seq = PySequence_Fast(records_obj, "records must be a sequence of offsets");
    if (seq == NULL)
        return NULL;
    count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_RANKS) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "wait_for watches at most %d ranks", MAX_RANKS);
    }
    Py_ssize_t need = H_REASON;
    for (Py_ssize_t i = 0; i < count; i++) {
        records[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (records[i] < 0 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return NULL;
        }
        if (records[i] < 0 || field < 0 || records[i] > PY_SSIZE_T_MAX - 8 - field ||
            records[i] > PY_SSIZE_T_MAX - 8 - R_STATE || (records[i] + field) % 8) {
            Py_DECREF(seq);
            return PyErr_Format(PyExc_ValueError, "wait_for: bad record offset %zd", records[i]);
        }
        if (records[i] + field + 8 > need)
            need = records[i] + field + 8;
        if (records[i] + R_STATE + 8 > need)
            need = records[i] + R_STATE + 8;
    }
    Py_DECREF(seq);
    if (pidfds_obj != NULL) {
        PyObject *fseq = PySequence_Fast(pidfds_obj, "pidfds must be a sequence of ints");
        if (fseq == NULL)
            return NULL;
        Py_ssize_t total = PySequence_Fast_GET_SIZE(fseq);
        for (Py_ssize_t i = 0; i < total && nfds < MAX_RANKS; i++) {
            long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(fseq, i));
            if (fd == -1 && PyErr_Occurred()) {
                Py_DECREF(fseq);
                return NULL;
            }
            if (fd >= 0) {
                fds[nfds].fd = (int)fd;
                fds[nfds].events = POLLIN;
                fds[nfds].revents = 0;
                fd_index[nfds++] = i;
            }
        }
        Py_DECREF(fseq);
    }
    Py_buffer header;
    if (writable_header(header_obj, &header, need) < 0)
        return NULL;
    char *base = header.buf;
    int status = -1;
    Py_ssize_t index = 0, short_index = -1, left_index = 0;
    Py_BEGIN_ALLOW_THREADS
    double deadline = monotonic() + timeout;
    for (int spin = 0; spin < SPINS && status < 0; spin++) {
        status = check(base, records, count, field, target, &short_index, &left_index);
        if (status < 0)
            cpu_relax();
    }
    while (status < 0) {
        uint32_t generation = __atomic_load_n(word32(base, H_GENERATION), __ATOMIC_SEQ_CST);
        status = check(base, records, count, field, target, &short_index, &left_index);
        if (status >= 0)
            break;
        if (nfds && poll(fds, (nfds_t)nfds, 0) > 0) {
            for (Py_ssize_t i = 0; i < nfds; i++) {
                if (fds[i].revents) {
                    index = fd_index[i];
                    break;
                }
            }
            status = EXITED;
            break;
        }
        double left = deadline - monotonic();
        if (left <= 0) {
            status = TIMED_OUT;
            index = short_index < 0 ? 0 : short_index;
            break;
        }
        double sleep = left < SLICE ? left : SLICE;
        struct timespec ts = {(time_t)sleep, (long)((sleep - (time_t)sleep) * 1e9)};
        __atomic_fetch_add(word32(base, H_WAITERS), 1, __ATOMIC_SEQ_CST);
        syscall(SYS_futex, word32(base, H_GENERATION), FUTEX_WAIT, generation, &ts, NULL, 0);
        __atomic_fetch_sub(word32(base, H_WAITERS), 1, __ATOMIC_SEQ_CST);
        /* a signal (it cut the futex's sleep short) whose handler raises: at once,
         * not at the timeout (a no-op off the main thread, where none are run) */
        Py_BLOCK_THREADS
        int interrupted = PyErr_CheckSignals();
        Py_UNBLOCK_THREADS
        if (interrupted < 0) {
            status = INTERRUPTED;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&header);
    if (status == INTERRUPTED)
        return NULL;
    if (status == CLOSED)
        index = left_index;
    return Py_BuildValue("(in)", status, index);
}

static PyObject *kernels(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{ssss}", "pair", float_kernels[pair_choice].name,
                         "more", float_kernels[many_choice].name);
}

static PyMethodDef methods[] = {
    {"reduce_into", reduce_into, METH_VARARGS,
     "reduce_into(dst, srcs, threads=1, kernel=None): dst = the sum of srcs, in their order "
     "(float32 in float64, rounded once; int32 modulo 2**32), cut over up to `threads` "
     "threads; float32 with the kernel the module found fastest, or the one named "
     "(lanes, blocks, pair)."},
    {"kernels", kernels, METH_NOARGS,
     "kernels() -> the float32 kernels reduce_into uses: {'pair': two sources, 'more': "
     "more}."},
    {"copy_into", copy_into, METH_VARARGS,
     "copy_into(dst, src, threads=1): dst = src (the same size in bytes), cut over up to "
     "`threads` threads."},
    {"publish", publish, METH_VARARGS,
     "publish(header, offset, value): raise a counter to value (never lower it) and wake "
     "the waiting ranks."},
    {"attach", attach, METH_VARARGS,
     "attach(header) -> the number of ranks attached, this one counted."},
    {"fail", fail, METH_VARARGS,
     "fail(header, code, rank, reason) -> whether this is the group's first failure."},
    {"wait_for", wait_for, METH_VARARGS,
     "wait_for(header, records, field, target, timeout, pidfds=()) -> (status, index)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_memory",
    "The local stage's shared-memory operations (memory.py's, compiled).", -1, methods,
};

PyMODINIT_FUNC PyInit__memory(void) {
    static int registered;
    if (!registered && pthread_atfork(NULL, NULL, forget_helpers) == 0)
        registered = 1;
    calibrate();
    return PyModule_Create(&module);
}
