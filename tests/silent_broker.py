"""A loopback port that accepts TCP and never says a word: a broker that cannot complete the
AMQP handshake (RabbitMQ out of file descriptors). Input is read and dropped, never blocking."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit, urlunsplit

__all__ = ["SilentListener"]


class SilentListener:
    """Accepts on a free loopback port, answers nothing, keeps each connection open until
    the client closes it (or the listener stops)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.settimeout(0.2)
        self.port: int = int(self._listener.getsockname()[1])
        self._clients: list[socket.socket] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._accept, name=f"Silent:{self.port}", daemon=True
        )

    def __enter__(self) -> SilentListener:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stopping.set()
        self._thread.join(5)
        for sock in [self._listener, *self._clients]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread reading it
            sock.close()

    @property
    def accepted(self) -> int:
        """Connections accepted so far (each one a client's attempt)."""
        return len(self._clients)

    def url_for(self, url: str) -> str:
        """``url`` (amqp:// or amqps://) pointed at this listener, credentials and vhost kept."""
        parts = urlsplit(url)
        userinfo, at, _ = parts.netloc.rpartition("@")
        netloc = f"{userinfo}{at}127.0.0.1:{self.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            self._clients.append(client)
            threading.Thread(target=self._drop_input, args=(client,), daemon=True).start()

    @staticmethod
    def _drop_input(client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while client.recv(65536):
                pass
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_RDWR)  # the client gave up: close our end too
