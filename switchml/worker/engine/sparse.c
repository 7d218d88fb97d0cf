/*
 * The sparse (OmniReduce) mode of _fastengine's core: sparse.py's
 * SparseAllreduce in C, bit-identical to it (tests/test_fastsparse.py).
 *
 * The stream machinery (window, RTT, retransmission, fast retransmit, run_io:
 * stream.c) stays one: it calls into this file only through SPARSE_CALL's
 * operations (struct CallOps, stream.h), for what differs between the dense and
 * the sparse call, each a function of its own:
 *
 *   sparse_init         the call's state (per-slot round counts, columns)
 *   sparse_scan, _map   the pass over the input (grid of local non-zero blocks,
 *                       chunk exponents, next non-zero position per cell), made
 *                       as the exponent rounds and the seed need it
 *   sparse_mode         the header's mode of a slot's current message
 *   sparse_fill         lane records and values of a message
 *   sparse_result_fits  whether a result is the answer to the message in flight
 *   sparse_absorb       a result into the output and the lanes' positions
 *   sparse_has_message  whether a slot has a message left
 *   sparse_finish       +0.0 over the blocks no result wrote (most are zeroed
 *                       already, as their lanes skip them: sparse_absorb)
 *
 * Why C: with frame-sized packets a 64 MiB call at density 0.1 is thousands of
 * rounds per worker, and sparse.py spends many numpy calls on each; here a
 * round is a few lane lookups and the quantisation of the blocks it carries.
 *
 * The arithmetic is quant.py's for blocks scaled by their chunk's exponent
 * (quantize_rows/quantize_blocks, dequantize_rows/dequantize_blocks),
 * including what they do with exponents no honest switch returns: sparse.py
 * takes the switch's exponents unchecked, so this file must do with a forged
 * one exactly what numpy does.
 */

struct SparseState {
    int64_t b;           /* block_elements */
    int64_t blocks;      /* blocks of the tensor (the last may be short) */
    int64_t full_blocks; /* blocks of b values */
    int64_t G;           /* lanes of the call: width * lanes */
    int64_t rows;        /* positions of the longest column */
    uint8_t *grid;       /* cell p*G + L: block p*G + L is non-zero locally (rows + 2 rows) */
    uint32_t *next;      /* cell p*G + L: first position >= p of lane L with a local
                          * non-zero block, or the column's length (rows + 2 rows) */
    uint32_t *column_length; /* per lane */
    uint32_t *pos;       /* per lane: its position (the round in flight's, in data rounds) */
    uint8_t *live;       /* per slot: a lane of it has a position left */
    int64_t *exp_rounds; /* per slot: exponent rounds before its seed round */
    int64_t *slot_chunks;/* per slot: the chunks j, j + W, ... it scales */
    uint8_t *ordinary;   /* per slot: all its chunk exponents are ordinary (quant.py) */
    int16_t *chunk_exp;  /* per chunk: the switch's exponent (WIRE_EXP_ZERO until known) */
    uint8_t *written;    /* per block: the output's block is final */
    int64_t scanned;     /* blocks whose grid cell (and chunk exponent) is known */
    int mapped;          /* every block scanned and next[] built */
};

static void sparse_free(struct SparseState *sp) {
    if (!sp)
        return;
    free(sp->grid);
    free(sp->next);
    free(sp->column_length);
    free(sp->pos);
    free(sp->live);
    free(sp->exp_rounds);
    free(sp->slot_chunks);
    free(sp->ordinary);
    free(sp->chunk_exp);
    free(sp->written);
    free(sp);
}

/* float32 2**clip(shift, -126, 127): quant._powers' table entry (exact). */
static inline float pow2_clipped(int64_t shift) {
    if (shift < -126)
        shift = -126;
    if (shift > 127)
        shift = 127;
    return ldexpf(1.0f, (int)shift);
}

/* quant.ordinary_exponents of one exponent */
static inline int ordinary_exponent(int e, int bits) {
    return (e >= bits - 126 || e == WIRE_EXP_ZERO) && e != WIRE_EXP_NONFINITE;
}

