"""``python -m keyq`` is the ``keyq`` command."""

from keyq.cli.root import main

main()
