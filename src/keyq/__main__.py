"""``python -m keyq`` is the ``keyq`` command."""

from keyq.cli import main

main()
