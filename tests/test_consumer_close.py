"""A worker letting go of a queue never leaves it looking unused while it holds deliveries:
``queue.delete(if_empty, if_unused)`` (the janitor's) ignores unacked messages, and pika's
``channel.close()`` cancels the consumer first, which opens exactly that window. Shown on the
real broker, with a deleter trying every few ms while a proxy slows the worker's link."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any
from urllib.parse import urlsplit

import pika
import pika.exceptions
import pytest

from keyq.broker.settings import Settings, load_settings
from keyq.worker.amqp.consume_rounds import ConsumeOutcome
from keyq.worker.amqp.deliveries import DeliveryBuffer
from keyq.worker.amqp.link import ConsumerLink
from tests.conftest import StreamFixture
from tests.faults import FaultProxy
from tests.helpers import drain, queue_depth
from tests.workers import bare_link, wait_until

MESSAGES = 20
LINK_DELAY_S = 0.25


class EagerDeleter:
    """Tries ``queue.delete(if_empty, if_unused)`` in a loop, as a janitor would, until it
    succeeds or is stopped."""

    def __init__(self, settings: Settings, queue: str) -> None:
        self._connection = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
        self._queue = queue
        self._stop = threading.Event()
        self.deleted = False
        self.attempts = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EagerDeleter:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._connection.close()

    def _run(self) -> None:
        channel = self._connection.channel()
        while not self._stop.is_set():
            self.attempts += 1
            try:
                channel.queue_delete(self._queue, if_unused=True, if_empty=True)
            except pika.exceptions.ChannelClosedByBroker as exc:
                assert exc.reply_code == 406, exc
                channel = self._connection.channel()
                self._stop.wait(0.003)
                continue
            self.deleted = True
            return


@pytest.fixture
def proxy(settings: Settings) -> Iterator[FaultProxy]:
    parts = urlsplit(settings.amqp_url)
    with FaultProxy(parts.hostname or "127.0.0.1", parts.port or 5672) as started:
        yield started


def _load(amqp: pika.BlockingConnection, stream: StreamFixture) -> str:
    """A durable queue of the test's own holding MESSAGES persistent messages."""
    queue = f"{stream.name}.close-{uuid.uuid4().hex[:6]}"
    stream.track(queue)
    channel = amqp.channel()
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()
    for n in range(MESSAGES):
        channel.basic_publish(
            "", queue, str(n).encode(), pika.BasicProperties(delivery_mode=2), mandatory=True
        )
    channel.close()
    return queue


@pytest.fixture
def loaded_queue(stream: StreamFixture, amqp: pika.BlockingConnection) -> str:
    return _load(amqp, stream)


@pytest.fixture
def consuming(
    settings: Settings, proxy: FaultProxy, stream: StreamFixture, loaded_queue: str
) -> Iterator[tuple[ConsumerLink, int]]:
    """A worker's link, through the proxy, holding every message of ``loaded_queue`` unacked."""
    buffer = DeliveryBuffer()
    link = bare_link(
        load_settings(**{**settings.model_dump(), "amqp_url": proxy.url_for(settings.amqp_url)}),
        stream.name,
        "test-consumer-close",
        prefetch=100 * settings.pack_max_events,  # in events: an AMQP prefetch of 100
        buffer=buffer,
    )
    link.start()
    try:
        epoch = link.consumers.new_epoch()
        assert link.consumers.consume(loaded_queue, epoch).outcome is ConsumeOutcome.CONSUMING
        wait_until(lambda: len(buffer) == MESSAGES, 10, "every message delivered")
        yield link, epoch
    finally:
        proxy.set_delay(0)
        link.stop()


def test_pikas_own_close_opens_the_window_the_worker_avoids(
    proxy: FaultProxy, loaded_queue: str, settings: Settings, amqp: pika.BlockingConnection
) -> None:
    """What the worker guards against, with pika's plain close: the queue is deleted although
    none of its messages was ever acked."""
    connection = pika.BlockingConnection(pika.URLParameters(proxy.url_for(settings.amqp_url)))
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=100)
        received: list[int] = []
        channel.basic_consume(
            loaded_queue, lambda _ch, method, _p, _b: received.append(method.delivery_tag)
        )
        wait_until(
            lambda: connection.process_data_events(0.05) or len(received) == MESSAGES,
            10,
            "every message delivered",
            every=0,
        )
        proxy.set_delay(LINK_DELAY_S)
        with EagerDeleter(settings, loaded_queue) as deleter:
            channel.close()
        assert deleter.deleted
        assert queue_depth(amqp, loaded_queue) is None  # gone, with 20 unacked messages
    finally:
        proxy.set_delay(0)
        if connection.is_open:
            connection.close()


