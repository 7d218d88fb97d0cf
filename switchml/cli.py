"""The ``switchml`` command: ``switch``, ``stats``, ``demo``, ``testbed`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys

from . import __version__, config
from .errors import SwitchMLError
from .switch.dataplane.pipeline import MAX_WORKERS
from .wire import max_packet_elements
from .worker.client import fetch_stats

LIMITS = f"""limits (each refused with an error that names it):
  at most {MAX_WORKERS} workers per job (max_workers: the width of the switch's
    contribution bitmap);
  at most {max_packet_elements(config.DEFAULT_BLOCK_ELEMENTS)} elements per packet with \
{config.DEFAULT_BLOCK_ELEMENTS}-value blocks (one UDP datagram
    holds (65507 - 32) // (12 + 4 * block) whole blocks): --packet-elements;
  at most --max-jobs jobs running at once (max_jobs);
  a job's window of slots must fit in the free part of the pool (slots): a job
    that does not fit is refused, or waits if its workers pass wait_for_slots;
  at most 65535 slots in the pool;
  a control connection must join (or ask for stats) within --join-deadline
    seconds; at most --max-unjoined connections that have not joined, and
    --max-unjoined-per-source from one address: one more closes the oldest;
  the descriptors the jobs may need must fit in the hard RLIMIT_NOFILE (the
    switch raises its soft limit to it at start)."""


#: ``switchml switch``'s flags that are settings of the switch (SwitchConfiguration).
SWITCH_FLAGS = ("host", "port", "slots", "packet_elements", "block_elements", "slots_per_job",
                "max_jobs", "metrics_port", "metrics_host", "keepalive", "drop_rate", "seed",
                "upstream", "shared_link", "token_file", "data_plane", "threads",
                "join_deadline", "max_unjoined", "max_unjoined_per_source")


def switch_configuration(args, environ=None) -> config.SwitchConfiguration:
    """``switchml switch``'s settings: the flags given, then SWITCHML_*, then the
    defaults, the port's being 7300 (a switch a host runs, not a test's)."""
    given = {name: getattr(args, name) for name in SWITCH_FLAGS
             if getattr(args, name) is not None}
    return config.SwitchConfiguration.from_env(defaults={"port": config.DEFAULT_PORT},
                                               environ=environ, **given)


def _switch(args) -> int:
    from .switch.server import Switch

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        switch = Switch(configuration=switch_configuration(args))
        switch.start()
    except (ValueError, OSError, SwitchMLError) as exc:
        print(f"switchml switch: {exc}", file=sys.stderr)
        return 2
    assert switch.address is not None
    host, port = switch.address
    print(f"switchml switch listening on {host}:{port} (TCP control, UDP data); "
          f"export SWITCHML_SWITCH={host}:{port}", flush=True)
    if switch.metrics_address:
        print("Prometheus metrics on http://%s:%d/metrics" % switch.metrics_address, flush=True)
    # SIGTERM (kill, systemd, docker stop) stops it as Ctrl-C does: detached,
    # and what it changed on its interfaces put back
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        switch.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    except SwitchMLError as exc:  # it stopped serving by itself (``Switch.failure``)
        print(f"switchml switch: {exc}", file=sys.stderr)
        return 1
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _table(header: list, rows: list) -> list:
    """Lines of a plain text table: the first column left-aligned, the others right."""
    cells = [[str(c) for c in row] for row in [header] + rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in cells]


#: The reasons a switch closes control connections, in words (``stats()["control"]``).
CLOSED_WORDS = {"join_deadline": "did not join within the deadline",
                "source_cap": "over the cap of one address", "unjoined_cap": "over the cap of all",
                "bad_message": "bad message", "slow_reader": "did not read its replies",
                "lost": "lost"}


def format_stats(stats: dict) -> str:
    """The counters of ``fetch_stats`` as tables: jobs, then drops by reason and job."""
    admission = stats.get("admission", {})
    running = admission.get("running", len(stats["jobs"]))
    lines = [f"slots {stats['slots']} (free {stats['free_slots']}), packet_elements "
             f"{stats['packet_elements']}, jobs running {running} (max "
             f"{admission.get('max_jobs', '?')}), cpu {stats.get('cpu_s', 0):.2f}s over "
             f"{stats.get('uptime_s', 0):.1f}s"]
    control = stats.get("control")
    if control is not None:
        limit = control.get("descriptor_limit")
        lines.append(f"control connections {control['connections']} ({control['unjoined']} "
                     f"not joined; at most {control['max_unjoined']}, "
                     f"{control['max_unjoined_per_source']} from one address; join deadline "
                     f"{control['join_deadline_s']:g}s), descriptor limit "
                     f"{limit if limit is not None else 'none'}")
        closed = {k: v for k, v in control["closed"].items() if v}
        if closed:
            lines.append("control connections closed: " + ", ".join(
                f"{CLOSED_WORDS.get(k, k)} {v}" for k, v in closed.items()))
    jobs = [(name, "running", job) for name, job in stats["jobs"].items()]
    jobs += [(name, job.get("state", "ended"), job) for name, job in stats["ended_jobs"].items()]
    rows = []
    for name, state, job in jobs:
        c = job["counters"]
        rows.append([name, f"{job['session']:08x}", state, job["world_size"],
                     f"{job['slot_base']}..{job['slot_base'] + job['slot_count'] - 1}",
                     c.get("packets_in", 0), c.get("results_out", 0),
                     c.get("retransmissions_answered", 0), c.get("duplicates", 0),
                     sum(v for k, v in c.items() if k.startswith("dropped_"))])
    lines += [""] + _table(["job", "session", "state", "world", "slots", "packets_in",
                            "results_out", "retransmits", "duplicates", "dropped"], rows)
    for job in admission.get("waiting", []):
        lines.append(f"waiting for room: {job['job']} ({job['world_size']} ranks, "
                     f"{job['slots']} slots)")
    for job in admission.get("gathering", []):
        lines.append(f"gathering: {job['job']} (ranks {job['present']} of {job['world_size']})")
    columns = [("(no job)", stats["counters"])] + [(name, job["counters"])
                                                   for name, _, job in jobs]
    reasons = sorted({k for _, c in columns for k in c if k.startswith("dropped_")})
    if reasons:
        lines += ["", "drops by reason:"]
        lines += _table(["reason"] + [name for name, _ in columns],
                        [[r[len("dropped_"):]] + [c.get(r, 0) for _, c in columns]
                         for r in reasons])
    events = {k: v for k, v in stats["counters"].items() if not k.startswith("dropped_")}
    refused = admission.get("refused", {})
    if events or refused:
        lines += ["", "switch events:"]
        lines += _table(["event", "count"], sorted(events.items())
                        + [(f"join refused: {k}", v) for k, v in sorted(refused.items())])
    return "\n".join(lines)


def _stats(args) -> int:
    try:
        stats = fetch_stats(args.switch)
    except (OSError, ValueError) as exc:
        print(f"switchml stats: cannot read the switch at {args.switch}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    ok = run_demo(workers=args.workers, sizes=args.sizes, repeats=args.repeats,
                  drop_rate=args.drop_rate, timeout=args.timeout)
    return 0 if ok else 1


def plain(doc: str | None) -> str:
    """A docstring as ``--help`` prints it: without reST's ``literal`` and :role: marks."""
    return re.sub(r":\w+:`([^`]*)`", r"\1", doc or "").replace("``", "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchml", description=plain(__doc__))
    parser.add_argument("--version", action="version", version=f"switchml {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("switch", help="run a software switch in the foreground until Ctrl-C",
                       epilog=LIMITS, formatter_class=argparse.RawDescriptionHelpFormatter)
    # No defaults here: a flag not given is SWITCHML_<FLAG> or the default
    # (switch_configuration), as for every switch.
    p.add_argument("--host", help="address to bind ($SWITCHML_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int,
                   help=f"TCP control and UDP data port ($SWITCHML_PORT, default "
                        f"{config.DEFAULT_PORT}; 0: any free port)")
    p.add_argument("--slots", type=int,
                   help=f"slots in the pool ($SWITCHML_SLOTS, default {config.DEFAULT_SLOTS})")
    p.add_argument("--packet-elements", type=int,
                   help="int32 values per packet, a multiple of --block-elements "
                        f"($SWITCHML_PACKET_ELEMENTS, default {config.DEFAULT_PACKET_ELEMENTS})")
    p.add_argument("--block-elements", type=int,
                   help="values per block: the sparse path's unit ($SWITCHML_BLOCK_ELEMENTS, "
                        f"default {config.DEFAULT_BLOCK_ELEMENTS})")
    p.add_argument("--slots-per-job", type=int,
                   help=f"slots each job gets: its window ($SWITCHML_SLOTS_PER_JOB, default "
                        f"{config.DEFAULT_SLOTS_PER_JOB})")
    p.add_argument("--max-jobs", type=int,
                   help=f"jobs running at once; more are refused or wait ($SWITCHML_MAX_JOBS, "
                        f"default {config.DEFAULT_MAX_JOBS})")
    p.add_argument("--metrics-port", type=int,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics "
                        "($SWITCHML_METRICS_PORT; 0: any free port; needs the 'metrics' "
                        "extra: pip install 'prometheus-client>=0.17')")
    p.add_argument("--metrics-host",
                   help="address the metrics endpoint binds (default: --host)")
    p.add_argument("--keepalive", type=float,
                   help="seconds within which a worker whose host vanished without closing "
                        f"its connection is noticed and its job failed ($SWITCHML_KEEPALIVE, "
                        f"default {config.DEFAULT_KEEPALIVE:g})")
    p.add_argument("--join-deadline", type=float,
                   help="seconds a control connection has to join a job (or ask for stats) "
                        f"before the switch closes it ($SWITCHML_JOIN_DEADLINE, default "
                        f"{config.DEFAULT_JOIN_DEADLINE:g})")
    p.add_argument("--max-unjoined", type=int,
                   help="control connections that have not joined, at most; one more closes "
                        f"the oldest ($SWITCHML_MAX_UNJOINED, default "
                        f"{config.DEFAULT_MAX_UNJOINED})")
    p.add_argument("--max-unjoined-per-source", type=int,
                   help="... from one source address; one more closes that address's oldest "
                        f"($SWITCHML_MAX_UNJOINED_PER_SOURCE, default "
                        f"{config.DEFAULT_MAX_UNJOINED_PER_SOURCE})")
    p.add_argument("--drop-rate", type=float,
                   help="simulated drop probability on ingress and on egress "
                        "($SWITCHML_DROP_RATE, default 0)")
    p.add_argument("--seed", type=int, default=None, help="seed of the drop simulator")
    p.add_argument("--upstream", metavar="HOST:PORT",
                   help="a spine switch: run as a rack switch whose jobs' partial sums go "
                        "up to it (two levels; Python data plane) ($SWITCHML_UPSTREAM)")
    p.add_argument("--data-plane", choices=["python", "c", "xdp"],
                   help="where datagrams are aggregated: python, c (default when built), or "
                        "xdp (an XDP program on the interface holding --host; root, clang, "
                        "libbpf; sparse calls go through the switch's user space) "
                        "($SWITCHML_DATA_PLANE)")
    p.add_argument("--threads", type=int,
                   help="data threads of the C data plane, a core each: each owns the slots "
                        "s where s %% threads is its index, with a socket of its own "
                        "($SWITCHML_SWITCH_THREADS; default: half the machine's cores, "
                        "1 to 8)")
    p.add_argument("--shared-link", action="store_true", default=None,
                   help="this switch is a server behind one link all its workers share (no "
                        "programmable switch): a job's window is its ranks' share of that "
                        "link's ($SWITCHML_SHARED_LINK=1)")
    p.add_argument("--token-file", metavar="FILE",
                   help="admission token: only workers that prove they know the token in "
                        "FILE (their SWITCHML_SWITCH_TOKEN) can create jobs "
                        "($SWITCHML_SWITCH_TOKEN_FILE; $SWITCHML_SWITCH_TOKEN gives the token)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="the switch's log, on stderr: joins, leaves and failures at info, "
                        "a summary of drops every 10 s at debug (default info)")
    p.set_defaults(func=_switch)

    p = sub.add_parser("stats", help="print a running switch's counters")
    p.add_argument("--switch", default=config.env("SWITCH", None),
                   required=config.env("SWITCH", None) is None,
                   help="HOST:PORT of the switch (default $SWITCHML_SWITCH)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_stats)

    p = sub.add_parser("demo", help="local switch + worker processes; check sums; print a table",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="worker processes, each a rank")
    p.add_argument("--sizes", type=int, nargs="+", default=[0, 1, 1000, 1_000_003],
                   help="array sizes, in values; each is summed as float32 and int32, the "
                        "largest also block-sparse")
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each case")
    p.add_argument("--drop-rate", type=float, default=0.0,
                   help="fraction of datagrams the switch drops on purpose (0 to 1): loss "
                        "recovery at work")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a worker waits without progress before it fails the job")
    p.set_defaults(func=_demo)

    from .testbed.cli import add_parsers  # testbed up|run|status|down
    add_parsers(sub)

    # Listed for --help; main() hands its arguments to the benchmark as they are.
    sub.add_parser("bench", add_help=False,
                   help="switchml dense/sparse against gloo, on loopback or the testbed "
                        "(the bench extra; switchml bench --help for its flags)")
    return parser


def _bench(argv: list) -> int:
    """``switchml bench ARGS``: the side-by-side suite (switchml/bench/suite.py)."""
    from .bench import suite

    return suite.cli(argv, prog="switchml bench", description=plain(suite.__doc__))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
