"""An HTTP service that publishes one keyq event per request, with the asyncio producer.

``POST /orders/{order_id}/events`` with a JSON object publishes it as the next event of that
order's key and answers 202 with where it went; ``?durable=true`` answers only once RabbitMQ
confirmed this one event. The producer opens with the application (its lifespan) and is
flushed and closed when it stops, so no accepted event is dropped by a clean shutdown.

Needs ``pip install keyq fastapi uvicorn`` and a RabbitMQ and Redis (``make services``):

    KEYQ_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2F uvicorn examples.fastapi_app:app
    curl -X POST localhost:8000/orders/order-17/events -H 'content-type: application/json' \\
        -d '{"type": "created", "total": 0}'
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
