/* The switch's socket loop in C: recvmmsg a batch of datagrams, run each through
 * the pipeline (fastpath_core.c), send the results with sendmmsg, those to one
 * worker as UDP GSO segments.  No Python here: _fastpath.c calls fp_io_drain
 * with the GIL released. */
#define _GNU_SOURCE
#include "fastpath_io.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>


/* Point every buffer of the loop into one block starting at `base` (0: only
 * measure it); returns its size.  Each buffer is 16-byte aligned. */
static size_t lay_out(fp_io *io, uintptr_t base)
{
    uintptr_t at = base;
#define CARVE(field, n)                                                                   \
    (io->field = (void *)at, at += ((size_t)(n) * sizeof *io->field + 15) & ~(size_t)15)
    CARVE(recv_buffers, (size_t)FP_RECV_BATCH * FP_RECV_BUFFER);
    CARVE(recv_msgs, FP_RECV_BATCH);
    CARVE(recv_iov, FP_RECV_BATCH);
    CARVE(recv_addrs, FP_RECV_BATCH);
    CARVE(send_queue, FP_SEND_QUEUE);
    CARVE(order, FP_SEND_QUEUE);
    CARVE(batch.msgs, FP_SEND_QUEUE);
    CARVE(batch.addrs, FP_SEND_QUEUE);
    CARVE(batch.control, FP_SEND_QUEUE);
    CARVE(batch.segments, FP_SEND_QUEUE);
    CARVE(batch.iov, FP_SEND_QUEUE);
#undef CARVE
    return (size_t)(at - base);
}

int fp_io_init(fp_io *io, fp_core *core)
{
    memset(io, 0, sizeof *io);
    io->core = core;
    io->block = calloc(1, lay_out(io, 0) + 16);
    if (!io->block)
        return -1;
    lay_out(io, ((uintptr_t)io->block + 15) & ~(uintptr_t)15);
    io->batch.max_messages = io->batch.max_datagrams = FP_SEND_QUEUE;
    return 0;
}

void fp_io_free(fp_io *io)
{
    free(io->block);
    memset(io, 0, sizeof *io);
}

/* Results to one destination of the same size leave in one sendmsg as UDP GSO
 * segments (udp_batch.h): sorted by destination, stably, so that a worker's
 * results stay in the order the pipeline made them. */
static int sort_by_destination(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b; /* (key, queue index) */
    return x[0] != y[0] ? (x[0] < y[0] ? -1 : 1) : (x[1] < y[1] ? -1 : x[1] > y[1]);
}

/* A send this host's queue toward the network refused (ENOBUFS: a switch server
 * sending faster than its link, as IP_RECVERR says) waits for the queue to drain,
 * as a switch's port buffer holds what its port cannot send yet, instead of losing
 * the results; EAGAIN (the socket's own buffer) is a loss, as with sendto. */
static int wait_for_queue(void *ctx, int fd, int error, int tries)
{
    fp_io *io = ctx;
    (void)fd;
    if (error != ENOBUFS || (long)(tries - 1) * UDP_SEND_PAUSE_NS >= UDP_SEND_PATIENCE_NS)
        return 0;
    struct timespec pause = {0, UDP_SEND_PAUSE_NS};
    nanosleep(&pause, NULL);
    fp_count(&io->core->counters, C_SEND_WAITS, 1);
    return 1;
}

/* A datagram larger than the path MTU, which the socket's IP_PMTUDISC_DO refuses:
 * a result of a job whose workers did not ask for frame-sized packets.  It goes
 * out fragmented, counted (send_fragmented), so that such a job still works; with
 * frame-sized packets this never runs. */
static int send_fragmented(void *ctx, int fd, const struct msghdr *one)
{
    fp_io *io = ctx;
    int dont = IP_PMTUDISC_DONT, do_ = IP_PMTUDISC_DO;
    ssize_t n;
    setsockopt(fd, IPPROTO_IP, IP_MTU_DISCOVER, &dont, sizeof dont);
    do
        n = sendto(fd, one->msg_iov[0].iov_base, one->msg_iov[0].iov_len, MSG_DONTWAIT,
                   one->msg_name, one->msg_namelen);
    while (n < 0 && errno == EINTR);
    fp_count(&io->core->counters, n < 0 ? C_SEND_ERRORS : C_SEND_FRAGMENTED, 1);
    setsockopt(fd, IPPROTO_IP, IP_MTU_DISCOVER, &do_, sizeof do_);
    udp_drain_error_queue(fd); /* the refusal that brought us here queued one */
    return n >= 0;
}

