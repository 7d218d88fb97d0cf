/* The dispatcher that lets several XDP switches share one interface: an
 * interface runs one XDP program, so switch/xdp/dispatch.py attaches this one
 * (a BPF link; in the driver's native mode where it has one, else generic)
 * once per interface, and each switch serving there
 * (each its own process or not, each with its own xdp_pipeline object and
 * maps) puts its own xdp_pipeline program in `switchml_progs` at its UDP port.
 * A UDP datagram over IPv4 goes, by bpf_tail_call, to the program registered
 * at its destination port, which runs on the frame as if it were attached
 * (its XDP action is the frame's); anything else (not IPv4/UDP, a later
 * fragment, a port no switch serves, an entry removed meanwhile: the tail call
 * falls through) passes to the host untouched, as xdp_pipeline passes what is
 * not its own.
 *
 * Why tail calls, and why indexed by the port itself:
 *  - the kernel's rules hold: the verifier refuses a tail call with a spin
 *    lock held, and where a program that tail-calls also has BPF-to-BPF
 *    calls, the JIT allows it with at most 256 bytes of stack a frame; the
 *    dispatcher makes the one tail call, holds no lock and has no
 *    subprograms, and a target has no rule of its own (xdp_pipeline, which
 *    takes its locks after it is entered, has no subprograms either: every
 *    helper of it is __always_inline).  A program array takes only programs
 *    like its owner (this one): the same type, both xdp.frags (multi-buffer
 *    frames, which the pipelines read) or neither, which the kernel checks
 *    when a pipeline is put in.  Tested on 6.18 (tests/test_xdp_dispatch.py).
 *  - one array slot per UDP port (65536, 512 KiB of pointers a dispatcher):
 *    the frame's port is the index, so there is no hash lookup per frame and
 *    no index to hand out, and two switches cannot take one slot by a race
 *    (the port is already theirs: their UDP sockets are bound to it).  The
 *    dispatcher and the tail call cost some 16 ns a frame (BPF_PROG_TEST_RUN,
 *    a frame the pipeline drops early: 62 ns alone, 78 through this); a frame
 *    to another port costs what xdp_pipeline's own test of it did.
 *  - libxdp's dispatcher (freplace programs in fixed slots, run in turn while
 *    each returns XDP_PASS) runs every program on every frame, loads a new
 *    dispatcher each time one comes or goes, and shares it between processes
 *    through pins in bpffs, which a killed process leaves behind; here one
 *    lookup picks the program the frame is for, a switch comes or goes with
 *    one map update, and the sharing is by file descriptors, which the kernel
 *    closes with the process.
 *
 * `switchml_owners` (port -> the registering switch) is user space's:
 * dispatch.py tells from it whether a port's program belongs to a switch
 * still running (a SIGKILLed switch's port is taken out by the next switch
 * that joins or leaves the interface); at port 0, which no switch serves, a
 * mark that the switches turned the interface's GRO on, for the last to turn
 * off.  The dispatcher stays attached while any
 * switch holds a file descriptor of its BPF link, and the kernel detaches it
 * when the last holder closes it or dies.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>

#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

/* what user space keeps of a registered switch (dispatch.py's Dispatcher) */
struct switchml_owner {
    __u32 pid;      /* the process serving the port (as it sees itself: for messages) */
    __u32 prog_id;  /* its xdp_pipeline program, as put in switchml_progs */
    __u32 alive_id; /* a program of its own that nothing else holds (its
                     * fan_out_results): the kernel frees it, and its id, when the
                     * switch closes or dies, which tells, across PID namespaces
                     * too, whether the switch is there */
};

/* [UDP port, host order] -> the xdp_pipeline serving it */
struct {
    __uint(type, BPF_MAP_TYPE_PROG_ARRAY);
    __uint(max_entries, 65536);
    __type(key, __u32);
    __type(value, __u32);
} switchml_progs SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 65536);
    __uint(map_flags, BPF_F_NO_PREALLOC); /* a few entries, not 65536 */
    __type(key, __u32); /* UDP port, host order */
    __type(value, struct switchml_owner);
} switchml_owners SEC(".maps");

/* Always 0 (read-only data, frozen at load: the verifier prunes the branch it
 * guards).  The branch names switchml_owners in the program, so that the
 * kernel lists that map among the program's, where a later switch finds it
 * (bpf_prog_info.map_ids) with no cost per frame. */
const volatile __u32 never = 0;

SEC("xdp.frags")
int switchml_dispatch(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) ||
        ip->protocol != IPPROTO_UDP || (ip->frag_off & bpf_htons(0x1FFF)))
        return XDP_PASS; /* a later fragment has no UDP header to tell whose */
    /* past IP options too: xdp_pipeline counts and drops its own with options */
    __u32 ihl = ip->ihl * 4;
    if (ihl < sizeof(struct iphdr) || ihl > 60)
        return XDP_PASS;
    struct udphdr *udp = (void *)ip + ihl;
    if ((void *)(udp + 1) > data_end)
        return XDP_PASS;
    __u32 port = bpf_ntohs(udp->dest);
    bpf_tail_call(ctx, &switchml_progs, port);
    if (never && bpf_map_lookup_elem(&switchml_owners, &port))
        return XDP_DROP;
    return XDP_PASS; /* no switch at that port */
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
