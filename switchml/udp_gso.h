/* UDP GSO for the C cores' batched senders: the switch's results (switch/
 * fastpath_io.c) and the worker's contributions (worker/stream_io.c) leave as
 * messages of UDP_SEGMENT segments, one trip through the kernel's UDP stack for
 * a run of datagrams, which the kernel (or the NIC) cuts into those datagrams:
 * the same datagrams in the same order.  One rule for a run and one way to mark
 * it, for both. */
#ifndef SWITCHML_UDP_GSO_H
#define SWITCHML_UDP_GSO_H

#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT /* Linux 4.18 */
#define UDP_SEGMENT 103
#endif
/* At most this many segments, of at most this many bytes in all, a message. */
#define GSO_MAX_SEGMENTS 64
#define GSO_MAX_BYTES 65000
/* Room for the control message that marks a GSO message. */
#define GSO_CONTROL_SIZE CMSG_SPACE(sizeof(uint16_t))

/* Whether a datagram of `len` bytes may join a run of `segs` segments of `size`
 * bytes (`bytes` in all): the kernel cuts a message into segments of one size,
 * the last one possibly shorter, so a shorter datagram ends a run. */
static inline int gso_run_takes(int segs, uint32_t bytes, uint32_t size, uint32_t len) {
    return segs < GSO_MAX_SEGMENTS && len <= size && bytes + len <= GSO_MAX_BYTES;
}

/* Mark message `h` as UDP GSO segments of `size` bytes; `control`: GSO_CONTROL_SIZE
 * bytes, aligned as a struct cmsghdr. */
static inline void gso_mark(struct msghdr *h, void *control, uint16_t size) {
    struct cmsghdr *cm = (struct cmsghdr *)control;
    h->msg_control = control;
    h->msg_controllen = GSO_CONTROL_SIZE;
    cm->cmsg_level = SOL_UDP;
    cm->cmsg_type = UDP_SEGMENT;
    cm->cmsg_len = CMSG_LEN(sizeof size);
    memcpy(CMSG_DATA(cm), &size, sizeof size);
}

#endif
