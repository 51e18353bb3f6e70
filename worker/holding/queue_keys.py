"""The key each queue was declared for, as the batch needs it (``KeyDirectory``)."""

from __future__ import annotations

from collections.abc import Collection

from keyq.broker.naming import Mode, is_bucket_queue
from keyq.broker.registry import QueueRegistry


class QueueKeys:
    """A key's own queue's key (key mode, or a promoted key in auto mode), from the registry,
    remembered once read: a message there without a key header still belongs to it. A bucket
    holds many keys: such a message has no key. Used by the batch loop's thread only."""

    def __init__(self, registry: QueueRegistry, mode: Mode, stream: str) -> None:
        self._registry = registry
        self._mode = mode
        self._stream = stream
        self._known: dict[str, str | None] = {}

    def keys_of(self, queues: Collection[str]) -> dict[str, str | None]:
        """The key of each of ``queues``, the ones not known yet in one round trip."""
        if self._mode is Mode.BUCKET:
            return dict.fromkeys(queues)
        found: dict[str, str | None] = {
            queue: None for queue in queues if is_bucket_queue(self._stream, queue)
        }
        unknown = [queue for queue in queues if queue not in self._known and queue not in found]
        if unknown:
            self._known.update(self._registry.original_keys(unknown))
        return {queue: found[queue] if queue in found else self._known[queue] for queue in queues}
