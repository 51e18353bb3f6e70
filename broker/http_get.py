"""A read-only ``GET`` on one of the broker's HTTP endpoints (the management API,
``rabbitmq_prometheus``), with the care both need.

Credentials go in the ``Authorization`` header only, and are not passed on if the endpoint
redirects; every error names the endpoint by its redacted URL and never chains the library
exception, which could carry them.
"""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

from keyq.broker.errors import HttpEndpointUnavailable
from keyq.broker.urls import redact_url, scrub

HTTP_UNAUTHORIZED = 401


def http_get(
    base_url: str,
    path: str,
    timeout: float,
    *,
    what: str,
    error: type[HttpEndpointUnavailable],
    default_port: int,
    default_credentials: tuple[str, str] | None = None,
    hints: Mapping[int, str] | None = None,
    accept: str | None = None,
) -> bytes:
    """The body of ``GET path`` (with its query) on the endpoint at ``base_url``.

    Raises ``error`` (its message names ``what`` at the redacted URL; its ``status`` is the
    HTTP status, if one came) when the endpoint does not answer or answers with an error;
    ``hints`` add a reason to a status.
    """
    shown = redact_url(base_url)
    try:
        parts = urllib.parse.urlsplit(base_url)
        port = parts.port or default_port
    except ValueError:
        raise error(f"{what} URL {shown} is not valid") from None
    host = parts.hostname or "localhost"
    if ":" in host:
        host = f"[{host}]"
    prefix = parts.path.rstrip("/")
    request = urllib.request.Request(f"{parts.scheme}://{host}:{port}{prefix}{path}")
    if accept is not None:
        request.add_header("Accept", accept)
    if default_credentials is not None or parts.username or parts.password:
        default_user, default_password = default_credentials or ("", "")
        user = urllib.parse.unquote(parts.username or default_user)
        password = urllib.parse.unquote(parts.password or default_password)
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        # Not passed on if the endpoint redirects, perhaps to another host or to plain http.
        request.add_unredirected_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as exc:
        reason = f"HTTP {exc.code}" + _said(exc)
        if exc.code == HTTP_UNAUTHORIZED:
            reason += ": the credentials were refused"
        elif hints and exc.code in hints:
            reason += f": {hints[exc.code]}"
        exc.close()
        raise error(f"{what} at {shown} refused: {reason}", status=exc.code) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        reason = scrub(str(getattr(exc, "reason", exc)), base_url)
        raise error(f"{what} at {shown} did not answer: {reason}") from None


def _said(exc: urllib.error.HTTPError) -> str:
    """The reason a RabbitMQ error answer gives (``{"error": ..., "reason": ...}``), if any."""
    try:
        said = json.loads(exc.read(2000))
    except (OSError, ValueError, http.client.HTTPException):
        return ""
    reason = said.get("reason") if isinstance(said, dict) else None
    return f" ({reason[:200]})" if isinstance(reason, str) and reason else ""
