/*
 * switchml.worker._fastengine: the dense allreduce state machine in C.
 *
 * A transcription of the Python reference (stream.py: Stream; engine.py: DenseAllreduce;
 * recovery.py: RttEstimator, CongestionWindow; quant.py: quantize_into,
 * dequantize_into, chunk_exponents) that must stay bit-identical to it: the
 * same datagrams in the same order, the same results, the same counters.
 * tests/test_fastengine.py checks that differentially.
 *
 * Why the whole state machine and not per-packet kernels: with frame-sized
 * packets a 64 MiB allreduce is 8192 results per worker, and the interpreter's
 * per-packet bookkeeping (window heaps, timers, validation) costs as much as the
 * arithmetic.  Only a state machine in C lets run_io() receive with recvmmsg,
 * absorb, quantise and send with sendmmsg without the GIL, so that training
 * threads keep running; Python is back every few ms for the control socket.
 *
 * The engine is sans-IO like the reference (receive_datagram, datagrams_to_send,
 * get_timer, handle_timer, pending); run_io() is its socket driver.
 * State the Session keeps across calls (message numbers, RTT, window) is passed
 * in at construction and read back with export_state().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "../wire.h" /* the datagram format, shared with the switch's data plane */

/* UDP GSO (Linux 4.18): a run of equal-sized datagrams to the switch leaves in
 * one send, cut into those datagrams by the kernel, as the switch sends results. */
#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#define GSO_MAX_SEGMENTS 64
#define GSO_MAX_BYTES 65000
/* The kernel refused a GSO send once (an old kernel, a device without it): the
 * worker's process sends one datagram a message from then on. */
static int gso_refused = 0;
/* SWITCHML_WORKER_GSO=0 turns it off (bench/ compares); read once at import. */
static int gso_wanted = 1;

/* local_exp of a dense chunk not read yet: never on the wire (a float32's
 * frexpf exponent lies in [-148, 129]) */
#define EXP_UNREAD 32766
#define LEAST_EXPONENT (-148)
#define GREATEST_EXPONENT 128
#define RECV_BATCH 64

/* ------------------------------------------------------------ little endian */
static inline uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void put_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void put_u32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}

/* ------------------------------------------------------------ block floating point */
/* float -> int32 as numpy's unsafe cast does on x86-64 (cvttss2si): NaN and
 * out-of-range values become INT32_MIN; C leaves them undefined.  Written as
 * selects, not branches, so that the loops below vectorise. */
static inline int32_t float_to_int32(float x) {
    int in_range = (x >= -2147483648.0f) & (x < 2147483648.0f);
    int32_t converted = (int32_t)(in_range ? x : 0.0f);
    return in_range ? converted : INT32_MIN;
}

/* rintf (round half to even, the default rounding mode) without a libm call:
 * below 2**23, adding and taking away 2**23 leaves the rounded value; from 2**23
 * on every float32 is an integer already.  NaN fails the test and stays NaN.
 * Exact only without -ffast-math and FMA contraction (setup.py). */
static inline float round_half_even(float x) {
    float magnitude = fabsf(x);
    float rounded = copysignf((magnitude + 8388608.0f) - 8388608.0f, x);
    return magnitude < 8388608.0f ? rounded : x;
}

/* round(src * factor) half to even, as int32 (float_to_int32's).  cvtps2dq
 * rounds in the current mode, half to even as rintf, and gives INT32_MIN for
 * NaN and out of range as cvttss2si: the same integers, four at a time,
 * without the range selects that SSE2 vectorises poorly. */
static void scale_round_into(const float *src, int64_t n, float factor, int32_t *dst) {
    int64_t i = 0;
#ifdef __SSE2__
    __m128 by = _mm_set1_ps(factor);
    for (; i + 4 <= n; i += 4)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm_cvtps_epi32(_mm_mul_ps(_mm_loadu_ps(src + i), by)));
#endif
    for (; i < n; i++)
        dst[i] = float_to_int32(round_half_even(src[i] * factor));
}

/* quant.quantize_into: round(src * 2**(bits - exponent)), half to even. */
static void quantize_into(const float *src, int64_t n, int exponent, int bits, int32_t *dst) {
    if (n == 0)
        return;
    if (exponent == WIRE_EXP_ZERO || exponent == WIRE_EXP_NONFINITE) {
        memset(dst, 0, (size_t)n * sizeof(int32_t));
        return;
    }
    int shift = bits - exponent;
    if (shift <= 127) {
        /* np.float32(2.0**shift): the double power rounded to float32 */
        scale_round_into(src, n, (float)ldexp(1.0, shift), dst);
    } else {
        /* 2**shift is no float32, but 2**(shift - 64) and 2**64 are: two exact
         * multiplies scale as ldexp does (the result is below 2**31).  Rare:
         * chunks below 2**-96 or so; kept scalar. */
        float first = (float)ldexp(1.0, shift - 64), second = 18446744073709551616.0f;
        for (int64_t i = 0; i < n; i++)
            dst[i] = float_to_int32(round_half_even(src[i] * first * second));
    }
}

/* quant.quantize16_into: quantize_into's rounding, then biased by 2**bits into
 * uint16 (0 .. 2**(bits+1) with bits = quant.scale_bits16(n)). */
static void quantize16_into(const float *src, int64_t n, int exponent, int bits, uint16_t *dst,
                            int32_t *wide) {
    quantize_into(src, n, exponent, bits, wide);
    int32_t bias = (int32_t)1 << bits;
    for (int64_t i = 0; i < n; i++)
        dst[i] = (uint16_t)(wide[i] + bias);
}

/* quant.dequantize_into: float32(sum) * 2**(exponent - bits). */
static void dequantize_into(const int32_t *src, int64_t n, int exponent, int bits, float *dst) {
    if (n == 0)
        return;
    if (exponent == WIRE_EXP_NONFINITE) {
        for (int64_t i = 0; i < n; i++)
            dst[i] = NAN;
        return;
    }
    if (exponent == WIRE_EXP_ZERO) {
        memset(dst, 0, (size_t)n * sizeof(float));
        return;
    }
    int shift = exponent - bits;
    if (shift >= -126) {
        float factor = (float)ldexp(1.0, shift);
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)src[i] * factor;
    } else { /* numpy computes int32 * python float in float64, then casts */
        double factor = ldexp(1.0, shift);
        for (int64_t i = 0; i < n; i++)
            dst[i] = (float)((double)src[i] * factor);
    }
}

/* quant.exponents_of_peaks of one chunk's peak (bits of its greatest magnitude) */
static int16_t exponent_of_peak(int32_t peak) {
    if (peak == 0)
        return WIRE_EXP_ZERO;
    if (peak >= 0x7F800000)
        return WIRE_EXP_NONFINITE;
    float f;
    memcpy(&f, &peak, 4);
    int e;
    frexpf(f, &e);
    return (int16_t)e;
}

/* The greatest of n float32 magnitudes as bits: with the sign cleared, a
 * float32's bits as an int32 grow with its magnitude and NaNs lie above inf
 * (quant.block_peaks), so an integer max.  The loop vectorises, but SSE2 (the
 * x86-64 baseline) has no int32 max and emulates it in four instructions; AVX2
 * has one, eight lanes wide: the pass over a sparse call's input, which its
 * first message waits for, takes a third of the time (bench/first_send.py).
 * One body, two builds, the AVX2 one picked at import where the CPU has it. */
