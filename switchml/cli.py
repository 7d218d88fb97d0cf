"""The ``switchml`` command: ``switch``, ``stats``, ``demo``, ``testbed`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys

from . import config
from .netutil import LineReader, encode_line


def _switch(args) -> int:
    from .switch.server import Switch

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        switch = Switch(args.host, args.port, drop_rate=args.drop_rate, slots=args.slots,
                        packet_elements=args.packet_elements, block_elements=args.block_elements,
                        slots_per_job=args.slots_per_job, seed=args.seed)
    except ValueError as exc:
        print(f"switchml switch: {exc}", file=sys.stderr)
        return 2
    switch.start()
    host, port = switch.address
    print(f"switchml switch listening on {host}:{port} (TCP control, UDP data); "
          f"export SWITCHML_SWITCH={host}:{port}", flush=True)
    try:
        switch.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    return 0


def fetch_stats(address, timeout: float = 5.0) -> dict:
    """Ask a running switch for its counters over its control port."""
    with socket.create_connection(config.parse_address(address), timeout=timeout) as conn:
        conn.sendall(encode_line({"op": "stats"}))
        reader = LineReader()
        while True:
            data = conn.recv(65536)
            if not data:
                raise ConnectionError("switch closed the connection")
            for msg in reader.feed(data):
                if msg.get("event") == "stats":
                    return msg["stats"]


def format_stats(stats: dict) -> str:
    lines = [f"slots {stats['slots']} (free {stats['free_slots']}), packet_elements "
             f"{stats['packet_elements']}, cpu {stats.get('cpu_s', 0):.2f}s over "
             f"{stats.get('uptime_s', 0):.1f}s"]
    for key, value in sorted(stats["counters"].items()):
        lines.append(f"  {key:<32} {value:>12}")
    for title, jobs in (("job", stats["jobs"]), ("ended job", stats["ended_jobs"])):
        for name, job in jobs.items():
            lines.append(f"{title} {name}: world {job['world_size']}, slots "
                         f"{job['slot_base']}..{job['slot_base'] + job['slot_count'] - 1}")
            for key, value in sorted(job["counters"].items()):
                lines.append(f"  {key:<32} {value:>12}")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchml", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("switch", help="run a software switch in the foreground until Ctrl-C")
    p.add_argument("--host", default=config.env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=config.env("PORT", config.DEFAULT_PORT, int))
    p.add_argument("--slots", type=int, default=config.env("SLOTS", config.DEFAULT_SLOTS, int),
                   help="slots in the pool (default %(default)s)")
    p.add_argument("--packet-elements", type=int,
                   default=config.env("PACKET_ELEMENTS", config.DEFAULT_PACKET_ELEMENTS, int),
                   help="int32 values per packet, a multiple of --block-elements "
                        "(default %(default)s)")
    p.add_argument("--block-elements", type=int,
                   default=config.env("BLOCK_ELEMENTS", config.DEFAULT_BLOCK_ELEMENTS, int),
                   help="values per block: the sparse path's unit "
                        "(default %(default)s)")
    p.add_argument("--slots-per-job", type=int,
                   default=config.env("SLOTS_PER_JOB", config.DEFAULT_SLOTS_PER_JOB, int),
                   help="slots each job gets: its window (default %(default)s)")
    p.add_argument("--drop-rate", type=float, default=config.env("DROP_RATE", 0.0, float),
                   help="simulated drop probability on ingress and on egress")
    p.add_argument("--seed", type=int, default=None, help="seed of the drop simulator")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_switch)

    p = sub.add_parser("stats", help="print a running switch's counters")
    p.add_argument("--switch", default=config.env("SWITCH", None), required=config.env("SWITCH", None) is None,
                   help="HOST:PORT of the switch (default $SWITCHML_SWITCH)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_stats)

    p = sub.add_parser("demo", help="local switch + worker processes; check sums; print a table")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--sizes", type=int, nargs="+", default=[0, 1, 1000, 1_000_003])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--drop-rate", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(func=_demo)

    from .testbed.cli import add_parsers  # testbed up|run|status|down, bench
    add_parsers(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