/* One block of b values scaled by its chunk's exponent e, as sparse.py's
 * quantize_rows (ordinary exponents) and quantize_blocks (any) do: for an
 * ordinary e both are round(x * 2**clip(bits - e)); quantize_blocks scales tiny
 * chunks' values with ldexp instead (2**(bits - e) is no float32) and sends
 * zeros for a non-finite chunk.  ``n`` values are read; the rest of the block
 * (the short last block's padding) quantises to 0. */
static void sparse_quantize_block(const float *src, int64_t n, int64_t b, int e, int bits,
                                  int32_t *dst) {
    if (e == WIRE_EXP_NONFINITE) {
        memset(dst, 0, (size_t)b * sizeof(int32_t));
        return;
    }
    if (e < bits - 127 && e != WIRE_EXP_ZERO) {
        for (int64_t i = 0; i < n; i++)
            dst[i] = float_to_int32(round_half_even(ldexpf(src[i], bits - e)));
    } else {
        scale_round_into(src, n, pow2_clipped((int64_t)bits - e), dst);
    }
    if (n < b)
        memset(dst + n, 0, (size_t)(b - n) * sizeof(int32_t));
}

/* dequantize_rows (``ordinary``: the slot's exponents all are) or
 * dequantize_blocks over one block's n sums.  They differ on one exponent only:
 * WIRE_EXP_ZERO, which the rows scale by 2**-126 and the blocks write as 0. */
static void sparse_dequantize_block(const int32_t *src, int64_t n, int e, int bits, int ordinary,
                                    float *dst) {
    if (!ordinary) {
        if (e == WIRE_EXP_NONFINITE) {
            for (int64_t i = 0; i < n; i++)
                dst[i] = NAN;
            return;
        }
        if (e == WIRE_EXP_ZERO) {
            memset(dst, 0, (size_t)n * sizeof(float));
            return;
        }
        if (e < bits - 126) { /* numpy: int32 * Python float in float64, then cast */
            double factor = ldexp(1.0, e - bits);
            for (int64_t i = 0; i < n; i++)
                dst[i] = (float)((double)src[i] * factor);
            return;
        }
    }
    float factor = pow2_clipped((int64_t)e - bits);
    for (int64_t i = 0; i < n; i++)
        dst[i] = (float)src[i] * factor;
}

/* The first of slot j's chunk rows whose exponent the seed carries (the last
 * F; exponent rounds carry those before it). */
static inline int64_t seed_first(const struct SparseState *sp, int j, int F) {
    return sp->slot_chunks[j] > F ? sp->slot_chunks[j] - F : 0;
}

/* SparseAllreduce.__init__'s state, but for the pass over the input, which
 * sparse_scan and sparse_map make as the rounds need it; returns -1 when out of
 * memory. */
