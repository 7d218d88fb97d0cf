/* The per-packet pipeline of the switch, in C.  It follows switch/dataplane/pipeline.py
 * (the reference model: read its docstring for the rules) step by step, in the
 * same order, with the same drop reasons and counters; tests/test_fastpath.py
 * checks that both give the same datagrams and counters for the same input. */
#include "fastpath.h"

#include <stdlib.h>
#include <string.h>

const char *const FP_COUNTER_NAMES[FP_NCOUNTERS] = {
    "packets_in", "results_completed", "results_out", "retransmissions_answered",
    "duplicates", "dropped_stale", "dropped_mismatch", "dropped_truncated",
    "dropped_bad_magic", "dropped_bad_version", "dropped_bad_kind", "dropped_bad_dtype",
    "dropped_bad_mode", "dropped_bad_length", "dropped_bad_token",
    "dropped_slot_out_of_range", "dropped_bad_lanes", "dropped_too_many_values",
    "dropped_bad_block_count", "dropped_egress_simulated", "sparse_blocks_in",
    "sparse_blocks_skipped", "sparse_bytes_saved", "sparse_blocks_out",
    "dropped_unknown_source", "dropped_ingress_simulated", "socket_errors", "send_errors",
    "send_fragmented", "probes_in", "probes_waiting", "resends_asked", "dropped_bad_probe",
    "send_waits", "queries_done", "dropped_not_handed_over",
    "handed_over", "runs_received",
};

/* Received datagrams may start anywhere: read them through these. */
static inline uint16_t le16(const uint8_t *p) { uint16_t x; memcpy(&x, p, 2); return x; }
static inline uint32_t le32(const uint8_t *p) { uint32_t x; memcpy(&x, p, 4); return x; }
static inline int16_t lei16(const uint8_t *p) { int16_t x; memcpy(&x, p, 2); return x; }
typedef uint32_t unaligned_u32 __attribute__((aligned(1), may_alias));

/* Lane record fields, at their offsets in a 12-byte record. */
#define LANE_POS 0
#define LANE_NXT 4
#define LANE_EXP 8
#define LANE_FLAG 10