#define MAGNITUDE_PEAK_BODY                                                        \
    {                                                                              \
        int32_t peak = 0;                                                          \
        for (int64_t i = 0; i < n; i++) {                                          \
            int32_t magnitude = bits[i] & 0x7FFFFFFF;                              \
            peak = magnitude > peak ? magnitude : peak;                            \
        }                                                                          \
        return peak;                                                               \
    }
static int32_t magnitude_peak_baseline(const int32_t *bits, int64_t n) MAGNITUDE_PEAK_BODY
#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_BUILD 1
__attribute__((target("avx2"))) static int32_t magnitude_peak_avx2(const int32_t *bits,
                                                                  int64_t n) MAGNITUDE_PEAK_BODY
#endif
static int32_t (*magnitude_peak)(const int32_t *, int64_t) = magnitude_peak_baseline;

/* quant.chunk_exponents of one chunk: smallest e with 2**e > max|x|, or a special. */
static int16_t chunk_exponent(const float *values, int64_t n) {
    return exponent_of_peak(magnitude_peak((const int32_t *)values, n));
}

/* ------------------------------------------------------------ (pkt_id, slot) min-heap */
typedef struct {
    int64_t key;
    int32_t slot;
} HeapItem;

typedef struct {
    HeapItem *items;
    Py_ssize_t len, cap;
} Heap;

static inline int heap_less(HeapItem a, HeapItem b) {
    return a.key < b.key || (a.key == b.key && a.slot < b.slot);
}

static int heap_push(Heap *h, int64_t key, int32_t slot) {
    if (h->len == h->cap) {
        Py_ssize_t cap = h->cap ? h->cap * 2 : 16;
        HeapItem *items = PyMem_RawRealloc(h->items, (size_t)cap * sizeof(HeapItem));
        if (!items)
            return -1;
        h->items = items;
        h->cap = cap;
    }
    Py_ssize_t i = h->len++;
    HeapItem item = {key, slot};
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!heap_less(item, h->items[parent]))
            break;
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i] = item;
    return 0;
}

static void heap_pop(Heap *h) {
    HeapItem last = h->items[--h->len];
    Py_ssize_t i = 0, n = h->len;
    if (n == 0)
        return;
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n)
            break;
        if (child + 1 < n && heap_less(h->items[child + 1], h->items[child]))
            child++;
        if (!heap_less(h->items[child], last))
            break;
        h->items[i] = h->items[child];
        i = child;
    }
    h->items[i] = last;
}

/* ------------------------------------------------------------ the engine */
/* recovery.FAST_RETRANSMIT_THRESHOLD and MAX_REORDERING (exported as the module's
 * constants, and tests/test_fastengine.py checks they agree) */
#define FAST_RETRANSMIT_THRESHOLD 3
#define MAX_REORDERING 16
/* recovery.TAIL_PROBE_ROUND_TRIPS, COPY_PROBE_ROUND_TRIPS, TAIL_PROBE_MARGIN (exported
 * too, checked against them) */
#define TAIL_PROBE_ROUND_TRIPS 2
#define COPY_PROBE_ROUND_TRIPS 8
#define TAIL_PROBE_MARGIN 0.00025
/* recovery.CongestionWindow.QUEUE_FACTOR, RttEstimator.MAX_KEPT_BACKOFF (exported; a
   test compares them) */
#define QUEUE_FACTOR 1.5
#define MAX_KEPT_BACKOFF 3
/* How a message's latest transmission went out (stream.py's SENT, FAST, PROBE). */
enum { COPY_SENT, COPY_FAST, COPY_PROBE };

enum { COUNTER_RESULTS_IN, COUNTER_RETRANSMISSIONS, COUNTER_SPURIOUS, COUNTER_WINDOW_DECREASES,
       COUNTER_RANDOM_LOSSES, COUNTER_STALE, COUNTER_MALFORMED, COUNTER_FOREIGN,
       COUNTER_BYTES_SENT, COUNTER_BYTES_RECEIVED, COUNTER_FAST_RETRANSMISSIONS,
       COUNTER_PROBE_RETRANSMISSIONS, COUNTER_SPARSE_BLOCKS_SENT,
       COUNTER_SPARSE_BLOCKS_RECEIVED, COUNTER_RESENDS, COUNTER_RESULTS_LOST,
       COUNTER_COUNT };

static const char *counter_names[COUNTER_COUNT] = {
    "results_in", "retransmissions", "spurious_retransmissions", "window_decreases",
    "random_losses", "dropped_stale", "dropped_malformed", "dropped_foreign", "bytes_sent",
    "bytes_received", "fast_retransmissions", "probe_retransmissions", "sparse_blocks_sent",
    "sparse_blocks_received", "resends", "results_lost"};

struct SparseState; /* fastsparse.c */

typedef struct {
    PyObject_HEAD
    Py_buffer src, out;
    int have_src, have_out;
    int is_float, dtype_code, lag, bits, lanes;
    int per_word, world_size; /* values a 32-bit word: 2 on the 16-bit wire */
    int32_t *wide;            /* the 16-bit wire's int32 scratch, a chunk long */
    uint32_t session, seq;
    int slot_base, width;
    int64_t k, size, chunks;
    int16_t *local_exp;
    uint8_t *nonfinite; /* per chunk: left as it was for the follow-up (nonfinite.py) */
    /* per slot */
    uint32_t *slot_msgs;
    int64_t *round, *messages;
    int16_t *global_exp;
    uint8_t *inflight, *lost;
    int32_t *backoff;
    double *sent_at, *deadline;
    uint8_t *packets; /* one packet buffer per slot */
    uint8_t *probes;  /* per slot: the probe of its message (WIRE_HEADER_SIZE bytes) */
    size_t packet_size;
    uint32_t *datagram_len;
    Heap ready, inflight_ids;
    int64_t inflight_count, remaining;
    /* fast retransmit (Stream's): send numbers, the candidates by send number,
     * the greatest send numbers answered (least first), the Session's reordering
     * threshold, and per slot the send number a fast retransmission followed */
    int64_t sends, *send_no, *overtaken_send_no;
    int reordering;
    int32_t *fast_copies; /* per slot: fast retransmissions and probes of its message */
    uint8_t *copy;        /* per slot: how its latest transmission went out (COPY_*) */
    Heap by_send;
    int64_t latest_results[MAX_REORDERING];
    int latest_len;
    /* datagrams to send: (slot, length, probe); the bytes are the slot's buffer
     * (or its probe's) when sent, as the reference's outbox holds views of its
     * packet buffers */
    struct OutboxEntry {
        int32_t slot;
        uint32_t len;
        int probe;
    } *outbox;
    Py_ssize_t outbox_len, outbox_cap;
    double last_progress, progress_timeout;
    int stalled;
    /* RttEstimator */
    int have_srtt;
    double srtt, rttvar, min_rtt, rto_value, min_rto, max_rto;
    int kept_backoff;  /* RttEstimator.kept_backoff */
    double kept_since; /* RttEstimator._kept_since */
    /* CongestionWindow */
    double cwnd, ssthresh, last_decrease, delay_margin, queue_margin;
    int64_t window_limit;
    int has_undo; /* the state before the last halving, to take a premature one back */
    double undo_at, undo_cwnd, undo_ssthresh;
    /* round trips of RTT samples: start and least sample of the current one, end of
     * the last one that showed a queue / none */
    double epoch_start, epoch_min, queue_at, clear_at;
    double *decreased_at; /* per slot: when its timeout halved the window, or NAN */
    int64_t counters[COUNTER_COUNT]; /* since the last export_state() */
    uint8_t *recv_buffers;           /* run_io's */
    /* the sparse mode (sparse.py's SparseAllreduce): its state, NULL when dense */
    struct SparseState *sp;
} DenseCore;

