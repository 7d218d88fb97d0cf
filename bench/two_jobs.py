"""Two switchml jobs sharing every link of the testbed: does each get an equal share?

    python bench/two_jobs.py --hosts 4 --link 1gbit --mtu 9000 --mib 64 --repeats 8

Job A's rank r and job B's rank r run in host namespace r, so both jobs cross the
same host links and the same switch, each with the switch's default settings.
Each job runs its dense allreduces back to back; a job's throughput is its bytes
per second over its timed calls, and its share is that over the two jobs'
total.  A fair window gives each about half.  Prints a table and writes JSON
(--json).  Root only (namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from switchml.bench.common import at_least, within  # noqa: E402
from switchml.bench.launch import OnTestbed, Roles  # noqa: E402
from switchml.testbed.core import add_host_queue_argument  # noqa: E402


def run(args) -> dict:
    from switchml.testbed import Testbed

    elements = int(args.mib * 2**20) // 4
    with Testbed(args.hosts, args.link, mtu=args.mtu, queue=args.queue,
                 host_queue=args.host_queue, prefix="smltwo") as tb:
        cluster = OnTestbed(tb)
        host, port = cluster.switch_bind
        with Roles(cluster, args.timeout) as roles:
            switch = roles.start("switch", "switch", "switch",
                                 {"host": host, "port": port, "options": {}}, stdin=True)
            _, msg = roles.next()
            address = "{}:{}".format(*msg["address"])
            for job in ("a", "b"):
                for rank in range(args.hosts):
                    roles.start(f"{job}{rank}", rank, "switchml", {
                        "switch": address, "rank": rank, "world": args.hosts,
                        "job": f"share-{job}", "ifname": None, "warmup": 1,
                        "repeats": args.repeats, "check": False, "seed": 0,
                        "timeout": args.timeout,
                        "cases": [{"id": 0, "elements": elements, "density": None,
                                   "sparse": False}]})
            times: dict = {"a": [], "b": []}
            done = 0
            while done < 2 * args.hosts:
                name, msg = roles.next()
                if msg["event"] == "case":
                    times[name[0]].append(msg["times"])
                elif msg["event"] == "done":
                    done += 1
            switch.stdin.write("stop\n")
            switch.stdin.flush()
            while True:
                name, msg = roles.next()
                if name == "switch" and msg["event"] == "stats":
                    stats = msg["stats"]
                    break
    nbytes = elements * 4
    jobs = {}
    for job, per_rank in times.items():
        slowest = [max(call) for call in zip(*per_rank)]  # the job's call ends with its last rank
        jobs[job] = {"median_s": statistics.median(slowest), "times_s": slowest,
                     "throughput_Gbps": nbytes * 8 / statistics.mean(slowest) / 1e9}
    total = sum(j["throughput_Gbps"] for j in jobs.values())
    for j in jobs.values():
        j["share"] = j["throughput_Gbps"] / total
        j["of_equal_share"] = j["share"] / 0.5
    retx = {name: job["counters"].get("retransmissions_answered", 0)
            for name, job in stats.get("ended_jobs", {}).items()}
    return {"command": "python bench/two_jobs.py " + " ".join(sys.argv[1:]),
            "settings": vars(args), "jobs": jobs, "link_Gbps": tb.link_bps / 1e9,
            "total_Gbps": total, "switch_retransmissions_answered": retx}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=at_least(2), default=4)
    p.add_argument("--link", default="1gbit")
    p.add_argument("--mtu", type=int, default=None)
    p.add_argument("--queue", default="256kb")
    add_host_queue_argument(p)
    p.add_argument("--mib", type=within(0, above_low=True), default=64.0)
    p.add_argument("--repeats", type=at_least(1), default=8)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    result = run(args)
    for name, job in result["jobs"].items():
        print(f"job {name}: median {job['median_s']:.3f} s a call, "
              f"{job['throughput_Gbps']:.3f} Gbit/s, share {job['share']:.1%} "
              f"({job['of_equal_share']:.0%} of an equal share)")
    print(f"together {result['total_Gbps']:.3f} Gbit/s of {result['link_Gbps']:.3f} per link")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
