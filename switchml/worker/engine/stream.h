/* The worker's engine in C, without Python: the state of a call and what its
 * files share.  One translation unit: _fastengine.c (the Python binding)
 * includes the parts, each named after its Python twin and holding no Python:
 *
 *   quant.c       quant.py: block floating point, exponents
 *   recovery.c    recovery.py: RttEstimator, CongestionWindow
 *   stream.c      stream.py: Stream, the state machine every call shares
 *   dense.c      dense.py: DenseAllreduce, the dense call's operations
 *   sparse.c  sparse.py: SparseAllreduce, the sparse call's operations
 *   stream_io.c   the call's socket loop (recvmmsg, sendmmsg, UDP GSO)
 *
 * The dense and the sparse call are two implementations of one set of
 * operations (struct CallOps), as DenseAllreduce and SparseAllreduce are two
 * subclasses of Stream with _fill, _absorb, _result_fits and _has_message.
 * tests/test_engine_files.py compiles these parts without Python's headers. */
#ifndef SWITCHML_WORKER_STREAM_H
#define SWITCHML_WORKER_STREAM_H

#include <errno.h>
#include <pthread.h>
#include <math.h>
#include <poll.h>
#include <stddef.h>
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

#include "../../wire.h" /* the datagram format, shared with the switch's data plane */

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

/* ------------------------------------------------------------ (pkt_id, slot) min-heap */
typedef struct {
    int64_t key;
    int32_t slot;
} HeapItem;

typedef struct {
    HeapItem *items;
    ptrdiff_t len, cap;
} Heap;

/* ------------------------------------------------------------ the engine */
/* recovery.FAST_RETRANSMIT_THRESHOLD and MAX_REORDERING (exported as the module's
 * constants, and tests/test_fastengine.py checks they agree) */
#define FAST_RETRANSMIT_THRESHOLD 3
#define MAX_REORDERING 16
/* protocol.MAX_DATA_THREADS: the most data threads a switch says it has */
#define MAX_DATA_THREADS 64
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
       COUNTER_LOCAL_REFUSALS, COUNTER_COUNT };

static const char *counter_names[COUNTER_COUNT] = {
    "results_in", "retransmissions", "spurious_retransmissions", "window_decreases",
    "random_losses", "dropped_stale", "dropped_malformed", "dropped_foreign", "bytes_sent",
    "bytes_received", "fast_retransmissions", "probe_retransmissions", "sparse_blocks_sent",
    "sparse_blocks_received", "resends", "results_lost", "local_refusals"};

struct SparseState; /* sparse.c */
struct CallOps;

/* The state of one call: stream.py's Stream (with its Membership's share), the
 * dense call's (dense.c) or the sparse call's (sparse.c) as `call` says. */
typedef struct StreamCore {
    const void *src; /* the input: `size` float32 or int32 values */
    void *out;       /* the output, as long (it may be the input) */
    const struct CallOps *call; /* the dense or the sparse call's operations */
    int is_float, dtype_code, lag, bits, lanes;
    int per_word, world_size; /* values a 32-bit word: 2 on the 16-bit wire */
    int32_t *wide;            /* the 16-bit wire's int32 scratch, a chunk long */
    uint32_t session, seq; /* session: what the switch's answers carry */
    uint32_t token;        /* what this rank's datagrams carry as session (Ready.token) */
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
    uint8_t *packets; /* one packet buffer per slot (a kept block: block_take) */
    uint8_t *probes;  /* per slot: the probe of its message (WIRE_HEADER_SIZE bytes) */
    size_t packet_size;
    uint32_t *datagram_len;
    Heap ready, inflight_ids;
    int64_t inflight_count, remaining;
    /* fast retransmit (Stream's): send numbers, per group (Stream._group: a slot's
     * switch data thread, or `every`, every thread's results, for a slot alone of
     * its thread) the candidates by send number and the greatest send numbers
     * answered (least first; every + 1 rows of MAX_REORDERING), the Membership's
     * reordering threshold, and per slot the send number a fast retransmission
     * followed */
    int64_t sends, *send_no, *overtaken_send_no;
    int reordering;
    int32_t *fast_copies; /* per slot: fast retransmissions and probes of its message */
    uint8_t *copy;        /* per slot: how its latest transmission went out (COPY_*) */
    int data_threads; /* Membership.data_threads: slot s's thread is s % data_threads */
    int every;        /* the group of every thread's results: data_threads, or 0 for one */
    int32_t *group;   /* per slot */
    Heap *by_send;
    int64_t *latest_results;
    int *latest_len;
    /* datagrams to send: (slot, length, probe); the bytes are the slot's buffer
     * (or its probe's) when sent, as the reference's outbox holds views of its
     * packet buffers */
    struct OutboxEntry {
        int32_t slot;
        uint32_t len;
        int probe;
    } *outbox;
    ptrdiff_t outbox_len, outbox_cap;
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
    uint8_t *recv_buffers;           /* run_io's (a kept block) */
    size_t packets_bytes, recv_bytes; /* the two kept blocks' sizes */
    /* the sparse mode (sparse.py's SparseAllreduce): its state, NULL when dense */
    struct SparseState *sp;
} StreamCore;

/* What a kind of call does in the stream's places (DenseAllreduce's and
 * SparseAllreduce's methods): dense.c's DENSE_CALL, sparse.c's SPARSE_CALL. */
struct CallOps {
    /* the call's own set-up after the stream's (-1: out of memory) */
    int (*start)(StreamCore *c, int64_t block_elements);
    /* _fill: slot j's message m into the packet (its lane records at `lanes`, its
     * values after them); returns the word count */
    int64_t (*fill)(StreamCore *c, int j, int64_t m, uint8_t *lanes);
    int (*mode)(StreamCore *c, int j); /* the header's mode for slot j's message */
    uint32_t call_flag;                /* wire.CALL_SPARSE in the header's call, or 0 */
    int (*has_message)(StreamCore *c, int j); /* _has_message */
    /* _result_fits: a result for slot j's message in flight is one of its own */
    int (*result_fits)(StreamCore *c, int j, const uint8_t *data, int mode, int64_t count);
    void (*absorb)(StreamCore *c, int j, int64_t m, const uint8_t *data, int64_t count);
    void (*finish)(StreamCore *c); /* after the last result */
    void (*free)(StreamCore *c); /* the call's own state, whatever of it was made */
};

#endif