static void count_lost(void *ctx, uint32_t datagrams, int error)
{
    fp_io *io = ctx;
    (void)error;
    fp_count(&io->core->counters, C_SEND_ERRORS, datagrams);
}

/* Send every queued result, then let the rows change again. */
static void flush_queue(fp_core *core, void *ctx)
{
    fp_io *io = ctx;
    const udp_policy policy = {wait_for_queue, send_fragmented, count_lost, io};
    uint32_t i, n = 0;
    uint64_t bytes = 0;
    for (i = 0; i < io->queued; i++) {
        fp_out *o = &io->send_queue[i];
        uint64_t key = core->jobs[o->job].members[o->rank];
        if (key & FP_KEY_NOT_IPV4) { /* an address no socket can reach */
            fp_count(&core->counters, C_SEND_ERRORS, 1);
            continue;
        }
        io->order[n][0] = key;
        io->order[n][1] = i;
        n++;
    }
    if (io->gso)
        qsort(io->order, n, sizeof io->order[0], sort_by_destination);
    udp_batch_start(&io->batch, io->gso);
    for (i = 0; i < n; i++) {
        fp_out *o = &io->send_queue[io->order[i][1]];
        uint64_t key = io->order[i][0];
        struct sockaddr_in to = {.sin_family = AF_INET,
                                 .sin_port = htons((uint16_t)key),
                                 .sin_addr.s_addr = htonl((uint32_t)(key >> 16))};
        udp_batch_add(&io->batch, &to, o->data, o->len); /* room for a whole queue */
    }
    io->sent += udp_batch_send(&io->batch, io->fd, MSG_DONTWAIT, &policy, &io->gso_refused,
                               &bytes);
    if (io->gso_refused)
        io->gso = 0; /* no GSO here: the rest one datagram each */
    io->queued = 0;
    core->epoch++; /* no row holds a datagram waiting to be sent */
}

static uint32_t drain_socket(fp_io *io, uint32_t limit)
{
    fp_core *core = io->core;
    fp_out out[FP_MAX_WORKERS];
    uint32_t received = 0, errors = 0, i;
    for (i = 0; i < FP_RECV_BATCH; i++) {
        io->recv_iov[i].iov_base = io->recv_buffers + (size_t)i * FP_RECV_BUFFER;
        io->recv_iov[i].iov_len = FP_RECV_BUFFER;
    }
    while (received < limit) {
        uint32_t want = limit - received < FP_RECV_BATCH ? limit - received : FP_RECV_BATCH;
        for (i = 0; i < want; i++) {
            struct msghdr *h = &io->recv_msgs[i].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_name = &io->recv_addrs[i];
            h->msg_namelen = sizeof io->recv_addrs[i];
            h->msg_iov = &io->recv_iov[i];
            h->msg_iovlen = 1;
        }
        int got = recvmmsg(io->fd, io->recv_msgs, want, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            if (errno != EINTR) { /* e.g. an ICMP error surfacing on Linux */
                udp_drain_error_queue(io->fd);
                fp_count(&core->counters, C_SOCKET_ERRORS, 1);
                if (++errors >= FP_MAX_RECV_ERRORS)
                    break;
            }
            continue;
        }
        for (i = 0; i < (uint32_t)got; i++) {
            struct sockaddr_in *sa = &io->recv_addrs[i];
            uint64_t key = FP_KEY_NONE;
            if (io->recv_msgs[i].msg_hdr.msg_namelen >= sizeof *sa &&
                sa->sin_family == AF_INET)
                key = (uint64_t)ntohl(sa->sin_addr.s_addr) << 16 | ntohs(sa->sin_port);
            if (io->queued + FP_MAX_WORKERS > FP_SEND_QUEUE)
                flush_queue(core, io);
            int n = fp_receive(core, io->recv_iov[i].iov_base, io->recv_msgs[i].msg_len,
                               key, out);
            memcpy(io->send_queue + io->queued, out, (size_t)n * sizeof *out);
            io->queued += (uint32_t)n;
        }
        received += (uint32_t)got;
        flush_queue(core, io);
        if ((uint32_t)got < want)
            break; /* the socket is empty */
    }
    return received;
}

uint32_t fp_io_drain(fp_io *io, int fd, uint32_t limit, int gso)
{
    uint32_t received;
    io->fd = fd;
    io->sent = 0;
    io->queued = 0;
    io->gso = gso && !io->gso_refused;
    io->core->flush = flush_queue;
    io->core->flush_ctx = io;
    received = drain_socket(io, limit);
    io->core->flush = NULL;
    return received;
}
