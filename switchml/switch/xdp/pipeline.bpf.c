/* The switch's per-packet pipeline as an XDP program: the dense path of
 * switch/dataplane/pipeline.py (the reference model: read its docstring for the rules),
 * step by step, in the same order, with the same drop reasons and counter
 * names.  switch/xdp/loader.py builds it (clang) and loads it (libbpf through
 * ctypes); switch/xdp/pipeline.py fills its maps from the Python control plane, serves
 * the switch's interface with it (through the dispatcher that the XDP
 * switches on one interface share, dispatch.bpf.c, which tail-calls it for
 * the datagrams to its port: in the driver's native mode where it has one, on
 * each port of a bridge, else generic; or attached alone, in driver mode), with
 * fan_out_results on the interface's TC ingress (one tcx program a switch,
 * each passing on what is not its own), and runs it with BPF_PROG_TEST_RUN
 * (tests, and probes passed up); tests/test_xdp.py feeds it and the Python pipeline the same
 * frames and requires the same datagrams out, the same counters and the same
 * slot state; tests/test_xdp_serve.py requires of fan_out_results the
 * datagrams the Python pipeline sends each rank.
 *
 * The sparse path is not here: a sparse contribution is checked up to its
 * sparseness and passed up as it came, and user space runs pipeline.py's
 * sparse path on the set in these maps (xdp.XdpPipeline.passed_up; see
 * receive_datagram).
 *
 * Function names follow pipeline.py: receive_datagram, answer_probe,
 * answer_retransmission (folded into the two callers' lock sections, see
 * below), complete, answer_header, record_mismatch.
 *
 * What leaves, and how (the caller of the program is the NIC driver):
 *  - a datagram dropped or consumed (a contribution added, a duplicate, a stale
 *    message...): XDP_DROP;
 *  - an answer to one rank (a stored result for its retransmission or probe, a
 *    resend, a done): rewritten in the received frame, addresses swapped,
 *    XDP_TX back out of the port it came in by (to the rank that sent it);
 *    on a veth in native mode, XDP_PASS with ANSWER_MARK in its metadata, and
 *    fan_out_results sends it back out (answers_by_stack, below);
 *  - a completed result, for every rank of the job: written over the
 *    contribution that completed it (a dense result has exactly that size) and
 *    handed on with XDP_PASS, addressed as the contribution was (from the last
 *    contributor to the switch's port).  The next hook on the same interface,
 *    TC ingress, runs fan_out_results (below), which sends one copy to each
 *    rank, addressed to it, and drops the frame: the kernel's multicast engine
 *    and egress rewrite.  Where it cannot reach a rank, it leaves the frame to
 *    the host stack: the switch's own UDP socket receives it and user space
 *    sends it to each member (a datagram of kind RESULT on that socket can
 *    only come from here: the program drops every result a member or
 *    stranger sends).  Where results leave in runs (config's
 *    results_in_runs), the kernel's GRO merges them, one sender's, before the
 *    TC hook, and fan_out_results sends each rank the run whole.  Not XDP
 *    alone: an XDP program has no helper that copies a frame, and a devmap
 *    broadcast (BPF_F_BROADCAST) clones one per *device*, not per
 *    destination, with egress programs that do not learn which entry they
 *    run for, so it cannot address copies to n ranks behind one port;
 *  - a sparse contribution, once checked: XDP_PASS, untouched (user space
 *    aggregates it and sends its result from the switch's socket);
 *  - anything that is not a UDP datagram to the switch's port: XDP_PASS,
 *    untouched.
 *
 * What the verifier refused (seen), and what this file does instead:
 *  - an offset into a map value computed from a header field before its bound
 *    check: clang hoisted 12 * lanes above the `lanes > XDP_MAX_LANES` test and
 *    kept the product, so the verifier saw row offsets up to 786420 in a
 *    4928-byte value ("invalid access to map value ... R1 max value is outside
 *    of the allowed memory range"); barrier_var() after the checks makes the
 *    later arithmetic start from the checked registers.
 * What it is known to refuse, designed around (not tried here):
 *  - loops over packet pointers: every access at a variable offset needs its
 *    own bounds check against data_end, and each exit of a bounded loop carries
 *    another packet range, so its states do not prune; the datagram's body is
 *    copied with bpf_xdp_load_bytes into the CPU's scratch map value (sizes
 *    known to the verifier) and the answer written back with
 *    bpf_xdp_store_bytes (both also work on multi-buffer frames, which a
 *    datagram past one page comes in);
 *  - helper calls while a bpf_spin_lock is held: lookups, load/store_bytes and
 *    adjust_tail all happen before the set's lock is taken or after it is
 *    released; under the lock only plain loads, stores and bounded loops, and
 *    the bytes to send are snapshotted into the scratch value there;
 *  - returning with the lock held: every branch under the lock sets an
 *    `action` and falls through to the one unlock;
 *  - a loop bounded by a live length: each exit narrows the length's range
 *    differently, so the rest of the program is walked once per exit (148,000
 *    instructions processed at 1024 values; past the limit at 16128); the
 *    loops are bounded by an `unlinked` copy instead (53,000 at 1024 values).
 * With these, it loads with loops bounded by XDP_MAX_LANES and XDP_MAX_VALUES
 * (xdp.XdpPipeline.verifier_stats says how many instructions were processed of
 * the verifier's 1,000,000).
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>

#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "../../wire.h" /* the datagram format, shared with the C cores */

#define XDP_MAX_WORKERS 32 /* pipeline.MAX_WORKERS: the bitmap is 32 bits */
/* The bounds of the loops, hence of a job's packets.  XDP_MAX_VALUES, the values
 * a row holds, is the pipeline's (xdp/pipeline.py builds the program for it, -D, a
 * multiple of 8): the rows are the size the switch's packets need, and the
 * verifier walks loops no longer than they need.  It takes them up to the
 * largest UDP datagram (16360 values in one lane, 16128 in 63: some 577,000
 * instructions processed of its 1,000,000; 79,000 at MTU 9000's 2048 values).
 * xdp/pipeline.py refuses a pipeline whose packets have more lanes. */
#define XDP_MAX_LANES 64
/* Bridge ports served in driver mode at most (the `ports` map). */
#define XDP_MAX_PORTS 256
#ifndef XDP_MAX_VALUES
#error "XDP_MAX_VALUES: the values a slot row holds (xdp/pipeline.py sets it)"
#endif
#define XDP_BODY_MAX (WIRE_LANE_SIZE * XDP_MAX_LANES + 4 * XDP_MAX_VALUES)
/* A slot row: a result datagram (header, lane registers, values) and, as in
 * pipeline.py, room past it (pipeline.py builds resends there; here they are
 * built in the frame, so that room stays unused). */
#define XDP_ROW_SIZE (WIRE_HEADER_SIZE + XDP_BODY_MAX + WIRE_HEADER_SIZE)
#define FRAME_HEADERS (sizeof(struct ethhdr) + sizeof(struct iphdr) + sizeof(struct udphdr))

/* Counters: the Python pipeline's names (pipeline.py, fastpath.h), C_ and
 * upper case; xdp/pipeline.py reads the names from this enum.  The last ones are this
 * program's own: frames the kernel would have dropped before the switch's
 * socket (so pipeline.py never sees them), and what it passes up. */
