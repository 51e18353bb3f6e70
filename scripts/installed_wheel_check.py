"""Use an installed keyq wheel as a producer would, on the real RabbitMQ and Redis.

Run by scripts/package_check.sh with the fresh venv's python, from outside the repository:
publishes a few events to a stream of its own with the SDK, checks that ``keyq status`` sees
them and that ``keyq console`` draws the key's page, then deletes the stream's queues and Redis
keys. Exits non-zero on any failure.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import keyq
from keyq import Producer, load_settings
from keyq.broker.connections import open_blocking_connection, open_redis
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.redis_keys import StreamKeys

EVENTS = 3


def installed_from_venv() -> None:
    """The keyq imported is the wheel's, not a source tree's."""
    where = Path(keyq.__file__).resolve()
    if not where.is_relative_to(Path(sys.prefix).resolve()):
        sys.exit(f"keyq was imported from {where}, not from the venv {sys.prefix}")


def published_and_seen(stream: str) -> None:
    with Producer(stream, mode="key") as producer:
        for n in range(EVENTS):
            producer.publish("order-1", {"n": n})
        producer.flush()
    keyq_command = Path(sys.executable).parent / "keyq"
    status = subprocess.run(
        [str(keyq_command), "status", "--stream", stream, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    queues = [q for q in json.loads(status.stdout)["queues"] if q["key"] == "order-1"]
    if not queues or queues[0]["depth"] < 1:
        sys.exit(f"keyq status --stream {stream} does not show order-1's events: {queues}")


def console_serves(stream: str) -> None:
    """``keyq console`` from the wheel draws the stream's key page, its templates and static
    files packaged with it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    keyq_command = Path(sys.executable).parent / "keyq"
    console = subprocess.Popen(
        [str(keyq_command), "console", "--port", str(port), "--stream", stream],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"{base}/streams/{stream}/key?key=order-1") as page:
                    html = page.read().decode()
                with urllib.request.urlopen(f"{base}/static/console.js") as script:
                    script.read()
                break
            except OSError:
                if console.poll() is not None:
                    sys.exit(f"keyq console exited: {console.stderr.read().decode()[-2000:]}")
                time.sleep(0.2)
        else:
            sys.exit("keyq console did not answer within 20 s")
        if "order-1" not in html:
            sys.exit("keyq console's key page does not show the key")
    finally:
        console.terminate()
        console.wait(10)


def remove(stream: str) -> None:
    """Every queue and Redis key of the stream."""
    settings = load_settings()
    keys = StreamKeys(stream)
    client = open_redis(settings)
    connection = open_blocking_connection(settings, "keyq-package-check")
    try:
        channel = connection.channel()
        for queue in [*client.zrange(keys.registry, 0, -1), dead_letter_queue_name(stream)]:
            channel.queue_delete(str(queue))
        for pattern in keys.all_patterns():
            for key in client.scan_iter(match=pattern, count=1000):
                client.delete(key)
    finally:
        connection.close()
        client.close()


def main() -> None:
    installed_from_venv()
    stream = f"pkg-{uuid.uuid4().hex[:12]}"
    try:
        published_and_seen(stream)
        console_serves(stream)
    finally:
        remove(stream)
    print(
        f"keyq package: the wheel published {EVENTS} events, keyq status saw them, "
        "keyq console drew them"
    )


if __name__ == "__main__":
    main()
