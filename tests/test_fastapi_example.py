"""examples/fastapi_app.py through its ASGI interface against the real broker: one event per
request lands in the order's queue, in order; a durable request answers after its confirm;
bad input is a 422."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from types import ModuleType

import pika
import pytest

from keyq.broker.naming import key_queue_name
from tests.conftest import StreamFixture
from tests.helpers import drain

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fastapi_app.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("keyq_fastapi_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_request_publishes_one_event(
    stream: StreamFixture, amqp: pika.BlockingConnection
) -> None:
    app = _example().create_app(stream.name, settings=stream.settings)
    orders = ["order-1", "order-2"]

    async def main() -> list[dict[str, object]]:
        answers = []
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
                for n in range(40):
                    response = await client.post(
                        f"/orders/{orders[n % 2]}/events", json={"n": n, "type": "item"}
                    )
                    assert response.status_code == 202, response.text
                    answers.append(response.json())
                durable = await client.post(
                    "/orders/order-1/events", params={"durable": "true"}, json={"n": 40}
                )
                assert durable.status_code == 202 and durable.json()["published"] is True
                answers.append(durable.json())
                bad = await client.post("/orders/order-1/events", json=[1, 2])
                assert bad.status_code == 422
        return answers  # the lifespan's end flushed and closed the producer

    answers = asyncio.run(main())
    queues = [key_queue_name(stream.name, order) for order in orders]
    stream.track(*queues)
    channel = amqp.channel()
    # The durable request's event last.
    expected = {"order-1": [*range(0, 40, 2), 40], "order-2": list(range(1, 40, 2))}
    for order, queue in zip(orders, queues, strict=True):
        landed = drain(channel, queue)
        assert [m.json()["n"] for m in landed] == expected[order]
        assert [m.seq for m in landed] == list(range(1, len(expected[order]) + 1))
        assert sum(answer["queue"] == queue for answer in answers) == len(expected[order])
