"""The console's settings, on top of the shared ones (each also ``KEYQ_<FIELD>``): what a
browser must present when the console listens beyond loopback. Kept secret: ``keyq settings``
and error messages show them as stars."""

from __future__ import annotations

from pydantic import Field, SecretStr

from keyq.broker.settings import Settings


class ConsoleSettings(Settings):
    """Who may use ``keyq console``."""

    console_token: SecretStr | None = Field(
        default=None,
        description="a token the console asks for: `Authorization: Bearer`, or as the password "
        "of basic auth with any user name",
    )
    console_basic_auth: SecretStr | None = Field(
        default=None, description="`user:password` the console asks for by basic auth"
    )
