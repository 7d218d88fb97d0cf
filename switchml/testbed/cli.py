"""``switchml testbed up|run|status|down``: their argparse set-up.

``switchml.cli.build_parser`` calls ``add_parsers``; nothing here is imported
beyond argparse and the testbed's core (which the package imports anyway) until
a command runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from .core import add_host_queue_argument

DEFAULT_PREFIX = "smltb"


def _testbed_up(args) -> int:
    from .core import OFFLOAD, STATE_DIR, SWITCH_PORT, Testbed, interpreter_env
    from .errors import TestbedError

    if args.data_plane and not args.switch:
        print("switchml testbed: --data-plane goes with --switch (the switch it starts)",
              file=sys.stderr)
        return 2
    if args.data_plane == "xdp" and args.loss:
        print("switchml testbed: --loss goes without --data-plane xdp: the testbed loses the "
              "workers' datagrams at the switch's input hook, which the XDP program runs "
              "before (the uplinks would lose nothing)", file=sys.stderr)
        return 2
    try:
        tb = Testbed(args.hosts, None if args.link == "none" else args.link, mtu=args.mtu,
                     loss=args.loss, prefix=args.prefix, subnet=args.subnet, burst=args.burst,
                     queue=args.queue, udp_offload=OFFLOAD[args.udp_offload],
                     switches=args.switches, racks=args.racks,
                     oversubscription=args.oversubscription,
                     ranks_per_host=args.ranks_per_host, host_queue=args.host_queue)
    except ValueError as exc:
        print(f"switchml testbed: {exc}", file=sys.stderr)
        return 2
    tb._catch_signals()  # TERM or HUP half way through up() cleans up like Ctrl-C
    try:
        # Not a ``with`` block: the testbed outlives this command.  up() removes what
        # it made if it fails or is interrupted half way.
        tb.up()
        if args.switch:
            # On the bridge, or one on each switch server (one job over all of them);
            # with racks, the spine on the bridge and a rack switch in each rack.
            where = ([f"s{k}" for k in range(tb.switches)] if tb.switches else
                     ["switch"] + [f"r{k}" for k in range(tb.racks)])
            logs = {}
            for node in where:
                log = logs[node] = os.path.join(
                    STATE_DIR, f"{args.prefix}-switch.log" if node == "switch"
                    else f"{args.prefix}-{node}-switch.log")
                command = [sys.executable, "-m", "switchml.cli", "switch", "--host",
                           tb.address(node), "--port", str(SWITCH_PORT)]
                if node.startswith("r"):  # a rack switch: the Python data plane
                    command += ["--upstream", tb.switch]
                elif args.data_plane:
                    command += ["--data-plane", args.data_plane]
                if tb.switches:  # a switch server, behind a link like a host's
                    command += ["--shared-link"]
                if args.slots_per_job is not None:
                    command += ["--slots-per-job", str(args.slots_per_job)]
                with open(log, "w") as f:
                    subprocess.Popen(tb.command(node, command),
                                     env={**os.environ, **interpreter_env()}, stdout=f,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
            for node, log in logs.items():
                if not _wait_for(log, "listening on", 15.0):
                    tb.down()
                    print(f"switchml testbed: the switch in {node} did not start; its log:\n"
                          f"{open(log).read()}", file=sys.stderr)
                    return 1
    except (TestbedError, ValueError) as exc:
        tb.down()  # (up() removed what it made already where it failed itself)
        print(f"switchml testbed: {exc}", file=sys.stderr)
        return 2
    except BaseException:  # Ctrl-C, TERM or HUP while its switch starts: nothing left
        tb.down()
        raise
    finally:
        tb._restore_signals()
    print(_describe(tb, running_switch=args.switch))
    return 0


def _wait_for(path, text, timeout) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path) as f:
            if text in f.read():
                return True
        time.sleep(0.1)
    return False


def _rate(bps) -> str:
    return "unshaped" if bps is None else f"{bps / 1e6:g} Mbit/s"


def _describe(tb, running_switch=False) -> str:
    from . import racks
    link = f"{tb.link} each way" if tb.link_bps else "unshaped"
    lines = [f"testbed '{tb.prefix}': {tb.hosts} hosts of {tb.ranks_per_host} rank(s), links "
             f"{link}, mtu {tb.mtu or 1500}, UDP loss {tb.loss:g}"
             + (", a queue per flow in each host" if tb.host_queue == "flows" else ""),
             f"  switch   namespace {tb.switch_namespace:<12} bridge {tb.bridge} "
             f"{tb.switch_address}" + (f"  (switch running on {tb.switch})"
                                        if running_switch and not tb.switches else "")]
    for h in range(tb.hosts):
        lines.append(f"  host {h:<3} namespace {tb.namespace(h):<12} veth   {tb.ifname(h)} "
                     f"{tb.address(h)}")
    for k in range(tb.switches):
        node = f"s{k}"
        lines.append(f"  server {k:<1} namespace {tb.namespace(node):<12} veth   "
                     f"{tb.ifname(node)} {tb.address(node)}"
                     + ("  (switch running)" if running_switch else ""))
    for k in range(tb.racks):
        node = f"r{k}"
        lines.append(f"  rack {k:<3} namespace {tb.namespace(node):<12} bridge "
                     f"{tb.prefix}-rb{k} {tb.address(node)}, hosts "
                     f"{[h for h in range(tb.hosts) if tb.rack_of(h) == k]}, uplink "
                     f"{_rate(racks.uplink_bps(tb, k))} ({tb.oversubscription:g}:1)"
                     + ("  (rack switch running)" if running_switch else ""))
    where = "its rack's switch" if tb.racks else tb.switch
    lines.append(f"run a command in a host:  switchml testbed run --prefix {tb.prefix} 0 -- CMD"
                 f"  (SWITCHML_SWITCH={where}, GLOO_SOCKET_IFNAME set)")
    if not running_switch:
        where = "s0" if tb.switches else "switch"
        lines.append(f"start the switch:         switchml testbed run --prefix {tb.prefix} "
                     f"{where} -- switchml switch" + ("  (and in s1, ...)" if tb.switches > 1
                                                       else "  (and in r0, ...: rack "
                                                       "switches under it)" if tb.racks
                                                       else ""))
    lines.append(f"a torchrun in every host: switchml testbed run --prefix {tb.prefix} --torchrun "
                 f"-- SCRIPT  ({tb.ranks_per_host} rank(s) a host)")
    lines.append(f"remove it:                switchml testbed down --prefix {tb.prefix}")
    return "\n".join(lines)


def _testbed_run(args) -> int:
    from .core import Testbed, interpreter_env
    from .errors import TestbedError

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.torchrun and args.host is not None:
        # `run --torchrun -- SCRIPT`: no host, so argparse took the script for one
        command = [args.host, *command]
    if not command:
        print("switchml testbed run: give a command after --", file=sys.stderr)
        return 2
    if args.torchrun:
        return _testbed_torchrun(args, command)
    if args.host is None:
        print("switchml testbed run: name a host (0, 1, ..., s0, switch), or --torchrun",
              file=sys.stderr)
        return 2
    try:
        tb = Testbed.from_state(args.prefix)
        argv = tb.command(args.host, command)
        env = {**os.environ, **interpreter_env(), **tb.env(args.host)}
    except (TestbedError, ValueError) as exc:
        print(f"switchml testbed run: {exc}", file=sys.stderr)
        return 2
    os.execvpe(argv[0], argv, env)  # the command's exit status becomes ours


def _testbed_torchrun(args, command) -> int:
    """A torchrun in every host (``--nnodes H --node-rank i --nproc-per-node k``);
    the first failing host's status, or 0."""
    from .core import Testbed, interpreter_env
    from .errors import TestbedError

    try:
        tb = Testbed.from_state(args.prefix)
        procs = [subprocess.Popen(tb.command(h, tb.torchrun_command(h, command)),
                                  env={**os.environ, **interpreter_env(), **tb.env(h)})
                 for h in range(tb.hosts)]
    except (TestbedError, ValueError) as exc:
        print(f"switchml testbed run: {exc}", file=sys.stderr)
        return 2
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        return 130
    failed = [(h, c) for h, c in enumerate(codes) if c]
    for h, code in failed:
        print(f"switchml testbed run: host {h}'s torchrun exited with status {code}",
              file=sys.stderr)
    return failed[0][1] if failed else 0


