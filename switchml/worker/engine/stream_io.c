/* The call's socket loop: recvmmsg batches into the stream, its outbox out with
 * sendmmsg as runs of UDP GSO segments, timers in between.  No Python: the
 * binding calls it with the GIL released. */

/* UDP GSO: a run of equal-sized datagrams to the switch leaves in one send, cut
 * into those datagrams by the kernel, by the sender the switch uses for its
 * results (udp_batch.h). */
#include "../../udp_batch.h"

/* The kernel refused a GSO send once (an old kernel, a device without it): the
 * worker's process sends one datagram a message from then on. */
static int gso_refused = 0;
/* SWITCHML_WORKER_GSO=0 turns it off (bench/ compares); read once at import. */
static int gso_wanted = 1;

/* UDP GRO: the switch sends a worker's results as GSO runs, and with UDP_GRO on
 * the socket a run that arrives whole (loopback, veths, a NIC that aggregates)
 * is one receive, cut here into its datagrams by the segment size the kernel
 * reports, instead of one skb and one copy-out a datagram.  On only while run_io
 * runs: the Python engine reads the same socket a datagram at a time.
 * SWITCHML_WORKER_GRO=0 turns it off (bench/ compares); read once at import. */
static int gro_wanted = 1;
/* What one receive holds with GRO on: a whole run (at most 64 KiB of payload). */
#define GRO_BUFFER 65536
#define GRO_BATCH 16


