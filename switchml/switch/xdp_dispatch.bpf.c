/* The dispatcher that lets several XDP switches share one interface: an
 * interface runs one XDP program, so switch/xdp_loader.py attaches this one
 * (generic mode, a BPF link) once per interface, and each switch serving there
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
 *  - xdp_pipeline is one function (every helper __always_inline, no BPF-to-BPF
 *    calls), holds no spin lock across the call (it is entered, not returning),
 *    and the dispatcher has no subprograms either: nothing of the kernel's
 *    restrictions on mixing tail calls with subprograms applies.  A program
 *    array takes only programs like its owner (this one): same type and both
 *    xdp.frags (multi-buffer frames, which the pipelines read), checked by the
 *    kernel when a pipeline is put in.
 *  - one array slot per UDP port (65536, 512 KiB of pointers a dispatcher):
 *    the frame's port is the index, so there is no hash lookup per frame and
 *    no index to hand out, and two switches cannot take one slot by a race
 *    (the port is already theirs: their UDP sockets are bound to it).
 *  - libxdp's dispatcher (freplace of fixed slots, run in turn while each
 *    returns XDP_PASS) runs every program on every frame and needs the kernel
 *    to rewrite it each time one comes or goes; here one lookup picks the one
 *    program the frame is for.
 *
 * `switchml_owners` (port -> the registering switch) is user space's:
 * xdp_loader.py tells from it whether a port's program belongs to a switch
 * still running (a SIGKILLed switch's port is taken out by the next switch
 * that joins or leaves the interface).  The dispatcher stays attached while any
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

/* what user space keeps of a registered switch (xdp_loader.Dispatcher) */
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
