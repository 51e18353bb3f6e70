"""Header and Redis values as text: they come as bytes or str depending on the client."""

from __future__ import annotations


def as_text(value: object) -> str:
    """``value`` as text: bytes decoded as UTF-8 (undecodable bytes replaced)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
