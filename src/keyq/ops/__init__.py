"""What the operator commands do against RabbitMQ and Redis: read a stream's status and a key's
picture, pause and resume keys, list, drop and redrive dead letters. Prints nothing: the
commands in ``keyq.cli`` show what these return."""