/* the sparse mode's own parts; the stream machinery below serves both */
#include "fastsparse.c"

static double rto(DenseCore *c, int backoff) {
    double base = c->rto_value > c->min_rto ? c->rto_value : c->min_rto;
    double value = base * ldexp(1.0, backoff + c->kept_backoff);
    return value < c->max_rto ? value : c->max_rto;
}

/* RttEstimator.on_premature_timeout */
static void rtt_on_premature_timeout(DenseCore *c, double sent_at, double now) {
    if (sent_at >= c->kept_since) {
        if (c->kept_backoff < MAX_KEPT_BACKOFF)
            c->kept_backoff++;
        c->kept_since = now;
    }
}

static void rtt_sample(DenseCore *c, double rtt, double sent_at) {
    if (sent_at >= c->kept_since)
        c->kept_backoff = 0;
    if (!c->have_srtt) {
        c->have_srtt = 1;
        c->srtt = rtt;
        c->rttvar = rtt / 2;
    } else {
        c->rttvar = 0.75 * c->rttvar + 0.25 * fabs(c->srtt - rtt);
        c->srtt = 0.875 * c->srtt + 0.125 * rtt;
    }
    if (rtt < c->min_rtt)
        c->min_rtt = rtt;
    c->rto_value = c->srtt + 4 * c->rttvar;
}

static int64_t window_allowed(DenseCore *c) {
    /* int(cwnd): cwnd is at least 1 and at most the limit, a small int */
    int64_t allowed = (int64_t)c->cwnd;
    if (allowed > c->width)
        allowed = c->width;
    return allowed < 1 ? 1 : allowed;
}

static void window_on_result(DenseCore *c, int window_limited) {
    if (!window_limited)
        return;
    if (c->cwnd < c->ssthresh)
        c->cwnd += 1.0;
    else
        c->cwnd += 1.0 / c->cwnd;
    if (c->cwnd > (double)c->window_limit)
        c->cwnd = (double)c->window_limit;
}

static void window_on_rtt_sample(DenseCore *c, double rtt, double sent_at, double now) {
    if (c->cwnd < c->ssthresh && rtt > 2 * c->min_rtt + c->delay_margin)
        c->ssthresh = c->cwnd;
    if (rtt < c->epoch_min)
        c->epoch_min = rtt;
    if (sent_at >= c->epoch_start) {
        if (c->epoch_min > QUEUE_FACTOR * c->min_rtt + c->queue_margin) /* a standing queue */
            c->queue_at = now;
        else
            c->clear_at = now;
        c->epoch_start = now;
        c->epoch_min = INFINITY;
    }
}

enum { SAME_EVENT, DECREASED, RANDOM_LOSS }; /* CongestionWindow.on_timeout's */

static int window_on_timeout(DenseCore *c, double sent_at, double now, int retries) {
    if (sent_at < c->last_decrease)
        return SAME_EVENT;
    if (c->clear_at > c->queue_at && (c->clear_at > sent_at || retries == 0))
        return RANDOM_LOSS; /* the last round trip showed no queue */
    c->has_undo = 1;
    c->undo_at = now;
    c->undo_cwnd = c->cwnd;
    c->undo_ssthresh = c->ssthresh;
    c->ssthresh = c->cwnd / 2 > 1.0 ? c->cwnd / 2 : 1.0;
    c->cwnd = c->ssthresh;
    c->last_decrease = now;
    return DECREASED;
}

static void window_undo_decrease(DenseCore *c, double decreased_at) {
    if (c->has_undo && c->undo_at == decreased_at) {
        if (c->undo_cwnd > c->cwnd)
            c->cwnd = c->undo_cwnd;
        if (c->undo_ssthresh > c->ssthresh)
            c->ssthresh = c->undo_ssthresh;
        c->has_undo = 0;
    }
}

static inline int64_t chunk_count(DenseCore *c, int64_t chunk) {
    if (chunk < 0)
        return 0;
    int64_t left = c->size - chunk * c->k;
    return left < c->k ? left : c->k;
}

static inline int64_t pkt_id_of(DenseCore *c, int j) { return c->round[j] * c->width + j; }

/* One more entry at the outbox's end: `len` bytes of slot j's packet buffer, or
 * of its probe's. */
static int outbox_append(DenseCore *c, int j, uint32_t len, int probe) {
    if (c->outbox_len == c->outbox_cap) {
        Py_ssize_t cap = c->outbox_cap ? c->outbox_cap * 2 : 16;
        struct OutboxEntry *entries = PyMem_RawRealloc(c->outbox, (size_t)cap * sizeof(*entries));
        if (!entries)
            return -1;
        c->outbox = entries;
        c->outbox_cap = cap;
    }
    c->outbox[c->outbox_len].slot = j;
    c->outbox[c->outbox_len].len = len;
    c->outbox[c->outbox_len].probe = probe;
    c->outbox_len++;
    return 0;
}

/* Queue slot j's datagram; it supersedes one of slot j still waiting to leave
 * (both are slot j's one packet buffer, which now holds the newer message: a
 * batch of results could otherwise send its bytes twice, once under the old
 * length).  As Stream._enqueue. */
static int outbox_add(DenseCore *c, int j) {
    Py_ssize_t kept = 0;
    for (Py_ssize_t i = 0; i < c->outbox_len; i++)
        if (c->outbox[i].slot != j)
            c->outbox[kept++] = c->outbox[i];
    c->outbox_len = kept;
    return outbox_append(c, j, c->datagram_len[j], 0);
}

/* Stream._enqueue_probe: queue the probe or query (kind) of slot j's message in
 * flight unless the message itself waits to leave. */
static int outbox_add_probe(DenseCore *c, int j, uint8_t kind) {
    for (Py_ssize_t i = 0; i < c->outbox_len; i++)
        if (c->outbox[i].slot == j)
            return 0;
    uint8_t *probe = c->probes + (size_t)j * WIRE_HEADER_SIZE;
    memcpy(probe, c->packets + (size_t)j * c->packet_size, WIRE_HEADER_SIZE);
    probe[3] = kind;
    memset(probe + 24, 0, 4); /* count and lanes */
    return outbox_append(c, j, WIRE_HEADER_SIZE, 1);
}

/* The bytes of outbox entry i. */
static uint8_t *outbox_bytes(DenseCore *c, Py_ssize_t i) {
    struct OutboxEntry *e = &c->outbox[i];
    return e->probe ? c->probes + (size_t)e->slot * WIRE_HEADER_SIZE
                    : c->packets + (size_t)e->slot * c->packet_size;
}

/* The local exponent of a dense float chunk, read when the message that
 * announces it is first built, not in a pass over the whole input before the
 * first send: that pass would keep the links idle while it reads the whole
 * input.  The input is not written before then, even in place: chunk c
 * is announced before its values go out, and its sum comes after. */
static int16_t local_exponent(DenseCore *c, int64_t chunk) {
    int16_t e = c->local_exp[chunk];
    if (e == EXP_UNREAD) {
        e = chunk_exponent((const float *)c->src.buf + chunk * c->k, chunk_count(c, chunk));
        c->local_exp[chunk] = e;
    }
    return e;
}