enum xdp_counter {
    C_PACKETS_IN,
    C_RESULTS_COMPLETED,
    C_RESULTS_OUT,
    C_RETRANSMISSIONS_ANSWERED,
    C_DUPLICATES,
    C_DROPPED_STALE,
    C_DROPPED_MISMATCH,
    C_DROPPED_TRUNCATED,
    C_DROPPED_BAD_MAGIC,
    C_DROPPED_BAD_VERSION,
    C_DROPPED_BAD_KIND,
    C_DROPPED_BAD_DTYPE,
    C_DROPPED_BAD_MODE,
    C_DROPPED_BAD_LENGTH,
    C_DROPPED_BAD_TOKEN,
    C_DROPPED_SLOT_OUT_OF_RANGE,
    C_DROPPED_BAD_LANES,
    C_DROPPED_TOO_MANY_VALUES,
    C_DROPPED_UNKNOWN_SOURCE,
    C_PROBES_IN,
    C_PROBES_WAITING,
    C_RESENDS_ASKED,
    C_DROPPED_BAD_PROBE,
    C_QUERIES_DONE,
    C_DROPPED_INGRESS_SIMULATED,
    C_DROPPED_EGRESS_SIMULATED,
    /* this program's own */
    C_DROPPED_BAD_IP_UDP,         /* a header the kernel refuses: checksum, lengths */
    C_DROPPED_IP_OPTIONS,         /* an IPv4 header with options (no worker sends one) */
    C_DROPPED_IP_FRAGMENT,        /* first fragment of a datagram to the switch */
    C_SPARSE_PASSED_UP,           /* sparse contributions: user space aggregates them */
    C_DROPPED_INTERNAL,           /* a map entry the control plane must have made */
    C_PROBES_PASSED_UP,           /* no room to answer in the frame: user space does */
    C_GSO_PASSED_UP,              /* a UDP GSO super-packet: its datagrams go through user space */
    C_RESULTS_FANNED_OUT,         /* copies of a result sent to ranks by fan_out_results */
    C_RESULTS_FANOUT_FAILED,      /* copies it could not send (the rank's probe recovers) */
    C_RESULT_RUNS_FANNED_OUT,     /* of those copies, the runs (one skb, several results) */
    XDP_NCOUNTERS
};

struct xdp_counters {
    __u64 value[XDP_NCOUNTERS];
};

/* The switch's settings (one entry). */
struct xdp_config {
    __u32 slots;
    __u16 port;    /* the switch's UDP port, network order */
    __u16 pad;
    __u32 ifindex; /* the interface served (xdp.XdpPipeline.serve); 0: none */
    /* simulated drops (pipeline.py's drop_rate, egress_drop_rate): a datagram
     * in, or an answer or result copy out, is lost when a random u32 falls
     * below these (the rate times 2**32); 0: none */
    __u32 ingress_drop, egress_drop;
    /* 1: an answer to one rank goes out by the stack, not XDP_TX: the program
     * runs in a veth's native mode, whose XDP_TX reaches the peer only where
     * the peer polls with NAPI (GRO on, or an XDP program of its own), which
     * the switch cannot tell or set from its side.  The answer, rewritten as
     * for XDP_TX, is passed (XDP_PASS) with ANSWER_MARK in its metadata, and
     * fan_out_results, next on the same device, sends it back out of it. */
    __u32 answers_by_stack;
    /* 1: completed results leave in runs.  On a veth in driver mode, with GRO
     * on the device and UDP_GRO on the switch's socket (xdp/pipeline.py sets
     * both), the kernel merges the results this program passes, one flow's,
     * into one skb, and fan_out_results sends each rank that run whole, as
     * the C switch sends its results (one skb, up to 64 datagrams).  GRO
     * merges UDP datagrams only with a checksum: a result keeps its
     * contribution's (on a veth the sender's seed of a checksum the stack
     * never computes, CHECKSUM_PARTIAL; the merged skb's is made anew by GRO),
     * and a mark in its metadata (RESULT_MARK), which GRO compares: a result
     * is never merged with a sparse contribution of the same flow. */
    __u32 results_in_runs;
    /* the switch's IPv4 address, network order: a datagram to its port for
     * another host (a bridge's port sees every container's traffic, a router
     * forwards others') is not the switch's; 0: any (not serving: test runs) */
    __u32 addr;
};

/* The metadata (bpf_xdp_adjust_meta) of an answer passed to fan_out_results. */
#define ANSWER_MARK 0x534D4C41 /* "SMLA" */
/* The metadata of a completed result passed up where results leave in runs. */
#define RESULT_MARK 0x534D4C52 /* "SMLR" */

/* Member table, the controller's table entries: source address -> job, rank. */
struct member_key {
    __u32 addr;   /* IPv4 source address, network order */
    __u16 port;   /* UDP source port, network order */
    __u16 pad;    /* zero */
};
struct member {
    __u32 job;  /* its job's slot_base: the index of the job in `jobs` */
    __u32 rank;
};

/* Where a rank's copy of a result goes: [slot_base * XDP_MAX_WORKERS + rank].
 * The control plane writes the address and port at install (learned 0); the
 * XDP program learns the Ethernet address a rank's datagrams come from on the
 * served interface, as a switch learns which port a host is behind. */
struct rank_address {
    __u32 addr;          /* IPv4, network order */
    __u16 port;          /* UDP, network order */
    __u8 mac[ETH_ALEN];  /* the source address of its frames */
    __u32 learned;       /* 1: mac holds it */
    __u32 pad;
};

/* pipeline.Job, what the data plane reads of it (written once, at install). */
struct xdp_job {
    __u32 session, world, slot_base, slot_count, lanes, packet_elements, block_elements;
    __u32 pad;
    __u32 tokens[XDP_MAX_WORKERS];
};

/* One shadow-copy set of one slot: pipeline.py's _valid, _msg, _bitmap, _count
 * and _ids, under the lock that makes a contribution's update of them and of
 * the row atomic across the CPUs that run this program at once. */
struct xdp_set {
    struct bpf_spin_lock lock;
    __u32 valid, msg, bitmap, count;
    __u32 seq, pkt_id, dtype, mode, id_count, call; /* pipeline.py's _ids */
};

struct xdp_row {
    __u8 bytes[XDP_ROW_SIZE];
};

/* pipeline.Mismatch of a job, the first only: state 0 none, 1 being written,
 * 2 ready for the controller, 3 taken.  record: the set's bitmap, its (seq,
 * call, dtype), the rank and its (seq, call, dtype). */
struct xdp_mismatch {
    __u32 state;
    __u32 record[8];
};

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct xdp_config);
} config SEC(".maps");

/* The devices the program is attached to besides the interface served (its
 * ifindex -> 1): the ports of a bridge served in driver mode, where a rank's
 * Ethernet address is learned as on the bridge itself. */
struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, XDP_MAX_PORTS);
    __type(key, __u32);
    __type(value, __u32);
} ports SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_HASH);
    __uint(max_entries, 1024); /* xdp/pipeline.py sets it: slots * MAX_WORKERS */
    __type(key, struct member_key);
    __type(value, struct member);
} members SEC(".maps");

/* xdp/pipeline.py sets max_entries to slots * MAX_WORKERS */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct rank_address);
} rank_addresses SEC(".maps");

/* by slot_base; xdp/pipeline.py sets max_entries to the pool's slots */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct xdp_job);
} jobs SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct xdp_mismatch);
} mismatches SEC(".maps");

/* [set * slots + slot], 2 * slots entries (xdp/pipeline.py) */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 2);
    __type(key, __u32);
    __type(value, struct xdp_set);
} sets SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 2);
    __type(key, __u32);
    __type(value, struct xdp_row);
} rows SEC(".maps");

