"""The key each queue was declared for, as the batch needs it (``KeyDirectory``)."""

from __future__ import annotations

from collections.abc import Collection

from keyq.broker.naming import Mode
from keyq.broker.registry import QueueRegistry


class QueueKeys:
    """A key-mode queue's key, from the registry, remembered once read: a message there
    without a key header still belongs to it. A bucket holds many keys: such a message has
    no key. Used by the batch loop's thread only."""

    def __init__(self, registry: QueueRegistry, mode: Mode) -> None:
        self._registry = registry
        self._mode = mode
        self._known: dict[str, str | None] = {}

    def keys_of(self, queues: Collection[str]) -> dict[str, str | None]:
        """The key of each of ``queues``, the ones not known yet in one round trip."""
        if self._mode is not Mode.KEY:
            return dict.fromkeys(queues)
        unknown = [queue for queue in queues if queue not in self._known]
        if unknown:
            self._known.update(self._registry.original_keys(unknown))
        return {queue: self._known[queue] for queue in queues}