/* Stream._number_send */
static int number_send(DenseCore *c, int j) {
    c->send_no[j] = ++c->sends;
    return heap_push(&c->by_send, c->sends, j);
}

/* DenseAllreduce._fill: records at ``lanes`` (the packet's table), values after
 * them; returns the word count. */
static int64_t dense_fill(DenseCore *c, int j, int64_t m, uint8_t *lanes) {
    int64_t W = c->width;
    for (int lane = 0; lane < c->lanes; lane++) { /* blank records: exp says "zero" */
        uint8_t *record = lanes + (size_t)lane * WIRE_LANE_SIZE;
        memset(record, 0, WIRE_LANE_SIZE);
        put_u16(record + 8, (uint16_t)WIRE_EXP_ZERO);
    }
    int64_t following = j + m * W;
    if (c->is_float && following < c->chunks)
        put_u16(lanes + 8, (uint16_t)local_exponent(c, following));
    int64_t chunk = j + (m - c->lag) * W;
    int64_t count = chunk_count(c, chunk); /* values */
    uint8_t *values = lanes + (size_t)c->lanes * WIRE_LANE_SIZE;
    if (count) {
        if (c->per_word == 2) {
            uint16_t *halves = (uint16_t *)values;
            quantize16_into((const float *)c->src.buf + chunk * c->k, count, c->global_exp[j],
                            c->bits, halves, c->wide);
            if (count % 2)
                halves[count] = 0; /* the last word's idle half */
        } else if (c->is_float) {
            quantize_into((const float *)c->src.buf + chunk * c->k, count, c->global_exp[j],
                          c->bits, (int32_t *)values);
        } else {
            memcpy(values, (const int32_t *)c->src.buf + chunk * c->k, (size_t)count * 4);
        }
    }
    return (count + c->per_word - 1) / c->per_word; /* words */
}

static int send_message(DenseCore *c, int j, double now) {
    uint8_t *packet = c->packets + (size_t)j * c->packet_size;
    int64_t m = c->round[j], W = c->width;
    uint8_t *lanes = packet + WIRE_HEADER_SIZE;
    int64_t count = c->sp ? sparse_fill(c, j, m, lanes) : dense_fill(c, j, m, lanes); /* words */
    put_u16(packet, WIRE_MAGIC);
    packet[2] = WIRE_VERSION;
    packet[3] = WIRE_KIND_CONTRIBUTION;
    packet[4] = (uint8_t)c->dtype_code;
    packet[5] = (uint8_t)(c->sp ? sparse_mode(c, j) : 0);
    put_u16(packet + 6, (uint16_t)(c->slot_base + j));
    put_u32(packet + 8, c->session);
    put_u32(packet + 12, c->slot_msgs[j]);
    put_u32(packet + 16, c->seq);
    put_u32(packet + 20, (uint32_t)(m * W + j));
    put_u16(packet + 24, (uint16_t)count);
    put_u16(packet + 26, (uint16_t)c->lanes);
    /* wire.call_id: the element count, bit 31 for a sparse call */
    put_u32(packet + 28, (uint32_t)(c->size & 0x7FFFFFFF) | (c->sp ? 0x80000000u : 0));
    c->datagram_len[j] = (uint32_t)(WIRE_HEADER_SIZE + WIRE_LANE_SIZE * c->lanes + 4 * count);
    c->inflight[j] = 1;
    c->inflight_count++;
    c->sent_at[j] = now;
    c->deadline[j] = now + rto(c, 0);
    if (number_send(c, j) < 0)
        return -1;
    return outbox_add(c, j);
}

static int resend_message(DenseCore *c, int j, double now) {
    c->lost[j] = 0;
    c->copy[j] = COPY_SENT;
    c->backoff[j]++;
    c->inflight_count++;
    c->sent_at[j] = now;
    c->deadline[j] = now + rto(c, c->backoff[j]);
    if (number_send(c, j) < 0)
        return -1;
    c->counters[COUNTER_RETRANSMISSIONS]++;
    return outbox_add_probe(c, j, WIRE_KIND_QUERY);
}

/* Stream._note_result */
static void note_result(DenseCore *c, int64_t send_no) {
    int64_t *latest = c->latest_results;
    int i;
    if (c->latest_len < MAX_REORDERING) {
        i = c->latest_len++;
    } else if (send_no > latest[0]) {
        /* drop the least, then insert */
        for (i = 0; i + 1 < MAX_REORDERING; i++)
            latest[i] = latest[i + 1];
        i = MAX_REORDERING - 1;
    } else {
        return;
    }
    while (i > 0 && latest[i - 1] > send_no) {
        latest[i] = latest[i - 1];
        i--;
    }
    latest[i] = send_no;
}

/* Stream._learn_reordering */
static void learn_reordering(DenseCore *c, int j) {
    int overtaken_by = 0;
    for (int i = c->latest_len - 1; i >= 0 && c->latest_results[i] > c->overtaken_send_no[j]; i--)
        overtaken_by++;
    int want = overtaken_by + 1 < MAX_REORDERING ? overtaken_by + 1 : MAX_REORDERING;
    if (want > c->reordering)
        c->reordering = want;
}

/* Stream._judge_loss */
static void judge_loss(DenseCore *c, int j, double now, int retries) {
    int outcome = window_on_timeout(c, c->sent_at[j], now, retries);
    if (outcome == DECREASED) {
        c->counters[COUNTER_WINDOW_DECREASES]++;
        c->decreased_at[j] = now;
    } else if (outcome == RANDOM_LOSS) {
        c->counters[COUNTER_RANDOM_LOSSES]++;
    }
}

/* Stream._fast_resend */
static int fast_resend(DenseCore *c, int j, double now) {
    /* as a first timeout: results overtook it, the path answers (stream.py) */
    judge_loss(c, j, now, 0);
    /* not backed off, plus a round trip (Stream._fast_resend says why) */
    c->deadline[j] = now + rto(c, c->backoff[j]) + (c->have_srtt ? c->srtt : 0.0);
    c->backoff[j]++;
    c->fast_copies[j]++;
    c->copy[j] = COPY_FAST;
    c->sent_at[j] = now;
    c->overtaken_send_no[j] = c->send_no[j];
    c->send_no[j] = ++c->sends; /* not a candidate again until its timer fires */
    c->counters[COUNTER_RETRANSMISSIONS]++;
    c->counters[COUNTER_FAST_RETRANSMISSIONS]++;
    return outbox_add(c, j); /* whole, as Stream._fast_resend */
}

/* Stream._fast_retransmit */
static int fast_retransmit(DenseCore *c, double now) {
    if (c->latest_len < c->reordering)
        return 0;
    int64_t bound = c->latest_results[c->latest_len - c->reordering];
    Heap *candidates = &c->by_send;
    while (candidates->len) {
        HeapItem top = candidates->items[0];
        int j = top.slot;
        if (!c->inflight[j] || c->lost[j] || c->send_no[j] != top.key) {
            heap_pop(candidates);
            continue;
        }
        if (top.key >= bound)
            return 0;
        heap_pop(candidates);
        if (fast_resend(c, j, now) < 0)
            return -1;
    }
    return 0;
}

