"""The daemons' HTTP endpoint: Prometheus metrics and health probes, from a daemon thread.

``/metrics`` renders the daemon's own ``prometheus_client`` registry (one per daemon, so
several workers in one process keep their numbers apart). ``/livez`` answers 200 while the
daemon's loop keeps turning, ``/readyz`` 200 while it serves, and 503 otherwise; ``/healthz``
is ``/livez`` under its older name. Each probe is a callable the daemon provides, read on
every request.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("keyq.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Health:
    """What the probes answer: ``live`` (the daemon's loop turns) and ``ready`` (it serves)."""

    live: Callable[[], bool] = _always
    ready: Callable[[], bool] = _always


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], registry: CollectorRegistry, health: Health
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.registry = registry
        self.health = health
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
                body = generate_latest(self.server.registry)
            except Exception:  # a broken collector must not take the endpoint down
                log.exception("collecting metrics failed")
                self._reply(500, b"collecting metrics failed\n")
                return
            self._reply(200, body, CONTENT_TYPE)
        elif path in ("/livez", "/healthz"):
            self._probe(self.server.health.live, b"live\n", b"not live: the loop stopped turning\n")
        elif path == "/readyz":
            self._probe(self.server.health.ready, b"ready\n", b"not ready\n")
        else:
            self._reply(404, b"not found: try /metrics, /livez or /readyz\n")

    def _probe(self, check: Callable[[], bool], yes: bytes, no: bytes) -> None:
        try:
            ok = check()
        except Exception:  # a probe that fails says "no", it does not take the server down
            log.exception("health probe failed")
            ok = False
        self._reply(200 if ok else 503, yes if ok else no)

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def start_first_free(
    port: int,
    span: int,
    host: str,
    *,
    registry: CollectorRegistry,
    health: Health | None = None,
) -> MetricsServer:
    """Serve on the first port of ``port`` .. ``port + span - 1`` that is free: replicas that
    share one network (host networking, several daemons on a machine) each find one, and
    say which, instead of failing in a restart loop. Port 0 lets the system choose.

    Raises ``OSError`` naming the whole span when every port of it is taken; any other bind
    failure (no such address, a privileged port) is raised at once, as it is no clash.
    """
    last = port if port == 0 else min(port + max(span, 1) - 1, 65535)
    for candidate in range(port, last + 1):
        server = MetricsServer(candidate, host, registry=registry, health=health)
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
    """Serves ``/metrics`` (from ``registry``), ``/livez``, ``/healthz`` and ``/readyz`` on
    ``host:port`` in a daemon thread. Port 0 picks a free port; ``port`` tells which."""

    def __init__(
        self,
        port: int,
        host: str = "0.0.0.0",
        *,
        registry: CollectorRegistry,
        health: Health | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"invalid metrics port {port}")
        self._host = host
        self._port = port
        self._registry = registry
        self._health = health or Health()
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
        server = _Server((self._host, self._port), self._registry, self._health)
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
