/* The switch's socket loop in C: recvmmsg a batch of datagrams, run each through
 * the pipeline (fastpath_core.c), send the results with sendmmsg, those to one
 * worker as UDP GSO segments.  No Python here: _fastpath.c calls fp_io_drain
 * with the GIL released. */
#define _GNU_SOURCE
#include "fastpath_io.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/filter.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>


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
    CARVE(recv_control, FP_RECV_BATCH);
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

int fp_io_init(fp_io *io, fp_core *core, fp_thread *thread)
{
    memset(io, 0, sizeof *io);
    io->core = core;
    io->thread = thread;
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
    fp_count(&io->thread->counters, C_SEND_WAITS, 1);
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
    fp_count(&io->thread->counters, n < 0 ? C_SEND_ERRORS : C_SEND_FRAGMENTED, 1);
    setsockopt(fd, IPPROTO_IP, IP_MTU_DISCOVER, &do_, sizeof do_);
    udp_drain_error_queue(fd); /* the refusal that brought us here queued one */
    return n >= 0;
}

static void count_lost(void *ctx, uint32_t datagrams, int error)
{
    fp_io *io = ctx;
    (void)error;
    fp_count(&io->thread->counters, C_SEND_ERRORS, datagrams);
}

/* Send every queued result, then let the rows change again. */
static void flush_queue(fp_thread *thread, void *ctx)
{
    fp_io *io = ctx;
    fp_core *core = io->core;
    const udp_policy policy = {wait_for_queue, send_fragmented, count_lost, io};
    uint32_t i, n = 0;
    uint64_t bytes = 0;
    for (i = 0; i < io->queued; i++) {
        fp_out *o = &io->send_queue[i];
        uint64_t key = core->jobs[o->job].members[o->rank];
        if (key & FP_KEY_NOT_IPV4) { /* an address no socket can reach */
            fp_count(&thread->counters, C_SEND_ERRORS, 1);
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
    thread->epoch++; /* no row of its slots holds a datagram waiting to be sent */
}

/* ------------------------------------------------------------ handing over */
/* An inbox entry: the sender's key, the length, then the datagram. */
#define INBOX_HEADER 16

static int inbox_init(fp_inbox *inbox, uint32_t row_size)
{
    memset(inbox, 0, sizeof *inbox);
    /* a datagram a row holds, and no longer: a longer one fits no job's packets */
    inbox->entry_size = (INBOX_HEADER + row_size + 15) & ~15u;
    inbox->capacity = FP_INBOX_BYTES / inbox->entry_size;
    if (inbox->capacity < FP_INBOX_MIN)
        inbox->capacity = FP_INBOX_MIN;
    inbox->event_fd = -1;
    if (!(inbox->entries = malloc((size_t)inbox->capacity * inbox->entry_size)))
        return ENOMEM;
    if ((inbox->event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) {
        free(inbox->entries);
        inbox->entries = NULL;
        return errno;
    }
    pthread_mutex_init(&inbox->lock, NULL);
    return 0;
}

static void inbox_free(fp_inbox *inbox)
{
    if (!inbox->entries)
        return;
    pthread_mutex_destroy(&inbox->lock);
    close(inbox->event_fd);
    free(inbox->entries);
    inbox->entries = NULL;
}

/* Give a datagram of another thread's slot to that thread; 0 when its inbox is
 * full (or the datagram longer than any the switch takes): then it is dropped,
 * counted, as a full socket buffer would drop it. */
static int hand_over(fp_io *io, const uint8_t *data, uint32_t len, uint64_t key)
{
    fp_serving *serving = io->serving;
    uint32_t slot = (uint32_t)data[6] | (uint32_t)data[7] << 8; /* fp_receive read it */
    uint64_t one = 1;
    int wake;
    if (!serving) /* not a data thread: drain() of a core of one thread */
        return 0;
    fp_inbox *inbox = &serving->ios[slot % serving->count].inbox;
    if (len > inbox->entry_size - INBOX_HEADER)
        return 0;
    pthread_mutex_lock(&inbox->lock);
    if (inbox->count == inbox->capacity) {
        pthread_mutex_unlock(&inbox->lock);
        return 0;
    }
    uint8_t *entry = inbox->entries +
                     (size_t)((inbox->head + inbox->count) % inbox->capacity) * inbox->entry_size;
    memcpy(entry, &key, 8);
    memcpy(entry + 8, &len, 4);
    memcpy(entry + INBOX_HEADER, data, len);
    /* 0 to 1: wake the owner; else it finds the entry when it frees what it took */
    wake = __atomic_fetch_add(&inbox->count, 1, __ATOMIC_RELEASE) == 0;
    pthread_mutex_unlock(&inbox->lock);
    if (wake)
        (void)!write(inbox->event_fd, &one, sizeof one);
    return 1;
}

static void queue_results(fp_io *io, const fp_out *out, int n)
{
    memcpy(io->send_queue + io->queued, out, (size_t)n * sizeof *out);
    io->queued += (uint32_t)n;
}

/* Handle what other threads handed over; how many there were (io->inbox_left:
 * entries handed over meanwhile, which woke no one). */
static uint32_t drain_inbox(fp_io *io)
{
    fp_inbox *inbox = &io->inbox;
    fp_out out[FP_MAX_WORKERS];
    uint32_t head, count, i;
    /* a look without the lock, every batch: no system call while nothing comes (the
     * event is read when poll reports it, so a wake stays until then) */
    if (!__atomic_load_n(&inbox->count, __ATOMIC_RELAXED))
        return 0;
    pthread_mutex_lock(&inbox->lock);
    head = inbox->head;
    count = inbox->count;
    pthread_mutex_unlock(&inbox->lock);
    for (i = 0; i < count; i++) { /* producers write only past head + count */
        const uint8_t *entry =
            inbox->entries + (size_t)((head + i) % inbox->capacity) * inbox->entry_size;
        uint64_t key;
        uint32_t len;
        memcpy(&key, entry, 8);
        memcpy(&len, entry + 8, 4);
        if (io->queued + FP_MAX_WORKERS > FP_SEND_QUEUE)
            flush_queue(io->thread, io);
        int n = fp_admit(io->core, io->thread, entry + INBOX_HEADER, len, key, out);
        if (n > 0)
            queue_results(io, out, n);
    }
    if (count) {
        flush_queue(io->thread, io);
        pthread_mutex_lock(&inbox->lock);
        inbox->head = (head + count) % inbox->capacity;
        __atomic_fetch_sub(&inbox->count, count, __ATOMIC_RELAXED); /* under the lock too */
        io->inbox_left = inbox->count;
        pthread_mutex_unlock(&inbox->lock);
    }
    return count;
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
            h->msg_control = &io->recv_control[i];
            h->msg_controllen = sizeof io->recv_control[i];
        }
        int got = recvmmsg(io->fd, io->recv_msgs, want, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            if (errno != EINTR) { /* e.g. an ICMP error surfacing on Linux */
                udp_drain_error_queue(io->fd);
                fp_count(&io->thread->counters, C_SOCKET_ERRORS, 1);
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
            const uint8_t *data = io->recv_iov[i].iov_base;
            size_t len = io->recv_msgs[i].msg_len;
            size_t segment = udp_gro_segment(&io->recv_msgs[i].msg_hdr, len);
            if (segment < len)
                fp_count(&io->thread->counters, C_RUNS_RECEIVED, 1);
            /* each datagram of a run; an empty one too, which the pipeline counts */
            for (size_t at = 0, first = 1; first || at < len; first = 0, at += segment) {
                uint32_t one = (uint32_t)(len - at < segment ? len - at : segment);
                if (io->queued + FP_MAX_WORKERS > FP_SEND_QUEUE)
                    flush_queue(io->thread, io);
                int n = fp_receive(core, io->thread, data + at, one, key, out);
                if (n == FP_OTHER_THREAD) {
                    int given = hand_over(io, data + at, one, key);
                    fp_count(&io->thread->counters,
                             given ? C_HANDED_OVER : C_DROPPED_NOT_HANDED_OVER, 1);
                    continue;
                }
                queue_results(io, out, n);
            }
        }
        received += (uint32_t)got;
        flush_queue(io->thread, io);
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
    io->thread->flush = flush_queue;
    io->thread->flush_ctx = io;
    /* the inbox first: what other threads handed over was received before what
     * this socket holds now, and a slot's results go out in the order its
     * datagrams came, as workers count on (engine/stream.py, fast retransmit) */
    received = io->inbox.entries ? drain_inbox(io) : 0;
    received += drain_socket(io, limit);
    io->thread->flush = NULL;
    return received;
}

/* ------------------------------------------------------------ data threads */
int fp_serving_init(fp_serving *serving)
{
    pthread_rwlockattr_t attr;
    int error;
    memset(serving, 0, sizeof *serving);
    serving->stop_fd = serving->notify_fd = -1;
    if ((error = pthread_rwlockattr_init(&attr)))
        return error;
    /* a writer waiting keeps new readers out: the control plane gets in between
     * two batches however busy the data threads are */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    error = pthread_rwlock_init(&serving->tables, &attr);
    pthread_rwlockattr_destroy(&attr);
    return error;
}

void fp_serving_free(fp_serving *serving)
{
    pthread_rwlock_destroy(&serving->tables);
}

static double thread_cpu_seconds(clockid_t clock)
{
    struct timespec ts;
    if (clock_gettime(clock, &ts) < 0)
        return -1.0;
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A data thread: a batch from its socket under the tables' read lock, then, when
 * the socket is empty, sleep in poll until datagrams or the stop come. */
static void *serve(void *arg)
{
    fp_io *io = arg;
    fp_serving *serving = io->serving;
    struct pollfd watch[3] = {{io->serve_fd, POLLIN, 0}, {serving->stop_fd, POLLIN, 0},
                              {io->inbox.event_fd, POLLIN, 0}};
    for (;;) {
        pthread_rwlock_rdlock(&serving->tables);
        uint32_t got = fp_io_drain(io, io->serve_fd, FP_RECV_BATCH, serving->gso);
        uint32_t mismatched = io->thread->mismatched;
        io->thread->mismatched = 0;
        pthread_rwlock_unlock(&serving->tables);
        if (mismatched && serving->notify_fd >= 0) /* wake the control plane to fail the job */
            (void)!send(serving->notify_fd, "m", 1, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (__atomic_load_n(&serving->stopping, __ATOMIC_ACQUIRE))
            break;
        if (got >= FP_RECV_BATCH || io->inbox_left)
            continue; /* there may be more */
        if (poll(watch, 3, -1) < 0) {
            if (errno == EINTR)
                continue;
            io->failure = errno;
            break;
        }
        if (watch[0].revents & POLLNVAL) { /* its socket was closed under it */
            io->failure = EBADF;
            break;
        }
        if (watch[0].revents & POLLERR) /* errors queued (IP_RECVERR): else poll spins */
            udp_drain_error_queue(io->serve_fd);
        if (watch[2].revents & POLLIN) { /* a hand-over woke it: its inbox is read next */
            uint64_t ticks;
            (void)!read(io->inbox.event_fd, &ticks, sizeof ticks);
        }
    }
    io->cpu_s = thread_cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    __atomic_store_n(&io->exited, 1, __ATOMIC_RELEASE);
    if (io->failure && serving->notify_fd >= 0) /* the control plane reports it now */
        (void)!send(serving->notify_fd, "f", 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    return NULL;
}

void fp_serve_stop(fp_serving *serving, fp_io *ios, uint32_t n)
{
    uint64_t one = 1;
    uint32_t i;
    if (!serving->started)
        return;
    __atomic_store_n(&serving->stopping, 1, __ATOMIC_RELEASE);
    (void)!write(serving->stop_fd, &one, sizeof one); /* never read: wakes every poll */
    for (i = 0; i < n; i++)
        pthread_join(ios[i].pthread, NULL);
    for (i = 0; i < serving->count; i++) /* every one: those of threads never started too */
        inbox_free(&ios[i].inbox);
    close(serving->stop_fd);
    serving->stop_fd = -1;
    serving->started = 0;
}

int fp_serve_start(fp_serving *serving, fp_io *ios, const int *fds, uint32_t n, int notify_fd,
                   int gso)
{
    uint32_t i;
    int error;
    if (serving->started)
        return EBUSY;
    if ((serving->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
        return errno;
    serving->notify_fd = notify_fd;
    serving->gso = gso;
    serving->stopping = 0;
    serving->ios = ios;
    serving->count = n;
    for (i = 0; i < n; i++)
        if ((error = inbox_init(&ios[i].inbox, ios[i].core->row_size))) {
            while (i--)
                inbox_free(&ios[i].inbox);
            close(serving->stop_fd);
            serving->stop_fd = -1;
            return error;
        }
    for (i = 0; i < n; i++) {
        fp_io *io = &ios[i];
        io->serving = serving;
        io->serve_fd = fds[i];
        io->failure = io->exited = 0;
        io->cpu_s = 0.0;
        if ((error = pthread_create(&io->pthread, NULL, serve, io))) {
            serving->started = 1;
            fp_serve_stop(serving, ios, i); /* those started: none is left running */
            return error;
        }
    }
    serving->started = 1;
    return 0;
}

double fp_io_cpu_seconds(fp_io *io)
{
    clockid_t clock;
    double seconds;
    if (__atomic_load_n(&io->exited, __ATOMIC_ACQUIRE))
        return io->cpu_s;
    /* a thread that returns meanwhile may have no clock any more: then its own reading */
    if (pthread_getcpuclockid(io->pthread, &clock) == 0 &&
        (seconds = thread_cpu_seconds(clock)) >= 0)
        return seconds;
    return __atomic_load_n(&io->exited, __ATOMIC_ACQUIRE) ? io->cpu_s : 0.0;
}

int fp_steer_by_slot(int fd, uint32_t n)
{
    /* Classic BPF, run by the kernel at the UDP payload: wire.h's slot is a
     * little-endian u16 at offset 6, which ldh would read big-endian, so byte by
     * byte.  A datagram too short for it fails the load, which returns 0: socket
     * 0, whose thread drops it as truncated. */
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_B | BPF_ABS, 7),     /* A = high byte */
        BPF_STMT(BPF_ALU | BPF_LSH | BPF_K, 8),    /* A <<= 8 */
        BPF_STMT(BPF_MISC | BPF_TAX, 0),           /* X = A */
        BPF_STMT(BPF_LD | BPF_B | BPF_ABS, 6),     /* A = low byte */
        BPF_STMT(BPF_ALU | BPF_OR | BPF_X, 0),     /* A = slot */
        BPF_STMT(BPF_ALU | BPF_MOD | BPF_K, n),    /* A = slot % n */
        BPF_STMT(BPF_RET | BPF_A, 0),              /* the socket of that index */
    };
    struct sock_fprog program = {sizeof code / sizeof code[0], code};
    if (n < 1)
        return EINVAL;
    if (setsockopt(fd, SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, &program, sizeof program) < 0)
        return errno;
    return 0;
}
