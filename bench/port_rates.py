"""What the testbed's switch ports carry, millisecond by millisecond, during a run.

    python bench/port_rates.py --netns smlbench-sw --ports smlbench-p0 smlbench-p1 \\
        --link 1gbit --seconds 8 --out rates.json

Samples the ports' byte counters (``/sys/class/net/PORT/statistics``: what a
port received is its host's uplink, what it sent the host's downlink) about
every half millisecond, then prints each port's share of the link rate and
every stretch of at least ``--gap`` ms in which no port moved a byte.  A call
that keeps the links full shows none; time spent between sends (a pass over the
input before the first one, say) shows as a gap per call.  Start it while a
benchmark runs (``python -m bench --testbed ...``: the switch namespace is
``PREFIX-sw``, the ports ``PREFIX-p0`` ...).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from switchml.bench.common import within
from switchml.testbed.netns import parse_rate


def sample(ports: list[str], seconds: float) -> list[list[float]]:
    """Rows of (time, rx, tx of each port) for ``seconds``, or until the ports go
    away or a SIGTERM comes (the run ended and takes its testbed down: it
    terminates what runs in its namespaces, and gives them time to finish)."""
    stop: list = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        return _sample(ports, seconds, stop)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sample(ports: list[str], seconds: float, stop: list) -> list[list[float]]:
    files = [(open(f"/sys/class/net/{p}/statistics/rx_bytes"),
              open(f"/sys/class/net/{p}/statistics/tx_bytes")) for p in ports]
    rows: list[list[float]] = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and not stop:
            row = [time.monotonic()]
            for rx, tx in files:
                rx.seek(0)
                tx.seek(0)
                row += [int(rx.read()), int(tx.read())]
            rows.append(row)
            time.sleep(0.0005)
    except OSError:  # ENODEV: the port is gone
        pass
    finally:
        for pair in files:
            for f in pair:
                f.close()
    return rows


def idle_gaps(rows: list[list[float]], min_gap: float) -> list[tuple[float, float]]:
    """(start, length) in seconds from the first sample, of every stretch of at
    least ``min_gap`` between samples in which no counter moved (so the links
    were idle at least that long)."""
    gaps, idle_since, still_at = [], None, None
    for before, after in zip(rows, rows[1:]):
        if after[1:] == before[1:]:
            idle_since = before[0] if idle_since is None else idle_since
            still_at = after[0]
            continue
        if idle_since is not None and still_at - idle_since >= min_gap:
            gaps.append((idle_since - rows[0][0], still_at - idle_since))
        idle_since = None
    if idle_since is not None and still_at - idle_since >= min_gap:  # idle to the end
        gaps.append((idle_since - rows[0][0], still_at - idle_since))
    return gaps


def shares(rows: list[list[float]], bps: float) -> list[tuple[float, float]]:
    """Each port's (uplink, downlink) bytes over the whole sample, as a share of
    the link rate."""
    span = rows[-1][0] - rows[0][0]
    return [((rows[-1][1 + 2 * i] - rows[0][1 + 2 * i]) * 8 / bps / span,
             (rows[-1][2 + 2 * i] - rows[0][2 + 2 * i]) * 8 / bps / span)
            for i in range((len(rows[0]) - 1) // 2)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--netns", help="sample inside this network namespace (ip netns exec)")
    p.add_argument("--ports", nargs="+", required=True)
    p.add_argument("--link", default="1gbit", help="the ports' rate (tc's units)")
    p.add_argument("--seconds", type=within(0, above_low=True), default=8.0)
    p.add_argument("--gap", type=within(0), default=2.0, help="least idle stretch shown, ms")
    p.add_argument("--out", help="write the samples and the summary as JSON")
    args = p.parse_args(argv)
    if args.netns:  # the same arguments but --netns NS (or --netns=NS), inside NS
        rest = list(argv if argv is not None else sys.argv[1:])
        for i, a in enumerate(rest):
            if a == "--netns":
                del rest[i:i + 2]
                break
            if a.startswith("--netns="):
                del rest[i]
                break
        sys.exit(subprocess.call(["ip", "netns", "exec", args.netns, sys.executable,
                                  os.path.abspath(__file__), *rest]))
    missing = [port for port in args.ports if not os.path.isdir(f"/sys/class/net/{port}")]
    if missing:
        p.error(f"--ports: no such interface here: {' '.join(missing)}")
    rows = sample(args.ports, args.seconds)
    if len(rows) < 2:
        sys.exit(f"port_rates: {len(rows)} sample(s) in {args.seconds:g} s: nothing to compare")
    gaps = idle_gaps(rows, args.gap / 1e3)
    loads = shares(rows, parse_rate(args.link))
    for port, (up, down) in zip(args.ports, loads):
        print(f"{port}: uplink {up:.1%} of the link, downlink {down:.1%}")
    for start, length in gaps:
        print(f"no byte on any port from {start * 1e3:.1f} ms for {length * 1e3:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ports": args.ports, "link": args.link, "shares": loads,
                       "idle_gaps_s": gaps, "samples": rows}, f)


if __name__ == "__main__":
    main()