static int sparse_init(StreamCore *c, int64_t b) {
    struct SparseState *sp = calloc(1, sizeof(*sp));
    if (!sp)
        return -1;
    c->sp = sp;
    int W = c->width, F = c->lanes;
    sp->b = b;
    sp->blocks = (c->size + b - 1) / b;
    sp->full_blocks = c->size / b;
    sp->G = (int64_t)W * F;
    int64_t G = sp->G;
    sp->rows = G ? (sp->blocks + G - 1) / G : 0;
    size_t cells = (size_t)(sp->rows + 2) * (size_t)(G ? G : 1);
    size_t w = W ? (size_t)W : 1;
    sp->grid = calloc(cells, 1);
    sp->next = malloc(cells * sizeof(uint32_t));
    sp->column_length = calloc(G ? (size_t)G : 1, sizeof(uint32_t));
    sp->pos = calloc(G ? (size_t)G : 1, sizeof(uint32_t));
    sp->live = malloc(w);
    sp->exp_rounds = calloc(w, sizeof(int64_t));
    sp->slot_chunks = calloc(w, sizeof(int64_t));
    sp->ordinary = malloc(w);
    sp->chunk_exp = malloc((c->chunks ? (size_t)c->chunks : 1) * sizeof(int16_t));
    sp->written = calloc(sp->blocks ? (size_t)sp->blocks : 1, 1);
    if (!sp->grid || !sp->next || !sp->column_length || !sp->pos || !sp->live ||
        !sp->exp_rounds || !sp->slot_chunks || !sp->ordinary || !sp->chunk_exp || !sp->written)
        return -1;
    for (int j = 0; j < W; j++) {
        sp->live[j] = 1;
        sp->ordinary[j] = 1;
        sp->slot_chunks[j] = j < c->chunks ? (c->chunks - j + W - 1) / W : 0;
        /* the seed carries the last F exponents; rounds before it the others,
         * k a round */
        int64_t first = seed_first(sp, j, F);
        sp->exp_rounds[j] = c->is_float ? (first + c->k - 1) / c->k : 0;
    }
    for (int64_t chunk = 0; chunk < c->chunks; chunk++)
        sp->chunk_exp[chunk] = WIRE_EXP_ZERO;
    for (int64_t lane = 0; lane < G; lane++)
        sp->column_length[lane] =
            (uint32_t)(sp->blocks > lane ? (sp->blocks - lane + G - 1) / G : 0);
    return 0;
}

/* SparseAllreduce._exp_round_chunks: the rows [*from, *to) of slot j whose
 * chunk exponents round m (an exponent round, or the seed) carries. */
static void exp_round_rows(StreamCore *c, int j, int64_t m, int64_t *from, int64_t *to) {
    struct SparseState *sp = c->sp;
    int64_t first = seed_first(sp, j, c->lanes);
    if (m == sp->exp_rounds[j]) {
        *from = first;
        *to = sp->slot_chunks[j];
    } else {
        *from = m * c->k;
        *to = (m + 1) * c->k < first ? (m + 1) * c->k : first;
    }
}

/* The pass over the input that sparse.py makes up front, made as the messages
 * need it: blocks up to ``upto`` (rounded up to a whole chunk) get their grid
 * cell, and their chunks (float32) their local exponent.  The exponent rounds
 * read the chunks in order, a batch a round, so the pass goes on while they
 * travel instead of before the first send (where the links waited on it). */
static void sparse_scan(StreamCore *c, int64_t upto) {
    struct SparseState *sp = c->sp;
    int64_t F = c->lanes;
    upto = (upto + F - 1) / F * F;
    if (upto > sp->blocks)
        upto = sp->blocks;
    const int32_t *bits = c->src;
    int64_t b = sp->b, size = c->size;
    /* Per block the peak of its values' bits with the sign cleared (float32:
     * they grow with the magnitude, NaNs above inf; int32: any bit), the block
     * non-zero when it is (NaN counts, -0.0 does not); for float32 the chunk's
     * exponent is its blocks' greatest peak's, as quant.chunk_exponents would
     * compute.  Scans start on a chunk's first block. */
    int32_t chunk_peak = 0;
    for (int64_t block = sp->scanned; block < upto; block++) {
        int64_t first = block * b, last = first + b < size ? first + b : size;
        int32_t peak = 0;
        if (c->is_float) {
            peak = magnitude_peak(bits + first, last - first);
            chunk_peak = peak > chunk_peak ? peak : chunk_peak;
            if ((block + 1) % F == 0 || block + 1 == sp->blocks) {
                c->local_exp[block / F] = exponent_of_peak(chunk_peak);
                chunk_peak = 0;
            }
        } else {
            for (int64_t i = first; i < last; i++)
                peak |= bits[i];
        }
        sp->grid[block] = peak != 0;
    }
    if (upto > sp->scanned)
        sp->scanned = upto;
}

