"""URL checks and redaction: the one place that decides how a URL may be shown."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

from keyq.broker.errors import ConfigurationError

AMQP_SCHEMES = ("amqp", "amqps")
REDIS_SCHEMES = ("redis", "rediss", "unix")
HTTP_SCHEMES = ("http", "https")


def split_urls(value: str) -> list[str]:
    """The URLs of a setting that may list several, comma-separated (a cluster's nodes)."""
    return [part.strip() for part in value.split(",") if part.strip()]


def vhost_of(amqp_url: str) -> str:
    """The virtual host an AMQP URL (or a cluster's URLs: they share it) names; ``/`` if none."""
    path = urlsplit(split_urls(amqp_url)[0]).path
    return unquote(path[1:]) if len(path) > 1 else "/"


def redact_url(url: str) -> str:
    """The URL (or comma-separated URLs) with any password replaced by ``***``, safe for logs
    and errors."""
    if "," in url:
        return ",".join(redact_url(part) for part in split_urls(url))
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable url>"
    if not password:
        if "@" in url:  # credentials we could not parse: hide everything before the host
            scheme, sep, _ = url.partition(":")
            host = url.rpartition("@")[2]
            return f"{scheme}{sep}***@{host}" if sep and scheme.isalpha() else f"***@{host}"
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}"
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is not None:
        netloc += f":{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def scrub(text: str, *urls: str) -> str:
    """``text`` with the passwords of ``urls`` removed, for messages a library produced."""
    for url in (part for listed in urls for part in split_urls(listed)):
        try:
            password = urlsplit(url).password
        except ValueError:
            continue
        if password:
            text = text.replace(password, "***")
    return text


def check_urls(value: str, schemes: tuple[str, ...], what: str) -> str:
    """``check_url`` for each of several comma-separated URLs (at least one)."""
    urls = split_urls(value)
    if not urls:
        raise ConfigurationError(f"{what} is empty")
    for url in urls:
        check_url(url, schemes, what)
    return value


def check_url(url: str, schemes: tuple[str, ...], what: str) -> str:
    """Reject URLs that can never connect, naming the setting but not the password."""
    try:
        parts = urlsplit(url)
        _ = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"{what} is not a valid URL: {redact_url(url)} ({exc})") from None
    if parts.scheme not in schemes:
        allowed = ", ".join(f"{s}://" for s in schemes)
        raise ConfigurationError(
            f"{what} must start with one of {allowed}; got {redact_url(url)!r}"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigurationError(f"{what} has no host: {redact_url(url)!r}")
    return url