/* Stream._probe_at: when message j is probed (INFINITY: it is not). */
static double probe_at(DenseCore *c, int j) {
    if (!c->have_srtt || !c->inflight[j] || c->lost[j] || c->copy[j] == COPY_PROBE)
        return INFINITY;
    if (c->copy[j] == COPY_FAST)
        return c->sent_at[j] +
               (COPY_PROBE_ROUND_TRIPS * c->srtt + 4 * c->rttvar + TAIL_PROBE_MARGIN);
    double since = c->sent_at[j] > c->last_progress ? c->sent_at[j] : c->last_progress;
    return since + (TAIL_PROBE_ROUND_TRIPS * c->srtt + TAIL_PROBE_MARGIN);
}

/* Stream._probe_room: tail probes the window has room for. */
static int64_t probe_room(DenseCore *c) {
    int64_t probes = 0;
    for (int j = 0; j < c->width; j++)
        probes += c->copy[j] == COPY_PROBE && c->inflight[j] && !c->lost[j];
    int64_t room = (int64_t)c->cwnd - c->inflight_count; /* not capped by the width */
    return (room < 1 ? 1 : room) - probes;
}

/* Stream._probe: not a loss for the window; its timer stays. */
static int probe(DenseCore *c, int j, double now) {
    c->backoff[j]++;
    c->fast_copies[j]++;
    c->copy[j] = COPY_PROBE;
    c->sent_at[j] = now;
    if (number_send(c, j) < 0)
        return -1;
    c->counters[COUNTER_RETRANSMISSIONS]++;
    c->counters[COUNTER_PROBE_RETRANSMISSIONS]++;
    return outbox_add_probe(c, j, WIRE_KIND_PROBE);
}

static int has_message(DenseCore *c, int j) {
    return c->sp ? sparse_has_message(c, j) : c->round[j] < c->messages[j];
}

/* Stream._lowest_in_flight; -1 when none is. */
static int64_t lowest_in_flight(DenseCore *c) {
    Heap *ids = &c->inflight_ids;
    while (ids->len) {
        HeapItem top = ids->items[0];
        if (c->inflight[top.slot] && !c->lost[top.slot] && pkt_id_of(c, top.slot) == top.key)
            return top.key;
        heap_pop(ids);
    }
    return -1;
}

/* Stream._send_ready. Returns -1 when out of memory. */
static int send_ready(DenseCore *c, double now) {
    Heap *ready = &c->ready;
    int64_t allowed = window_allowed(c);
    while (ready->len) {
        HeapItem top = ready->items[0];
        int j = top.slot;
        if (pkt_id_of(c, j) != top.key || (c->inflight[j] && !c->lost[j])) {
            heap_pop(ready);
            continue;
        }
        if (c->inflight_count >= allowed) {
            int64_t lowest = lowest_in_flight(c);
            if (lowest >= 0 && lowest < top.key)
                return 0;
        }
        heap_pop(ready);
        if (heap_push(&c->inflight_ids, top.key, j) < 0)
            return -1;
        if ((c->lost[j] ? resend_message(c, j, now) : send_message(c, j, now)) < 0)
            return -1;
    }
    return 0;
}

/* DenseAllreduce._absorb */
static void dense_absorb(DenseCore *c, int j, int64_t m, const uint8_t *data, int64_t count) {
    int64_t chunk = j + (m - c->lag) * c->width;
    if (count && c->is_float && c->global_exp[j] == WIRE_EXP_NONFINITE) {
        c->nonfinite[chunk] = 1; /* untouched: the input stays for the follow-up */
    } else if (count && c->per_word == 2) { /* quant.dequantize16_into */
        const uint16_t *halves = (const uint16_t *)(data + WIRE_HEADER_SIZE + WIRE_LANE_SIZE * c->lanes);
        int64_t n = chunk_count(c, chunk);
        int32_t bias = (int32_t)c->world_size << c->bits;
        for (int64_t i = 0; i < n; i++)
            c->wide[i] = (int32_t)halves[i] - bias;
        dequantize_into(c->wide, n, c->global_exp[j], c->bits, (float *)c->out.buf + chunk * c->k);
    } else if (count) {
        const int32_t *values = (const int32_t *)(data + WIRE_HEADER_SIZE + WIRE_LANE_SIZE * c->lanes);
        if (c->is_float) {
            dequantize_into(values, count, c->global_exp[j], c->bits,
                            (float *)c->out.buf + chunk * c->k);
        } else {
            memcpy((int32_t *)c->out.buf + chunk * c->k, values, (size_t)count * 4);
        }
    }
    c->global_exp[j] = (int16_t)get_u16(data + WIRE_HEADER_SIZE + 8);
}

/* Stream._names_in_flight: whether the header at `data` (a result or a probe's
 * answer) is about slot j's message in flight (this call, its message number and
 * packet). */
static int names_in_flight(DenseCore *c, int j, const uint8_t *data) {
    return c->inflight[j] && get_u32(data + 16) == c->seq &&
           get_u32(data + 12) == c->slot_msgs[j] &&
           (int64_t)get_u32(data + 20) == c->round[j] * c->width + j;
}

/* Stream.receive_datagram + the call's _result_fits/_absorb (dense here, sparse in
 * fastsparse.c). -1: out of memory. */