/* Every block scanned and next[] built: what the seed and data rounds read. */
static void sparse_map(StreamCore *c) {
    struct SparseState *sp = c->sp;
    if (sp->mapped)
        return;
    sparse_scan(c, sp->blocks);
    int64_t G = sp->G;
    /* From the last row up: the rows past every column's end find none. */
    for (int64_t p = sp->rows + 1; p >= 0; p--) {
        const uint8_t *row = sp->grid + p * G;
        uint32_t *next = sp->next + p * G;
        if (p == sp->rows + 1) {
            for (int64_t lane = 0; lane < G; lane++)
                next[lane] = sp->column_length[lane];
            continue;
        }
        for (int64_t lane = 0; lane < G; lane++)
            next[lane] = row[lane] ? (uint32_t)p : next[lane + G];
    }
    sp->mapped = 1;
}

static inline int sparse_mode(StreamCore *c, int j) {
    int64_t r = c->round[j], seed = c->sp->exp_rounds[j];
    if (r < seed)
        return WIRE_MODE_MAX; /* an exponent round: values the switch maxes */
    return WIRE_MODE_SPARSE | (r == seed ? WIRE_MODE_SEED : 0);
}

/* SparseAllreduce._fill: records at ``lanes`` (the packet's table), values after
 * them; returns the value count. */
static int64_t sparse_fill(StreamCore *c, int j, int64_t m, uint8_t *lanes) {
    struct SparseState *sp = c->sp;
    int F = c->lanes;
    int64_t b = sp->b, G = sp->G, W = c->width, seed = sp->exp_rounds[j];
    int64_t first_lane = (int64_t)j * F;
    if (m <= seed) {
        for (int i = 0; i < F; i++) { /* blank records: exp says "zero" */
            uint8_t *record = lanes + (size_t)i * WIRE_LANE_SIZE;
            memset(record, 0, WIRE_LANE_SIZE);
            put_u16(record + 8, (uint16_t)WIRE_EXP_ZERO);
        }
        int64_t from = 0, to = 0;
        if (c->is_float)
            exp_round_rows(c, j, m, &from, &to);
        if (m < seed) { /* local exponents as values */
            int32_t *values = (int32_t *)(lanes + (size_t)F * WIRE_LANE_SIZE);
            for (int64_t row = from; row < to; row++) {
                int64_t chunk = j + row * W;
                sparse_scan(c, (chunk + 1) * F);
                values[row - from] = c->local_exp[chunk];
            }
            return to - from;
        }
        for (int64_t row = from; row < to; row++) { /* the seed's: in its lane records */
            int64_t chunk = j + row * W;
            sparse_scan(c, (chunk + 1) * F);
            put_u16(lanes + (size_t)(row - from) * WIRE_LANE_SIZE + 8, (uint16_t)c->local_exp[chunk]);
        }
        sparse_map(c); /* the first next pointers: the whole map now */
        for (int i = 0; i < F; i++) {
            uint8_t *record = lanes + (size_t)i * WIRE_LANE_SIZE;
            put_u32(record, WIRE_POS_END);
            put_u32(record + 4, sp->next[first_lane + i]);
        }
        return 0;
    }
    sparse_map(c); /* (done at the seed already) */
    /* A data round rewrites all but "exp": it carries the seed's, which the
     * switch maxes and the workers ignore. */
    int32_t *values = (int32_t *)(lanes + (size_t)F * WIRE_LANE_SIZE);
    int64_t sending = 0;
    for (int i = 0; i < F; i++) {
        uint8_t *record = lanes + (size_t)i * WIRE_LANE_SIZE;
        uint32_t pos = sp->pos[first_lane + i];
        int64_t cell = (int64_t)pos * G + first_lane + i; /* the block at the lane's position */
        int has = sp->grid[cell];
        put_u32(record, pos);
        put_u32(record + 4, sp->next[cell + G]);
        put_u16(record + 10, (uint16_t)has);
        if (!has)
            continue;
        /* a non-zero block is one of the tensor's: cell < blocks */
        int64_t n = cell < sp->full_blocks ? b : c->size - sp->full_blocks * b;
        int32_t *dst = values + sending * b;
        if (c->is_float) {
            sparse_quantize_block((const float *)c->src + cell * b, n, b,
                                  sp->chunk_exp[cell / F], c->bits, dst);
        } else {
            memcpy(dst, (const int32_t *)c->src + cell * b, (size_t)n * sizeof(int32_t));
            if (n < b)
                memset(dst + n, 0, (size_t)(b - n) * sizeof(int32_t));
        }
        sending++;
    }
    c->counters[COUNTER_SPARSE_BLOCKS_SENT] += sending;
    return sending * b;
}

