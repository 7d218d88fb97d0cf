/* The call's socket loop: recvmmsg batches into the stream, its outbox out with
 * sendmmsg as runs of UDP GSO segments, timers in between.  No Python: the
 * binding calls it with the GIL released. */

/* UDP GSO: a run of equal-sized datagrams to the switch leaves in one send, cut
 * into those datagrams by the kernel, as the switch sends results (udp_gso.h). */
#include "../udp_gso.h"

/* The kernel refused a GSO send once (an old kernel, a device without it): the
 * worker's process sends one datagram a message from then on. */
static int gso_refused = 0;
/* SWITCHML_WORKER_GSO=0 turns it off (bench/ compares); read once at import. */
static int gso_wanted = 1;


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
static void flush_outbox(StreamCore *c, int fd, struct sockaddr_in *dst) {
    struct mmsghdr msgs[64];
    struct iovec iov[1024];
    union {
        char buf[GSO_CONTROL_SIZE];
        struct cmsghdr align;
    } control[64];
    int segments[64];
    ptrdiff_t done = 0;
    int waits = 0;
    while (done < c->outbox_len) {
        int n = 0, v = 0;
        ptrdiff_t next = done;
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
                     gso_run_takes(segs, bytes, size, c->outbox[next].len));
            memset(&msgs[n].msg_hdr, 0, sizeof(struct msghdr));
            msgs[n].msg_hdr.msg_name = dst;
            msgs[n].msg_hdr.msg_namelen = sizeof(*dst);
            msgs[n].msg_hdr.msg_iov = first;
            msgs[n].msg_hdr.msg_iovlen = (size_t)segs;
            segments[n] = segs;
            if (segs > 1)
                gso_mark(&msgs[n].msg_hdr, control[n].buf, (uint16_t)size);
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


/* Drive the call on the non-blocking UDP socket `fd` towards `dst` for up to
 * `slice` seconds: IO_DONE, IO_STALLED, IO_CONTROL (control_fd readable) or
 * IO_SLICE, or -1 out of memory.  Called without the GIL. */
static int stream_run_io(StreamCore *c, int fd, struct sockaddr_in dst, int control_fd,
                         double slice) {
    /* Longer datagrams cannot be results of ours: MSG_TRUNC gives their real
     * length, and receive() reads no more than their header to drop them. */
    size_t buffer_size = c->packet_size + 64;
    if (!c->recv_buffers) {
        c->recv_buffers = malloc(buffer_size * RECV_BATCH);
        if (!c->recv_buffers)
            return -1;
    }
    int status = IO_SLICE, oom = 0;
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
    return oom ? -1 : status;
}
