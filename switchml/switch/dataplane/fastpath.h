/* The switch's data plane in C: the same object as switch/dataplane/pipeline.py (the
 * reference model), for the packet rates of frame-sized packets.
 *
 * fastpath_core.c holds the per-packet pipeline (no Python in it); _fastpath.c
 * wraps it as a Python type and adds the batched socket loop.  Everything is
 * allocated when the core is built; nothing grows per packet.
 */
#ifndef SWITCHML_FASTPATH_H
#define SWITCHML_FASTPATH_H

#include <stddef.h>
#include <stdint.h>

#include "../../wire.h" /* the datagram format, shared with the worker's engine */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the slot rows hold little-endian datagrams: a little-endian host is needed"
#endif

#define FP_MAX_WORKERS 32
/* Data threads a core serves at most (each owns the slots s with s % threads == its
 * index); a switch server's cores, with room. */
#define FP_MAX_THREADS 64
/* A key no member has: the source of a datagram whose address is not a member's. */
#define FP_KEY_NONE UINT64_MAX

/* Counter names, in the order of FP_COUNTER_NAMES (the Python pipeline's names). */
enum fp_counter {
    C_PACKETS_IN, C_RESULTS_COMPLETED, C_RESULTS_OUT, C_RETRANSMISSIONS_ANSWERED,
    C_DUPLICATES, C_DROPPED_STALE, C_DROPPED_MISMATCH, C_DROPPED_TRUNCATED,
    C_DROPPED_BAD_MAGIC, C_DROPPED_BAD_VERSION, C_DROPPED_BAD_KIND, C_DROPPED_BAD_DTYPE,
    C_DROPPED_BAD_MODE, C_DROPPED_BAD_LENGTH, C_DROPPED_BAD_TOKEN,
    C_DROPPED_SLOT_OUT_OF_RANGE, C_DROPPED_BAD_LANES, C_DROPPED_TOO_MANY_VALUES,
    C_DROPPED_BAD_BLOCK_COUNT, C_DROPPED_EGRESS_SIMULATED, C_SPARSE_BLOCKS_IN,
    C_SPARSE_BLOCKS_SKIPPED, C_SPARSE_BYTES_SAVED, C_SPARSE_BLOCKS_OUT,
    /* not attributable to a job */
    C_DROPPED_UNKNOWN_SOURCE, C_DROPPED_INGRESS_SIMULATED, C_SOCKET_ERRORS, C_SEND_ERRORS,
    C_SEND_FRAGMENTED,
    /* probes (pipeline.Pipeline._answer_probe) */
    C_PROBES_IN, C_PROBES_WAITING, C_RESENDS_ASKED, C_DROPPED_BAD_PROBE,
    C_SEND_WAITS, /* not a job's: sends this host's queue refused, tried again */
    C_QUERIES_DONE,
    /* a datagram of a slot another data thread owns (the steering could not see it:
     * a UDP GSO run on loopback) that could not be handed over to that thread */
    C_DROPPED_NOT_HANDED_OVER,
    C_HANDED_OVER, /* datagrams a data thread gave to the thread owning their slot */
    C_RUNS_RECEIVED, /* receives that held a run of datagrams (UDP_GRO), not one */
    FP_NCOUNTERS
};
extern const char *const FP_COUNTER_NAMES[FP_NCOUNTERS];

/* Counters, with a bit per counter that was incremented (even by 0) since Python
 * last took them: a Python Counter has a key exactly when it was incremented. */
typedef struct {
    int64_t value[FP_NCOUNTERS];
    uint64_t touched;
} fp_counters;

typedef struct {
    uint32_t session; /* 0: no job starts at this slot */
    uint32_t world, slot_base, slot_count, lanes, packet_elements, block_elements;
    uint64_t members[FP_MAX_WORKERS]; /* address key of each rank */
    uint32_t tokens[FP_MAX_WORKERS];  /* what each rank's datagrams carry as session */
    /* The first disagreement between ranks (pipeline.Mismatch): 0 none, 1 waiting
     * for Python's take_mismatches, 2 taken.  `mismatch` holds the ranks' bitmap,
     * the set's (seq, call, dtype), the rank and its (seq, call, dtype).  Data
     * threads claim it with an atomic compare-and-swap from 0 (two threads may
     * see a job's first disagreements at once, in different slots); the record is
     * read only while every thread is held (_fastpath.c lock_threads). */
    uint32_t mismatch_state;
    uint32_t mismatch[8];
} fp_job;