/* [slot_base] a job's counters, [slots] those no job owns (pipeline.counters);
 * per CPU, so that counting needs no atomic operation */
struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, 2);
    __type(key, __u32);
    __type(value, struct xdp_counters);
} counts SEC(".maps");

/* The datagram's body in, the answer's bytes out: [cpu], as a packet is handled
 * from start to end on one CPU (an array, not a per-CPU one, whose values are
 * limited to 32 KiB; xdp/pipeline.py sets max_entries to the possible CPUs). */
struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct xdp_row);
} scratch SEC(".maps");

/* wire.HEADER */
struct wire_header {
    __u16 magic;
    __u8 version, kind, dtype, mode;
    __u16 slot;
    __u32 session, msg, seq, pkt_id;
    __u16 count, lanes;
    __u32 call;
};
_Static_assert(sizeof(struct wire_header) == WIRE_HEADER_SIZE, "wire.HEADER is 32 bytes");

/* What the locked section decided; acted on after the unlock. */
enum action {
    A_DROP,       /* consumed or dropped; the counter is already counted */
    A_DUPLICATE,  /* counters named after the reason, counted after the unlock */
    A_STALE,
    A_MISMATCH,
    A_WAITING,
    A_COMPLETE,   /* result in scratch, to every rank */
    A_RESULT_ONE, /* stored result in scratch, to the sender alone */
    A_RESEND,
    A_DONE,
};

#define LANE_EXP 8

#ifndef barrier_var /* bpf_helpers.h has it from libbpf 1.0 */
#define barrier_var(var) asm volatile("" : "+r"(var))
#endif

static __always_inline int msg_newer(__u32 a, __u32 b)
{ /* wire.msg_newer: serial arithmetic */
    __u32 d = a - b;
    return 0 < d && d < 0x80000000u;
}

static __always_inline void count(struct xdp_counters *c, enum xdp_counter which, __u64 n)
{
    c->value[which] += n;
}

static __always_inline __u16 ip_checksum(struct iphdr *ip)
{ /* over a 20-byte header whose check field is 0 */
    __u16 *w = (__u16 *)ip;
    __u32 sum = 0;
#pragma unroll
    for (int i = 0; i < 10; i++)
        sum += w[i];
    sum = (sum & 0xFFFF) + (sum >> 16);
    sum = (sum & 0xFFFF) + (sum >> 16);
    return (__u16)~sum;
}

/* The loops over a datagram's body and a row go by chunks of 32 bytes, four
 * 64-bit words (8 values) a turn, then at most 7 single values: a quarter of
 * the loop's own instructions per value, and a quarter of the turns for the
 * verifier to walk. */
#define CHUNK 32
_Static_assert(XDP_ROW_SIZE % CHUNK == 0, "snapshot copies whole chunks of a row");
_Static_assert(XDP_MAX_VALUES % 8 == 0, "the value loops go by 8 values");

/* A copy of `var` that the verifier does not link to it (a mov would: the ALU
 * operation gives the copy an identity of its own).  A loop bounded by the copy
 * narrows what the verifier knows of the copy alone, at each of its exits; so
 * the exits differ only in registers that are dead after the loop, and prune to
 * one, instead of each taking the rest of the program with another range of
 * `var` (with 16128 values, two thousand exits: past the verifier's limit). */
#define unlinked(var)                                                               \
    ({                                                                              \
        __u32 __copy = (var);                                                       \
        asm volatile("%0 |= 0" : "+r"(__copy));                                     \
        __copy;                                                                     \
    })

/* Copy the first `bytes` bytes of the row into the scratch value, rounded up to
 * whole chunks (both values hold them: `bytes` is at most a datagram, and a row
 * has a header's room past one): the bytes to send, taken while the set's lock
 * is held so that no other CPU's update of the row tears them. */
static __always_inline void snapshot(__u8 *dst, const __u8 *row, __u32 len)
{
    __u32 bytes = unlinked(len);
    for (__u32 i = 0; i < XDP_ROW_SIZE / CHUNK; i++) {
        if (CHUNK * i >= bytes)
            break;
        __u64 *d = (__u64 *)(dst + CHUNK * i);
        const __u64 *s = (const __u64 *)(row + CHUNK * i);
        d[0] = s[0];
        d[1] = s[1];
        d[2] = s[2];
        d[3] = s[3];
    }
}

/* dst[:bytes] = src[:bytes], exactly (`bytes` a multiple of 4, at most
 * XDP_BODY_MAX): a contribution's lane table and values into a row. */
static __always_inline void copy_body(__u8 *dst, const __u8 *src, __u32 len)
{
    __u32 i, bytes = unlinked(len);
    for (i = 0; i < XDP_BODY_MAX / CHUNK; i++) {
        if (CHUNK * i + CHUNK > bytes)
            break;
        __u64 *d = (__u64 *)(dst + CHUNK * i);
        const __u64 *s = (const __u64 *)(src + CHUNK * i);
        d[0] = s[0];
        d[1] = s[1];
        d[2] = s[2];
        d[3] = s[3];
    }
    __u32 done = bytes & ~(__u32)(CHUNK - 1);
    for (i = 0; i < CHUNK / 4 - 1; i++) {
        __u32 at = done + 4 * i;
        if (at >= bytes || at >= XDP_BODY_MAX)
            break;
        barrier_var(at);
        *(__u32 *)(dst + at) = *(const __u32 *)(src + at);
    }
}

/* Two int32 adds in one 64-bit word, each wrapping around on its own: the low 31
 * bits of each half add without reaching the other half, the top bits by xor. */
static __always_inline __u64 add2(__u64 a, __u64 b)
{
    const __u64 high = 0x8000000080000000ull;
    return ((a & ~high) + (b & ~high)) ^ ((a ^ b) & high);
}

/* row[:values] += in[:values], as int32 with wrap-around. */
static __always_inline void add_values(__u8 *row, const __u8 *in, __u32 count)
{
    __u32 i, values = unlinked(count);
    for (i = 0; i < XDP_MAX_VALUES / 8; i++) {
        if (8 * i + 8 > values)
            break;
        __u64 *r = (__u64 *)(row + CHUNK * i);
        const __u64 *x = (const __u64 *)(in + CHUNK * i);
        r[0] = add2(r[0], x[0]);
        r[1] = add2(r[1], x[1]);
        r[2] = add2(r[2], x[2]);
        r[3] = add2(r[3], x[3]);
    }
    __u32 done = values & ~7u;
    for (i = 0; i < 7; i++) {
        __u32 k = done + i;
        if (k >= values || k >= XDP_MAX_VALUES)
            break;
        barrier_var(k); /* clang would index by done | i, whose bound the verifier loses */
        *(__u32 *)(row + 4 * k) += *(const __u32 *)(in + 4 * k);
    }
}

/* *r = max(*r, *x), as int32, without a branch: a branch per value would leave
 * the verifier a pending state per value, past its limit (8192) at 16368. */
static __always_inline void max_value(__s32 *r, const __s32 *x)
{
    __s64 a = *x, b = *r, d = a - b; /* no overflow in 64 bits */
    barrier_var(d); /* else clang sees a max, and branches */
    *r = (__s32)(a - (d & (d >> 63))); /* d < 0: a - d = b */
}

