/* The switch's batched socket loop (fastpath_io.c), around the C pipeline. */
#ifndef SWITCHML_FASTPATH_IO_H
#define SWITCHML_FASTPATH_IO_H

#include <sys/socket.h>
#include <netinet/in.h>

#include "../udp_batch.h"
#include "fastpath.h"

/* Datagrams taken from the socket per recvmmsg call. */
#define FP_RECV_BATCH 64
/* Results queued for sending at most; a batch's results fit beside each other. */
#define FP_SEND_QUEUE (FP_RECV_BATCH * FP_MAX_WORKERS)
/* An IPv4 UDP datagram is at most 65507 bytes. */
#define FP_RECV_BUFFER 65536
/* recvmmsg errors (ICMP errors surfacing, say) tolerated in one drain call. */
#define FP_MAX_RECV_ERRORS 16
/* Address keys with this bit are not IPv4 addresses (FastPipeline gives them). */
#define FP_KEY_NOT_IPV4 ((uint64_t)1 << 48)

/* The loop's buffers, allocated once with the core, in one block. */
typedef struct {
    fp_core *core;
    void *block;
    uint8_t *recv_buffers;
    struct mmsghdr *recv_msgs;
    struct iovec *recv_iov;
    struct sockaddr_in *recv_addrs;
    fp_out *send_queue;
    uint64_t (*order)[2]; /* (destination key, queue index) */
    udp_batch batch;      /* the sender; its storage is in the block too */
    uint32_t queued;
    int fd;
    int gso;         /* this drain call may send GSO messages */
    int gso_refused; /* the kernel refused one: never again */
    uint64_t sent;   /* datagrams sent by the last drain call */
} fp_io;

int fp_io_init(fp_io *io, fp_core *core);
void fp_io_free(fp_io *io);
/* Handle up to `limit` datagrams waiting on the UDP socket `fd`; returns how many
 * were received (io->sent: how many went out). Call without the GIL. */
uint32_t fp_io_drain(fp_io *io, int fd, uint32_t limit, int gso);

#endif
