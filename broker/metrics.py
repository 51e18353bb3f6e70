"""A small Prometheus endpoint: the text exposition format 0.0.4, on the standard library only.

``MetricsServer`` serves ``GET /metrics`` (and ``GET /healthz``) from a daemon thread, and
calls ``collect()`` on every scrape, so the numbers are read when Prometheus asks for them.
``Metric`` is one metric family; ``render`` turns families into the text format.
"""

from __future__ import annotations

import errno
import logging
import math
import re
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal
from urllib.parse import urlsplit

log = logging.getLogger("keyq.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Kind = Literal["counter", "gauge", "summary", "histogram"]
KINDS: frozenset[str] = frozenset({"counter", "gauge", "summary", "histogram"})

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_RESERVED_LABEL = {"histogram": "le", "summary": "quantile"}


@dataclass(frozen=True, slots=True)
class Histogram:
    """One histogram child: ``buckets`` are (upper bound, cumulative count) in ascending
    order, without ``+Inf`` (its count is ``count``); ``sum`` is the sum of observations."""

    buckets: Sequence[tuple[float, int]]
    count: int
    sum: float


@dataclass(frozen=True, slots=True)
class Summary:
    """One summary child: (quantile in [0, 1], value) pairs, the count and sum of
    observations (both cumulative)."""

    quantiles: Sequence[tuple[float, float]]
    count: int
    sum: float


Value = float | Histogram | Summary
Sample = tuple[Mapping[str, str], Value]


@dataclass(frozen=True)
class Metric:
    """A metric family: its name, kind, help text and samples, each (labels, value).

    Counters and gauges take numbers; histograms take ``Histogram`` values and summaries
    ``Summary`` values. Counter names end in ``_total``. Checked on construction, so a bad
    family fails where it is built, not in the middle of a scrape.
    """

    name: str
    kind: Kind
    help: str
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not _METRIC_NAME.match(self.name):
            raise ValueError(f"invalid metric name {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: unknown kind {self.kind!r}")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"{self.name}: counter names end in _total")
        seen: set[frozenset[tuple[str, str]]] = set()
        for labels, value in self.samples:
            self._check_labels(labels)
            self._check_value(value)
            identity = frozenset(labels.items())
            if identity in seen:
                raise ValueError(f"{self.name}: duplicate labels {dict(labels)}")
            seen.add(identity)

    def _check_labels(self, labels: Mapping[str, str]) -> None:
        for name, value in labels.items():
            if not _LABEL_NAME.match(name) or name.startswith("__"):
                raise ValueError(f"{self.name}: invalid label name {name!r}")
            if name == _RESERVED_LABEL.get(self.kind):
                raise ValueError(f"{self.name}: label {name!r} is reserved for a {self.kind}")
            if not isinstance(value, str):
                raise TypeError(f"{self.name}: label {name} must be a string, not {value!r}")

    def _check_value(self, value: Value) -> None:
        if self.kind == "histogram":
            if not isinstance(value, Histogram):
                raise TypeError(f"{self.name}: a histogram sample takes a Histogram")
            bounds = [bound for bound, _count in value.buckets]
            counts = [count for _bound, count in value.buckets]
            if any(not math.isfinite(b) for b in bounds) or bounds != sorted(set(bounds)):
                raise ValueError(f"{self.name}: bucket bounds must be finite and ascending")
            if counts != sorted(counts) or any(c < 0 or c > value.count for c in counts):
                raise ValueError(f"{self.name}: bucket counts must be cumulative, <= count")
        elif self.kind == "summary":
            if not isinstance(value, Summary):
                raise TypeError(f"{self.name}: a summary sample takes a Summary")
            if any(not 0 <= q <= 1 for q, _v in value.quantiles):
                raise ValueError(f"{self.name}: quantiles lie in [0, 1]")
        else:
            if isinstance(value, Histogram | Summary) or not isinstance(value, int | float):
                raise TypeError(f"{self.name}: a {self.kind} sample takes a number")
            if self.kind == "counter" and not value >= 0:
                raise ValueError(f"{self.name}: a counter cannot be {value}")


# ---- the text format ---------------------------------------------------------------------