/* SparseAllreduce._result_fits (mode included); the header is valid and of
 * this slot's message, its lane count the call's. */
static int sparse_result_fits(StreamCore *c, int j, const uint8_t *data, int mode, int64_t count) {
    if (mode != sparse_mode(c, j))
        return 0;
    struct SparseState *sp = c->sp;
    int F = c->lanes;
    const uint8_t *records = data + WIRE_HEADER_SIZE;
    if (c->round[j] < sp->exp_rounds[j]) { /* the maxed exponents, as sent */
        int64_t from, to;
        exp_round_rows(c, j, c->round[j], &from, &to);
        return count == to - from;
    }
    int64_t present = 0;
    for (int i = 0; i < F; i++)
        present += get_u16(records + (size_t)i * WIRE_LANE_SIZE + 10) & WIRE_FLAG_BLOCK;
    if (count != present * sp->b)
        return 0;
    if (c->round[j] == sp->exp_rounds[j])
        return count == 0;
    /* the contribution in flight is still in the slot's packet buffer */
    const uint8_t *ours = c->packets + (size_t)j * c->packet_size + WIRE_HEADER_SIZE;
    for (int i = 0; i < F; i++) {
        const uint8_t *record = records + (size_t)i * WIRE_LANE_SIZE;
        uint32_t pos = get_u32(record), nxt = get_u32(record + 4);
        uint32_t length = sp->column_length[(int64_t)j * F + i];
        if (pos != get_u32(ours + (size_t)i * WIRE_LANE_SIZE))
            return 0;
        /* every live lane moved on, none flagged past its column's end: else
         * the call would be held in place, or written past the tensor */
        int flagged = get_u16(record + 10) & WIRE_FLAG_BLOCK;
        if (pos < length ? nxt <= pos : (nxt < length || flagged))
            return 0;
    }
    return 1;
}

/* SparseAllreduce._fill_nonfinite_chunks of one chunk: left as it was, listed
 * for the follow-up exchange (worker/engine/nonfinite.py). */
static void sparse_fill_nonfinite_chunk(StreamCore *c, int64_t chunk) {
    struct SparseState *sp = c->sp;
    c->nonfinite[chunk] = 1;
    int64_t last_block = (chunk + 1) * c->lanes < sp->blocks ? (chunk + 1) * c->lanes : sp->blocks;
    for (int64_t block = chunk * c->lanes; block < last_block; block++)
        sp->written[block] = 1;
}

/* +0.0 over a block no result will write (unless written, or left for the
 * follow-up exchange), as sparse_finish does. */
static void sparse_zero_block(StreamCore *c, int64_t block) {
    struct SparseState *sp = c->sp;
    if (block >= sp->blocks || sp->written[block])
        return;
    int64_t n = block < sp->full_blocks ? sp->b : c->size - sp->full_blocks * sp->b;
    memset((int32_t *)c->out + block * sp->b, 0, (size_t)n * sizeof(int32_t));
    sp->written[block] = 1;
}

