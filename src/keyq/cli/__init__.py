"""The ``keyq`` command: the click command tree (``root``), its one-line errors and checks of
option values, and what each command prints. What a command does against RabbitMQ and Redis is
``keyq.ops``'s."""
