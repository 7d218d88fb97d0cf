/* The batched UDP sender of both C cores: the switch's results (switch/
 * fastpath_io.c) and the worker's contributions (worker/engine/stream_io.c).
 *
 * Datagrams are added in the order they must leave; consecutive datagrams to one
 * destination, all of one size but the last, form one message of UDP GSO segments
 * (UDP_SEGMENT), which the kernel (or the NIC) cuts into those datagrams: one trip
 * through the kernel's UDP stack for a run instead of one each, the same datagrams
 * in the same order.  udp_batch_send hands the messages to sendmmsg and deals with
 * what the kernel refuses, by the rules below, asking its caller (a udp_policy)
 * only what differs between a switch and a worker: how long to wait for a full
 * queue, what to do with a datagram larger than the path allows, and how a loss is
 * counted. */
#ifndef SWITCHML_UDP_BATCH_H
#define SWITCHML_UDP_BATCH_H

#include <netinet/in.h>
#include <stdint.h>
#include <sys/socket.h>

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT /* Linux 4.18 */
#define UDP_SEGMENT 103
#endif
/* A send this host's own queue refused (ENOBUFS: its link is full, as IP_RECVERR
 * says) is tried again after UDP_SEND_PAUSE_NS, for at most UDP_SEND_PATIENCE_NS
 * a message, then lost: netutil.SEND_PAUSE and SEND_PATIENCE, in nanoseconds,
 * for the switch's results and the worker's contributions alike. */
#define UDP_SEND_PAUSE_NS 50000L
#define UDP_SEND_PATIENCE_NS 200000000L
#ifndef UDP_GRO /* Linux 5.0 */
#define UDP_GRO 104
#endif
/* At most this many segments, of at most this many bytes in all, a message. */
#define GSO_MAX_SEGMENTS 64
#define GSO_MAX_BYTES 65000
/* Room for the control message that marks a GSO message. */
#define GSO_CONTROL_SIZE CMSG_SPACE(sizeof(uint16_t))

typedef union {
    char buf[GSO_CONTROL_SIZE];
    struct cmsghdr align;
} udp_control;

/* A batch over storage its owner provides: room for `max_messages` messages and
 * `max_datagrams` datagrams. */
typedef struct {
    struct mmsghdr *msgs;        /* [max_messages] */
    struct sockaddr_in *addrs;   /* [max_messages]: each message's destination */
    udp_control *control;        /* [max_messages] */
    uint32_t *segments;          /* [max_messages]: datagrams in each message */
    struct iovec *iov;           /* [max_datagrams] */
    uint32_t max_messages, max_datagrams;
    uint32_t messages, datagrams;
    uint32_t run_bytes; /* bytes in the last message */
    int run_open;       /* the last message may take another segment */
    int gso;            /* runs may form (off: one datagram a message) */
} udp_batch;

/* What a sender does where switch and worker differ; `ctx` is the caller's. */
typedef struct {
    /* The socket's or the host's queue is full (`error`: EAGAIN, ENOBUFS) at the
     * message's `tries`-th attempt: wait and return 1 to try again, 0 to give it up. */
    int (*full)(void *ctx, int fd, int error, int tries);
    /* A datagram larger than the path allows (EMSGSIZE): send it some other way,
     * count what happened, and return 1 if it left.  NULL: it is lost. */
    int (*too_big)(void *ctx, int fd, const struct msghdr *one);
    /* `datagrams` given up, for `error` (an errno). */
    void (*lost)(void *ctx, uint32_t datagrams, int error);
    void *ctx;
} udp_policy;

/* Whether a datagram of `len` bytes may join a run of `segs` segments of `size`
 * bytes (`bytes` in all): the kernel cuts a message into segments of one size,
 * the last one possibly shorter, so a shorter datagram ends a run. */
static inline int gso_run_takes(uint32_t segs, uint32_t bytes, uint32_t size, uint32_t len)
{
    return segs < GSO_MAX_SEGMENTS && len <= size && bytes + len <= GSO_MAX_BYTES;
}

/* Empty `b`; `gso`: whether its runs may leave as GSO messages. */
void udp_batch_start(udp_batch *b, int gso);
/* Add a datagram of `len` bytes at `data` for `to` (its bytes must stay until the
 * batch is sent); 0 when the batch is full (send it, start again, add). */
int udp_batch_add(udp_batch *b, const struct sockaddr_in *to, const void *data, uint32_t len);
/* Send the batch on `fd` with sendmmsg (`flags`: MSG_DONTWAIT or 0).  Returns the
 * datagrams that left (*bytes += their bytes).  A kernel that refuses GSO (EIO,
 * ENOPROTOOPT, EOPNOTSUPP) sets *gso_refused and gets the run one datagram at a
 * time; a run refused for its size (EINVAL, EMSGSIZE) goes one datagram at a
 * time, and each datagram too large for the path to policy->too_big; ECONNREFUSED (an ICMP error
 * queued by an earlier datagram) is retried once; other errors lose the message.
 * The batch is empty afterwards. */
uint64_t udp_batch_send(udp_batch *b, int fd, int flags, const udp_policy *policy,
                        int *gso_refused, uint64_t *bytes);
/* The segment size of a message of `len` bytes received on a socket with UDP_GRO
 * on: the size its UDP_GRO control message gives (a run of datagrams that
 * arrived whole, each that long but the last), else `len` (one datagram). */
size_t udp_gro_segment(const struct msghdr *h, size_t len);
/* netutil.drain_error_queue: read away what IP_RECVERR queued on `fd` (ICMP errors
 * from a peer gone, a datagram refused for its size): the queue is charged to the
 * receive buffer. */
void udp_drain_error_queue(int fd);

#endif