static int receive(DenseCore *c, const uint8_t *data, Py_ssize_t len, double now) {
    if (len < WIRE_HEADER_SIZE) {
        c->counters[COUNTER_MALFORMED]++;
        return 0;
    }
    int kind = data[3], dtype = data[4], mode = data[5];
    uint16_t count = get_u16(data + 24), lanes = get_u16(data + 26);
    if (get_u16(data) != WIRE_MAGIC || data[2] != WIRE_VERSION ||
        kind < WIRE_KIND_CONTRIBUTION || kind > WIRE_KIND_DONE || /* wire.KINDS */
        dtype > WIRE_DTYPE_FLOAT16_WIRE ||
        (mode != 0 && mode != WIRE_MODE_SPARSE && mode != (WIRE_MODE_SPARSE | WIRE_MODE_SEED) &&
         mode != WIRE_MODE_MAX) || /* wire.MODES */
        len != WIRE_HEADER_SIZE + WIRE_LANE_SIZE * (Py_ssize_t)lanes + 4 * (Py_ssize_t)count) {
        c->counters[COUNTER_MALFORMED]++;
        return 0;
    }
    int j = (int)get_u16(data + 6) - c->slot_base;
    if ((kind != WIRE_KIND_RESULT && kind != WIRE_KIND_RESEND && kind != WIRE_KIND_DONE) ||
        get_u32(data + 8) != c->session || j < 0 || j >= c->width) {
        c->counters[COUNTER_FOREIGN]++;
        return 0;
    }
    int64_t m = c->round[j];
    if (kind != WIRE_KIND_RESULT) { /* a probe's answer (stream.py): send the message whole */
        if (!names_in_flight(c, j, data) || count || lanes) {
            c->counters[COUNTER_STALE]++; /* e.g. the result came before the done */
            return 0;
        }
        c->counters[kind == WIRE_KIND_RESEND ? COUNTER_RESENDS : COUNTER_RESULTS_LOST]++;
        return outbox_add(c, j);
    }
    int fits = names_in_flight(c, j, data) && dtype == c->dtype_code && lanes == c->lanes;
    if (fits && c->sp) {
        fits = sparse_result_fits(c, j, data, mode, count);
    } else if (fits) {
        fits = mode == 0 &&
               count == (chunk_count(c, j + (m - c->lag) * c->width) + c->per_word - 1) /
                            c->per_word;
    }
    int exponent = 0;
    if (fits && !c->sp) {
        exponent = (int16_t)get_u16(data + WIRE_HEADER_SIZE + 8);
        if (c->is_float && !((exponent >= LEAST_EXPONENT && exponent <= GREATEST_EXPONENT) ||
                             exponent == WIRE_EXP_ZERO || exponent == WIRE_EXP_NONFINITE))
            fits = 0;
    }
    if (!fits) {
        c->counters[COUNTER_STALE]++;
        return 0;
    }
    c->counters[COUNTER_RESULTS_IN]++;
    int64_t answered = c->send_no[j]; /* the latest transmission's, unless proven otherwise */
    double elapsed = now - c->sent_at[j];
    if (c->backoff[j] == 0) {
        if (!c->lost[j]) { /* Karn: only unambiguous samples */
            rtt_sample(c, elapsed, c->sent_at[j]);
            window_on_rtt_sample(c, elapsed, c->sent_at[j], now);
        }
    } else if (!c->lost[j] && c->have_srtt && elapsed < c->min_rtt) {
        c->counters[COUNTER_SPURIOUS]++;
        if (c->copy[j] == COPY_FAST) {
            learn_reordering(c, j);
            answered = c->overtaken_send_no[j]; /* the original's result */
        } else if (c->copy[j] == COPY_SENT) { /* the timer's copy: the RTO was too short */
            rtt_on_premature_timeout(c, c->sent_at[j], now);
        }
        if (!isnan(c->decreased_at[j]))
            window_undo_decrease(c, c->decreased_at[j]);
    }
    note_result(c, answered);
    window_on_result(c, c->inflight_count >= window_allowed(c));
    c->last_progress = now;
    if (c->sp)
        sparse_absorb(c, j, m, data);
    else
        dense_absorb(c, j, m, data, count);
    c->slot_msgs[j] = c->slot_msgs[j] + 1;
    c->round[j] = m + 1;
    c->inflight[j] = 0;
    if (c->lost[j])
        c->lost[j] = 0;
    else
        c->inflight_count--;
    c->deadline[j] = INFINITY;
    c->backoff[j] = 0;
    c->fast_copies[j] = 0;
    c->copy[j] = COPY_SENT;
    c->decreased_at[j] = NAN;
    if (has_message(c, j)) {
        if (heap_push(&c->ready, pkt_id_of(c, j), j) < 0)
            return -1;
    } else {
        c->remaining--;
        if (!c->remaining) {
            if (c->sp)
                sparse_finish(c);
            return 0;
        }
    }
    if (send_ready(c, now) < 0)
        return -1;
    return fast_retransmit(c, now);
}

static double get_timer(DenseCore *c) { /* NAN: none */
    if (c->remaining == 0 || c->stalled)
        return NAN;
    double timer = c->last_progress + c->progress_timeout;
    int64_t room = probe_room(c);
    for (int j = 0; j < c->width; j++) {
        if (c->deadline[j] < timer)
            timer = c->deadline[j];
        if (room <= 0 && c->copy[j] != COPY_FAST)
            continue;
        double probe_time = probe_at(c, j);
        if (probe_time < timer)
            timer = probe_time;
    }
    return timer;
}