/* row[:values] = max(row[:values], in[:values]), as int32 (MODE_MAX). */
static __always_inline void max_values(__u8 *row, const __u8 *in, __u32 count)
{
    __u32 i, values = unlinked(count);
    for (i = 0; i < XDP_MAX_VALUES / 8; i++) {
        if (8 * i + 8 > values)
            break;
        __s32 *r = (__s32 *)(row + CHUNK * i);
        const __s32 *x = (const __s32 *)(in + CHUNK * i);
#pragma unroll
        for (int j = 0; j < 8; j++)
            max_value(r + j, x + j);
    }
    __u32 done = values & ~7u;
    for (i = 0; i < 7; i++) {
        __u32 k = done + i;
        if (k >= values || k >= XDP_MAX_VALUES)
            break;
        barrier_var(k); /* clang would index by done | i, whose bound the verifier loses */
        max_value((__s32 *)(row + 4 * k), (const __s32 *)(in + 4 * k));
    }
}

/* pipeline.Pipeline._complete's header: the row becomes the result datagram. */
static __always_inline void write_result_header(__u8 *row, struct xdp_set *set,
                                                const struct xdp_job *job, __u16 slot,
                                                __u16 lanes)
{
    struct wire_header *h = (struct wire_header *)row;
    h->magic = WIRE_MAGIC;
    h->version = WIRE_VERSION;
    h->kind = WIRE_KIND_RESULT;
    h->dtype = (__u8)set->dtype;
    h->mode = (__u8)set->mode;
    h->slot = slot;
    h->session = job->session;
    h->msg = set->msg;
    h->seq = set->seq;
    h->pkt_id = set->pkt_id;
    h->count = (__u16)set->id_count;
    h->lanes = lanes;
    h->call = set->call;
}

/* pipeline.Pipeline._record_mismatch: the first disagreement of a job, claimed
 * with a compare-and-swap (CPUs race for it), published when written. */
static __always_inline void record_mismatch(struct xdp_mismatch *mm, const __u32 record[8])
{
    if (!mm || __sync_val_compare_and_swap(&mm->state, 0, 1) != 0)
        return;
#pragma unroll
    for (int i = 0; i < 8; i++)
        mm->record[i] = record[i];
    __sync_lock_test_and_set(&mm->state, 2); /* an exchange: a full barrier */
}

/* The frame's headers for an answer to the rank that sent it (XDP_TX): swap
 * the addresses and ports, set the lengths, fresh IP checksum, no UDP
 * checksum (IPv4 allows 0: none; the payload was rewritten). */
static __always_inline int frame_to_sender(struct xdp_md *ctx, __u32 len)
{
    void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = (void *)(eth + 1);
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > data_end)
        return XDP_DROP;
    __u8 mac[ETH_ALEN];
    __builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
    __builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
    __builtin_memcpy(eth->h_source, mac, ETH_ALEN);
    __u32 addr = ip->saddr;
    ip->saddr = ip->daddr;
    ip->daddr = addr;
    ip->tot_len = bpf_htons(sizeof(struct iphdr) + sizeof(struct udphdr) + len);
    ip->ttl = 64;
    ip->check = 0;
    ip->check = ip_checksum(ip);
    __u16 port = udp->source;
    udp->source = udp->dest;
    udp->dest = port;
    udp->len = bpf_htons(sizeof(struct udphdr) + len);
    udp->check = 0;
    __u32 zero = 0;
    const struct xdp_config *cfg = bpf_map_lookup_elem(&config, &zero);
    __u32 in = ctx->ingress_ifindex;
    /* by the stack where it came in by a device that fan_out_results serves
     * (not BPF_PROG_TEST_RUN's: user space sends that answer); XDP_TX where
     * the driver keeps no metadata (a NIC's XDP_TX works) */
    if (!cfg || !cfg->answers_by_stack ||
        (in != cfg->ifindex && !bpf_map_lookup_elem(&ports, &in)) ||
        bpf_xdp_adjust_meta(ctx, -(int)sizeof(__u32)))
        return XDP_TX;
    __u32 *mark = (void *)(long)ctx->data_meta;
    if ((void *)(mark + 1) > (void *)(long)ctx->data)
        return XDP_DROP; /* cannot be: the room was just made */
    *mark = ANSWER_MARK;
    return XDP_PASS;
}

/* The frame's headers for a completed result handed to the switch's socket
 * (XDP_PASS): addressed as the contribution was, the same length; no UDP
 * checksum, as the payload changed.  Where results leave in runs (config's
 * results_in_runs) and it came in by a device fan_out_results serves: the
 * contribution's checksum kept (GRO merges nothing without one) and
 * RESULT_MARK in its metadata; fan_out_results makes each copy's checksum. */
static __always_inline int frame_to_host(struct xdp_md *ctx, __u32 len)
{
    void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
    struct iphdr *ip = data + sizeof(struct ethhdr);
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > data_end)
        return XDP_DROP;
    __u16 tot = bpf_htons(sizeof(struct iphdr) + sizeof(struct udphdr) + len);
    if (ip->tot_len != tot) { /* its IP packet was longer than its datagram (padding,
                               * which the kernel trims): the result's own length */
        ip->tot_len = tot;
        ip->check = 0;
        ip->check = ip_checksum(ip);
    }
    __u32 zero = 0, in = ctx->ingress_ifindex;
    const struct xdp_config *cfg = bpf_map_lookup_elem(&config, &zero);
    if (cfg && cfg->results_in_runs && udp->check &&
        (in == cfg->ifindex || bpf_map_lookup_elem(&ports, &in)) &&
        !bpf_xdp_adjust_meta(ctx, -(int)sizeof(__u32))) {
        __u32 *mark = (void *)(long)ctx->data_meta;
        if ((void *)(mark + 1) > (void *)(long)ctx->data)
            return XDP_DROP; /* cannot be: the room was just made */
        *mark = RESULT_MARK;
        return XDP_PASS;
    }
    /* no checksum (also where there was no room for the mark: GRO then leaves it
     * alone); the frame read again, as a failed bpf_xdp_adjust_meta may move it */
    data = (void *)(long)ctx->data;
    data_end = (void *)(long)ctx->data_end;
    udp = data + sizeof(struct ethhdr) + sizeof(struct iphdr);
    if ((void *)(udp + 1) > data_end)
        return XDP_DROP;
    udp->check = 0;
    return XDP_PASS;
}

/* pipeline.py's simulated egress drop of one answer or result copy (of `n`
 * datagrams: a run of results is lost whole): whether it is lost (counted). */
static __always_inline int egress_dropped(struct xdp_counters *counters, __u64 n)
{
    __u32 zero = 0;
    const struct xdp_config *cfg = bpf_map_lookup_elem(&config, &zero);
    if (!cfg || !cfg->egress_drop || bpf_get_prandom_u32() >= cfg->egress_drop)
        return 0;
    count(counters, C_DROPPED_EGRESS_SIMULATED, n);
    return 1;
}

/* Send the `len` bytes in scratch (a result) instead of the datagram: the frame
 * (of its headers and the datagram, and whatever padding followed it) grows or
 * shrinks to fit. */
#define NO_ROOM 1
static __always_inline int put_scratch(struct xdp_md *ctx, const __u8 *bytes, __u32 len)
{
    if (len < 1 || len > XDP_ROW_SIZE)
        return -1; /* cannot be: a row prefix; bounds the helper's size */
    int delta = (int)(FRAME_HEADERS + len) - (int)bpf_xdp_get_buff_len(ctx);
    if (delta && bpf_xdp_adjust_tail(ctx, delta))
        return NO_ROOM; /* the frame as it came: the caller decides */
    return bpf_xdp_store_bytes(ctx, FRAME_HEADERS, (void *)bytes, len) ? -1 : 0;
}

/* pipeline.Pipeline._answer_probe: a retransmission without its values, a probe
 * or a query.  Returns the XDP action. */
