"""keyq's shared core: settings, naming, hashing, stream config, registry, membership, locks.

Every other package depends on this one and it depends on none of them.
"""

from broker.errors import KeyqError
from broker.naming import Mode
from broker.settings import Settings, load_settings
from broker.streams import StreamConfig

__all__ = ["KeyqError", "Mode", "Settings", "StreamConfig", "load_settings"]
