/* The switch's batched socket loop (fastpath_io.c), around the C pipeline. */
#ifndef SWITCHML_FASTPATH_IO_H
#define SWITCHML_FASTPATH_IO_H

#include <pthread.h>
#include <sys/socket.h>
#include <netinet/in.h>

#include "../../udp_batch.h"
#include "fastpath.h"

/* Datagrams taken from the socket per recvmmsg call. */
#define FP_RECV_BATCH 64
/* Results queued for sending at most; a batch's results fit beside each other. */
#define FP_SEND_QUEUE (FP_RECV_BATCH * FP_MAX_WORKERS)
/* Bytes of a data thread's inbox (at least FP_INBOX_MIN entries). */
#define FP_INBOX_BYTES (4u << 20)
#define FP_INBOX_MIN 16
/* An IPv4 UDP datagram is at most 65507 bytes. */
#define FP_RECV_BUFFER 65536
/* recvmmsg errors (ICMP errors surfacing, say) tolerated in one drain call. */
#define FP_MAX_RECV_ERRORS 16
/* Address keys with this bit are not IPv4 addresses (FastPipeline gives them). */
#define FP_KEY_NOT_IPV4 ((uint64_t)1 << 48)

typedef struct fp_serving fp_serving;

/* Room for the control message of a run received whole (UDP_GRO: its segment size). */
typedef union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
} fp_gro_control;

/* Datagrams other data threads handed over to a thread: those of its slots that
 * reached their sockets.  The kernel steers each datagram by its slot, but a UDP
 * GSO run that stays unsegmented up to the socket (a worker on the switch's own
 * host: loopback) goes whole to the socket its first datagram's slot picks.
 * A ring of fixed entries (key, length, datagram); producers append under
 * `lock`, the owner takes what is there, handles it, then frees the entries. */
typedef struct {
    pthread_mutex_t lock;
    uint8_t *entries;
    uint32_t entry_size, capacity, head, count;
    int event_fd; /* readable while the ring may hold entries: the owner polls it */
} fp_inbox;

/* The loop's buffers, allocated once with the core, in one block; one per data
 * thread, with what that thread owns. */
typedef struct {
    fp_core *core;
    fp_thread *thread; /* its slots, counters and draws in the core */
    void *block;
    uint8_t *recv_buffers;
    struct mmsghdr *recv_msgs;
    struct iovec *recv_iov;
    struct sockaddr_in *recv_addrs;
    fp_gro_control *recv_control; /* each message's UDP_GRO segment size */
    fp_out *send_queue;
    uint64_t (*order)[2]; /* (destination key, queue index) */
    udp_batch batch;      /* the sender; its storage is in the block too */
    uint32_t queued;
    int fd;
    int gso;         /* this drain call may send GSO messages */
    int gso_refused; /* the kernel refused one: never again */
    uint64_t sent;   /* datagrams sent by the last drain call */
    /* as a data thread (fp_serve_start) */
    fp_serving *serving;
    pthread_t pthread;
    int serve_fd;      /* its own socket of the port's SO_REUSEPORT group */
    fp_inbox inbox;
    uint32_t inbox_left; /* its inbox held entries when it last freed some */
    int failure;       /* the errno that ended it; 0 while it serves, or stopped when told */
    int exited;        /* 1 once it returned (atomic) */
    double cpu_s;      /* its CPU time when it returned */
} fp_io;

/* The data threads of a threaded core.  Each drains its own socket, where the
 * kernel steers the datagrams of its slots (fp_steer_by_slot), so slot state
 * needs no lock; what they share is the job and member tables, which the
 * control plane changes: they hold `tables` for reading across a batch of
 * datagrams, the control plane takes it for writing (writers first, so that a
 * busy thread never starves it).  An uncontended read lock costs two atomic
 * operations a batch of up to FP_RECV_BATCH datagrams; per-thread locks taken
 * all at once by the writer would save that, at more code, for no rate we saw. */
struct fp_serving {
    pthread_rwlock_t tables;
    fp_io *ios;      /* [thread_count]: whose inbox a datagram is handed over to */
    uint32_t count;
    int started;   /* threads running (0: the core is drained by drain() calls) */
    int stopping;  /* atomic: set before stop_fd is written */
    int stop_fd;   /* an eventfd, readable once the threads are to stop */
    int notify_fd; /* a byte here when a thread recorded a mismatch or failed; -1 none */
    int gso;
};

int fp_io_init(fp_io *io, fp_core *core, fp_thread *thread);
void fp_io_free(fp_io *io);
/* Handle up to `limit` datagrams waiting on the UDP socket `fd`; returns how many
 * were received (io->sent: how many went out). Call without the GIL. */
uint32_t fp_io_drain(fp_io *io, int fd, uint32_t limit, int gso);

int fp_serving_init(fp_serving *serving);
void fp_serving_free(fp_serving *serving);
/* Start a data thread per io, io[i] on fds[i]; 0, or an errno (none left running). */
int fp_serve_start(fp_serving *serving, fp_io *ios, const int *fds, uint32_t n, int notify_fd,
                   int gso);
/* Tell the threads to stop and join them (call without the GIL). */
void fp_serve_stop(fp_serving *serving, fp_io *ios, uint32_t n);
/* A data thread's CPU time so far, in seconds. */
double fp_io_cpu_seconds(fp_io *io);
/* Make the kernel hand each datagram of the SO_REUSEPORT group of `fd` (bound
 * socket by socket, in order) to the socket of index slot % n; 0 or an errno. */
int fp_steer_by_slot(int fd, uint32_t n);

#endif
