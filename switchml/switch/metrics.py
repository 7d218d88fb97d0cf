"""Prometheus metrics of a switch, read from its counters at scrape time.

A custom collector turns ``Switch.stats()`` into metric families when Prometheus
scrapes: the data plane keeps counting into its plain ``Counter``s and pays
nothing per packet for the metrics.  Needs prometheus-client (the ``metrics``
extra: ``pip install 'prometheus-client>=0.17'``).

Families (all ``switchml_``):

=================================  =====================  =========================================
name                               labels                 meaning
=================================  =====================  =========================================
job_packets_in_total               job, session           contributions admitted to the job's slots
job_results_completed_total        job, session           aggregations completed (one per message)
job_results_out_total              job, session           result datagrams sent to workers
job_retransmissions_answered_total job, session           stored results sent again to one worker
job_duplicates_total               job, session           contributions already counted: not added
job_dropped_packets_total          job, session, reason   the job's packets dropped, by reason
job_sparse_blocks_total            job, session, kind     sparse blocks in / out / skipped
job_sparse_bytes_saved_total       job, session           bytes the skipped blocks did not cost
job_info                           job, session, state,   1 per running or recently ended job
                                   world_size, slots
dropped_packets_total              reason                 every drop since the switch started,
                                                          with or without a job (monotonic)
packets_in_total                                          every admitted contribution (monotonic)
control_events_total               event                  jobs started / ended / failed, joins
                                                          refused, control connections hung up
                                                          (bad message, slow reader, lost), errors
joins_refused_total                reason                 refused joins by reason or limit
control_closed_total               reason                 control connections the switch closed:
                                                          join_deadline, source_cap,
                                                          unjoined_cap (switch/lobby.py),
                                                          bad_message, slow_reader, lost
control_connections                state                  joined (members) and unjoined
descriptor_limit                                          the switch's RLIMIT_NOFILE
slots / slots_free                                        the pool and its free part
jobs                               state                  running, waiting for room, gathering
max_jobs / max_workers                                    limits
uptime_seconds / cpu_seconds_total                        the switch thread's life and CPU time
=================================  =====================  =========================================

Per-job series cover running jobs and the last few ended ones (``ENDED_JOBS_KEPT``);
the switch-wide totals never go down.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import wsgiref.simple_server

from ..errors import MetricsUnavailableError

#: Per-job counters with a family of their own (the rest go to generic families).
JOB_COUNTERS = {
    "packets_in": "contributions admitted to the job's slots",
    "results_completed": "aggregations completed (one per message)",
    "results_out": "result datagrams sent to workers",
    "retransmissions_answered": "stored results sent again to one worker",
    "duplicates": "contributions already counted, not added again",
}
SPARSE_BLOCKS = {"sparse_blocks_in": "in", "sparse_blocks_out": "out",
                 "sparse_blocks_skipped": "skipped"}
DROPPED = "dropped_"


def require_prometheus_client():
    """The prometheus_client module, or an error saying how to install it."""
    try:
        import prometheus_client
    except ImportError:
        raise MetricsUnavailableError(
            "Prometheus metrics need prometheus-client (the 'metrics' extra): "
            "pip install 'prometheus-client>=0.17'"
        ) from None
    return prometheus_client


class SwitchCollector:
    """Metric families built from ``stats()`` (a ``Switch.stats``) on every scrape."""

    def __init__(self, stats):
        self._stats = stats

    def describe(self):
        return []  # families depend on the jobs present; checked at scrape time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._stats()
        job_labels = ["job", "session"]
        per_job = {key: CounterMetricFamily(f"switchml_job_{key}", text, labels=job_labels)
                   for key, text in JOB_COUNTERS.items()}
        dropped = CounterMetricFamily("switchml_job_dropped_packets",
                                      "the job's packets dropped, by reason",
                                      labels=job_labels + ["reason"])
        blocks = CounterMetricFamily("switchml_job_sparse_blocks",
                                     "sparse blocks received (in), sent (out), never sent "
                                     "(skipped)", labels=job_labels + ["kind"])
        saved = CounterMetricFamily("switchml_job_sparse_bytes_saved",
                                    "bytes the skipped sparse blocks did not cost",
                                    labels=job_labels)
        other = CounterMetricFamily("switchml_job_other_events",
                                    "other per-job counters", labels=job_labels + ["counter"])
        info = GaugeMetricFamily("switchml_job_info", "running and recently ended jobs",
                                 labels=job_labels + ["state", "world_size", "slots"])
        # A re-formed job may share its name with an ended one: the session tells them apart.
        for name, job in list(stats["jobs"].items()) + list(stats["ended_jobs"].items()):
            labels = [name, f"{job['session']:08x}"]
            slots = f"{job['slot_base']}..{job['slot_base'] + job['slot_count'] - 1}"
            info.add_metric(labels + [job.get("state", "running"), str(job["world_size"]), slots],
                            1)
            counters = job["counters"]
            for key in JOB_COUNTERS:
                per_job[key].add_metric(labels, counters.get(key, 0))
            for key, value in counters.items():
                if key.startswith(DROPPED):
                    dropped.add_metric(labels + [key[len(DROPPED):]], value)
                elif key in SPARSE_BLOCKS:
                    blocks.add_metric(labels + [SPARSE_BLOCKS[key]], value)
                elif key == "sparse_bytes_saved":
                    saved.add_metric(labels, value)
                elif key not in JOB_COUNTERS:
                    other.add_metric(labels + [key], value)
        yield from per_job.values()
        yield from (dropped, blocks, saved, other, info)
        yield from self._switch_families(stats, CounterMetricFamily, GaugeMetricFamily)

    @staticmethod
    def _switch_families(stats, CounterMetricFamily, GaugeMetricFamily):
        totals = stats["totals"]
        dropped = CounterMetricFamily("switchml_dropped_packets",
                                      "every packet dropped since the switch started, by reason",
                                      labels=["reason"])
        events = CounterMetricFamily("switchml_control_events",
                                     "control plane events since the switch started",
                                     labels=["event"])
        for key, value in sorted(totals.items()):
            if key.startswith(DROPPED):
                dropped.add_metric([key[len(DROPPED):]], value)
        for key, value in sorted(stats["counters"].items()):
            if not key.startswith(DROPPED):
                events.add_metric([key], value)
        yield dropped
        yield events
        yield CounterMetricFamily("switchml_packets_in", "every admitted contribution",
                                  value=totals.get("packets_in", 0))
        admission = stats.get("admission", {})
        refused = CounterMetricFamily("switchml_joins_refused", "refused joins, by reason",
                                      labels=["reason"])
        for reason, value in sorted(admission.get("refused", {}).items()):
            refused.add_metric([reason], value)
        yield refused
        control = stats.get("control")
        if control is not None:
            closed = CounterMetricFamily("switchml_control_closed",
                                         "control connections the switch closed, by reason",
                                         labels=["reason"])
            for reason, value in sorted(control["closed"].items()):
                closed.add_metric([reason], value)
            yield closed
            connections = GaugeMetricFamily("switchml_control_connections",
                                            "control connections: members of jobs (joined) "
                                            "and waiting to join (unjoined)", labels=["state"])
            connections.add_metric(["joined"], control["connections"] - control["unjoined"])
            connections.add_metric(["unjoined"], control["unjoined"])
            yield connections
            if control.get("descriptor_limit") is not None:
                yield GaugeMetricFamily("switchml_descriptor_limit",
                                        "file descriptors the switch may hold (RLIMIT_NOFILE)",
                                        value=control["descriptor_limit"])
        yield GaugeMetricFamily("switchml_slots", "slots in the pool", value=stats["slots"])
        yield GaugeMetricFamily("switchml_slots_free", "free slots", value=stats["free_slots"])
        jobs = GaugeMetricFamily("switchml_jobs", "jobs by state", labels=["state"])
        jobs.add_metric(["running"], admission.get("running", len(stats["jobs"])))
        jobs.add_metric(["waiting"], len(admission.get("waiting", [])))
        jobs.add_metric(["gathering"], len(admission.get("gathering", [])))
        yield jobs
        if "max_jobs" in admission:
            yield GaugeMetricFamily("switchml_max_jobs", "jobs the switch runs at once",
                                    value=admission["max_jobs"])
            yield GaugeMetricFamily("switchml_max_workers", "workers per job",
                                    value=admission["max_workers"])
        yield GaugeMetricFamily("switchml_uptime_seconds", "seconds since the switch started",
                                value=stats.get("uptime_s", 0.0))
        yield CounterMetricFamily("switchml_cpu_seconds", "CPU time of the switch thread",
                                  value=stats.get("cpu_s", 0.0))


#: Scrapes served at once; one more is closed at once.  Each holds a descriptor
#: and a thread of the switch's process (descriptors.RESERVED_DESCRIPTORS counts
#: them): idle clients must not take what the switch's members need.
MAX_METRICS_CLIENTS = 16
#: Seconds a scrape's client has to send its request and take the answer.
METRICS_CLIENT_S = 5.0


class _Server(socketserver.ThreadingMixIn, wsgiref.simple_server.WSGIServer):
    """prometheus_client's threaded WSGI server, with a cap on the clients served
    at once and none of wsgiref's tracebacks for a client that went away."""

    daemon_threads = True

    def __init__(self, address, handler):
        self._slots = threading.BoundedSemaphore(MAX_METRICS_CLIENTS)
        if ":" in address[0]:  # an IPv6 address ("::", "::1")
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # past the cap: closed at once
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        pass  # a slow, gone or malformed client: its connection is closed, that is all


class _Handler(wsgiref.simple_server.WSGIRequestHandler):
    timeout = METRICS_CLIENT_S  # a client that sends a byte a minute is let go

    def log_message(self, *args):
        pass


class MetricsServer:
    """The HTTP endpoint (``/metrics``) on a thread of its own; ``close()`` stops it."""

    def __init__(self, stats, host: str, port: int):
        prometheus_client = require_prometheus_client()
        self.registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self.registry.register(SwitchCollector(stats))
        server = self._server = wsgiref.simple_server.make_server(
            host, port, prometheus_client.make_wsgi_app(self.registry), _Server, _Handler)
        self._thread = threading.Thread(target=server.serve_forever, daemon=True,
                                        name="switchml-metrics")
        self._thread.start()
        self.address = (host, server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve_metrics(stats, host: str, port: int) -> MetricsServer:
    """Serve ``stats()`` as Prometheus metrics on http://host:port/metrics."""
    return MetricsServer(stats, host, port)