static int handle_timer(DenseCore *c, double now) {
    if (c->remaining == 0 || c->stalled)
        return 0;
    if (now >= c->last_progress + c->progress_timeout) {
        c->stalled = 1;
        return 0;
    }
    int expired = 0;
    for (int j = 0; j < c->width; j++) {
        if (c->deadline[j] <= now) {
            judge_loss(c, j, now, c->backoff[j] - c->fast_copies[j]);
            c->lost[j] = 1;
            c->inflight_count--;
            c->deadline[j] = INFINITY;
            if (heap_push(&c->ready, pkt_id_of(c, j), j) < 0)
                return -1;
            expired = 1;
        }
    }
    if (expired && send_ready(c, now) < 0)
        return -1;
    int64_t room = probe_room(c);
    for (int j = 0; j < c->width; j++) {
        if ((room > 0 || c->copy[j] == COPY_FAST) && probe_at(c, j) <= now) {
            room -= c->copy[j] == COPY_SENT;
            if (probe(c, j, now) < 0)
                return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ Python glue */
/* ------------------------------------------------------------ state by name
 * The Session's RTT estimator and window cross the binding as dicts keyed by
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
static int read_rtt_state(DenseCore *c, PyObject *state) {
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
static int read_window_state(DenseCore *c, PyObject *state) {
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
static PyObject *rtt_state(DenseCore *c) {
    PyObject *srtt = c->have_srtt ? PyFloat_FromDouble(c->srtt) : Py_NewRef(Py_None);
    if (!srtt)
        return NULL;
    return Py_BuildValue("{s:N,s:d,s:d,s:d,s:i,s:d}", "srtt", srtt, "rttvar", c->rttvar,
                         "min_rtt", c->min_rtt, "_rto", c->rto_value,
                         "kept_backoff", c->kept_backoff, "_kept_since", c->kept_since);
}

static PyObject *window_state(DenseCore *c) {
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

static void core_dealloc(DenseCore *c) {
    if (c->have_src)
        PyBuffer_Release(&c->src);
    if (c->have_out)
        PyBuffer_Release(&c->out);
    PyMem_RawFree(c->local_exp);
    PyMem_RawFree(c->nonfinite);
    PyMem_RawFree(c->wide);
    PyMem_RawFree(c->slot_msgs);
    PyMem_RawFree(c->round);
    PyMem_RawFree(c->messages);
    PyMem_RawFree(c->global_exp);
    PyMem_RawFree(c->inflight);
    PyMem_RawFree(c->lost);
    PyMem_RawFree(c->backoff);
    PyMem_RawFree(c->sent_at);
    PyMem_RawFree(c->deadline);
    PyMem_RawFree(c->decreased_at);
    PyMem_RawFree(c->packets);
    PyMem_RawFree(c->probes);
    PyMem_RawFree(c->datagram_len);
    PyMem_RawFree(c->outbox);
    PyMem_RawFree(c->ready.items);
    PyMem_RawFree(c->inflight_ids.items);
    PyMem_RawFree(c->by_send.items);
    PyMem_RawFree(c->send_no);
    PyMem_RawFree(c->overtaken_send_no);
    PyMem_RawFree(c->fast_copies);
    PyMem_RawFree(c->copy);
    PyMem_RawFree(c->recv_buffers);
    sparse_free(c->sp);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int core_init(DenseCore *c, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"src", "out", "is_float", "session", "slot_base", "width",
                             "packet_elements", "lanes", "bits", "seq", "slot_msgs", "now",
                             "progress_timeout", "rtt", "window", "wire_bits", "world_size",
                             "sparse", "block_elements", "reordering",
                             NULL};
    PyObject *src, *out, *slot_msgs, *rtt_arg, *window_arg;
    int is_float, wire_bits = 32;
    unsigned int session, seq;
    long long k;
    double now;
    int sparse = 0;
    long long block_elements = 0;
    c->world_size = 1;
    c->reordering = FAST_RETRANSMIT_THRESHOLD;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOpIiiLiiIOddOO|iipLi", kwlist, &src, &out,
                                     &is_float, &session, &c->slot_base, &c->width, &k,
                                     &c->lanes, &c->bits, &seq, &slot_msgs, &now,
                                     &c->progress_timeout, &rtt_arg, &window_arg,
                                     &wire_bits, &c->world_size, &sparse, &block_elements,
                                     &c->reordering))
        return -1;
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
    if (c->have_src || c->have_out) {
        PyErr_SetString(PyExc_RuntimeError, "DenseCore is initialised once");
        return -1;
    }
    if (PyObject_GetBuffer(src, &c->src, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    c->have_src = 1;
    if (PyObject_GetBuffer(out, &c->out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return -1;
    c->have_out = 1;
    if (c->src.len != c->out.len || c->src.len % 4 || k < 1 || c->width < 0 || c->lanes < 1) {
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
    c->seq = seq;
    c->k = k * c->per_word; /* values a chunk; a packet holds k words */
    c->size = c->src.len / 4;
    c->chunks = (c->size + c->k - 1) / c->k;
    int W = c->width;
    if (!PyList_Check(slot_msgs) || PyList_GET_SIZE(slot_msgs) < W) {
        PyErr_SetString(PyExc_ValueError, "slot_msgs: a list of at least width numbers");
        return -1;
    }
    if (read_rtt_state(c, rtt_arg) < 0 || read_window_state(c, window_arg) < 0)
        return -1;
    size_t n = W ? (size_t)W : 1;
    c->packet_size = WIRE_HEADER_SIZE + WIRE_LANE_SIZE * (size_t)c->lanes + 4 * (size_t)k;
    c->wide = PyMem_RawMalloc(c->per_word == 2 ? (size_t)c->k * sizeof(int32_t) : 1);
    c->slot_msgs = PyMem_RawCalloc(n, sizeof(uint32_t));
    c->round = PyMem_RawCalloc(n, sizeof(int64_t));
    c->messages = PyMem_RawCalloc(n, sizeof(int64_t));
    c->global_exp = PyMem_RawCalloc(n, sizeof(int16_t));
    c->inflight = PyMem_RawCalloc(n, 1);
    c->lost = PyMem_RawCalloc(n, 1);
    c->backoff = PyMem_RawCalloc(n, sizeof(int32_t));
    c->sent_at = PyMem_RawCalloc(n, sizeof(double));
    c->deadline = PyMem_RawCalloc(n, sizeof(double));
    c->decreased_at = PyMem_RawCalloc(n, sizeof(double));
    c->send_no = PyMem_RawCalloc(n, sizeof(int64_t));
    c->overtaken_send_no = PyMem_RawCalloc(n, sizeof(int64_t));
    c->fast_copies = PyMem_RawCalloc(n, sizeof(int32_t));
    c->copy = PyMem_RawCalloc(n, 1); /* COPY_SENT */
    /* malloc, not calloc: every byte is written before it is sent, and memory
     * freed by the previous call is reused without being zeroed again */
    c->packets = PyMem_RawMalloc(n * c->packet_size);
    c->probes = PyMem_RawMalloc(n * WIRE_HEADER_SIZE);
    c->datagram_len = PyMem_RawCalloc(n, sizeof(uint32_t));
    c->local_exp = PyMem_RawCalloc(c->chunks ? (size_t)c->chunks : 1, sizeof(int16_t));
    c->nonfinite = PyMem_RawCalloc(c->chunks ? (size_t)c->chunks : 1, 1);
    if (!c->slot_msgs || !c->round || !c->messages || !c->global_exp || !c->inflight || !c->lost ||
        !c->backoff || !c->sent_at || !c->deadline || !c->decreased_at || !c->send_no || !c->overtaken_send_no ||
        !c->fast_copies || !c->copy || !c->packets || !c->probes || !c->datagram_len || !c->local_exp ||
        !c->wide || !c->nonfinite) {
        PyErr_NoMemory();
        return -1;
    }
    for (int j = 0; j < W; j++) {
        unsigned long v = PyLong_AsUnsignedLong(PyList_GET_ITEM(slot_msgs, j));
        if (v == (unsigned long)-1 && PyErr_Occurred())
            return -1;
        c->slot_msgs[j] = (uint32_t)v;
        c->messages[j] = (c->chunks - j + W - 1) / W + c->lag;
        c->global_exp[j] = WIRE_EXP_ZERO;
        c->deadline[j] = INFINITY;
        c->decreased_at[j] = NAN;
    }
    if (is_float && !sparse) /* read as they are announced; sparse_init has its own pass */
        for (int64_t chunk = 0; chunk < c->chunks; chunk++)
            c->local_exp[chunk] = EXP_UNREAD;
    if (sparse && sparse_init(c, block_elements) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    c->remaining = W;
    c->last_progress = now;
    for (int j = 0; j < W; j++) /* Stream._start: message 0 of slot j has pkt_id j */
        if (heap_push(&c->ready, j, j) < 0) {
            PyErr_NoMemory();
            return -1;
        }
    if (send_ready(c, now) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static PyObject *core_receive_datagram(DenseCore *c, PyObject *args) {
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

static PyObject *core_datagrams_to_send(DenseCore *c, PyObject *unused) {
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

static PyObject *core_get_timer(DenseCore *c, PyObject *unused) {
    double timer = get_timer(c);
    if (isnan(timer))
        Py_RETURN_NONE;
    return PyFloat_FromDouble(timer);
}

static PyObject *core_handle_timer(DenseCore *c, PyObject *arg) {
    double now = PyFloat_AsDouble(arg);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    if (handle_timer(c, now) < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *core_pending(DenseCore *c, PyObject *unused) {
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

/* {"slot_msgs", "rtt", "window", "counters", "reordering"}: what the Session keeps, the
 * RTT estimator's and window's fields by their recovery.py names; counters since the
 * last call. */
static PyObject *core_export_state(DenseCore *c, PyObject *unused) {
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

/* ------------------------------------------------------------ the socket driver */
static double monotonic_now(void) { /* time.monotonic()'s clock */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum { IO_DONE = 0, IO_STALLED = 1, IO_CONTROL = 2, IO_SLICE = 3 };

/* Send the outbox with sendmmsg; a full socket buffer waits a little, then what
 * is left counts as lost (the retransmission timer recovers it).  Consecutive
 * datagrams of one size (the last of a run may be shorter) go as one message
 * of UDP GSO segments: the same datagrams in the same order, one trip through
 * the kernel's UDP stack instead of one each. */
static void flush_outbox(DenseCore *c, int fd, struct sockaddr_in *dst) {
    struct mmsghdr msgs[64];
    struct iovec iov[1024];
    union {
        char buf[CMSG_SPACE(sizeof(uint16_t))];
        struct cmsghdr align;
    } control[64];
    int segments[64];
    Py_ssize_t done = 0;
    int waits = 0;
    while (done < c->outbox_len) {
        int n = 0, v = 0;
        Py_ssize_t next = done;
        for (; n < 64 && next < c->outbox_len && v + GSO_MAX_SEGMENTS <= 1024; n++) {
            uint32_t size = c->outbox[next].len, bytes = 0;
            struct iovec *first = &iov[v];
            int segs = 0;
            do { /* a run: every segment `size` bytes, the last one possibly less */
                uint32_t len = c->outbox[next].len;
                iov[v].iov_base = outbox_bytes(c, next);
                iov[v].iov_len = len;
                v++, segs++, next++, bytes += len;
                if (len < size)
                    break;
            } while (gso_wanted && !gso_refused && next < c->outbox_len &&
                     segs < GSO_MAX_SEGMENTS && c->outbox[next].len <= size &&
                     bytes + c->outbox[next].len <= GSO_MAX_BYTES);
            memset(&msgs[n].msg_hdr, 0, sizeof(struct msghdr));
            msgs[n].msg_hdr.msg_name = dst;
            msgs[n].msg_hdr.msg_namelen = sizeof(*dst);
            msgs[n].msg_hdr.msg_iov = first;
            msgs[n].msg_hdr.msg_iovlen = (size_t)segs;
            segments[n] = segs;
            if (segs > 1) {
                uint16_t gso_size = (uint16_t)size;
                struct cmsghdr *cm = &control[n].align;
                msgs[n].msg_hdr.msg_control = control[n].buf;
                msgs[n].msg_hdr.msg_controllen = sizeof control[n].buf;
                cm->cmsg_level = SOL_UDP;
                cm->cmsg_type = UDP_SEGMENT;
                cm->cmsg_len = CMSG_LEN(sizeof gso_size);
                memcpy(CMSG_DATA(cm), &gso_size, sizeof gso_size);
            }
        }
        int sent = sendmmsg(fd, msgs, (unsigned int)n, 0);
        if (sent < 0) {
            if ((errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) && waits++ < 10) {
                struct pollfd p = {fd, POLLOUT, 0};
                poll(&p, 1, 1);
                continue;
            }
            if (errno == EINTR)
                continue;
            if (errno == ECONNREFUSED) /* an ICMP error queued: the next send goes */
                continue;
            if (segments[0] > 1 && (errno == EIO || errno == EINVAL || errno == ENOPROTOOPT ||
                                    errno == EOPNOTSUPP)) {
                gso_refused = 1; /* send them one a message */
                continue;
            }
            break; /* the rest is lost; timers resend it */
        }
        for (int i = 0; i < sent; i++) {
            c->counters[COUNTER_BYTES_SENT] += msgs[i].msg_len;
            done += segments[i];
        }
    }
    c->outbox_len = 0;
}

static PyObject *core_run_io(DenseCore *c, PyObject *args) {
    int fd, control_fd;
    const char *host;
    int port;
    double slice;
    if (!PyArg_ParseTuple(args, "i(si)id", &fd, &host, &port, &control_fd, &slice))
        return NULL;
    struct sockaddr_in dst;
    memset(&dst, 0, sizeof(dst));
    dst.sin_family = AF_INET;
    dst.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &dst.sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "run_io needs an IPv4 address, not %s", host);
        return NULL;
    }
    /* Longer datagrams cannot be results of ours: MSG_TRUNC gives their real
     * length, and receive() reads no more than their header to drop them. */
    size_t buffer_size = c->packet_size + 64;
    if (!c->recv_buffers) {
        c->recv_buffers = PyMem_RawMalloc(buffer_size * RECV_BATCH);
        if (!c->recv_buffers)
            return PyErr_NoMemory();
    }
    int status = IO_SLICE, oom = 0;
    Py_BEGIN_ALLOW_THREADS
    double until = monotonic_now() + slice;
    struct mmsghdr msgs[RECV_BATCH];
    struct iovec iov[RECV_BATCH];
    flush_outbox(c, fd, &dst);
    for (;;) {
        if (c->remaining == 0) {
            status = IO_DONE;
            break;
        }
        for (int i = 0; i < RECV_BATCH; i++) {
            iov[i].iov_base = c->recv_buffers + (size_t)i * buffer_size;
            iov[i].iov_len = buffer_size;
            memset(&msgs[i].msg_hdr, 0, sizeof(struct msghdr));
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
        }
        int received = recvmmsg(fd, msgs, RECV_BATCH, MSG_DONTWAIT | MSG_TRUNC, NULL);
        if (received < 0)
            received = 0; /* EAGAIN, or an ICMP error queued: control tells us */
        for (int i = 0; i < received; i++) { /* after the last result: stale, as in Python */
            c->counters[COUNTER_BYTES_RECEIVED] += msgs[i].msg_len;
            if (receive(c, iov[i].iov_base, msgs[i].msg_len, monotonic_now()) < 0)
                oom = 1;
        }
        flush_outbox(c, fd, &dst);
        if (oom)
            break;
        if (c->remaining == 0) {
            status = IO_DONE;
            break;
        }
        double now = monotonic_now();
        double timer = get_timer(c);
        if (!isnan(timer) && now >= timer) {
            if (handle_timer(c, now) < 0) {
                oom = 1;
                break;
            }
            if (c->stalled) {
                status = IO_STALLED;
                break;
            }
            flush_outbox(c, fd, &dst);
            timer = get_timer(c);
        }
        if (now >= until) {
            status = IO_SLICE;
            break;
        }
        if (received == RECV_BATCH)
            continue; /* more is waiting: results before anything else */
        double wait = until - now;
        if (!isnan(timer) && timer - now < wait)
            wait = timer - now;
        struct pollfd fds[2] = {{fd, POLLIN, 0}, {control_fd, POLLIN, 0}};
        int timeout_ms = wait <= 0 ? 0 : (int)ceil(wait * 1000);
        int ready = poll(fds, control_fd >= 0 ? 2 : 1, timeout_ms);
        /* Results first: a result that completes the call may sit behind news
         * of the switch going away, and the call did complete. */
        if (ready > 0 && !(fds[0].revents & POLLIN) && control_fd >= 0 && fds[1].revents) {
            status = IO_CONTROL;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (oom)
        return PyErr_NoMemory();
    return PyLong_FromLong(status);
}

static PyObject *core_nonfinite_chunks(DenseCore *c, PyObject *unused) {
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

static PyObject *core_get_done(DenseCore *c, void *unused) { return PyBool_FromLong(c->remaining == 0); }

static PyObject *core_get_error(DenseCore *c, void *unused) {
    if (c->stalled)
        return PyUnicode_FromString("stalled");
    Py_RETURN_NONE;
}

static PyObject *core_get_width(DenseCore *c, void *unused) { return PyLong_FromLong(c->width); }

static PyObject *core_get_inflight_count(DenseCore *c, void *unused) {
    return PyLong_FromLongLong(c->inflight_count);
}

static PyObject *core_get_last_progress(DenseCore *c, void *unused) {
    return PyFloat_FromDouble(c->last_progress);
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
    {"pending", (PyCFunction)core_pending, METH_NOARGS,
     "(absolute slot, message number) of every message awaiting its result."},
    {"nonfinite_chunks", (PyCFunction)core_nonfinite_chunks, METH_NOARGS,
     "Chunks left as they were for the follow-up exchange (worker/nonfinite.py)."},
    {"export_state", (PyCFunction)core_export_state, METH_NOARGS,
     "{slot_msgs, rtt, window, counters since the last call, reordering}: rtt and window "
     "by recovery.py's field names."},
    {"run_io", (PyCFunction)core_run_io, METH_VARARGS,
     "run_io(fd, (host, port), control_fd, slice): drive the call on a non-blocking UDP "
     "socket without the GIL for up to slice seconds; 0 done, 1 stalled, 2 control "
     "readable, 3 slice over."},
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
    .tp_name = "switchml.worker._fastengine.DenseCore",
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
    {"magnitude_peak", py_magnitude_peak, METH_VARARGS,
     "magnitude_peak(values, build): the greatest magnitude's bits by one build, or None "
     "(tests)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastengine",
                                    "The worker's dense allreduce in C.", -1, module_methods};

PyMODINIT_FUNC PyInit__fastengine(void) {
    const char *gso = getenv("SWITCHML_WORKER_GSO");
    gso_wanted = !(gso && strcmp(gso, "0") == 0);
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
