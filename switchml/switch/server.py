"""The software switch behind real sockets: UDP data plane, TCP control plane.

One thread runs everything: it drains the UDP socket through the pipeline and
serves control connections in between, so the sans-IO pipeline and controller
never see concurrent calls.  The control port and the data port have the same
number (TCP and UDP).
"""

from __future__ import annotations

import errno
import json
import logging
import selectors
import socket
import threading
import time

from ..config import DEFAULT_PACKET_ELEMENTS, DEFAULT_SLOTS, DEFAULT_SLOTS_PER_JOB
from ..netutil import LineReader, encode_line, enlarge_buffers
from .control import Controller
from .pipeline import Pipeline

log = logging.getLogger("switchml.switch")

#: Datagrams handled between two looks at the control sockets.
DRAIN_BATCH = 256


class Switch:
    """A software switch: ``with Switch() as sw: ...`` or ``start()`` / ``stop()``.

    Options: ``slots`` (pool size), ``packet_elements`` (int32 values per packet),
    ``block_elements`` (values per block: the unit of the sparse path),
    ``slots_per_job`` (window a job gets), ``egress_drop_rate`` (defaults to
    ``drop_rate``), ``seed`` (of the drop simulator).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, drop_rate: float = 0.0,
                 slots: int = DEFAULT_SLOTS, packet_elements: int = DEFAULT_PACKET_ELEMENTS,
                 block_elements: int | None = None, slots_per_job: int = DEFAULT_SLOTS_PER_JOB,
                 egress_drop_rate: float | None = None, seed: int | None = None):
        if not 0.0 <= drop_rate < 1.0:
            raise ValueError(f"drop_rate must be in [0, 1), got {drop_rate}")
        self.pipeline = Pipeline(slots, packet_elements, block_elements=block_elements,
                                 drop_rate=drop_rate,
                                 egress_drop_rate=egress_drop_rate, seed=seed)
        self._host = host
        self._port = port
        self._slots_per_job = slots_per_job
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._running = False
        self._tcp = self._udp = None
        self.address: tuple[str, int] | None = None
        self._started_at = 0.0
        self._cpu_seconds = 0.0

    # -------------------------------------------------------------- lifecycle
    def start(self) -> "Switch":
        if self._thread is not None:
            return self
        self._tcp, self._udp = _bind_pair(self._host, self._port)
        self.address = (self._host, self._tcp.getsockname()[1])
        self.controller = Controller(self.pipeline, data_port=self.address[1],
                                     slots_per_job=self._slots_per_job, stats=self.stats,
                                     rcvbuf=self._udp.getsockopt(socket.SOL_SOCKET,
                                                                 socket.SO_RCVBUF))
        self._wake_r, self._wake_w = socket.socketpair()
        self._running = True
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._serve, name="switchml-switch", daemon=True)
        self._thread.start()
        log.info("switch listening on %s:%d (slots=%d, packet_elements=%d)", *self.address,
                 self.pipeline.slots, self.pipeline.packet_elements)
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._running = False
        self._wake_w.send(b"x")
        self._thread.join()
        self._thread = None
        for s in (self._tcp, self._udp, self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> "Switch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stats(self) -> dict:
        """Counters of the pool, of every job and of drops, plus the switch's CPU time."""
        with self._lock:
            stats = json.loads(json.dumps(self.pipeline.stats()))
        stats["uptime_s"] = time.monotonic() - self._started_at if self._thread else 0.0
        stats["cpu_s"] = self._cpu_seconds
        return stats

    def serve_forever(self) -> None:
        """Run until KeyboardInterrupt (for the CLI)."""
        self.start()
        try:
            self._thread.join()
        finally:
            self.stop()

    # -------------------------------------------------------------- the loop
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._tcp, selectors.EVENT_READ, "accept")
        sel.register(self._udp, selectors.EVENT_READ, "data")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        readers: dict = {}
        buf = bytearray(65536)
        view = memoryview(buf)
        udp = self._udp
        pipeline = self.pipeline
        try:
            while self._running:
                busy = False
                with self._lock:
                    for _ in range(DRAIN_BATCH):
                        try:
                            n, addr = udp.recvfrom_into(buf)
                        except BlockingIOError:
                            break
                        except OSError as exc:  # e.g. ICMP errors surfacing on Linux
                            pipeline.counters["socket_errors"] += 1
                            log.debug("udp receive error: %s", exc)
                            continue
                        try:
                            replies = pipeline.receive_datagram(view[:n], addr)
                        except Exception:  # a bug must not take the switch down
                            pipeline.counters["internal_errors"] += 1
                            log.exception("pipeline failed on a datagram from %s", addr)
                            continue
                        for datagram, dst in replies:
                            try:
                                udp.sendto(datagram, dst)
                            except OSError:
                                pipeline.counters["send_errors"] += 1
                    else:
                        busy = True
                self._cpu_seconds = time.thread_time()
                for key, _ in sel.select(0 if busy else 1.0):
                    if key.data == "accept":
                        conn, _ = self._tcp.accept()
                        conn.setblocking(False)
                        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        readers[conn] = LineReader()
                        sel.register(conn, selectors.EVENT_READ, "control")
                    elif key.data == "control":
                        self._on_control(key.fileobj, readers, sel)
                    elif key.data == "wake":
                        key.fileobj.recv(64)
        finally:
            for conn in list(readers):
                sel.unregister(conn)
                conn.close()
            sel.close()

    def _on_control(self, conn, readers, sel) -> None:
        try:
            data = conn.recv(65536)
            messages = readers[conn].feed(data) if data else None
        except (OSError, ValueError) as exc:
            log.info("closing control connection: %s", exc)
            self.pipeline.counters["control_bad_message"] += 1
            messages = None
        with self._lock:
            if messages is None:
                sel.unregister(conn)
                del readers[conn]
                replies = self.controller.handle_disconnect(conn)
                conn.close()
            else:
                replies = [r for m in messages for r in self.controller.handle_message(conn, m)]
        for target, message in replies:
            try:
                target.setblocking(True)
                target.sendall(encode_line(message))
                target.setblocking(False)
            except OSError:
                pass  # its disconnect will be seen by the loop


def _bind_pair(host: str, port: int, attempts: int = 50):
    """A TCP listener and a UDP socket bound to the same port number."""
    last = None
    for _ in range(attempts if port == 0 else 1):
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((host, port))
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            udp.bind((host, tcp.getsockname()[1]))
        except OSError as exc:
            tcp.close()
            udp.close()
            last = exc
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        tcp.listen(128)
        udp.setblocking(False)
        enlarge_buffers(udp)
        return tcp, udp
    raise OSError(f"could not bind TCP and UDP to one port on {host}: {last}")