/* SparseAllreduce._absorb */
static void sparse_absorb(StreamCore *c, int j, int64_t m, const uint8_t *data) {
    struct SparseState *sp = c->sp;
    int F = c->lanes;
    int64_t b = sp->b, G = sp->G, W = c->width, seed = sp->exp_rounds[j];
    int64_t first_lane = (int64_t)j * F;
    const uint8_t *records = data + WIRE_HEADER_SIZE;
    if (m <= seed && c->is_float) {
        int64_t from, to;
        exp_round_rows(c, j, m, &from, &to);
        const uint8_t *maxed = records + (size_t)F * WIRE_LANE_SIZE; /* an exponent round's */
        for (int64_t row = from; row < to; row++) {
            int64_t chunk = j + row * W, i = row - from;
            int e = m < seed ? (int16_t)get_u32(maxed + 4 * i) /* as numpy's astype */
                             : (int16_t)get_u16(records + (size_t)i * WIRE_LANE_SIZE + 8);
            sp->chunk_exp[chunk] = (int16_t)e;
            if (!ordinary_exponent(e, c->bits))
                sp->ordinary[j] = 0;
            if (e == WIRE_EXP_NONFINITE)
                sparse_fill_nonfinite_chunk(c, chunk);
        }
    }
    if (m < seed)
        return;
    if (m > seed) {
        const int32_t *sums = (const int32_t *)(records + (size_t)F * WIRE_LANE_SIZE);
        int64_t taken = 0;
        for (int i = 0; i < F; i++) {
            if (!(get_u16(records + (size_t)i * WIRE_LANE_SIZE + 10) & WIRE_FLAG_BLOCK))
                continue;
            int64_t block = (int64_t)sp->pos[first_lane + i] * G + first_lane + i;
            const int32_t *src = sums + taken * b;
            taken++;
            if (block >= sp->blocks) /* cannot be: sparse_result_fits refuses it */
                continue;
            if (c->is_float && sp->chunk_exp[block / F] == WIRE_EXP_NONFINITE)
                continue; /* its chunk is left for the follow-up */
            int64_t n = block < sp->full_blocks ? b : c->size - sp->full_blocks * b;
            if (c->is_float)
                sparse_dequantize_block(src, n, sp->chunk_exp[block / F], c->bits,
                                        sp->ordinary[j], (float *)c->out + block * b);
            else
                memcpy((int32_t *)c->out + block * b, src, (size_t)n * sizeof(int32_t));
            sp->written[block] = 1;
        }
        c->counters[COUNTER_SPARSE_BLOCKS_RECEIVED] += taken;
    }
    /* A position past the column's end would index past the grid: clamp it. */
    int live = 0;
    for (int i = 0; i < F; i++) {
        uint32_t nxt = get_u32(records + (size_t)i * WIRE_LANE_SIZE + 4);
        uint32_t length = sp->column_length[first_lane + i];
        uint32_t to = nxt < length ? nxt : length;
        /* The positions the lane skips hold no rank's block: their sums are
         * +0.0 now, written while results still come (not by sparse_finish,
         * after the last, a pass over most of the output with the links idle).
         * This rank sends nothing from them any more, so in place is safe. */
        int64_t from = m == seed ? 0 : (int64_t)sp->pos[first_lane + i] + 1;
        for (int64_t row = from; row < (int64_t)to; row++)
            sparse_zero_block(c, row * G + first_lane + i);
        sp->pos[first_lane + i] = to;
        live |= nxt < length;
    }
    sp->live[j] = (uint8_t)live;
}

static inline int sparse_has_message(StreamCore *c, int j) {
    /* exponent rounds and the seed always run */
    return c->round[j] <= c->sp->exp_rounds[j] || c->sp->live[j];
}

/* SparseAllreduce._finish: blocks no result wrote are zero on every worker, their
 * sum +0.0 (the input may hold -0.0 when it is the output). */
static void sparse_finish(StreamCore *c) {
    for (int64_t block = 0; block < c->sp->blocks; block++) /* most are written by now */
        sparse_zero_block(c, block);
}

static void sparse_absorb_call(StreamCore *c, int j, int64_t m, const uint8_t *data,
                               int64_t count) {
    sparse_absorb(c, j, m, data);
}

static void sparse_free_call(StreamCore *c) {
    sparse_free(c->sp);
    c->sp = NULL;
}

static const struct CallOps SPARSE_CALL = {
    .start = sparse_init, .fill = sparse_fill, .mode = sparse_mode,
    .call_flag = WIRE_CALL_SPARSE, .has_message = sparse_has_message,
    .result_fits = sparse_result_fits, .absorb = sparse_absorb_call, .finish = sparse_finish,
    .free = sparse_free_call,
};
