"""A loopback port that accepts TCP connections and never says a word.

It stands for a broker that cannot complete the AMQP handshake: RabbitMQ overloaded (out of
file descriptors, say) keeps accepting TCP connections but never answers a client's protocol
header. A client connects at once, sends its header, and waits for ``connection.start`` in
vain. What the client sends is read and dropped, so it is never held up writing.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit

__all__ = ["SilentListener"]


class SilentListener:
    """Accepts every connection on a free loopback port, reads and drops what it receives,
    answers nothing, and keeps each connection open until the client closes it."""

    def __init__(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind(("127.0.0.1", 0))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port: int = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._accepted = 0
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"SilentListener:{self.port}", daemon=True
        )

    def start(self) -> SilentListener:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection; idempotent."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(5)

    def __enter__(self) -> SilentListener:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def accepted(self) -> int:
        """Connections accepted so far (each one a client's attempt)."""
        with self._lock:
            return self._accepted

    def url_for(self, url: str) -> str:
        """``url`` (amqp:// or amqps://) pointed at this listener, credentials and vhost kept."""
        parts = urlsplit(url)
        userinfo, at, _ = parts.netloc.rpartition("@")
        netloc = f"{userinfo}{at}127.0.0.1:{self.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    def _run(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        return
                for key, _ in self._selector.select(1.0):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._wake_r:
                        continue
                    if sock is self._listener:
                        self._accept()
                    else:
                        self._drop_input(sock)
        finally:
            for key in list(self._selector.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]
            self._selector.close()
            self._wake_w.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            client.setblocking(False)
            self._selector.register(client, selectors.EVENT_READ)
            with self._lock:
                self._accepted += 1

    def _drop_input(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client gave up: close our end too
            self._selector.unregister(sock)
            sock.close()