static uint64_t splitmix64(uint64_t *state)
{ /* the simulated drops need no more than a seeded uniform draw */
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double rng_uniform(fp_thread *t)
{
    return (double)(splitmix64(&t->rng) >> 11) * (1.0 / 9007199254740992.0);
}

/* ------------------------------------------------------------ member table */
/* Open addressing, linear probing, deletion by backward shift: no tombstones,
 * so lookups stay short however many jobs came and went. */
static uint32_t hash_key(uint64_t key, uint32_t mask)
{
    key ^= key >> 33;
    key *= 0xFF51AFD7ED558CCDULL;
    key ^= key >> 33;
    return (uint32_t)key & mask;
}

static fp_member *member_find(fp_core *c, uint64_t key)
{
    uint32_t i = hash_key(key, c->member_mask);
    for (;;) {
        fp_member *m = &c->members[i];
        if (m->key == FP_KEY_NONE) /* checked first: FP_KEY_NONE is no member's key */
            return NULL;
        if (m->key == key)
            return m;
        i = (i + 1) & c->member_mask;
    }
}

static void member_insert(fp_core *c, uint64_t key, uint32_t job, uint32_t rank)
{
    uint32_t i = hash_key(key, c->member_mask);
    while (c->members[i].key != FP_KEY_NONE)
        i = (i + 1) & c->member_mask;
    c->members[i] = (fp_member){key, job, rank};
    c->member_count++;
}

static void member_delete(fp_core *c, uint64_t key)
{
    uint32_t i = hash_key(key, c->member_mask), j;
    while (c->members[i].key != key) {
        if (c->members[i].key == FP_KEY_NONE)
            return;
        i = (i + 1) & c->member_mask;
    }
    c->members[i].key = FP_KEY_NONE;
    c->member_count--;
    /* Move back every later entry of the run that may no longer be found. */
    for (j = (i + 1) & c->member_mask; c->members[j].key != FP_KEY_NONE;
         j = (j + 1) & c->member_mask) {
        uint32_t home = hash_key(c->members[j].key, c->member_mask);
        /* entry j stays if its home lies cyclically in (i, j] */
        if (i <= j ? (i < home && home <= j) : (i < home || home <= j))
            continue;
        c->members[i] = c->members[j];
        c->members[j].key = FP_KEY_NONE;
        i = j;
    }
}

/* ------------------------------------------------------------ life cycle */
int fp_core_init(fp_core *c, uint32_t slots, uint32_t row_size, uint8_t *rows,
                 uint32_t member_limit, uint32_t threads)
{
    uint32_t capacity = 16, i;
    int failed = 0;
    memset(c, 0, sizeof *c);
    while (capacity < 2 * member_limit)
        capacity <<= 1;
    c->slots = slots;
    c->row_size = row_size;
    c->rows = rows;
    c->member_limit = member_limit;
    c->member_mask = capacity - 1;
    c->sets = aligned_alloc(64, 2 * (size_t)slots * sizeof *c->sets);
    if (c->sets)
        memset(c->sets, 0, 2 * (size_t)slots * sizeof *c->sets);
    c->jobs = calloc(slots, sizeof *c->jobs);
    c->members = calloc(capacity, sizeof *c->members);
    c->threads = aligned_alloc(64, threads * sizeof *c->threads);
    if (c->threads) {
        memset(c->threads, 0, threads * sizeof *c->threads);
        c->thread_count = threads;
        for (i = 0; i < threads; i++) {
            fp_thread *t = &c->threads[i];
            t->index = i;
            t->of = threads;
            t->epoch = 1;
            t->job_counters = calloc(slots, sizeof *t->job_counters);
            failed |= !t->job_counters;
        }
    }
    if (failed || !c->sets || !c->jobs || !c->members || !c->threads) {
        fp_core_free(c);
        return -1;
    }
    for (i = 0; i < capacity; i++)
        c->members[i].key = FP_KEY_NONE;
    return 0;
}

void fp_core_free(fp_core *c)
{
    free(c->sets);
    free(c->jobs);
    free(c->members);
    for (uint32_t i = 0; c->threads && i < c->thread_count; i++)
        free(c->threads[i].job_counters);
    free(c->threads);
    c->threads = NULL;
    c->thread_count = 0;
    c->sets = NULL;
    c->jobs = NULL;
    c->members = NULL;
}

void fp_seed(fp_core *c, uint64_t seed)
{
    uint32_t i;
    uint64_t state = seed;
    c->threads[0].rng = seed; /* one thread draws as before threads came */
    for (i = 1; i < c->thread_count; i++) /* a hashed start: far from the others' draws */
        c->threads[i].rng = splitmix64(&state);
}

int fp_install(fp_core *c, const fp_job *job)
{
    uint32_t s, v, r, i;
    if (c->member_count + job->world > c->member_limit)
        return -1;
    c->jobs[job->slot_base] = *job;
    for (i = 0; i < c->thread_count; i++)
        memset(&c->threads[i].job_counters[job->slot_base], 0, sizeof(fp_counters));
    for (s = job->slot_base; s < job->slot_base + job->slot_count; s++)
        for (v = 0; v < 2; v++) {
            fp_set *set = &c->sets[v * c->slots + s];
            set->valid = 0;
            set->bitmap = 0;
            set->count = 0;
        }
    for (r = 0; r < job->world; r++)
        member_insert(c, job->members[r], job->slot_base, r);
    return 0;
}

void fp_remove(fp_core *c, uint32_t slot_base)
{
    fp_job *job = &c->jobs[slot_base];
    uint32_t r;
    for (r = 0; r < job->world; r++)
        member_delete(c, job->members[r]);
    if (job->mismatch_state == 1)
        __atomic_fetch_sub(&c->mismatches, 1, __ATOMIC_RELAXED);
    job->mismatch_state = 0;
    job->session = 0;
}

/* ------------------------------------------------------------ data plane */
static inline int msg_newer(uint32_t a, uint32_t b)
{
    uint32_t d = a - b;
    return 0 < d && d < 0x80000000u;
}

/* A row is about to change: datagrams pointing into it must leave first. */
static inline void before_write(fp_core *c, fp_thread *t, uint32_t row)
{
    if (t->flush && c->sets[row].unsent_epoch == t->epoch)
        t->flush(t, t->flush_ctx);
}

static int emit(fp_core *c, fp_thread *t, fp_job *job, fp_set *set, uint32_t row,
                uint32_t only_rank, fp_out *out)
{
    uint32_t len = WIRE_HEADER_SIZE + WIRE_LANE_SIZE * job->lanes + 4 * set->id_count, r, n = 0;
    const uint8_t *data = c->rows + (size_t)row * c->row_size;
    uint32_t first = only_rank == UINT32_MAX ? 0 : only_rank;
    uint32_t last = only_rank == UINT32_MAX ? job->world : only_rank + 1;
    for (r = first; r < last; r++) {
        if (c->egress_drop_rate > 0 && rng_uniform(t) < c->egress_drop_rate) {
            fp_count(&t->job_counters[job->slot_base], C_DROPPED_EGRESS_SIMULATED, 1);
            continue;
        }
        out[n++] = (fp_out){data, len, job->slot_base, r};
    }
    fp_count(&t->job_counters[job->slot_base], C_RESULTS_OUT, n);
    if (n)
        c->sets[row].unsent_epoch = t->epoch;
    return (int)n;
}

static void start_sparse(fp_job *job, fp_set *set, uint8_t *regs, uint32_t *vals,
                         const uint8_t *lanes, const uint8_t *payload, uint32_t flagged)
{
    uint32_t i, k = 0, block = job->block_elements;
    memset(vals, 0, 4 * (size_t)job->lanes * block);
    for (i = 0; i < job->lanes; i++) {
        if (le16(lanes + WIRE_LANE_SIZE * i + LANE_FLAG) & WIRE_FLAG_BLOCK)
            memcpy(vals + (size_t)i * block, payload + 4 * (size_t)k++ * block, 4 * (size_t)block);
        regs[WIRE_LANE_SIZE * i + LANE_FLAG] &= WIRE_FLAG_BLOCK;
        regs[WIRE_LANE_SIZE * i + LANE_FLAG + 1] = 0;
    }
    set->blocks = flagged;
}

static void add_sparse(fp_job *job, fp_set *set, uint8_t *regs, uint32_t *vals,
                       const uint8_t *lanes, const uint8_t *payload, uint32_t flagged)
{
    uint32_t i, j, k = 0, block = job->block_elements;
    for (i = 0; i < job->lanes; i++) {
        const uint8_t *lane = lanes + WIRE_LANE_SIZE * i;
        uint8_t *reg = regs + WIRE_LANE_SIZE * i;
        uint16_t flag = le16(lane + LANE_FLAG);
        if (flag & WIRE_FLAG_BLOCK) {
            uint32_t *dst = vals + (size_t)i * block;
            const unaligned_u32 *src = (const unaligned_u32 *)(payload + 4 * (size_t)k++ * block);
            for (j = 0; j < block; j++)
                dst[j] += src[j];
        }
        uint32_t nxt = le32(lane + LANE_NXT), reg_nxt = le32(reg + LANE_NXT);
        if (nxt < reg_nxt)
            memcpy(reg + LANE_NXT, &nxt, 4);
        int16_t exp = lei16(lane + LANE_EXP), reg_exp = lei16(reg + LANE_EXP);
        if (exp > reg_exp)
            memcpy(reg + LANE_EXP, &exp, 2);
        reg[LANE_FLAG] |= flag & WIRE_FLAG_BLOCK;
    }
    set->blocks += flagged;
}

/* Compact the present blocks to the front; count blocks seen and skipped.
 * Returns the result's value count. */
static uint32_t finish_sparse(fp_counters *counters, fp_job *job, fp_set *set, uint8_t *regs,
                              uint32_t *vals)
{
    int64_t n = job->world, skipped = 0, active = 0, gaps = 0;
    uint32_t i, present = 0, block = job->block_elements;
    for (i = 0; i < job->lanes; i++) {
        const uint8_t *reg = regs + WIRE_LANE_SIZE * i;
        int64_t nxt = le32(reg + LANE_NXT), pos = le32(reg + LANE_POS);
        if (le16(reg + LANE_FLAG)) {
            if (present != i) /* never reads a block already overwritten: present <= i */
                memmove(vals + (size_t)present * block, vals + (size_t)i * block,
                        4 * (size_t)block);
            present++;
        }
        if (set->mode & WIRE_MODE_SEED) {
            skipped += nxt; /* positions before every lane's first block */
        } else if (nxt > pos) { /* an exhausted lane reports its column length again */
            active++;
            gaps += nxt - pos - 1;
        }
    }
    if (set->mode & WIRE_MODE_SEED)
        skipped *= n;
    else
        skipped = n * active - set->blocks + n * gaps;
    fp_count(counters, C_SPARSE_BLOCKS_IN, set->blocks);
    fp_count(counters, C_SPARSE_BLOCKS_SKIPPED, skipped);
    fp_count(counters, C_SPARSE_BYTES_SAVED, skipped * block * 4);
    fp_count(counters, C_SPARSE_BLOCKS_OUT, (int64_t)present * n);
    return present * block;
}

/* pipeline.Pipeline._answer_header: the probe's header as `kind`, past the row. */
static int answer_header(fp_core *c, fp_thread *t, fp_job *job, uint32_t rank, uint32_t row,
                         const uint8_t *d, uint8_t kind, fp_out *out)
{
    if (c->egress_drop_rate > 0 && rng_uniform(t) < c->egress_drop_rate) {
        fp_count(&t->job_counters[job->slot_base], C_DROPPED_EGRESS_SIMULATED, 1);
        return 0;
    }
    before_write(c, t, row); /* a reply of this row may still wait to leave */
    uint8_t *reply = c->rows + (size_t)(row + 1) * c->row_size - WIRE_HEADER_SIZE;
    memcpy(reply, d, WIRE_HEADER_SIZE);
    reply[3] = kind;
    memcpy(reply + 8, &job->session, 4); /* not the rank's token */
    c->sets[row].unsent_epoch = t->epoch;
    out[0] = (fp_out){reply, WIRE_HEADER_SIZE, job->slot_base, rank};
    return 1;
}

/* pipeline.Pipeline._answer_probe: a retransmission without its values (a probe or
 * a query). */
static int answer_probe(fp_core *c, fp_thread *t, fp_job *job, uint32_t rank,
                        const uint8_t *d, fp_out *out)
{
    fp_counters *counters = &t->job_counters[job->slot_base];
    uint32_t slot = le16(d + 6), msg = le32(d + 12);
    if (le16(d + 24) || le16(d + 26)) {
        fp_count(counters, C_DROPPED_BAD_PROBE, 1);
        return 0;
    }
    fp_count(counters, C_PROBES_IN, 1);
    uint32_t v = msg & 1, row = v * c->slots + slot;
    fp_set *set = &c->sets[row];
    if (set->valid && msg == set->msg) {
        if (set->bitmap >> rank & 1) {
            if (set->count < job->world) {
                fp_count(counters, C_PROBES_WAITING, 1); /* for another rank's contribution */
                return 0;
            }
            if (d[3] == WIRE_KIND_PROBE) {
                fp_count(counters, C_RETRANSMISSIONS_ANSWERED, 1);
                return emit(c, t, job, set, row, rank, out);
            }
            fp_count(counters, C_QUERIES_DONE, 1); /* a query: its result went out already */
            return answer_header(c, t, job, rank, row, d, WIRE_KIND_DONE, out);
        }
    } else if (set->valid && !msg_newer(msg, set->msg)) {
        fp_count(counters, C_DROPPED_STALE, 1);
        return 0;
    }
    fp_count(counters, C_RESENDS_ASKED, 1);
    return answer_header(c, t, job, rank, row, d, WIRE_KIND_RESEND, out);
}

int fp_receive(fp_core *c, fp_thread *t, const uint8_t *d, size_t len, uint64_t src,
               fp_out *out)
{
    if (c->ingress_drop_rate > 0 && rng_uniform(t) < c->ingress_drop_rate) {
        fp_count(&t->counters, C_DROPPED_INGRESS_SIMULATED, 1);
        return 0;
    }
    return fp_admit(c, t, d, len, src, out);
}

int fp_admit(fp_core *c, fp_thread *t, const uint8_t *d, size_t len, uint64_t src,
             fp_out *out)
{
    fp_member *member = member_find(c, src);
    if (!member) {
        fp_count(&t->counters, C_DROPPED_UNKNOWN_SOURCE, 1);
        return 0;
    }
    fp_job *job = &c->jobs[member->job];
    fp_counters *counters = &t->job_counters[member->job];
    uint32_t rank = member->rank;
#define DROP(reason)                                                                      \
    do {                                                                                  \
        fp_count(counters, reason, 1);                                                    \
        return 0;                                                                         \
    } while (0)
    /* wire.decode_header, in its order */
    if (len < WIRE_HEADER_SIZE)
        DROP(C_DROPPED_TRUNCATED);
    uint32_t kind = d[3], dtype = d[4], mode = d[5], slot = le16(d + 6);
    uint32_t session = le32(d + 8), msg = le32(d + 12), seq = le32(d + 16);
    uint32_t pkt_id = le32(d + 20), count = le16(d + 24), lanes = le16(d + 26);
    uint32_t call = le32(d + 28);
    if (le16(d) != WIRE_MAGIC)
        DROP(C_DROPPED_BAD_MAGIC);
    if (d[2] != WIRE_VERSION)
        DROP(C_DROPPED_BAD_VERSION);
    if (kind < WIRE_KIND_CONTRIBUTION || kind > WIRE_KIND_DONE) /* wire.KINDS */
        DROP(C_DROPPED_BAD_KIND);
    if (dtype > 2) /* int32, float32, the 16-bit wire: the adds are the same */
        DROP(C_DROPPED_BAD_DTYPE);
    if (mode != 0 && mode != WIRE_MODE_SPARSE && mode != (WIRE_MODE_SPARSE | WIRE_MODE_SEED) &&
        mode != WIRE_MODE_MAX)
        DROP(C_DROPPED_BAD_MODE);
    if (len != WIRE_HEADER_SIZE + (size_t)WIRE_LANE_SIZE * lanes + 4 * (size_t)count)
        DROP(C_DROPPED_BAD_LENGTH);
    /* admission: the job's table entries */
    if (kind != WIRE_KIND_CONTRIBUTION && kind != WIRE_KIND_PROBE && kind != WIRE_KIND_QUERY)
        DROP(C_DROPPED_BAD_KIND);
    if (session != job->tokens[rank]) /* not this rank's token: forged, or an old job's */
        DROP(C_DROPPED_BAD_TOKEN);
    if (slot < job->slot_base || slot >= job->slot_base + job->slot_count)
        DROP(C_DROPPED_SLOT_OUT_OF_RANGE);
    /* Never touch another thread's slot: the socket steering gives a slot's
     * datagrams to its owner, but the kernel steers a UDP GSO run (loopback
     * delivers it unsegmented) by its first datagram's slot.  What the packet
     * and the job alone refuse is refused here first, under its own reason: a
     * datagram too long for a row could not be handed over. */
    if (kind != WIRE_KIND_CONTRIBUTION) {
        if (slot % t->of != t->index)
            return FP_OTHER_THREAD;
        return answer_probe(c, t, job, rank, d, out);
    }
    if (lanes != job->lanes)
        DROP(C_DROPPED_BAD_LANES);
    if (count > job->packet_elements)
        DROP(C_DROPPED_TOO_MANY_VALUES);
    const uint8_t *lane_table = d + WIRE_HEADER_SIZE;
    const uint8_t *payload = lane_table + WIRE_LANE_SIZE * lanes;
    uint32_t sparse = mode & WIRE_MODE_SPARSE, flagged = 0, i;
    if (sparse) {
        for (i = 0; i < lanes; i++)
            flagged += le16(lane_table + WIRE_LANE_SIZE * i + LANE_FLAG) & WIRE_FLAG_BLOCK;
        if (count != flagged * job->block_elements)
            DROP(C_DROPPED_BAD_BLOCK_COUNT);
    }
    if (slot % t->of != t->index)
        return FP_OTHER_THREAD;
    fp_count(counters, C_PACKETS_IN, 1);

    uint32_t v = msg & 1, row = v * c->slots + slot, bit = (uint32_t)1 << rank;
    uint32_t id_count = sparse ? 0 : count;
    fp_set *set = &c->sets[row];
    uint8_t *regs = c->rows + (size_t)row * c->row_size + WIRE_HEADER_SIZE;
    uint32_t *vals = (uint32_t *)(regs + WIRE_LANE_SIZE * lanes);
    if (!set->valid || msg_newer(msg, set->msg)) { /* a fresh aggregation */
        before_write(c, t, row);
        set->valid = 1;
        set->msg = msg;
        set->seq = seq;
        set->pkt_id = pkt_id;
        set->dtype = dtype;
        set->mode = mode;
        set->id_count = id_count;
        set->call = call;
        set->bitmap = bit;
        set->count = 1;
        memcpy(regs, lane_table, WIRE_LANE_SIZE * (size_t)lanes);
        if (sparse)
            start_sparse(job, set, regs, vals, lane_table, payload, flagged);
        else
            memcpy(vals, payload, 4 * (size_t)count);
    } else if (msg == set->msg) {
        if (set->bitmap & bit) {
            if (set->count == job->world) {
                fp_count(counters, C_RETRANSMISSIONS_ANSWERED, 1);
                return emit(c, t, job, set, row, rank, out);
            }
            DROP(C_DUPLICATES);
        }
        int mismatch = seq != set->seq || pkt_id != set->pkt_id || dtype != set->dtype ||
                       mode != set->mode || id_count != set->id_count || call != set->call;
        uint32_t unclaimed = 0;
        if (mismatch && __atomic_compare_exchange_n(&job->mismatch_state, &unclaimed, 1, 0,
                                                    __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            /* pipeline._record_mismatch: the job's first, whichever thread saw it */
            uint32_t record[8] = {set->bitmap, set->seq, set->call, set->dtype,
                                  rank,        seq,      call,      dtype};
            memcpy(job->mismatch, record, sizeof record);
            __atomic_fetch_add(&c->mismatches, 1, __ATOMIC_RELAXED);
            t->mismatched = 1;
        }
        for (i = 0; sparse && !mismatch && i < lanes; i++)
            mismatch = le32(lane_table + WIRE_LANE_SIZE * i + LANE_POS) !=
                       le32(regs + WIRE_LANE_SIZE * i + LANE_POS);
        if (mismatch)
            DROP(C_DROPPED_MISMATCH);
        before_write(c, t, row);
        if (sparse) {
            add_sparse(job, set, regs, vals, lane_table, payload, flagged);
        } else {
            const unaligned_u32 *src = (const unaligned_u32 *)payload;
            if (mode == WIRE_MODE_MAX) {
                for (i = 0; i < count; i++)
                    if ((int32_t)src[i] > (int32_t)vals[i])
                        vals[i] = src[i];
            } else {
                for (i = 0; i < count; i++) /* unsigned: int32 sums wrap around */
                    vals[i] += src[i];
            }
            for (i = 0; i < lanes; i++) {
                int16_t exp = lei16(lane_table + WIRE_LANE_SIZE * i + LANE_EXP);
                uint8_t *reg_exp = regs + WIRE_LANE_SIZE * i + LANE_EXP;
                if (exp > lei16(reg_exp))
                    memcpy(reg_exp, &exp, 2);
            }
        }
        set->bitmap |= bit;
        set->count++;
    } else {
        DROP(C_DROPPED_STALE);
    }
#undef DROP

    if (set->count < job->world)
        return 0;
    set->id_count = sparse ? finish_sparse(counters, job, set, regs, vals) : count;
    uint8_t *header = regs - WIRE_HEADER_SIZE;
    uint16_t magic = WIRE_MAGIC, slot16 = (uint16_t)slot, count16 = (uint16_t)set->id_count;
    uint16_t lanes16 = (uint16_t)lanes;
    memcpy(header, &magic, 2);
    header[2] = WIRE_VERSION;
    header[3] = WIRE_KIND_RESULT;
    header[4] = (uint8_t)set->dtype;
    header[5] = (uint8_t)set->mode;
    memcpy(header + 6, &slot16, 2);
    memcpy(header + 8, &job->session, 4);
    memcpy(header + 12, &msg, 4);
    memcpy(header + 16, &set->seq, 4);
    memcpy(header + 20, &set->pkt_id, 4);
    memcpy(header + 24, &count16, 2);
    memcpy(header + 26, &lanes16, 2);
    memcpy(header + 28, &set->call, 4);
    fp_count(counters, C_RESULTS_COMPLETED, 1);
    return emit(c, t, job, set, row, UINT32_MAX, out);
}
