/* dense.py's DenseAllreduce in C: the dense call's operations on the stream
 * (stream.c), SwitchML's chunk a slot message with one exponent a chunk. */

/* The local exponent of a dense float chunk, read when the message that
 * announces it is first built, not in a pass over the whole input before the
 * first send: that pass would keep the links idle while it reads the whole
 * input.  The input is not written before then, even in place: chunk c
 * is announced before its values go out, and its sum comes after. */
static int16_t local_exponent(StreamCore *c, int64_t chunk) {
    int16_t e = c->local_exp[chunk];
    if (e == EXP_UNREAD) {
        e = chunk_exponent((const float *)c->src + chunk * c->k, chunk_count(c, chunk));
        c->local_exp[chunk] = e;
    }
    return e;
}

/* DenseAllreduce._fill: records at ``lanes`` (the packet's table), values after
 * them; returns the word count. */
static int64_t dense_fill(StreamCore *c, int j, int64_t m, uint8_t *lanes) {
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
            quantize16_into((const float *)c->src + chunk * c->k, count, c->global_exp[j],
                            c->bits, halves, c->wide);
            if (count % 2)
                halves[count] = 0; /* the last word's idle half */
        } else if (c->is_float) {
            quantize_into((const float *)c->src + chunk * c->k, count, c->global_exp[j],
                          c->bits, (int32_t *)values);
        } else {
            memcpy(values, (const int32_t *)c->src + chunk * c->k, (size_t)count * 4);
        }
    }
    return (count + c->per_word - 1) / c->per_word; /* words */
}

/* DenseAllreduce._absorb */
static void dense_absorb(StreamCore *c, int j, int64_t m, const uint8_t *data, int64_t count) {
    int64_t chunk = j + (m - c->lag) * c->width;
    if (count && c->is_float && c->global_exp[j] == WIRE_EXP_NONFINITE) {
        c->nonfinite[chunk] = 1; /* untouched: the input stays for the follow-up */
    } else if (count && c->per_word == 2) { /* quant.dequantize16_into */
        const uint16_t *halves = (const uint16_t *)(data + WIRE_HEADER_SIZE + WIRE_LANE_SIZE * c->lanes);
        int64_t n = chunk_count(c, chunk);
        int32_t bias = (int32_t)c->world_size << c->bits;
        for (int64_t i = 0; i < n; i++)
            c->wide[i] = (int32_t)halves[i] - bias;
        dequantize_into(c->wide, n, c->global_exp[j], c->bits, (float *)c->out + chunk * c->k);
    } else if (count) {
        const int32_t *values = (const int32_t *)(data + WIRE_HEADER_SIZE + WIRE_LANE_SIZE * c->lanes);
        if (c->is_float) {
            dequantize_into(values, count, c->global_exp[j], c->bits,
                            (float *)c->out + chunk * c->k);
        } else {
            memcpy((int32_t *)c->out + chunk * c->k, values, (size_t)count * 4);
        }
    }
    c->global_exp[j] = (int16_t)get_u16(data + WIRE_HEADER_SIZE + 8);
}


/* DenseAllreduce._result_fits: the count of slot j's chunk, dense mode, and an
 * exponent a float sum can have */
static int dense_result_fits(StreamCore *c, int j, const uint8_t *data, int mode, int64_t count) {
    int64_t m = c->round[j];
    if (mode != 0 ||
        count != (chunk_count(c, j + (m - c->lag) * c->width) + c->per_word - 1) / c->per_word)
        return 0;
    int exponent = (int16_t)get_u16(data + WIRE_HEADER_SIZE + 8);
    return !c->is_float || (exponent >= LEAST_EXPONENT && exponent <= GREATEST_EXPONENT) ||
           exponent == WIRE_EXP_ZERO || exponent == WIRE_EXP_NONFINITE;
}

/* DenseAllreduce._has_message */
static int dense_has_message(StreamCore *c, int j) { return c->round[j] < c->messages[j]; }

static int dense_mode(StreamCore *c, int j) { return 0; }

/* local exponents of float chunks are read as their messages announce them */
static int dense_start(StreamCore *c, int64_t block_elements) {
    if (c->is_float)
        for (int64_t chunk = 0; chunk < c->chunks; chunk++)
            c->local_exp[chunk] = EXP_UNREAD;
    return 0;
}

static void dense_finish(StreamCore *c) {}

static const struct CallOps DENSE_CALL = {
    .start = dense_start, .fill = dense_fill, .mode = dense_mode, .call_flag = 0,
    .has_message = dense_has_message, .result_fits = dense_result_fits,
    .absorb = dense_absorb, .finish = dense_finish, .free = NULL,
};