static __always_inline int answer_probe(struct xdp_md *ctx, struct xdp_counters *counters,
                                        const struct xdp_job *job, __u32 rank,
                                        const struct wire_header *h, __u32 slots)
{
    if (h->count || h->lanes) {
        count(counters, C_DROPPED_BAD_PROBE, 1);
        return XDP_DROP;
    }
    count(counters, C_PROBES_IN, 1);
    __u32 v = h->msg & 1, row_index = v * slots + h->slot, cpu = bpf_get_smp_processor_id();
    struct xdp_set *set = bpf_map_lookup_elem(&sets, &row_index);
    struct xdp_row *row = bpf_map_lookup_elem(&rows, &row_index);
    struct xdp_row *out = bpf_map_lookup_elem(&scratch, &cpu);
    if (!set || !row || !out) {
        count(counters, C_DROPPED_INTERNAL, 1);
        return XDP_DROP;
    }
    __u32 lanes = job->lanes;
    if (lanes > XDP_MAX_LANES) /* cannot be (xdp/pipeline.py); bounds the lengths below */
        lanes = XDP_MAX_LANES;
    barrier_var(lanes); /* see receive_datagram */
    enum action action;
    __u32 out_len = 0;
    bpf_spin_lock(&set->lock);
    if (set->valid && h->msg == set->msg) {
        if (set->bitmap >> rank & 1) {
            if (set->count < job->world) {
                action = A_WAITING; /* for another rank's contribution */
            } else if (h->kind == WIRE_KIND_PROBE) {
                /* pipeline._answer_retransmission */
                __u32 values = set->id_count > XDP_MAX_VALUES ? XDP_MAX_VALUES : set->id_count;
                out_len = WIRE_HEADER_SIZE + WIRE_LANE_SIZE * lanes + 4 * values;
                snapshot(out->bytes, row->bytes, out_len);
                action = A_RESULT_ONE;
            } else {
                action = A_DONE; /* a query: its result went out already */
            }
        } else {
            action = A_RESEND;
        }
    } else if (set->valid && !msg_newer(h->msg, set->msg)) {
        action = A_STALE;
    } else {
        action = A_RESEND;
    }
    bpf_spin_unlock(&set->lock);

    switch (action) {
    case A_WAITING:
        count(counters, C_PROBES_WAITING, 1);
        return XDP_DROP;
    case A_STALE:
        count(counters, C_DROPPED_STALE, 1);
        return XDP_DROP;
    case A_RESULT_ONE: {
        int put = put_scratch(ctx, out->bytes, out_len);
        if (put == NO_ROOM) {
            /* Attached in generic mode, a frame is the skb it came in, whose
             * tail has no room for a result when it held a 32-byte probe; a
             * driver's frame (a page) has room for a result that fits a page,
             * and no frame for a result past the tail of its last buffer.
             * Passed up as it is (a probe: the switch's socket never takes it
             * for a result), user space runs it through this program again
             * (xdp.XdpPipeline.passed_up) in a frame padded to a whole
             * result's length, which answers it and counts it:
             * uncounted here, by adding -1 (the per-CPU sums are taken modulo
             * 2**64). */
            count(counters, C_PROBES_IN, (__u64)-1);
            count(counters, C_PROBES_PASSED_UP, 1);
            return XDP_PASS;
        }
        if (put) {
            count(counters, C_DROPPED_INTERNAL, 1);
            return XDP_DROP;
        }
        count(counters, C_RETRANSMISSIONS_ANSWERED, 1);
        if (egress_dropped(counters, 1))
            return XDP_DROP;
        count(counters, C_RESULTS_OUT, 1);
        return frame_to_sender(ctx, out_len);
    }
    default: { /* pipeline._answer_header: the probe's header as a resend or done */
        __u8 kind = action == A_DONE ? WIRE_KIND_DONE : WIRE_KIND_RESEND;
        count(counters, action == A_DONE ? C_QUERIES_DONE : C_RESENDS_ASKED, 1);
        if (egress_dropped(counters, 1))
            return XDP_DROP;
        __u32 session = job->session; /* the job's, not the rank's token */
        if (bpf_xdp_store_bytes(ctx, FRAME_HEADERS + 3, &kind, 1) ||
            bpf_xdp_store_bytes(ctx, FRAME_HEADERS + 8, &session, 4)) {
            count(counters, C_DROPPED_INTERNAL, 1);
            return XDP_DROP;
        }
        return frame_to_sender(ctx, WIRE_HEADER_SIZE);
    }
    }
}

/* Remember the Ethernet address rank `rank` of job `job_index` sends from, for
 * fan_out_results: only for frames that came in by the interface served (not
 * BPF_PROG_TEST_RUN's frames, which come "from" the loopback device with
 * made-up addresses), and only once the rank's token matched. */
static __always_inline void learn_address(__u32 job_index, __u32 rank, const __u8 *mac)
{
    __u32 at = job_index * XDP_MAX_WORKERS + rank;
    struct rank_address *a = bpf_map_lookup_elem(&rank_addresses, &at);
    if (!a)
        return;
    __u8 differ = !a->learned;
#pragma unroll
    for (int i = 0; i < ETH_ALEN; i++)
        differ |= a->mac[i] ^ mac[i];
    if (!differ)
        return;
    __builtin_memcpy(a->mac, mac, ETH_ALEN);
    a->learned = 1;
}

/* pipeline.Pipeline.receive_datagram, after the frame's headers are checked.
 * `src_mac`: the frame's Ethernet source where it came in by the interface
 * served, else NULL. */
