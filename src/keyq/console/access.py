"""Who may use the console and how a change is proven to come from its own page.

A console bound to loopback may run open; bound anywhere else it needs ``KEYQ_CONSOLE_TOKEN``
(sent as ``Authorization: Bearer``, or as the password of HTTP basic auth) or
``KEYQ_CONSOLE_BASIC_AUTH`` (``user:password``), and refuses to start without one. Every change
is a POST carrying a CSRF token: an HMAC, under a secret of the process, of a random session
cookie that is SameSite=Strict and HttpOnly, so that a page elsewhere can neither read nor send
it. A POST whose Origin is another site is refused as well. Secrets are compared in constant
time and never logged.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass, field

from keyq.broker.errors import ConfigurationError
from keyq.console.settings import ConsoleSettings

SESSION_COOKIE = "keyq_console_session"
LOCAL_USER = "local"


class ConsoleExposed(ConfigurationError):
    """The console would listen beyond loopback with nobody's password asked."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """The console's credentials and mode; ``secret`` signs CSRF tokens for this process."""

    token: str | None = field(default=None, repr=False)
    basic_user: str | None = None
    basic_password: str | None = field(default=None, repr=False)
    read_only: bool = False
    allowed_hosts: frozenset[str] = frozenset()  # Host names beyond loopback (guarded only)
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    @classmethod
    def from_settings(
        cls,
        settings: ConsoleSettings,
        host: str,
        *,
        read_only: bool,
        allowed_hosts: tuple[str, ...] = (),
    ) -> Access:
        """From ``KEYQ_CONSOLE_TOKEN`` and ``KEYQ_CONSOLE_BASIC_AUTH``; refuses an address
        beyond loopback without either."""
        secret = settings.console_token
        token = secret.get_secret_value() if secret is not None else None
        given = settings.console_basic_auth
        basic = given.get_secret_value() if given is not None else None
        user = password = None
        if basic is not None:
            user, sep, password = basic.partition(":")
            if not sep or not user or not password:
                raise ConfigurationError("KEYQ_CONSOLE_BASIC_AUTH must be user:password")
        names = {name.lower() for name in allowed_hosts}
        if host not in ("0.0.0.0", "::", ""):  # a name or address of its own: it is reached so
            names.add(host.strip("[]").lower())
        access = cls(
            token=token or None,
            basic_user=user,
            basic_password=password,
            read_only=read_only,
            allowed_hosts=frozenset(names),
        )
        if not is_loopback(host) and not access.guarded:
            raise ConsoleExposed(
                f"the console would listen on {host} with no password: set KEYQ_CONSOLE_TOKEN "
                "or KEYQ_CONSOLE_BASIC_AUTH (user:password), or bind to 127.0.0.1"
            )
        return access

    @property
    def guarded(self) -> bool:
        return self.token is not None or self.basic_user is not None

    def who(self, authorization: str | None) -> str | None:
        """The user an Authorization header proves, ``local`` on an open console, else None."""
        if not self.guarded:
            return LOCAL_USER
        scheme, _, value = (authorization or "").partition(" ")
        if scheme.lower() == "bearer" and self.token is not None:
            return "token" if _same(value.strip(), self.token) else None
        if scheme.lower() != "basic":
            return None
        try:
            user, sep, password = base64.b64decode(value.strip()).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        if not sep:
            return None
        basic = self.basic_user is not None and self.basic_password is not None
        if (
            basic
            and _same(user, self.basic_user or "")
            and _same(password, self.basic_password or "")
        ):
            return user
        if self.token is not None and _same(password, self.token):
            return user or "token"
        return None

    def answers(self, hostname: str) -> bool:
        """Whether a request addressed to ``hostname`` is for this console: loopback names
        always; others only on a guarded console that was told them (``--allowed-host``), so a
        site whose name is rebound to this address is refused even with the password."""
        if is_loopback(hostname):
            return True
        return self.guarded and hostname.lower() in self.allowed_hosts

    def csrf_token(self, session: str) -> str:
        return hmac.new(self.secret, session.encode(), hashlib.sha256).hexdigest()

    def csrf_valid(self, session: str | None, token: str | None) -> bool:
        if not session or not token:
            return False
        return hmac.compare_digest(self.csrf_token(session), token)


def new_session() -> str:
    return secrets.token_urlsafe(24)


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
