/* recovery.py in C: RttEstimator and CongestionWindow on a call's copy of its
 * Membership's state (the binding reads it and gives it back by recovery.py's field
 * names). */

static double rto(StreamCore *c, int backoff) {
    double base = c->rto_value > c->min_rto ? c->rto_value : c->min_rto;
    double value = base * ldexp(1.0, backoff + c->kept_backoff);
    return value < c->max_rto ? value : c->max_rto;
}

/* RttEstimator.on_premature_timeout */
static void rtt_on_premature_timeout(StreamCore *c, double sent_at, double now) {
    if (sent_at >= c->kept_since) {
        if (c->kept_backoff < MAX_KEPT_BACKOFF)
            c->kept_backoff++;
        c->kept_since = now;
    }
}

static void rtt_sample(StreamCore *c, double rtt, double sent_at) {
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

static int64_t window_allowed(StreamCore *c) {
    /* int(cwnd): cwnd is at least 1 and at most the limit, a small int */
    int64_t allowed = (int64_t)c->cwnd;
    if (allowed > c->width)
        allowed = c->width;
    return allowed < 1 ? 1 : allowed;
}

static void window_on_result(StreamCore *c, int window_limited) {
    if (!window_limited)
        return;
    if (c->cwnd < c->ssthresh)
        c->cwnd += 1.0;
    else
        c->cwnd += 1.0 / c->cwnd;
    if (c->cwnd > (double)c->window_limit)
        c->cwnd = (double)c->window_limit;
}

static void window_on_rtt_sample(StreamCore *c, double rtt, double sent_at, double now) {
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

static int window_on_timeout(StreamCore *c, double sent_at, double now, int retries) {
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

static int window_on_local_refusal(StreamCore *c, double now, double rtt) {
    if (now - c->last_decrease < rtt)
        return 0;
    c->has_undo = 0;
    c->ssthresh = c->cwnd / 2 > 1.0 ? c->cwnd / 2 : 1.0;
    c->cwnd = c->ssthresh;
    c->last_decrease = now;
    return 1;
}

static void window_undo_decrease(StreamCore *c, double decreased_at) {
    if (c->has_undo && c->undo_at == decreased_at) {
        if (c->undo_cwnd > c->cwnd)
            c->cwnd = c->undo_cwnd;
        if (c->undo_ssthresh > c->ssthresh)
            c->ssthresh = c->undo_ssthresh;
        c->has_undo = 0;
    }
}

