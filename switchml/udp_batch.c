/* The batched UDP sender of both C cores (udp_batch.h says what it does). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "udp_batch.h"

#include <errno.h>
#include <string.h>

#define HIDDEN __attribute__((visibility("hidden")))

HIDDEN void udp_batch_start(udp_batch *b, int gso)
{
    b->messages = b->datagrams = 0;
    b->run_bytes = 0;
    b->run_open = 0;
    b->gso = gso;
}

static int same_destination(const struct sockaddr_in *a, const struct sockaddr_in *b)
{
    return a->sin_addr.s_addr == b->sin_addr.s_addr && a->sin_port == b->sin_port;
}

HIDDEN int udp_batch_add(udp_batch *b, const struct sockaddr_in *to, const void *data,
                         uint32_t len)
{
    if (b->datagrams == b->max_datagrams)
        return 0;
    struct iovec *v = &b->iov[b->datagrams];
    v->iov_base = (void *)data;
    v->iov_len = len;
    if (b->run_open) {
        uint32_t m = b->messages - 1, size = (uint32_t)b->msgs[m].msg_hdr.msg_iov[0].iov_len;
        if (same_destination(&b->addrs[m], to) &&
            gso_run_takes(b->segments[m], b->run_bytes, size, len)) {
            b->segments[m]++;
            b->msgs[m].msg_hdr.msg_iovlen++;
            b->run_bytes += len;
            b->run_open = len == size; /* a shorter segment ends the run */
            b->datagrams++;
            return 1;
        }
    }
    if (b->messages == b->max_messages)
        return 0;
    uint32_t m = b->messages++;
    struct msghdr *h = &b->msgs[m].msg_hdr;
    memset(h, 0, sizeof *h);
    b->addrs[m] = *to;
    h->msg_name = &b->addrs[m];
    h->msg_namelen = sizeof b->addrs[m];
    h->msg_iov = v;
    h->msg_iovlen = 1;
    b->segments[m] = 1;
    b->run_bytes = len;
    b->run_open = b->gso;
    b->datagrams++;
    return 1;
}

/* Mark message `h` as UDP GSO segments of `size` bytes. */
static void gso_mark(struct msghdr *h, udp_control *control, uint16_t size)
{
    struct cmsghdr *cm = &control->align;
    h->msg_control = control->buf;
    h->msg_controllen = GSO_CONTROL_SIZE;
    cm->cmsg_level = SOL_UDP;
    cm->cmsg_type = UDP_SEGMENT;
    cm->cmsg_len = CMSG_LEN(sizeof size);
    memcpy(CMSG_DATA(cm), &size, sizeof size);
}

/* Send message `h`'s datagrams one a message, with the same rules. */
static uint64_t send_one_by_one(const struct msghdr *h, int fd, int flags,
                                const udp_policy *policy, uint64_t *bytes)
{
    uint64_t sent = 0;
    for (size_t i = 0; i < h->msg_iovlen; i++) {
        struct msghdr one;
        memset(&one, 0, sizeof one);
        one.msg_name = h->msg_name;
        one.msg_namelen = h->msg_namelen;
        one.msg_iov = &h->msg_iov[i];
        one.msg_iovlen = 1;
        for (int tries = 1;; tries++) {
            ssize_t n = sendmsg(fd, &one, flags);
            if (n >= 0) {
                sent++;
                *bytes += (uint64_t)n;
                break;
            }
            int error = errno;
            if (error == EINTR || (error == ECONNREFUSED && tries == 1))
                continue;
            if ((error == EAGAIN || error == EWOULDBLOCK || error == ENOBUFS) &&
                policy->full(policy->ctx, fd, error, tries))
                continue;
            if (error == EMSGSIZE && policy->too_big)
                sent += (uint64_t)policy->too_big(policy->ctx, fd, &one);
            else
                policy->lost(policy->ctx, 1, error);
            break;
        }
    }
    return sent;
}

HIDDEN uint64_t udp_batch_send(udp_batch *b, int fd, int flags, const udp_policy *policy,
                               int *gso_refused, uint64_t *bytes)
{
    uint64_t sent = 0;
    uint32_t done = 0;
    int tries = 1;
    for (uint32_t m = 0; m < b->messages; m++)
        if (b->segments[m] > 1)
            gso_mark(&b->msgs[m].msg_hdr, &b->control[m],
                     (uint16_t)b->msgs[m].msg_hdr.msg_iov[0].iov_len);
    while (done < b->messages) {
        int n = sendmmsg(fd, b->msgs + done, b->messages - done, flags);
        if (n > 0) {
            for (uint32_t i = done; i < done + (uint32_t)n; i++) {
                sent += b->segments[i];
                *bytes += b->msgs[i].msg_len;
            }
            done += (uint32_t)n;
            tries = 1;
            continue;
        }
        int error = n < 0 ? errno : EAGAIN;
        struct msghdr *h = &b->msgs[done].msg_hdr;
        uint32_t segments = b->segments[done];
        if (error == EINTR || (error == ECONNREFUSED && tries++ == 1))
            continue;
        if ((error == EAGAIN || error == EWOULDBLOCK || error == ENOBUFS) &&
            policy->full(policy->ctx, fd, error, tries++))
            continue;
        if (segments > 1 && (error == EIO || error == ENOPROTOOPT || error == EOPNOTSUPP ||
                             error == EINVAL || error == EMSGSIZE)) {
            if (error != EINVAL && error != EMSGSIZE)
                *gso_refused = 1; /* no GSO on this path */
            sent += send_one_by_one(h, fd, flags, policy, bytes);
        } else if (error == EMSGSIZE && policy->too_big) {
            sent += (uint64_t)policy->too_big(policy->ctx, fd, h);
        } else {
            policy->lost(policy->ctx, segments, error);
        }
        done++;
        tries = 1;
    }
    b->messages = b->datagrams = 0;
    b->run_open = 0;
    return sent;
}

HIDDEN size_t udp_gro_segment(const struct msghdr *h, size_t len)
{
    size_t segment = len;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(h); cm; cm = CMSG_NXTHDR((struct msghdr *)h, cm))
        if (cm->cmsg_level == SOL_UDP && cm->cmsg_type == UDP_GRO) {
            int size;
            memcpy(&size, CMSG_DATA(cm), sizeof size);
            if (size > 0)
                segment = (size_t)size;
        }
    return segment;
}

HIDDEN void udp_drain_error_queue(int fd)
{
    char data[64], control[256];
    for (int i = 0; i < 256; i++) {
        struct iovec iov = {data, sizeof data};
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = control;
        m.msg_controllen = sizeof control;
        if (recvmsg(fd, &m, MSG_ERRQUEUE | MSG_DONTWAIT) < 0)
            break;
    }
}
