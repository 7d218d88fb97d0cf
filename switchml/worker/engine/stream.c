/* stream.py's Stream in C: what every call shares.  At most one message per
 * slot, the result of a message makes the slot's next one ready, ready messages
 * leave in pkt_id order within the congestion window, the lowest unfinished one
 * always in flight; timers, fast retransmit and probes (stream.py says why).
 * What differs between the dense and the sparse call goes through c->call. */

/* ------------------------------------------------------------ kept blocks */
/* buffers.py's BufferPool for a call's two large blocks, its packet buffers and
 * run_io's receive buffers (a few MiB with 64 KiB packets): a call frees them
 * into this process-wide cache and the next call takes them again, instead of
 * the allocator giving them back to the kernel and the next call faulting in
 * fresh pages (buffers.py says what that costs).  Several I/O threads make
 * calls at once: a lock, tried only, so that a child forked while another
 * thread held it allocates as before.  Two blocks a call, one call at a time a
 * channel: room for 16 channels (a rank of 8 I/O threads on 2 switches); what
 * is kept is what calls used at once. */
#define KEPT_BLOCKS 32
static struct { void *block; size_t bytes; } kept_blocks[KEPT_BLOCKS];
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;
static int64_t blocks_allocated = 0; /* ever: a steady state allocates none */

/* A block of at least `bytes` (at most twice, as BufferPool's slack); *got: its size. */
static void *block_take(size_t bytes, size_t *got) {
    if (pthread_mutex_trylock(&kept_lock) == 0) {
        int best = -1;
        for (int i = 0; i < KEPT_BLOCKS; i++)
            if (kept_blocks[i].block && kept_blocks[i].bytes >= bytes &&
                kept_blocks[i].bytes <= 2 * bytes &&
                (best < 0 || kept_blocks[i].bytes < kept_blocks[best].bytes))
                best = i;
        if (best >= 0) {
            void *block = kept_blocks[best].block;
            *got = kept_blocks[best].bytes;
            kept_blocks[best].block = NULL;
            pthread_mutex_unlock(&kept_lock);
            return block;
        }
        pthread_mutex_unlock(&kept_lock);
    }
    __atomic_fetch_add(&blocks_allocated, 1, __ATOMIC_RELAXED);
    *got = bytes;
    return malloc(bytes);
}

/* Keep `block` for a later call: in an empty place, or over the smallest kept
 * one if it is smaller (the largest serve the most calls). */
static void block_give(void *block, size_t bytes) {
    if (!block)
        return;
    if (pthread_mutex_trylock(&kept_lock) == 0) {
        int place = -1;
        for (int i = 0; i < KEPT_BLOCKS && place < 0; i++)
            if (!kept_blocks[i].block)
                place = i;
        if (place < 0) {
            place = 0;
            for (int i = 1; i < KEPT_BLOCKS; i++)
                if (kept_blocks[i].bytes < kept_blocks[place].bytes)
                    place = i;
            if (kept_blocks[place].bytes < bytes) {
                free(kept_blocks[place].block);
            } else {
                place = -1;
            }
        }
        if (place >= 0) {
            kept_blocks[place].block = block;
            kept_blocks[place].bytes = bytes;
            block = NULL;
        }
        pthread_mutex_unlock(&kept_lock);
    }
    free(block);
}

static inline int heap_less(HeapItem a, HeapItem b) {
    return a.key < b.key || (a.key == b.key && a.slot < b.slot);
}

