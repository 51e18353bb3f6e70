"""The ``keyq`` command: the edge that wires broker, producer, worker and janitor together."""
