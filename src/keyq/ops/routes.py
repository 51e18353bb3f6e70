"""``keyq key promote``: an operator gives keys of an auto-mode stream a queue of their own now,
as workers do by themselves for hot, backlogged or held-back keys (``keyq.broker.routes``).

The route is recorded first (the bucket's holder then forwards the key's events), then the
key's own queue is declared under a publish lease, registered with its key and announced
(``broker.key_wake``), so a worker claims it within a tick instead of at the first forward.
A janitor may demote an idle promoted key between the two steps: its own queue would then
be woken for a key that has none, so the route is read again after the wake and the key
promoted afresh, a few times at most.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis

from keyq.broker.errors import InvalidInput, KeyqError
from keyq.broker.key_wake import wake_keys
from keyq.broker.naming import Mode
from keyq.broker.routes import WHY_OPERATOR, Route, RouteBook
from keyq.ops.context import OperatorContext

ATTEMPTS = 3  # promote-and-wake rounds for keys a janitor demotes meanwhile


class NotAutoMode(InvalidInput):
    """Only keys of an auto-mode stream have routes (exit 2)."""


class PromotionRefused(KeyqError):
    """A key's events wait aside in its bucket: only that bucket's holder may drain them, so
    the key is not moved meanwhile (exit 1: nothing of that key was changed)."""


@dataclass
class Promoted:
    """What ``promote`` did: each key's route, whether it was promoted already, the queues
    it woke, and the keys refused."""

    routes: dict[str, Route] = field(default_factory=dict)
    already: list[str] = field(default_factory=list)
    woken: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    def rows(self) -> list[dict[str, object]]:
        return [
            {"key": key, "already": key in self.already} | route.describe()
            for key, route in self.routes.items()
        ]


def check_auto(ctx: OperatorContext) -> None:
    if ctx.config.mode is not Mode.AUTO:
        raise NotAutoMode(
            f"stream {ctx.stream} is in {ctx.config.mode.value} mode: only keys of an auto-mode "
            "stream are promoted to a queue of their own"
        )


def promote(ctx: OperatorContext, keys: list[str]) -> Promoted:
    """Promote ``keys`` (why: operator) and wake their own queues. Keys refused (their events
    wait aside in their bucket) are listed in ``refused``; the others are promoted."""
    check_auto(ctx)
    config, done = ctx.config, Promoted()
    with ctx.services():
        connection = ctx.amqp()  # before any change: RabbitMQ down changes nothing
        book = RouteBook(ctx.redis, ctx.stream)
        before = book.routes(keys)
        pending = list(dict.fromkeys(keys))
        for _ in range(ATTEMPTS):
            promoted: list[str] = []
            for key in pending:
                route = book.promote(
                    key, config.own_queue_for(key), config.queue_for(key), WHY_OPERATOR
                )
                if route is None:
                    done.refused.append(key)
                    done.routes.pop(key, None)
                    continue
                done.routes[key] = route
                promoted.append(key)
            woken = wake_keys(ctx.redis, connection, config, promoted)
            done.woken += [queue for queue in woken if queue not in done.woken]
            after = book.routes(promoted)
            pending = [key for key in promoted if key not in after]  # demoted meanwhile
            if not pending:
                break
        else:
            raise PromotionRefused(
                f"key {pending[0]!r} was demoted again by a janitor each time it was promoted; "
                "run the command again"
            )
    done.already = [
        key
        for key, route in done.routes.items()
        if key in before and before[key].epoch == route.epoch
    ]
    return done


def refusal(refused: list[str]) -> str:
    """Why keys were not promoted, and what to do about it."""
    shown = ", ".join(repr(key) for key in refused[:5]) + (" …" if len(refused) > 5 else "")
    one = len(refused) == 1
    its, it = ("its", "it") if one else ("their", "them")
    return (
        f"not promoted: {shown}: {its} events wait aside in {its} bucket; resume {it} if "
        f"paused, redrive {it} if parked (keyq dlq redrive), then wait until the bucket's "
        f"holder has drained those events, and promote {it} again"
    )


PROMOTED, DEMOTED = "promoted:", "demoted"  # ``RouteBook.counts``' names


def route_summary(client: redis.Redis, stream: str) -> dict[str, Any]:
    """An auto-mode stream's keys with a queue of their own, the moves still open, and how many
    keys were promoted (by why) and demoted since the stream began."""
    book = RouteBook(client, stream)
    counts = book.counts()
    return {
        "promoted_keys": book.count(),
        "open_moves": len(book.open_moves()),
        "promotions": {
            name.removeprefix(PROMOTED): count
            for name, count in sorted(counts.items())
            if name.startswith(PROMOTED)
        },
        "demotions": counts.get(DEMOTED, 0),
    }