static __always_inline int receive_datagram(struct xdp_md *ctx, __u32 len,
                                            const struct member *m, __u32 slots,
                                            const __u8 *src_mac)
{
    __u32 job_index = m->job, cpu = bpf_get_smp_processor_id();
    const struct xdp_job *job = bpf_map_lookup_elem(&jobs, &job_index);
    struct xdp_counters *counters = bpf_map_lookup_elem(&counts, &job_index);
    if (!job || !counters)
        return XDP_DROP; /* cannot be: the control plane writes both before the member */
    __u32 rank = m->rank & (XDP_MAX_WORKERS - 1); /* < world <= 32; the mask bounds it */
#define DROP(reason)                                                                      \
    do {                                                                                  \
        count(counters, reason, 1);                                                       \
        return XDP_DROP;                                                                  \
    } while (0)
    /* wire.decode_header, in its order */
    if (len < WIRE_HEADER_SIZE)
        DROP(C_DROPPED_TRUNCATED);
    /* The header is in the frame's first buffer (a page, or the whole frame):
     * read in place, which costs less than the helper's copy. */
    struct wire_header h;
    const void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
    if (data + FRAME_HEADERS + sizeof h <= data_end)
        __builtin_memcpy(&h, data + FRAME_HEADERS, sizeof h);
    else if (bpf_xdp_load_bytes(ctx, FRAME_HEADERS, &h, sizeof h))
        DROP(C_DROPPED_TRUNCATED); /* cannot be: the UDP length was checked against the frame */
    if (h.magic != WIRE_MAGIC)
        DROP(C_DROPPED_BAD_MAGIC);
    if (h.version != WIRE_VERSION)
        DROP(C_DROPPED_BAD_VERSION);
    if (h.kind < WIRE_KIND_CONTRIBUTION || h.kind > WIRE_KIND_DONE) /* wire.KINDS */
        DROP(C_DROPPED_BAD_KIND);
    if (h.dtype > WIRE_DTYPE_FLOAT16_WIRE) /* all three add as int32 */
        DROP(C_DROPPED_BAD_DTYPE);
    if (h.mode != 0 && h.mode != WIRE_MODE_SPARSE &&
        h.mode != (WIRE_MODE_SPARSE | WIRE_MODE_SEED) && h.mode != WIRE_MODE_MAX)
        DROP(C_DROPPED_BAD_MODE);
    __u32 declared = WIRE_HEADER_SIZE + WIRE_LANE_SIZE * (__u32)h.lanes + 4 * (__u32)h.count;
    if (len != declared) {
        /* Longer by a header or more: a UDP GSO super-packet, a run of
         * datagrams a sender on this host (a veth peer, loopback) hands over
         * whole, which XDP sees as one.  Passed up, the kernel cuts it into its
         * datagrams for the switch's socket (a socket without UDP_GRO), and
         * user space runs each through this program (xdp.XdpPipeline.passed_up);
         * anything else that long is dropped there, as bad_length. */
        if (len > declared && len - declared >= WIRE_HEADER_SIZE &&
            (h.kind == WIRE_KIND_CONTRIBUTION || h.kind == WIRE_KIND_PROBE ||
             h.kind == WIRE_KIND_QUERY)) { /* what a worker sends: never a result */
            count(counters, C_GSO_PASSED_UP, 1);
            return XDP_PASS;
        }
        DROP(C_DROPPED_BAD_LENGTH);
    }
    /* admission: the job's table entries */
    if (h.kind != WIRE_KIND_CONTRIBUTION && h.kind != WIRE_KIND_PROBE &&
        h.kind != WIRE_KIND_QUERY)
        DROP(C_DROPPED_BAD_KIND);
    if (h.session != job->tokens[rank]) /* not this rank's token: forged, or an old job's */
        DROP(C_DROPPED_BAD_TOKEN);
    if (src_mac)
        learn_address(job_index, rank, src_mac);
    if (h.slot < job->slot_base || h.slot >= job->slot_base + job->slot_count)
        DROP(C_DROPPED_SLOT_OUT_OF_RANGE);
    if (h.slot >= slots) /* cannot be: the job's slots are the pool's */
        DROP(C_DROPPED_INTERNAL);
    if (h.kind != WIRE_KIND_CONTRIBUTION)
        return answer_probe(ctx, counters, job, rank, &h, slots);
    __u32 lanes = h.lanes, values = h.count;
    if (lanes != job->lanes)
        DROP(C_DROPPED_BAD_LANES);
    if (values > job->packet_elements)
        DROP(C_DROPPED_TOO_MANY_VALUES);
    if (h.mode & WIRE_MODE_SPARSE) {
        /* The sparse path (its blocks flagged per lane, added at their own
         * places, compacted at the end) is not in this program: the datagram
         * goes up to the switch's socket as it came, checked so far, and
         * xdp.XdpPipeline.passed_up runs pipeline.py's sparse path on this
         * set, read from and written back to these maps (which this program
         * then answers the set's probes and retransmissions from).  A set
         * holding a sparse message is written by user space alone: a dense
         * contribution of its message differs in mode (a mismatch), and a
         * newer message comes only once its result went out. */
        count(counters, C_SPARSE_PASSED_UP, 1);
        return XDP_PASS;
    }
    if (lanes > XDP_MAX_LANES || values > XDP_MAX_VALUES)
        DROP(C_DROPPED_INTERNAL); /* cannot be: xdp/pipeline.py refuses such jobs; bounds the loops */
    /* clang computed 12 * lanes from the unchecked u16 before this check and kept
     * it; the verifier then saw offsets up to 786420 into a 4928-byte value.  The
     * barrier makes every later use start from the checked registers. */
    barrier_var(lanes);
    barrier_var(values);
    count(counters, C_PACKETS_IN, 1);

    __u32 body = WIRE_LANE_SIZE * lanes + 4 * values; /* >= 12: a job has a lane */
    __u32 v = h.msg & 1, row_index = v * slots + h.slot, bit = 1u << rank;
    struct xdp_set *set = bpf_map_lookup_elem(&sets, &row_index);
    struct xdp_row *row = bpf_map_lookup_elem(&rows, &row_index);
    struct xdp_row *in = bpf_map_lookup_elem(&scratch, &cpu);
    if (!set || !row || !in || body < 1 || body > XDP_BODY_MAX)
        DROP(C_DROPPED_INTERNAL);
    if (bpf_xdp_load_bytes(ctx, FRAME_HEADERS + WIRE_HEADER_SIZE, in->bytes, body))
        DROP(C_DROPPED_INTERNAL); /* cannot be: the length was checked */

    const __u8 *in_lanes = in->bytes, *in_values = in->bytes + WIRE_LANE_SIZE * lanes;
    __u8 *regs = row->bytes + WIRE_HEADER_SIZE;
    __u8 *row_values = regs + WIRE_LANE_SIZE * lanes;
    __u32 world = job->world, i, out_len = 0;
    __u32 record[8];
    enum action action = A_DROP;

    bpf_spin_lock(&set->lock);
    if (!set->valid || msg_newer(h.msg, set->msg)) { /* a fresh aggregation */
        set->valid = 1;
        set->msg = h.msg;
        set->seq = h.seq;
        set->pkt_id = h.pkt_id;
        set->dtype = h.dtype;
        set->mode = h.mode;
        set->id_count = values;
        set->call = h.call;
        set->bitmap = bit;
        set->count = 1;
        copy_body(regs, in_lanes, body); /* regs[:] = lanes, values[:count] = values */
    } else if (h.msg == set->msg) {
        if (set->bitmap & bit) {
            if (set->count == world) { /* pipeline._answer_retransmission */
                __u32 stored = set->id_count > XDP_MAX_VALUES ? XDP_MAX_VALUES : set->id_count;
                out_len = WIRE_HEADER_SIZE + WIRE_LANE_SIZE * lanes + 4 * stored;
                snapshot(in->bytes, row->bytes, out_len);
                action = A_RESULT_ONE;
            } else {
                action = A_DUPLICATE;
            }
        } else if (h.seq != set->seq || h.pkt_id != set->pkt_id || h.dtype != set->dtype ||
                   h.mode != set->mode || values != set->id_count || h.call != set->call) {
            record[0] = set->bitmap; /* pipeline._record_mismatch's, taken under the lock */
            record[1] = set->seq;
            record[2] = set->call;
            record[3] = set->dtype;
            record[4] = rank;
            record[5] = h.seq;
            record[6] = h.call;
            record[7] = h.dtype;
            action = A_MISMATCH;
        } else {
            if (h.mode == WIRE_MODE_MAX)
                max_values(row_values, in_values, values);
            else
                add_values(row_values, in_values, values);
            for (i = 0; i < XDP_MAX_LANES; i++) { /* per lane, the largest exponent */
                if (i >= lanes)
                    break;
                __s16 exp = *(const __s16 *)(in_lanes + WIRE_LANE_SIZE * i + LANE_EXP);
                __s16 *reg = (__s16 *)(regs + WIRE_LANE_SIZE * i + LANE_EXP);
                if (exp > *reg)
                    *reg = exp;
            }
            set->bitmap |= bit;
            set->count++;
        }
    } else {
        action = A_STALE;
    }
    if (action == A_DROP && set->count >= world) { /* pipeline._complete */
        set->id_count = values;
        write_result_header(row->bytes, set, job, h.slot, (__u16)lanes);
        out_len = WIRE_HEADER_SIZE + body;
        snapshot(in->bytes, row->bytes, out_len);
        action = A_COMPLETE;
    }
    bpf_spin_unlock(&set->lock);

    switch (action) {
    case A_DUPLICATE:
        DROP(C_DUPLICATES);
    case A_STALE:
        DROP(C_DROPPED_STALE);
    case A_MISMATCH: /* the record's entry looked up only here: a rare path */
        record_mismatch(bpf_map_lookup_elem(&mismatches, &job_index), record);
        DROP(C_DROPPED_MISMATCH);
    case A_RESULT_ONE:
        count(counters, C_RETRANSMISSIONS_ANSWERED, 1);
        if (egress_dropped(counters, 1))
            return XDP_DROP;
        if (put_scratch(ctx, in->bytes, out_len))
            DROP(C_DROPPED_INTERNAL);
        count(counters, C_RESULTS_OUT, 1);
        return frame_to_sender(ctx, out_len);
    case A_COMPLETE:
        count(counters, C_RESULTS_COMPLETED, 1);
        if (put_scratch(ctx, in->bytes, out_len))
            DROP(C_DROPPED_INTERNAL);
        count(counters, C_RESULTS_OUT, world); /* fan_out_results or user space: each rank */
        return frame_to_host(ctx, out_len);
    default:
        return XDP_DROP; /* added: the set waits for other ranks */
    }
#undef DROP
}

