"""keyq's shared core: settings, naming, hashing, stream config, registry, membership, locks.

Every other package depends on this one and it depends on none of them.
"""

from keyq.broker.errors import KeyqError
from keyq.broker.naming import Mode
from keyq.broker.settings import Settings, load_settings
from keyq.broker.streams import StreamConfig

__all__ = ["KeyqError", "Mode", "Settings", "StreamConfig", "load_settings"]