static int heap_push(Heap *h, int64_t key, int32_t slot) {
    if (h->len == h->cap) {
        ptrdiff_t cap = h->cap ? h->cap * 2 : 16;
        HeapItem *items = realloc(h->items, (size_t)cap * sizeof(HeapItem));
        if (!items)
            return -1;
        h->items = items;
        h->cap = cap;
    }
    ptrdiff_t i = h->len++;
    HeapItem item = {key, slot};
    while (i > 0) {
        ptrdiff_t parent = (i - 1) / 2;
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
    ptrdiff_t i = 0, n = h->len;
    if (n == 0)
        return;
    for (;;) {
        ptrdiff_t child = 2 * i + 1;
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

static inline int64_t chunk_count(StreamCore *c, int64_t chunk) {
    if (chunk < 0)
        return 0;
    int64_t left = c->size - chunk * c->k;
    return left < c->k ? left : c->k;
}

static inline int64_t pkt_id_of(StreamCore *c, int j) { return c->round[j] * c->width + j; }

/* One more entry at the outbox's end: `len` bytes of slot j's packet buffer, or
 * of its probe's. */
static int outbox_append(StreamCore *c, int j, uint32_t len, int probe) {
    if (c->outbox_len == c->outbox_cap) {
        ptrdiff_t cap = c->outbox_cap ? c->outbox_cap * 2 : 16;
        struct OutboxEntry *entries = realloc(c->outbox, (size_t)cap * sizeof(*entries));
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
static int outbox_add(StreamCore *c, int j) {
    ptrdiff_t kept = 0;
    for (ptrdiff_t i = 0; i < c->outbox_len; i++)
        if (c->outbox[i].slot != j)
            c->outbox[kept++] = c->outbox[i];
    c->outbox_len = kept;
    return outbox_append(c, j, c->datagram_len[j], 0);
}

/* Stream._enqueue_probe: queue the probe or query (kind) of slot j's message in
 * flight unless the message itself waits to leave. */
static int outbox_add_probe(StreamCore *c, int j, uint8_t kind) {
    for (ptrdiff_t i = 0; i < c->outbox_len; i++)
        if (c->outbox[i].slot == j)
            return 0;
    uint8_t *probe = c->probes + (size_t)j * WIRE_HEADER_SIZE;
    memcpy(probe, c->packets + (size_t)j * c->packet_size, WIRE_HEADER_SIZE);
    probe[3] = kind;
    memset(probe + 24, 0, 4); /* count and lanes */
    return outbox_append(c, j, WIRE_HEADER_SIZE, 1);
}

/* The bytes of outbox entry i. */
static uint8_t *outbox_bytes(StreamCore *c, ptrdiff_t i) {
    struct OutboxEntry *e = &c->outbox[i];
    return e->probe ? c->probes + (size_t)e->slot * WIRE_HEADER_SIZE
                    : c->packets + (size_t)e->slot * c->packet_size;
}

/* Stream._number_send */
static int number_send(StreamCore *c, int j) {
    c->send_no[j] = ++c->sends;
    return heap_push(&c->by_send[c->group[j]], c->sends, j);
}

static int send_message(StreamCore *c, int j, double now) {
    uint8_t *packet = c->packets + (size_t)j * c->packet_size;
    int64_t m = c->round[j], W = c->width;
    uint8_t *lanes = packet + WIRE_HEADER_SIZE;
    int64_t count = c->call->fill(c, j, m, lanes); /* words */
    put_u16(packet, WIRE_MAGIC);
    packet[2] = WIRE_VERSION;
    packet[3] = WIRE_KIND_CONTRIBUTION;
    packet[4] = (uint8_t)c->dtype_code;
    packet[5] = (uint8_t)c->call->mode(c, j);
    put_u16(packet + 6, (uint16_t)(c->slot_base + j));
    put_u32(packet + 8, c->token);
    put_u32(packet + 12, c->slot_msgs[j]);
    put_u32(packet + 16, c->seq);
    put_u32(packet + 20, (uint32_t)(m * W + j));
    put_u16(packet + 24, (uint16_t)count);
    put_u16(packet + 26, (uint16_t)c->lanes);
    /* wire.call_id: the element count, bit 31 for a sparse call */
    put_u32(packet + 28, (uint32_t)(c->size & 0x7FFFFFFF) | c->call->call_flag);
    c->datagram_len[j] = (uint32_t)(WIRE_HEADER_SIZE + WIRE_LANE_SIZE * c->lanes + 4 * count);
    c->inflight[j] = 1;
    c->inflight_count++;
    c->sent_at[j] = now;
    c->deadline[j] = now + rto(c, 0);
    if (number_send(c, j) < 0)
        return -1;
    return outbox_add(c, j);
}

static int resend_message(StreamCore *c, int j, double now) {
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

/* Stream._note_in */
static void note_in(StreamCore *c, int group, int64_t send_no) {
    int64_t *latest = c->latest_results + (size_t)group * MAX_REORDERING;
    int i;
    if (c->latest_len[group] < MAX_REORDERING) {
        i = c->latest_len[group]++;
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

/* Stream._note_result */
static void note_result(StreamCore *c, int j, int64_t send_no) {
    note_in(c, c->group[j], send_no);
    if (c->group[j] != c->every)
        note_in(c, c->every, send_no);
}

/* Stream._learn_reordering */
static void learn_reordering(StreamCore *c, int j) {
    int group = c->group[j], overtaken_by = 0;
    const int64_t *latest = c->latest_results + (size_t)group * MAX_REORDERING;
    for (int i = c->latest_len[group] - 1; i >= 0 && latest[i] > c->overtaken_send_no[j]; i--)
        overtaken_by++;
    int want = overtaken_by + 1 < MAX_REORDERING ? overtaken_by + 1 : MAX_REORDERING;
    if (want > c->reordering)
        c->reordering = want;
}

/* Stream._judge_loss */
static void judge_loss(StreamCore *c, int j, double now, int retries) {
    int outcome = window_on_timeout(c, c->sent_at[j], now, retries);
    if (outcome == DECREASED) {
        c->counters[COUNTER_WINDOW_DECREASES]++;
        c->decreased_at[j] = now;
    } else if (outcome == RANDOM_LOSS) {
        c->counters[COUNTER_RANDOM_LOSSES]++;
    }
}

/* Stream._fast_resend */
static int fast_resend(StreamCore *c, int j, double now) {
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

/* Stream._fast_retransmit_group */
static int fast_retransmit_group(StreamCore *c, int group, double now) {
    int len = c->latest_len[group];
    if (len < c->reordering)
        return 0;
    int64_t bound = c->latest_results[(size_t)group * MAX_REORDERING + len - c->reordering];
    Heap *candidates = &c->by_send[group];
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

/* Stream._fast_retransmit: slot `answered`'s group, then the slots alone of their thread */
static int fast_retransmit(StreamCore *c, int answered, double now) {
    if (fast_retransmit_group(c, c->group[answered], now) < 0)
        return -1;
    return c->group[answered] != c->every ? fast_retransmit_group(c, c->every, now) : 0;
}

/* Stream._probe_at: when message j is probed (INFINITY: it is not). */
static double probe_at(StreamCore *c, int j) {
    if (!c->have_srtt || !c->inflight[j] || c->lost[j] || c->copy[j] == COPY_PROBE)
        return INFINITY;
    if (c->copy[j] == COPY_FAST)
        return c->sent_at[j] +
               (COPY_PROBE_ROUND_TRIPS * c->srtt + 4 * c->rttvar + TAIL_PROBE_MARGIN);
    double since = c->sent_at[j] > c->last_progress ? c->sent_at[j] : c->last_progress;
    return since + (TAIL_PROBE_ROUND_TRIPS * c->srtt + TAIL_PROBE_MARGIN);
}

/* Stream._probe_room: tail probes the window has room for. */
static int64_t probe_room(StreamCore *c) {
    int64_t probes = 0;
    for (int j = 0; j < c->width; j++)
        probes += c->copy[j] == COPY_PROBE && c->inflight[j] && !c->lost[j];
    int64_t room = (int64_t)c->cwnd - c->inflight_count; /* not capped by the width */
    return (room < 1 ? 1 : room) - probes;
}

/* Stream._probe: not a loss for the window; its timer stays. */
static int probe(StreamCore *c, int j, double now) {
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

static int has_message(StreamCore *c, int j) {
    return c->call->has_message(c, j);
}

/* Stream._lowest_in_flight; -1 when none is. */
static int64_t lowest_in_flight(StreamCore *c) {
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
static int send_ready(StreamCore *c, double now) {
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

/* Stream.send_refused: this host's queue refused a datagram (ENOBUFS). */
static void send_refused(StreamCore *c, double now) {
    c->counters[COUNTER_LOCAL_REFUSALS]++;
    if (window_on_local_refusal(c, now, c->have_srtt ? c->srtt : rto(c, 0)))
        c->counters[COUNTER_WINDOW_DECREASES]++;
}

/* Stream._names_in_flight: whether the header at `data` (a result or a probe's
 * answer) is about slot j's message in flight (this call, its message number and
 * packet). */
static int names_in_flight(StreamCore *c, int j, const uint8_t *data) {
    return c->inflight[j] && get_u32(data + 16) == c->seq &&
           get_u32(data + 12) == c->slot_msgs[j] &&
           (int64_t)get_u32(data + 20) == c->round[j] * c->width + j;
}

/* Stream.receive_datagram, with the call's _result_fits and _absorb. -1: out of
 * memory. */
static int receive(StreamCore *c, const uint8_t *data, ptrdiff_t len, double now) {
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
        len != WIRE_HEADER_SIZE + WIRE_LANE_SIZE * (ptrdiff_t)lanes + 4 * (ptrdiff_t)count) {
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
    if (!(names_in_flight(c, j, data) && dtype == c->dtype_code && lanes == c->lanes &&
          c->call->result_fits(c, j, data, mode, count))) {
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
    note_result(c, j, answered);
    window_on_result(c, c->inflight_count >= window_allowed(c));
    c->last_progress = now;
    c->call->absorb(c, j, m, data, count);
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
            c->call->finish(c);
            return 0;
        }
    }
    if (send_ready(c, now) < 0)
        return -1;
    return fast_retransmit(c, j, now);
}

static double get_timer(StreamCore *c) { /* NAN: none */
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

static int handle_timer(StreamCore *c, double now) {
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


/* The per-slot and per-chunk arrays of a call of `width` slots whose packets hold
 * `words` words; -1: out of memory (stream_free frees what was allocated). */
static int stream_allocate(StreamCore *c, int64_t words) {
    size_t n = c->width ? (size_t)c->width : 1;
    c->packet_size = WIRE_HEADER_SIZE + WIRE_LANE_SIZE * (size_t)c->lanes + 4 * (size_t)words;
    c->wide = malloc(c->per_word == 2 ? (size_t)c->k * sizeof(int32_t) : 1);
    c->slot_msgs = calloc(n, sizeof(uint32_t));
    c->round = calloc(n, sizeof(int64_t));
    c->messages = calloc(n, sizeof(int64_t));
    c->global_exp = calloc(n, sizeof(int16_t));
    c->inflight = calloc(n, 1);
    c->lost = calloc(n, 1);
    c->backoff = calloc(n, sizeof(int32_t));
    c->sent_at = calloc(n, sizeof(double));
    c->deadline = calloc(n, sizeof(double));
    c->decreased_at = calloc(n, sizeof(double));
    c->send_no = calloc(n, sizeof(int64_t));
    c->overtaken_send_no = calloc(n, sizeof(int64_t));
    c->fast_copies = calloc(n, sizeof(int32_t));
    c->copy = calloc(n, 1); /* COPY_SENT */
    c->every = c->data_threads > 1 ? c->data_threads : 0;
    c->group = calloc(n, sizeof(int32_t));
    c->by_send = calloc((size_t)c->every + 1, sizeof(Heap));
    c->latest_results = calloc(((size_t)c->every + 1) * MAX_REORDERING, sizeof(int64_t));
    c->latest_len = calloc((size_t)c->every + 1, sizeof(int));
    if (c->group && c->every) { /* Stream._group: a thread's slots, if it has two */
        int slots_of[MAX_DATA_THREADS] = {0};
        for (int j = 0; j < c->width; j++)
            slots_of[(c->slot_base + j) % c->data_threads]++;
        for (int j = 0; j < c->width; j++) {
            int thread = (c->slot_base + j) % c->data_threads;
            c->group[j] = slots_of[thread] > 1 ? thread : c->every;
        }
    }
    /* a kept block, not zeroed: every byte is written before it is sent */
    c->packets = block_take(n * c->packet_size, &c->packets_bytes);
    c->probes = malloc(n * WIRE_HEADER_SIZE);
    c->datagram_len = calloc(n, sizeof(uint32_t));
    c->local_exp = calloc(c->chunks ? (size_t)c->chunks : 1, sizeof(int16_t));
    c->nonfinite = calloc(c->chunks ? (size_t)c->chunks : 1, 1);
    if (!c->slot_msgs || !c->round || !c->messages || !c->global_exp || !c->inflight || !c->lost ||
        !c->backoff || !c->sent_at || !c->deadline || !c->decreased_at || !c->send_no ||
        !c->overtaken_send_no || !c->fast_copies || !c->copy || !c->packets || !c->probes ||
        !c->datagram_len || !c->local_exp || !c->wide || !c->nonfinite || !c->group ||
        !c->by_send || !c->latest_results || !c->latest_len)
        return -1;
    return 0;
}

/* Stream._start, once the Membership's message numbers are in slot_msgs: every
 * slot's first message ready, then sent as the window allows. -1: out of memory. */
static int stream_start(StreamCore *c, double now, const struct CallOps *call,
                        int64_t block_elements) {
    int W = c->width;
    c->call = call;
    for (int j = 0; j < W; j++) {
        c->messages[j] = (c->chunks - j + W - 1) / W + c->lag;
        c->global_exp[j] = WIRE_EXP_ZERO;
        c->deadline[j] = INFINITY;
        c->decreased_at[j] = NAN;
    }
    if (call->start(c, block_elements) < 0)
        return -1;
    c->remaining = W;
    c->last_progress = now;
    for (int j = 0; j < W; j++) /* Stream._start: message 0 of slot j has pkt_id j */
        if (heap_push(&c->ready, j, j) < 0)
            return -1;
    return send_ready(c, now);
}

static void stream_free(StreamCore *c) {
    free(c->local_exp);
    free(c->nonfinite);
    free(c->wide);
    free(c->slot_msgs);
    free(c->round);
    free(c->messages);
    free(c->global_exp);
    free(c->inflight);
    free(c->lost);
    free(c->backoff);
    free(c->sent_at);
    free(c->deadline);
    free(c->decreased_at);
    block_give(c->packets, c->packets_bytes);
    free(c->probes);
    free(c->datagram_len);
    free(c->outbox);
    free(c->ready.items);
    free(c->inflight_ids.items);
    for (int g = 0; c->by_send && g <= c->every; g++)
        free(c->by_send[g].items);
    free(c->group);
    free(c->by_send);
    free(c->latest_results);
    free(c->latest_len);
    free(c->send_no);
    free(c->overtaken_send_no);
    free(c->fast_copies);
    free(c->copy);
    block_give(c->recv_buffers, c->recv_bytes);
    if (c->call && c->call->free)
        c->call->free(c);
}