/* xdp.frags: frames past one page come as several buffers (multi-buffer XDP);
 * the headers are read in the first, the datagram with load and store bytes. */
SEC("xdp.frags")
int xdp_pipeline(struct xdp_md *ctx)
{
    void *data = (void *)(long)ctx->data, *data_end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = (void *)(eth + 1);
    struct udphdr *udp = (void *)(ip + 1);
    __u32 zero = 0;
    /* not a UDP datagram over IPv4 (ARP, IPv6, TCP...): the host's business */
    if ((void *)(ip + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP) ||
        ip->protocol != IPPROTO_UDP)
        return XDP_PASS;
    const struct xdp_config *cfg = bpf_map_lookup_elem(&config, &zero);
    if (!cfg)
        return XDP_PASS;
    __u32 slots = cfg->slots;
    struct xdp_counters *global = bpf_map_lookup_elem(&counts, &slots);
    if (!global)
        return XDP_PASS; /* not configured yet */
    if (ip->frag_off & bpf_htons(0x1FFF))
        return XDP_PASS; /* a later fragment: no port to tell whose; the host drops it */
    if (ip->ihl != 5) {
        /* options: the UDP header is further on; drop the switch's, pass the rest */
        __u32 ihl = ip->ihl * 4;
        if (ihl < sizeof(struct iphdr) || ihl > 60)
            return XDP_PASS;
        struct udphdr *u = (void *)ip + ihl;
        if ((void *)(u + 1) > data_end || u->dest != cfg->port ||
            (cfg->addr && ip->daddr != cfg->addr))
            return XDP_PASS;
        count(global, C_DROPPED_IP_OPTIONS, 1);
        return XDP_DROP;
    }
    if ((void *)(udp + 1) > data_end || udp->dest != cfg->port ||
        (cfg->addr && ip->daddr != cfg->addr))
        return XDP_PASS;
    if (ip->frag_off & bpf_htons(0x2000)) { /* a first fragment (workers set DF) */
        count(global, C_DROPPED_IP_FRAGMENT, 1);
        return XDP_DROP;
    }
    /* What the kernel checks before a datagram reaches a socket (ip_rcv,
     * udp_rcv): a datagram it would drop is one pipeline.py never sees.  The UDP
     * checksum is not verified here yet (see xdp/pipeline.py). */
    __u32 frame = bpf_xdp_get_buff_len(ctx), tot = bpf_ntohs(ip->tot_len), ulen = bpf_ntohs(udp->len);
    __u16 check = ip->check;
    ip->check = 0;
    __u16 want = ip_checksum(ip);
    ip->check = check;
    if (check != want || tot < sizeof(struct iphdr) + sizeof(struct udphdr) ||
        tot > frame - sizeof(struct ethhdr) || ulen < sizeof(struct udphdr) ||
        ulen > tot - sizeof(struct iphdr)) {
        count(global, C_DROPPED_BAD_IP_UDP, 1);
        return XDP_DROP;
    }
    if (cfg->ingress_drop && bpf_get_prandom_u32() < cfg->ingress_drop) {
        count(global, C_DROPPED_INGRESS_SIMULATED, 1);
        return XDP_DROP;
    }
    struct member_key key = {.addr = ip->saddr, .port = udp->source, .pad = 0};
    const struct member *m = bpf_map_lookup_elem(&members, &key);
    if (!m) {
        count(global, C_DROPPED_UNKNOWN_SOURCE, 1);
        return XDP_DROP;
    }
    __u8 src_mac[ETH_ALEN];
    __builtin_memcpy(src_mac, eth->h_source, ETH_ALEN);
    __u32 in = ctx->ingress_ifindex;
    int served = cfg->ifindex && (in == cfg->ifindex || bpf_map_lookup_elem(&ports, &in));
    return receive_datagram(ctx, ulen - sizeof(struct udphdr), m, slots,
                            served ? src_mac : (const __u8 *)0);
}

/* The multicast engine and egress of a switch, for completed results: a TC
 * program on the ingress of the interface served, which sees what the XDP
 * program passes up (XDP runs first, on the same device).  A datagram of kind
 * RESULT to the switch's port from a member's address is a result the XDP
 * program completed (it drops every result a member sends); this sends one
 * copy to every rank of the member's job (bpf_clone_redirect, and the frame
 * itself to the last rank, bpf_redirect; out of the interface served, through
 * its normal transmit path: a bridge forwards each
 * copy to the port its Ethernet address is behind, through that port's
 * qdisc), each addressed as the switch's socket would address it: from the
 * switch's address and port to the rank's, to the Ethernet address its
 * datagrams come from, a fresh IP checksum, no UDP checksum (as XDP_TX's
 * answers).  Several ranks behind one port or host each get their own copy.
 *
 * When a rank's Ethernet address is not known (it never sent a datagram in by
 * this interface: a rank on the switch's own host, or one that came by
 * another interface), the result goes on to the switch's socket (TCX_NEXT,
 * below: the stack after the hook's other programs) and user space sends it
 * to every rank
 * (xdp.XdpPipeline.passed_up, counted as results_passed_up). */
struct result_headers {
    __u16 pad; /* aligns the IP header: the verifier wants aligned stack accesses */
    struct ethhdr eth;
    struct iphdr ip;
    struct udphdr udp;
};
/* What a tcx program returns for a frame it leaves alone: the next program on
 * the hook runs (another switch's fan_out_results, on an interface that
 * several XDP switches share), and after the last, the stack.  TC_ACT_OK
 * (TCX_PASS) would end the chain there, and a later switch's program would
 * never see its results.  TCX_NEXT is TC_ACT_UNSPEC, which older uapi headers
 * have under that name only. */
#define TCX_NEXT TC_ACT_UNSPEC
#define RESULT_HEADERS_AT __builtin_offsetof(struct result_headers, eth)
_Static_assert(sizeof(struct result_headers) == 2 + FRAME_HEADERS, "headers unpadded");

/* The 16-bit one's-complement sum of the UDP pseudo-header (addresses, protocol,
 * length as they are in the packet), folded, not inverted: the checksum field
 * of a CHECKSUM_PARTIAL skb, from which the segments' checksums are made. */