def _testbed_status(args) -> int:
    from . import netns, racks
    from .core import Testbed, find_testbeds, read_state
    from .errors import TestbedError

    try:
        netns.require_root()
        found = find_testbeds()
    except TestbedError as exc:
        print(f"switchml testbed status: {exc}", file=sys.stderr)
        return 2
    prefixes = [args.prefix] if args.prefix else sorted(found)
    if not prefixes:
        print("no testbed is up")
    for prefix in prefixes:
        if prefix not in found:
            print(f"testbed '{prefix}': not up")
            continue
        if read_state(prefix) is None:
            print(f"testbed '{prefix}': namespaces {', '.join(sorted(found[prefix]))} "
                  f"(left over: no record; remove with `switchml testbed down --prefix "
                  f"{prefix}`)")
            continue
        tb = Testbed.from_state(prefix)
        print(_describe(tb).split("\nrun a command")[0])
        for h in range(tb.hosts):
            c = tb.link_counters(h)
            pids = netns.namespace_pids(tb.namespace(h))
            print(f"  host {h}: sent {c['tx_bytes']} B, received {c['rx_bytes']} B, "
                  f"processes {pids or 'none'}")
        for k in range(tb.switches):
            c = tb.link_counters(f"s{k}")
            pids = netns.namespace_pids(tb.namespace(f"s{k}"))
            print(f"  server {k}: sent {c['tx_bytes']} B, received {c['rx_bytes']} B, "
                  f"processes {pids or 'none'}")
        for k in range(tb.racks):
            c = racks.uplink_counters(tb, k)
            pids = netns.namespace_pids(tb.namespace(f"r{k}"))
            print(f"  rack {k}: uplink sent {c['tx_bytes']} B, received {c['rx_bytes']} B, "
                  f"processes {pids or 'none'}")
        print(f"  switch processes: {netns.namespace_pids(tb.switch_namespace) or 'none'}")
        if tb.loss:
            print(f"  datagrams dropped by the loss rules: {tb.loss_drops()}")
    return 0


