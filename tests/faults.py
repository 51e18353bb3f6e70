"""Loopback TCP fault-injection proxy: stalls, latency, cut or refused connections between a
client and RabbitMQ or Redis, without touching the shared servers. All socket work is on one
selector thread; public methods wait for it, so a fault is in effect when they return."""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

__all__ = ["FaultProxy"]

_log = logging.getLogger(__name__)

_CHUNK = 65536
# Stop reading a side once this much is held for the other: back-pressure, not growth.
_HIGH_WATER = 1 << 20
_CALL_TIMEOUT = 5.0
_SCHEMES = frozenset({"amqp", "amqps", "redis", "rediss"})
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


def _loopback_addresses(host: str, port: int) -> list[tuple[int, tuple[str, int]]]:
    """Resolve ``host``, refusing anything not loopback: tests never send traffic away."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve {host!r}: {exc}") from exc
    found: list[tuple[int, tuple[str, int]]] = []
    for family, _, _, _, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        address = str(sockaddr[0])
        if not ipaddress.ip_address(address.split("%", 1)[0]).is_loopback:
            raise ValueError(f"{host!r} resolves to non-loopback address {address}")
        found.append((int(family), (address, int(sockaddr[1]))))
    if not found:
        raise ValueError(f"{host!r} has no IPv4/IPv6 address")
    # IPv4 first: servers here commonly bind 127.0.0.1 only.
    found.sort(key=lambda item: item[0] != socket.AF_INET)
    return found


def _close(sock: socket.socket, *, reset: bool) -> None:
    """Close ``sock``, with an RST instead of a FIN when ``reset``."""
    with contextlib.suppress(OSError):
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    with contextlib.suppress(OSError):
        sock.close()


@dataclass(eq=False)
class _Flow:
    """One direction: bytes read from ``src``, held with their due time until sent to ``dst``."""

    src: socket.socket
    dst: socket.socket
    chunks: deque[tuple[float, bytes]] = field(default_factory=deque)
    sent: int = 0  # bytes of chunks[0] already written
    held: int = 0  # total bytes in chunks
    eof: bool = False  # src sent FIN
    shut: bool = False  # FIN forwarded to dst


_FRAME_METHOD, _FRAME_HEADER, _FRAME_BODY = 1, 2, 3
_BASIC_DELIVER = (60, 60)


class _DeliveryDropper:
    """Cuts whole ``basic.deliver`` messages whose body holds a marker out of the broker's AMQP
    stream (delivered for the broker, never seen by the client); the rest passes unchanged."""

    def __init__(self, markers: list[bytes]) -> None:
        self.markers = markers  # shared with the proxy: each is used once
        self.dropped = 0
        self._pending = b""
        # channel -> (frames held, body bytes still to come or None before the header)
        self._messages: dict[int, tuple[list[bytes], int | None]] = {}

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        out: list[bytes] = []
        while len(self._pending) >= 7:
            kind, channel, size = struct.unpack(">BHI", self._pending[:7])
            if len(self._pending) < 8 + size:
                break
            frame, self._pending = self._pending[: 8 + size], self._pending[8 + size :]
            payload = frame[7:-1]
            held = self._messages.get(channel)
            if kind == _FRAME_METHOD and struct.unpack(">HH", payload[:4]) == _BASIC_DELIVER:
                self._messages[channel] = ([frame], None)
            elif held is not None and kind == _FRAME_HEADER:
                body_size = struct.unpack(">Q", payload[4:12])[0]
                self._messages[channel] = (held[0] + [frame], body_size)
            elif held is not None and kind == _FRAME_BODY and held[1] is not None:
                self._messages[channel] = (held[0] + [frame], held[1] - len(payload))
            else:
                out.append(frame)
                continue
            frames, left = self._messages[channel]
            if left is not None and left <= 0:
                del self._messages[channel]
                body = b"".join(f[7:-1] for f in frames[2:])
                marker = next((m for m in self.markers if m in body), None)
                if marker is not None:
                    self.markers.remove(marker)
                    self.dropped += 1
                else:
                    out.extend(frames)
        return b"".join(out)


@dataclass(eq=False)
class _Pipe:
    client: socket.socket
    upstream: socket.socket
    up: _Flow  # client -> upstream
    down: _Flow  # upstream -> client
    dropper: _DeliveryDropper | None = None  # on ``down``, while deliveries are dropped
    connected: bool = False  # upstream connect() completed
    closed: bool = False
    client_reads: int = 0  # chunks read from the client so far


class FaultProxy:
    """A loopback TCP proxy that can pause, delay, cut or refuse connections on demand."""

    def __init__(
        self, upstream_host: str, upstream_port: int, *, listen_host: str = "127.0.0.1"
    ) -> None:
        self._upstream = _loopback_addresses(upstream_host, upstream_port)[0]
        listen_family, listen_addr = _loopback_addresses(listen_host, 0)[0]
        self._listen_host = listen_addr[0]
        self._listener = socket.socket(listen_family, socket.SOCK_STREAM)
        try:
            self._listener.bind(listen_addr)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port: int = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._interest: dict[socket.socket, int] = {}
        self._pipes: list[_Pipe] = []
        self.accepted = 0  # connections accepted so far, refused ones too
        self._paused = False
        self._refusing = False
        self._dropping_handshakes = False
        self._delay = 0.0
        self._drop_markers: list[bytes] = []
        self._droppers: list[_DeliveryDropper] = []
        # Guards the command queue, the running/stopped flags and the pipe count.
        self._lock = threading.Condition()
        self._commands: deque[tuple[Callable[[], None], Future[None]]] = deque()
        self._thread: threading.Thread | None = None
        self._loop_running = False
        self._stopping = False

    def start(self) -> FaultProxy:
        """Start forwarding on a daemon thread; returns ``self`` for chaining."""
        with self._lock:
            if self._stopping:
                raise RuntimeError("FaultProxy was stopped; create a new one")
            if self._thread is not None:
                return self
            self._loop_running = True
            self._thread = threading.Thread(
                target=self._run, name=f"FaultProxy:{self.port}", daemon=True
            )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection (with RST); idempotent."""
        with self._lock:
            if self._stopping:
                thread = None
            else:
                self._stopping = True
                thread = self._thread
                if thread is None:
                    self._shutdown()
                    return
        if thread is not None and thread is not threading.current_thread():
            self._wake()
            thread.join(_CALL_TIMEOUT)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def pause(self) -> None:
        """Stop forwarding both ways; connections stay open, bytes held until :meth:`resume`."""
        self._call(lambda: setattr(self, "_paused", True))

    def resume(self) -> None:
        """Forward again, held bytes first and in order."""
        self._call(lambda: setattr(self, "_paused", False))

    def cut(self) -> None:
        """Reset every current connection both sides; new connections are still accepted."""
        self._call(self._abort_all)

    def refuse(self, on: bool = True) -> None:
        """While on, reset new connections at once, as a server that is down; others stay."""
        self._call(lambda: setattr(self, "_refusing", on))

    def drop_handshakes(self, on: bool = True) -> None:
        """While on, new connections are forwarded until the client's second chunk (for
        AMQP, its credentials), then reset: a server that is starting or stopping."""
        self._call(lambda: setattr(self, "_dropping_handshakes", on))

    def drop_deliveries(self, *markers: bytes) -> None:
        """On connections opened from now on, cut out the first ``basic.deliver`` whose body
        holds each marker: RabbitMQ counts it delivered and unacked; the consumer never gets it."""
        self._call(lambda: self._drop_markers.extend(markers))

    @property
    def deliveries_dropped(self) -> int:
        with self._lock:
            return sum(dropper.dropped for dropper in self._droppers)

    def set_delay(self, seconds: float) -> None:
        """Hold every chunk read from either side ``seconds`` before forwarding it, in order."""
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        self._call(lambda: setattr(self, "_delay", float(seconds)))

    @property
    def connections(self) -> int:
        """Number of client connections currently open through the proxy."""
        with self._lock:
            return len(self._pipes)

    def wait_connections(self, count: int, timeout: float = 2.0) -> bool:
        """Wait until exactly ``count`` connections are open (accepts and closes are async)."""
        with self._lock:
            return self._lock.wait_for(lambda: len(self._pipes) == count, timeout)

    def url_for(self, url: str) -> str:
        """``url`` pointed at this proxy, everything but host and port exactly as written."""
        parts = urlsplit(url)
        if parts.scheme.lower() not in _SCHEMES:
            raise ValueError(f"unsupported URL scheme {parts.scheme!r}")
        if not parts.netloc:
            raise ValueError("URL has no host")
        userinfo, at, _ = parts.netloc.rpartition("@")
        host = f"[{self._listen_host}]" if ":" in self._listen_host else self._listen_host
        netloc = f"{userinfo}{at}{host}:{self.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    def _call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the proxy thread and wait (inline if it is not running)."""
        done: Future[None] = Future()
        with self._lock:
            if not self._loop_running:
                fn()
                return
            self._commands.append((fn, done))
        self._wake()
        try:
            done.result(_CALL_TIMEOUT)
        except TimeoutError:
            raise RuntimeError("FaultProxy thread did not respond") from None

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, done = self._commands.popleft()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - re-raised in the calling thread
                done.set_exception(exc)
            else:
                done.set_result(None)

    def _wake(self) -> None:
        # OSError: buffer full (a wake-up is already pending) or already closed.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _run(self) -> None:
        try:
            self._set_interest(self._listener, selectors.EVENT_READ)
            self._set_interest(self._wake_r, selectors.EVENT_READ)
            while True:
                self._run_commands()
                with self._lock:
                    if self._stopping:
                        break
                timeout = self._update()
                for key, ready in self._selector.select(timeout):
                    self._dispatch(key, ready)
        except Exception:  # noqa: BLE001 - a bug must not kill the test run silently
            _log.exception("FaultProxy on port %d failed; closing it", self.port)
        finally:
            # Under the lock: _call() runs inline from here, not while sockets close.
            with self._lock:
                self._loop_running = False
                self._stopping = True
                self._run_commands()  # release callers that raced with shutdown
                self._shutdown()

    def _shutdown(self) -> None:
        self._abort_all()
        for sock in (self._listener, self._wake_r, self._wake_w):
            _close(sock, reset=False)
        self._interest.clear()
        with contextlib.suppress(OSError):
            self._selector.close()

    def _dispatch(self, key: selectors.SelectorKey, ready: int) -> None:
        sock = key.fileobj
        if sock is self._wake_r:
            with contextlib.suppress(OSError):
                while self._wake_r.recv(4096):
                    pass
        elif sock is self._listener:
            self._accept()
        else:
            pipe: _Pipe = key.data
            if pipe.closed:
                return
            if ready & selectors.EVENT_READ:
                self._read(pipe, pipe.up if sock is pipe.client else pipe.down)
            if pipe.closed:
                return
            if ready & selectors.EVENT_WRITE:
                if sock is pipe.upstream and not pipe.connected:
                    self._finish_connect(pipe)
                else:
                    self._flush(pipe, pipe.down if sock is pipe.client else pipe.up)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            self.accepted += 1
            if self._refusing:
                _close(client, reset=True)
                continue
            self._open_pipe(client)

    def _open_pipe(self, client: socket.socket) -> None:
        family, address = self._upstream
        upstream = socket.socket(family, socket.SOCK_STREAM)
        for sock in (client, upstream):
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pipe = _Pipe(client, upstream, _Flow(client, upstream), _Flow(upstream, client))
        if self._drop_markers:
            pipe.dropper = _DeliveryDropper(self._drop_markers)
        with self._lock:
            if pipe.dropper is not None:
                self._droppers.append(pipe.dropper)
            self._pipes.append(pipe)
            self._lock.notify_all()
        err = upstream.connect_ex(address)
        if err == 0:
            pipe.connected = True
        elif err not in (errno.EINPROGRESS, errno.EWOULDBLOCK):
            self._close_pipe(pipe, reset=True)

    def _finish_connect(self, pipe: _Pipe) -> None:
        if pipe.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self._close_pipe(pipe, reset=True)  # upstream down: reset the client
            return
        pipe.connected = True
        self._flush(pipe, pipe.up)

    def _read(self, pipe: _Pipe, flow: _Flow) -> None:
        try:
            data = flow.src.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_pipe(pipe, reset=True)  # propagate the reset
            return
        if data and flow is pipe.up:
            pipe.client_reads += 1
            if self._dropping_handshakes and pipe.client_reads >= 2:
                self._close_pipe(pipe, reset=True)
                return
        if data and flow is pipe.down and pipe.dropper is not None:
            data = pipe.dropper.feed(data)
            if not data:
                return  # all of it held back, or dropped
        if data:
            flow.chunks.append((time.monotonic() + self._delay, data))
            flow.held += len(data)
        else:
            flow.eof = True
        self._flush(pipe, flow)

    def _flush(self, pipe: _Pipe, flow: _Flow) -> None:
        """Write the due chunks of ``flow`` the kernel takes; forward EOF once none is left."""
        if self._paused or not pipe.connected or pipe.closed:
            return
        now = time.monotonic()
        while flow.chunks:
            due, data = flow.chunks[0]
            if due > now:
                return
            try:
                flow.sent += flow.dst.send(memoryview(data)[flow.sent :])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close_pipe(pipe, reset=True)
                return
            if flow.sent < len(data):
                return
            flow.chunks.popleft()
            flow.held -= len(data)
            flow.sent = 0
        if flow.eof and not flow.shut:
            flow.shut = True
            with contextlib.suppress(OSError):
                flow.dst.shutdown(socket.SHUT_WR)
            if pipe.up.shut and pipe.down.shut:
                self._close_pipe(pipe, reset=False)

    def _update(self) -> float | None:
        """Move due data, set selector interests; return how long select may sleep."""
        now = time.monotonic()
        next_due: float | None = None
        for pipe in list(self._pipes):
            for flow in (pipe.up, pipe.down):
                if self._paused or not pipe.connected:
                    continue
                if flow.chunks and flow.chunks[0][0] > now:
                    due = flow.chunks[0][0]
                    next_due = due if next_due is None else min(next_due, due)
                elif flow.chunks or (flow.eof and not flow.shut):
                    self._flush(pipe, flow)  # due data, or EOF held by a pause
            if pipe.closed:
                continue
            for sock, out, inc in (
                (pipe.client, pipe.up, pipe.down),
                (pipe.upstream, pipe.down, pipe.up),
            ):
                events = 0
                usable = sock is pipe.client or pipe.connected
                if not usable:
                    events = selectors.EVENT_WRITE  # wait for connect()
                elif not self._paused:
                    if not out.eof and out.held < _HIGH_WATER:
                        events |= selectors.EVENT_READ
                    if inc.chunks and inc.chunks[0][0] <= now:
                        events |= selectors.EVENT_WRITE  # send() would block
                self._set_interest(sock, events, pipe)
        return None if next_due is None else max(0.0, next_due - now)

    def _set_interest(self, sock: socket.socket, events: int, data: object = None) -> None:
        current = self._interest.get(sock, 0)
        if events == current:
            return
        if current == 0:
            self._selector.register(sock, events, data)
        elif events == 0:
            self._selector.unregister(sock)
        else:
            self._selector.modify(sock, events, data)
        if events:
            self._interest[sock] = events
        else:
            del self._interest[sock]

    def _close_pipe(self, pipe: _Pipe, *, reset: bool) -> None:
        if pipe.closed:
            return
        pipe.closed = True
        for sock in (pipe.client, pipe.upstream):
            if self._interest.pop(sock, 0):
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._selector.unregister(sock)
            _close(sock, reset=reset)
        with self._lock:
            self._pipes.remove(pipe)
            self._lock.notify_all()

    def _abort_all(self) -> None:
        for pipe in list(self._pipes):
            self._close_pipe(pipe, reset=True)