def format_value(value: float) -> str:
    """A sample value as the text format writes it (``+Inf``, ``-Inf``, ``NaN``)."""
    if isinstance(value, int):
        return str(int(value))  # int(): True is 1, not "True"
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def escape_label_value(value: str) -> str:
    """Backslash, double quote and newline, escaped as the text format demands."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Backslash and newline, escaped (a HELP line leaves quotes alone)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: Mapping[str, str], extra: tuple[str, str] | None = None) -> str:
    pairs = [*labels.items(), *([extra] if extra else [])]
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in pairs) + "}"


def _sample_lines(metric: Metric, labels: Mapping[str, str], value: Value) -> list[str]:
    name = metric.name
    if isinstance(value, Histogram):
        lines = [
            f"{name}_bucket{_labels(labels, ('le', format_value(float(bound))))} {count}"
            for bound, count in value.buckets
        ]
        lines.append(f"{name}_bucket{_labels(labels, ('le', '+Inf'))} {value.count}")
        lines.append(f"{name}_sum{_labels(labels)} {format_value(value.sum)}")
        lines.append(f"{name}_count{_labels(labels)} {value.count}")
        return lines
    if isinstance(value, Summary):
        lines = [
            f"{name}{_labels(labels, ('quantile', format_value(float(q))))} {format_value(v)}"
            for q, v in value.quantiles
        ]
        lines.append(f"{name}_sum{_labels(labels)} {format_value(value.sum)}")
        lines.append(f"{name}_count{_labels(labels)} {value.count}")
        return lines
    return [f"{name}{_labels(labels)} {format_value(value)}"]


def render(metrics: Iterable[Metric]) -> str:
    """The families in the text format 0.0.4; each family name may appear once."""
    lines: list[str] = []
    names: set[str] = set()
    for metric in metrics:
        if metric.name in names:
            raise ValueError(f"metric family {metric.name} given twice")
        names.add(metric.name)
        lines.append(f"# HELP {metric.name} {escape_help(metric.help)}")
        lines.append(f"# TYPE {metric.name} {metric.kind}")
        for labels, value in metric.samples:
            lines.extend(_sample_lines(metric, labels, value))
    return "".join(line + "\n" for line in lines)


# ---- the server --------------------------------------------------------------------------

Collect = Callable[[], Iterable[Metric]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], collect: Collect) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.collect = collect
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A scraper that hangs up mid-reply is not worth a traceback on stderr.
        log.debug("metrics request from %s failed", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "keyq-metrics"

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            try:
                body = render(self.server.collect()).encode()
            except Exception:  # a broken collector must not take the endpoint down
                log.exception("collecting metrics failed")
                self._reply(500, b"collecting metrics failed\n")
                return
            self._reply(200, body, CONTENT_TYPE)
        elif path == "/healthz":
            self._reply(200, b"ok")
        else:
            self._reply(404, b"not found: try /metrics\n")

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def start_first_free(port: int, span: int, host: str, *, collect: Collect) -> MetricsServer:
    """Serve on the first port of ``port`` .. ``port + span - 1`` that is free: replicas that
    share one network (host networking, several daemons on a machine) each find one, and
    say which, instead of failing in a restart loop. Port 0 lets the system choose.

    Raises ``OSError`` naming the whole span when every port of it is taken; any other bind
    failure (no such address, a privileged port) is raised at once, as it is no clash.
    """
    last = port if port == 0 else min(port + max(span, 1) - 1, 65535)
    for candidate in range(port, last + 1):
        server = MetricsServer(candidate, host, collect=collect)
        try:
            server.start()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        if candidate != port:
            log.warning(
                "metrics port %d is taken; serving on %d instead (the span allows %d-%d)",
                port,
                candidate,
                port,
                last,
            )
        return server
    taken = f"port {port} is" if last == port else f"ports {port}-{last} are all"
    raise OSError(errno.EADDRINUSE, f"{taken} taken on {host}")


class MetricsServer:
    """Serves ``/metrics`` (from ``collect()``) and ``/healthz`` on ``host:port`` in a
    daemon thread. Port 0 picks a free port; ``port`` tells which, once started."""

    def __init__(self, port: int, host: str = "0.0.0.0", *, collect: Collect) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"invalid metrics port {port}")
        self._host = host
        self._port = port
        self._collect = collect
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port once started (so the real one for port 0), else the one asked."""
        if self._server is not None:
            return int(self._server.server_address[1])
        return self._port

    @property
    def host(self) -> str:
        return self._host

    def start(self) -> MetricsServer:
        """Bind and serve; raises ``OSError`` if the port cannot be bound."""
        if self._server is not None:
            raise RuntimeError("the metrics server is already started")
        server = _Server((self._host, self._port), self._collect)
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name=f"keyq-metrics-{server.server_address[1]}",
            daemon=True,
        )
        thread.start()
        self._server, self._thread = server, thread
        log.info("serving metrics on http://%s:%d/metrics", self._host, self.port)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket; a no-op when not started."""
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(5)
        self._server = self._thread = None

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