/* One shadow-copy set of one slot: the registers beside its row of the pool.  A
 * cache line each: neighbouring slots belong to different data threads, which
 * write their sets every packet. */
typedef struct {
    uint32_t valid, msg, bitmap, count, blocks;
    /* the ids a contribution must match, echoed in the result */
    uint32_t seq, pkt_id, dtype, mode, id_count, call;
    uint32_t unsent_epoch; /* == its thread's epoch: datagrams of the row wait to be sent */
} __attribute__((aligned(64))) fp_set;

typedef struct {
    uint64_t key; /* FP_KEY_NONE: empty */
    uint32_t job; /* slot_base of its job */
    uint32_t rank;
} fp_member;

/* A datagram to send: a whole row prefix of the pool, to one rank of a job. */
typedef struct {
    const uint8_t *data;
    uint32_t len;
    uint32_t job;
    uint32_t rank;
} fp_out;

typedef struct fp_thread fp_thread;
/* Called before a row is written while datagrams that point into it wait to be sent. */
typedef void (*fp_flush_fn)(fp_thread *thread, void *ctx);

/* What one data thread owns: the slots s with s % of == index, so that no slot's
 * set, row or bitmap is ever touched by two threads and needs no lock; and its
 * own counters (a job's counts are the sum over its threads), random draws and
 * send queue, so that the threads share no cache line they write per packet. */
struct fp_thread {
    uint32_t index, of;
    fp_counters counters;      /* drops no job owns, socket errors */
    fp_counters *job_counters; /* [slot_base]: this thread's part of each job's */
    uint64_t rng;
    uint32_t epoch; /* rows of its slots with datagrams not sent: unsent_epoch == epoch */
    fp_flush_fn flush;
    void *flush_ctx;
    uint32_t mismatched; /* it recorded a job's first disagreement since this was cleared */
} __attribute__((aligned(64))); /* a cache line of its own */

typedef struct fp_core {
    uint32_t slots, row_size;
    uint8_t *rows; /* 2 * slots * row_size bytes: the Python pipeline's _rows */
    fp_set *sets;  /* [set * slots + slot] */
    fp_job *jobs;  /* [slot_base] */
    fp_member *members;
    uint32_t member_mask, member_count, member_limit;
    double ingress_drop_rate, egress_drop_rate;
    uint32_t mismatches; /* jobs with mismatch_state 1 (atomic: threads add to it) */
    uint32_t thread_count;
    fp_thread *threads; /* [thread_count]; thread 0 alone when the core is not threaded */
} fp_core;

/* Build the registers of a pool of `slots` rows of `row_size` bytes at `rows`,
 * served by `threads` data threads; -1 when out of memory. */
int fp_core_init(fp_core *c, uint32_t slots, uint32_t row_size, uint8_t *rows,
                 uint32_t member_limit, uint32_t threads);
/* Seed every thread's draws from one seed: thread 0 draws from `seed` itself. */
void fp_seed(fp_core *c, uint64_t seed);
void fp_core_free(fp_core *c);
/* Install a job (the Python pipeline checked its arguments); -1 if the member
 * table is full. */
int fp_install(fp_core *c, const fp_job *job);
void fp_remove(fp_core *c, uint32_t slot_base);
/* fp_receive's answer for a datagram of a slot another thread owns: the caller
 * hands it over to that thread (slot % thread_count), which calls fp_admit. */
#define FP_OTHER_THREAD (-1)
/* One datagram from the member with address key `src`, handled by data thread `t`:
 * fills `out` (room for FP_MAX_WORKERS) and returns how many datagrams to send, or
 * FP_OTHER_THREAD (nothing counted, nothing touched). */
int fp_receive(fp_core *c, fp_thread *t, const uint8_t *data, size_t len, uint64_t src,
               fp_out *out);
/* fp_receive past the simulated ingress loss: a datagram handed over had its draw. */
int fp_admit(fp_core *c, fp_thread *t, const uint8_t *data, size_t len, uint64_t src,
             fp_out *out);

static inline void fp_count(fp_counters *c, enum fp_counter which, int64_t n)
{
    c->value[which] += n;
    c->touched |= (uint64_t)1 << which;
}

#endif