def test_the_pika_internals_the_close_relies_on_are_there(amqp: pika.BlockingConnection) -> None:
    """``broker.consumers`` reaches beneath pika's blocking channel; a pika that moved these
    would silently bring back the cancel-then-close window, so fail loudly here instead."""
    channel: Any = amqp.channel()
    try:
        impl = channel._impl
        assert isinstance(impl._cancelled, set)
        assert isinstance(impl._consumers, dict)
        assert callable(impl.close) and callable(channel._flush_output)
        assert callable(channel._cleanup)
        assert channel.connection is amqp and callable(amqp._flush_output)  # type: ignore[attr-defined]
    finally:
        channel.close()


def test_closing_queues_or_stopping_the_link_gives_every_unacked_message_back(
    settings: Settings,
    proxy: FaultProxy,
    consuming: tuple[ConsumerLink, int],
    loaded_queue: str,
    stream: StreamFixture,
    amqp: pika.BlockingConnection,
) -> None:
    """Queues closed together each get every unacked message back, in order, and none looks
    unused meanwhile; a queue deleted by someone else while our close is on its way sends a
    basic.cancel to a closing channel, which must not break the shared connection; stopping
    the link gives back what it still holds."""
    link, epoch = consuming
    others = [_load(amqp, stream) for _ in range(4)]
    epochs = {queue: link.consumers.new_epoch() for queue in others}
    for queue in others:
        assert link.consumers.consume(queue, epochs[queue]).outcome is ConsumeOutcome.CONSUMING
    wait_until(
        lambda: all(queue_depth(amqp, queue) == 0 for queue in [loaded_queue, *others]),
        10,
        "all delivered, unacked",
    )
    together, cancelled = others[:3], others[3]
    proxy.set_delay(LINK_DELAY_S)
    with ExitStack() as stack:
        deleters = [stack.enter_context(EagerDeleter(settings, queue)) for queue in together]
        began = time.monotonic()
        link.consumers.close_queues([(queue, epochs[queue]) for queue in together])
        took = time.monotonic() - began
        time.sleep(2 * LINK_DELAY_S)
    assert all(deleter.attempts > 10 for deleter in deleters), "a deleter hardly tried"
    assert not any(deleter.deleted for deleter in deleters), "a queue went with its messages"
    # Pipelined: about one round trip (two link delays), not three; reported, as a loaded
    # machine's timings are no dependable check.
    print(f"closing {len(together)} queues took {took:.2f} s")

    def delete_meanwhile() -> None:
        time.sleep(LINK_DELAY_S / 5)
        amqp.channel().queue_delete(cancelled)

    deleter = threading.Thread(target=delete_meanwhile)
    deleter.start()
    link.consumers.close_queue(cancelled, epochs[cancelled])
    deleter.join(10)
    time.sleep(3 * LINK_DELAY_S)  # the cancel, if late, arrives now
    assert link.failure is None
    assert link.reconnects == 0, "the broker's cancel during the close broke the connection"
    assert link.counts.message_count(cancelled) == 0  # still connected and answering
    assert link.consumers.held() == {loaded_queue: epoch}
    with EagerDeleter(settings, loaded_queue) as eager:
        link.stop()
        time.sleep(2 * LINK_DELAY_S)
    assert eager.attempts > 10, "the deleter hardly tried"
    assert not eager.deleted, "the queue was deleted with the stopped link's unacked messages"
    proxy.set_delay(0)
    assert queue_depth(amqp, loaded_queue) == MESSAGES
    for queue in together:
        bodies = [int(landed.body) for landed in drain(amqp.channel(), queue)]
        assert bodies == list(range(MESSAGES)), f"{queue} came back whole and in order"
