"""An HTTP service that publishes one keyq event per request, with the asyncio producer.

``POST /orders/{order_id}/events`` with an order event (a JSON object, the ``order`` field
taken from the path) publishes it as the next event of that order's key and answers 202 with
where it went; ``?durable=true`` answers only once RabbitMQ confirmed this one event. The
producer opens with the application (its lifespan) and is flushed and closed when it stops, so
no accepted event is dropped by a clean shutdown.

The events are those of the order pipeline, ``keyq.demo.orders``: ``created``, ``item_added`` and
``item_removed`` (with ``sku``, ``qty``, ``price_cents``), ``paid``, ``cancelled``,
``shipped``. Needs ``pip install . fastapi uvicorn`` in a checkout and a RabbitMQ and Redis
(``make services``); a worker folds the events into each order's state:

    uvicorn examples.fastapi_app:app
    keyq worker --stream orders --pipeline keyq.demo.orders:pipeline      # needs ".[worker]"
    curl -X POST localhost:8000/orders/order-17/events -H 'content-type: application/json' \\
        -d '{"type": "created"}'
    curl -X POST localhost:8000/orders/order-17/events -H 'content-type: application/json' \\
        -d '{"type": "item_added", "sku": "tea", "qty": 2, "price_cents": 450}'
    keyq state --stream orders --key order-17
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException

from keyq.aio import InvalidEvent, InvalidKey, Producer, ProducerClosed, PublishTimeout

STREAM = os.environ.get("KEYQ_EXAMPLE_STREAM", "orders")
DURABLE_WAIT_S = 10.0


def create_app(stream: str = STREAM, **producer_options: Any) -> FastAPI:
    """The application; ``producer_options`` go to ``keyq.aio.Producer`` (settings...)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with Producer(stream, mode="key", **producer_options) as producer:
            app.state.producer = producer
            yield

    app = FastAPI(title="keyq orders intake", lifespan=lifespan)

    @app.post("/orders/{order_id}/events", status_code=202)
    async def add_event(
        order_id: str, event: dict[str, Any], durable: bool = False
    ) -> dict[str, Any]:
        producer: Producer = app.state.producer
        if event.setdefault("order", order_id) != order_id:
            raise HTTPException(status_code=422, detail="the event's order is not the path's")
        try:
            receipt = await producer.publish(order_id, event)
            if durable:
                await receipt.wait(DURABLE_WAIT_S)
        except (InvalidKey, InvalidEvent) as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        except (PublishTimeout, ProducerClosed) as exc:
            # The broker is slow, blocking publishers or away: the client may try again.
            raise HTTPException(
                status_code=503, detail=str(exc), headers={"Retry-After": "1"}
            ) from exc
        return {
            "queue": receipt.queue,
            "seq": receipt.seq,
            "message_id": receipt.message_id,
            "published": receipt.published,
        }

    return app


app = create_app()