def _testbed_down(args) -> int:
    from .core import teardown
    from .errors import TestbedError

    try:
        removed = teardown(args.prefix)
    except (TestbedError, ValueError) as exc:
        print(f"switchml testbed down: {exc}", file=sys.stderr)
        return 2
    print(f"removed {', '.join(sorted(removed))}" if removed else "nothing to remove")
    return 0


def add_parsers(sub) -> None:
    """Add ``testbed`` (with up, run, status, down) to ``switchml``'s commands."""
    tb = sub.add_parser("testbed", help="an emulated cluster: network namespaces, shaped links "
                                        "(root)")
    tsub = tb.add_subparsers(dest="testbed_command", required=True)

    def prefixed(p):
        p.add_argument("--prefix", default=DEFAULT_PREFIX,
                       help="start of every namespace and device name (default %(default)s)")
        return p

    p = prefixed(tsub.add_parser("up", help="create N host namespaces and a switch namespace"))
    p.add_argument("--hosts", type=int, default=4,
                   help="host namespaces, each with its link to the bridge (default 4)")
    p.add_argument("--link", default="1gbit",
                   help="rate of every link each way, tc style (1gbit, 200mbit) or 'none'")
    p.add_argument("--mtu", type=int, default=None, help="MTU of the links (default 1500)")
    p.add_argument("--loss", type=float, default=0.0,
                   help="probability of dropping a UDP datagram on each link (needs nft)")
    p.add_argument("--subnet", default="10.77.0.0/24",
                   help="the addresses of the hosts and switches (default %(default)s)")
    p.add_argument("--burst", default="256kb", help="tbf bucket size (default %(default)s)")
    p.add_argument("--queue", default="256kb",
                   help="bytes each link queues before it drops, as a switch port's buffer "
                        "(tbf limit; default %(default)s)")
    add_host_queue_argument(p)
    p.add_argument("--udp-offload", choices=["auto", "on", "off"], default="auto",
                   help="the veths' UDP segmentation offload: on (a GSO run crosses the "
                        "emulated wire as one packet), off (cut into frames at the first "
                        "link: per-datagram loss, and frame-by-frame work on this machine), "
                        "or auto: on without loss, off with it (default)")
    p.add_argument("--switches", type=int, default=0,
                   help="switch servers: namespaces s0..s<K-1> behind shaped links like "
                        "hosts', for one job over K switch processes (default 0: the "
                        "switch on the bridge)")
    p.add_argument("--racks", type=int, default=0,
                   help="racks: R namespaces r0..r<R-1>, each a bridge with its hosts and "
                        "a rack switch, wired to the spine's bridge by a shaped uplink "
                        "(default 0: one flat bridge)")
    p.add_argument("--oversubscription", type=float, default=1.0,
                   help="with --racks: a rack's uplink carries its hosts' links' rate "
                        "divided by this (default 1: 1:1; 4: 4:1)")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks a job runs in each host: `testbed run --torchrun` starts "
                        "that many a host (default 1)")
    p.add_argument("--data-plane", choices=["python", "c", "xdp"], default=None,
                   help="with --switch: the switch's data plane (default: the switch's; "
                        "the rack switches run Python's)")
    p.add_argument("--switch", action="store_true",
                   help="also start a switchml switch on the bridge, or one on each switch "
                        "server, or the spine and a rack switch in each rack (in the "
                        "background)")
    p.add_argument("--slots-per-job", type=int, default=None,
                   help="that switch's slots per job (default: the switch's own; a job's "
                        "window adapts to the path within them)")
    p.set_defaults(func=_testbed_up)

    p = prefixed(tsub.add_parser("run", help="run a command in a host (0, 1, ...), a switch "
                                             "server (s0, ...) or 'switch'"))
    p.add_argument("host", nargs="?",
                   help="host index (0, h0, ...), switch server (s0, ...) or 'switch'")
    p.add_argument("--torchrun", action="store_true",
                   help="in every host, torchrun --nnodes HOSTS --node-rank i "
                        "--nproc-per-node RANKS_PER_HOST -- SCRIPT [ARGS...] (the rendezvous "
                        "on host 0)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(func=_testbed_run)

    p = tsub.add_parser("status", help="the testbeds that are up, their links and processes")
    p.add_argument("--prefix", default=None, help="only this testbed")
    p.set_defaults(func=_testbed_status)

    p = prefixed(tsub.add_parser("down", help="end its processes, remove its namespaces "
                                              "(also after a crash)"))
    p.set_defaults(func=_testbed_down)
