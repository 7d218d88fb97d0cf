"""A flood of control connections, each holding part of a line: ``python
bench/control_flood.py HOST PORT SOURCE COUNT SECONDS`` opens COUNT connections
from address SOURCE (at most SECONDS), never completes a line on any, and
watches each until the switch closes it.  It prints one JSON object: how many
it opened, how many the switch closed, how long the longest lived (from its
connect to the switch's close), and how many were still open at the end."""

import json
import resource
import selectors
import socket
import sys
import time

#: Connects in progress at once: more would only wait in the switch's accept queue.
IN_PROGRESS = 128
PARTIAL = b'{"partial": '


def flood(host: str, port: int, source: str, count: int, seconds: float) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 65536 if hard == resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        target = soft
    most_open = max(64, min(target - 64, 8000))
    sel = selectors.DefaultSelector()
    connecting: set = set()
    opened_at: dict = {}
    lifetimes: list = []
    started = failed = 0
    start = time.monotonic()
    end = start + seconds
    while time.monotonic() < end and (started < count or connecting or opened_at):
        while (started < count and len(connecting) < IN_PROGRESS
               and len(connecting) + len(opened_at) < most_open):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.bind((source, 0))
            sock.connect_ex((host, port))
            connecting.add(sock)
            sel.register(sock, selectors.EVENT_WRITE)
            started += 1
        for key, _ in sel.select(0.02):
            sock = key.fileobj
            now = time.monotonic()
            if sock in connecting:
                connecting.discard(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    failed += 1
                    sel.unregister(sock)
                    sock.close()
                    continue
                try:
                    sock.send(PARTIAL)
                except OSError:
                    pass  # closed already: its read says so
                opened_at[sock] = now
                sel.modify(sock, selectors.EVENT_READ)
                continue
            try:
                data = sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                lifetimes.append(now - opened_at.pop(sock))
                sel.unregister(sock)
                sock.close()
    for sock in list(connecting) + list(opened_at):
        sock.close()
    return {"started": started, "opened": len(lifetimes) + len(opened_at),
            "closed_by_switch": len(lifetimes), "connect_failures": failed,
            "still_open": len(opened_at), "longest_s": max(lifetimes, default=0.0),
            "seconds": time.monotonic() - start}


if __name__ == "__main__":
    host, port, source, count, seconds = sys.argv[1:6]
    print(json.dumps(flood(host, int(port), source, int(count), float(seconds))), flush=True)