static __always_inline __u16 pseudo_header_sum(__u32 saddr, __u32 daddr, __u16 udp_len)
{
    __u32 sum = (saddr >> 16) + (saddr & 0xFFFF) + (daddr >> 16) + (daddr & 0xFFFF) +
                bpf_htons(IPPROTO_UDP) + udp_len;
    sum = (sum & 0xFFFF) + (sum >> 16);
    sum = (sum & 0xFFFF) + (sum >> 16);
    return (__u16)sum;
}

/* Whether skb->data is at the frame's IP header `ip` (1) rather than at its
 * Ethernet header (0), or unreadable (-1).  At TC ingress it is where the
 * kernel put the Ethernet header back for the program, but for a frame XDP
 * passed up in generic mode this kernel leaves it at the IP header (seen on
 * 6.18: mac_len 0). */
static __always_inline int data_at_ip(struct __sk_buff *skb, const struct iphdr *ip)
{
    struct iphdr at_data;
    if (bpf_skb_load_bytes(skb, 0, &at_data, sizeof at_data))
        return -1;
    return at_data.saddr == ip->saddr && at_data.daddr == ip->daddr &&
           at_data.id == ip->id && at_data.tot_len == ip->tot_len;
}

/* A result's UDP checksum set to none, for the switch's socket: where results
 * leave in runs the XDP program kept its contribution's, which is not its
 * own (the socket trusts it only in a CHECKSUM_PARTIAL skb).  `ip`: its IP
 * header. */
static __always_inline void no_udp_checksum(struct __sk_buff *skb, const struct iphdr *ip)
{
    __u16 none = 0;
    int at_ip = data_at_ip(skb, ip);
    if (at_ip < 0)
        return;
    bpf_skb_store_bytes(skb, (at_ip ? 0 : ETH_HLEN) + sizeof(struct iphdr) +
                        __builtin_offsetof(struct udphdr, check), &none, sizeof none, 0);
}

SEC("tc")
int fan_out_results(struct __sk_buff *skb)
{
    __u32 zero = 0;
    const struct xdp_config *cfg = bpf_map_lookup_elem(&config, &zero);
    if (!cfg || !cfg->ifindex)
        return TCX_NEXT;
    void *meta = (void *)(long)skb->data_meta, *data = (void *)(long)skb->data;
    if (cfg->answers_by_stack && meta + sizeof(__u32) <= data &&
        *(__u32 *)meta == ANSWER_MARK) /* an answer the XDP program made: back out */
        return bpf_redirect(skb->ifindex, 0);
    struct result_headers f;
    __u8 kind;
    if (bpf_skb_load_bytes_relative(skb, 0, &f.eth, sizeof f.eth, BPF_HDR_START_MAC) ||
        bpf_skb_load_bytes_relative(skb, 0, &f.ip, sizeof f.ip + sizeof f.udp,
                                    BPF_HDR_START_NET) ||
        f.eth.h_proto != bpf_htons(ETH_P_IP) || f.ip.ihl != 5 ||
        f.ip.protocol != IPPROTO_UDP || f.udp.dest != cfg->port ||
        (f.ip.frag_off & bpf_htons(0x3FFF)) || /* a fragment: its payload is no header */
        (cfg->addr && f.ip.daddr != cfg->addr) ||
        bpf_skb_load_bytes_relative(skb, sizeof f.ip + sizeof f.udp + 3, &kind, 1,
                                    BPF_HDR_START_NET) ||
        kind != WIRE_KIND_RESULT)
        return TCX_NEXT;
    struct member_key key = {.addr = f.ip.saddr, .port = f.udp.source, .pad = 0};
    const struct member *m = bpf_map_lookup_elem(&members, &key);
    if (!m)
        return TCX_NEXT;
    __u32 job_index = m->job, rank, at;
    const struct xdp_job *job = bpf_map_lookup_elem(&jobs, &job_index);
    struct xdp_counters *counters = bpf_map_lookup_elem(&counts, &job_index);
    if (!job || !counters || job->world < 1 || job->world > XDP_MAX_WORKERS)
        return TCX_NEXT;
    __u32 world = job->world;
    /* A run of results the kernel merged (config's results_in_runs): its
     * datagrams count one each, and it goes to each rank whole. */
    __u32 segs = skb->gso_segs > 1 ? skb->gso_segs : 1;
    for (rank = 0; rank < XDP_MAX_WORKERS; rank++) { /* every rank reachable from here? */
        if (rank >= world)
            break;
        at = job_index * XDP_MAX_WORKERS + rank;
        const struct rank_address *a = bpf_map_lookup_elem(&rank_addresses, &at);
        if (!a || !a->learned) { /* user space sends it to every rank */
            if (cfg->results_in_runs && segs == 1)
                no_udp_checksum(skb, &f.ip); /* the contribution's, kept: not this one's */
            return TCX_NEXT;
        }
    }
    /* The copies leave from skb->data, which must be the Ethernet header:
     * where it is at the IP header (data_at_ip), room is made for one. */
    int at_ip = data_at_ip(skb, &f.ip);
    if (at_ip < 0 || (at_ip && bpf_skb_change_head(skb, ETH_HLEN, 0)))
        return TCX_NEXT;
    __u8 switch_mac[ETH_ALEN];
    __builtin_memcpy(switch_mac, f.eth.h_dest, ETH_ALEN);
    __u32 switch_addr = f.ip.daddr;
    __u16 switch_port = f.udp.dest;
    for (rank = 0; rank < XDP_MAX_WORKERS; rank++) {
        if (rank >= world)
            break;
        at = job_index * XDP_MAX_WORKERS + rank;
        const struct rank_address *a = bpf_map_lookup_elem(&rank_addresses, &at);
        if (!a)
            break; /* cannot be: checked above */
        if (egress_dropped(counters, segs)) { /* this copy lost: counted out again */
            count(counters, C_RESULTS_OUT, -(__u64)segs);
            continue;
        }
        __builtin_memcpy(f.eth.h_dest, a->mac, ETH_ALEN);
        __builtin_memcpy(f.eth.h_source, switch_mac, ETH_ALEN);
        f.ip.saddr = switch_addr;
        f.ip.daddr = a->addr;
        f.ip.ttl = 64;
        f.ip.check = 0;
        f.ip.check = ip_checksum(&f.ip);
        f.udp.source = switch_port;
        f.udp.dest = a->port;
        /* a run's segmentation completes the checksum from the pseudo-header's
         * sum (GRO made the skb CHECKSUM_PARTIAL); a datagram alone has none */
        f.udp.check = segs > 1 ? pseudo_header_sum(switch_addr, a->addr, f.udp.len) : 0;
        if (bpf_skb_store_bytes(skb, 0, (__u8 *)&f + RESULT_HEADERS_AT, FRAME_HEADERS, 0)) {
            count(counters, C_RESULTS_FANOUT_FAILED, segs);
            continue;
        }
        if (segs > 1)
            count(counters, C_RESULT_RUNS_FANNED_OUT, 1);
        if (rank + 1 == world) { /* the frame itself goes to the last rank: no clone */
            count(counters, C_RESULTS_FANNED_OUT, segs);
            return bpf_redirect(cfg->ifindex, 0);
        }
        if (bpf_clone_redirect(skb, cfg->ifindex, 0)) {
            count(counters, C_RESULTS_FANOUT_FAILED, segs);
            if (segs > 1)
                count(counters, C_RESULT_RUNS_FANNED_OUT, (__u64)-1);
        } else {
            count(counters, C_RESULTS_FANNED_OUT, segs);
        }
    }
    return TC_ACT_SHOT; /* the last rank's copy failed or was lost: the socket gets nothing */
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