/* ------------------------------------------------------------ the socket driver */
static double monotonic_now(void) { /* time.monotonic()'s clock */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

enum { IO_DONE = 0, IO_STALLED = 1, IO_CONTROL = 2, IO_SLICE = 3 };
/* stream_run_io's failures: out of memory; a datagram larger than the path takes
 * (EMSGSIZE: driver.py's send_waiting raises it, as no retransmission would
 * get it through). */
enum { IO_NO_MEMORY = -1, IO_TOO_BIG = -2 };

typedef struct {
    StreamCore *core;
    int socket_waits; /* full socket buffer waits of this flush */
    int too_big;      /* a datagram was larger than the path allows */
} send_wait;

/* This host's queue toward the network refused a datagram (ENOBUFS, which the
 * socket's IP_RECVERR reports: client.py sets it): the window hears of it once
 * (send_refused), and the datagram waits for room, UDP_SEND_PAUSE_NS at a time,
 * for UDP_SEND_PATIENCE_NS at most, as TCP's segments wait in its socket.  A full socket
 * buffer (EAGAIN) waits a little (1 ms, ten times a flush at most).  Then what is
 * left counts as lost: the retransmission timer recovers it. */
static int wait_for_socket(void *ctx, int fd, int error, int tries) {
    send_wait *w = ctx;
    if (error == ENOBUFS) {
        if (tries == 1) /* once a datagram */
            send_refused(w->core, monotonic_now());
        if ((long)(tries - 1) * UDP_SEND_PAUSE_NS >= UDP_SEND_PATIENCE_NS)
            return 0;
        struct timespec pause = {0, UDP_SEND_PAUSE_NS};
        nanosleep(&pause, NULL);
        return 1;
    }
    if (w->socket_waits++ >= 10)
        return 0;
    struct pollfd p = {fd, POLLOUT, 0};
    poll(&p, 1, 1);
    return 1;
}

static void lost_to_timers(void *ctx, uint32_t datagrams, int error) {
    (void)ctx, (void)datagrams, (void)error; /* the retransmission timer resends them */
}

/* A datagram larger than the path takes (its MTU fell under the job's packets):
 * noted, for the call to fail with EMSGSIZE, as the Python engine's does. */
static int path_too_small(void *ctx, int fd, const struct msghdr *one) {
    (void)fd, (void)one;
    ((send_wait *)ctx)->too_big = 1;
    return 0;
}

/* Send the outbox in batches of udp_batch.h: runs of one size as UDP GSO
 * messages (unless `gso` is 0: the switch asked for datagrams apart), the same
 * datagrams in the same order.  1 where a datagram was larger than the path. */
static int flush_outbox(StreamCore *c, int fd, struct sockaddr_in *dst, int gso) {
    struct mmsghdr msgs[64];
    struct sockaddr_in addrs[64];
    udp_control control[64];
    uint32_t segments[64];
    struct iovec iov[1024];
    send_wait waits = {c, 0, 0};
    const udp_policy policy = {wait_for_socket, path_too_small, lost_to_timers, &waits};
    udp_batch batch = {.msgs = msgs, .addrs = addrs, .control = control,
                       .segments = segments, .iov = iov, .max_messages = 64,
                       .max_datagrams = 1024};
    uint64_t bytes = 0;
    udp_batch_start(&batch, gso && gso_wanted && !gso_refused);
    for (ptrdiff_t i = 0; i < c->outbox_len; i++) {
        if (!udp_batch_add(&batch, dst, outbox_bytes(c, i), c->outbox[i].len)) {
            udp_batch_send(&batch, fd, 0, &policy, &gso_refused, &bytes);
            udp_batch_start(&batch, gso && gso_wanted && !gso_refused);
            udp_batch_add(&batch, dst, outbox_bytes(c, i), c->outbox[i].len);
        }
    }
    udp_batch_send(&batch, fd, 0, &policy, &gso_refused, &bytes);
    c->counters[COUNTER_BYTES_SENT] += bytes;
    c->outbox_len = 0;
    return waits.too_big;
}


/* One received message: a datagram, or with UDP GRO a run of them, each
 * `segment` bytes (the cmsg's) but the last.  A datagram past the buffer (MSG_TRUNC
 * gave its real length) goes to receive() with that length, which drops it. */
static int receive_run(StreamCore *c, struct mmsghdr *msg, const uint8_t *data,
                       size_t capacity) {
    size_t len = msg->msg_len, segment = udp_gro_segment(&msg->msg_hdr, len);
    size_t held = len < capacity ? len : capacity;
    /* each datagram of a run; an empty one too, which receive() counts */
    for (size_t at = 0, first = 1; first || at < len; first = 0, at += segment) {
        size_t one = len - at < segment ? len - at : segment;
        c->counters[COUNTER_BYTES_RECEIVED] += one;
        if (at >= held) /* cut off: nothing of it to read */
            c->counters[COUNTER_MALFORMED]++;
        else if (receive(c, data + at, (ptrdiff_t)one, monotonic_now()) < 0)
            return -1;
    }
    return 0;
}


/* Drive the call on the non-blocking UDP socket `fd` towards `dst` for up to
 * `slice` seconds: IO_DONE, IO_STALLED, IO_CONTROL (control_fd readable) or
 * IO_SLICE; IO_NO_MEMORY, or IO_TOO_BIG where a datagram was larger than the path.  `gso`: whether the switch takes GSO runs.
 * Called without the GIL. */
static int stream_run_io(StreamCore *c, int fd, struct sockaddr_in dst, int control_fd,
                         double slice, int gso) {
    /* Longer datagrams cannot be results of ours: MSG_TRUNC gives their real
     * length, and receive() reads no more than their header to drop them. */
    size_t buffer_size = c->packet_size + 64;
    if (!c->recv_buffers) { /* before GRO goes on: nothing to undo where it fails */
        size_t plain = (c->packet_size + 64) * RECV_BATCH;
        size_t grouped = (GRO_BUFFER > c->packet_size + 64 ? GRO_BUFFER : c->packet_size + 64)
                         * GRO_BATCH;
        c->recv_buffers = block_take(plain > grouped ? plain : grouped, &c->recv_bytes);
        if (!c->recv_buffers)
            return IO_NO_MEMORY;
    }
    int on = 1, gro = gro_wanted && setsockopt(fd, SOL_UDP, UDP_GRO, &on, sizeof(on)) == 0;
    int batch = RECV_BATCH;
    if (gro) {
        buffer_size = GRO_BUFFER > buffer_size ? GRO_BUFFER : buffer_size;
        batch = GRO_BATCH;
    }
    int status = IO_SLICE, oom = 0;
    double until = monotonic_now() + slice;
    struct mmsghdr msgs[RECV_BATCH];
    struct iovec iov[RECV_BATCH];
    char control[GRO_BATCH][CMSG_SPACE(sizeof(int))];
    int too_big = flush_outbox(c, fd, &dst, gso);
    while (!too_big) {
        if (c->remaining == 0) {
            status = IO_DONE;
            break;
        }
        for (int i = 0; i < batch; i++) {
            iov[i].iov_base = c->recv_buffers + (size_t)i * buffer_size;
            iov[i].iov_len = buffer_size;
            memset(&msgs[i].msg_hdr, 0, sizeof(struct msghdr));
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            if (gro) {
                msgs[i].msg_hdr.msg_control = control[i];
                msgs[i].msg_hdr.msg_controllen = sizeof(control[i]);
            }
        }
        int received = recvmmsg(fd, msgs, (unsigned)batch, MSG_DONTWAIT | MSG_TRUNC, NULL);
        if (received < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                udp_drain_error_queue(fd); /* an ICMP error queued: control tells us */
            received = 0;
        }
        for (int i = 0; i < received; i++) { /* after the last result: stale, as in Python */
            if (receive_run(c, &msgs[i], iov[i].iov_base, buffer_size) < 0)
                oom = 1;
        }
        too_big = flush_outbox(c, fd, &dst, gso);
        if (oom || too_big)
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
            if ((too_big = flush_outbox(c, fd, &dst, gso)))
                break;
            timer = get_timer(c);
        }
        if (now >= until) {
            status = IO_SLICE;
            break;
        }
        if (received == batch)
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
    if (gro) {
        on = 0;
        setsockopt(fd, SOL_UDP, UDP_GRO, &on, sizeof(on));
    }
    return oom ? IO_NO_MEMORY : too_big ? IO_TOO_BIG : status;
}
