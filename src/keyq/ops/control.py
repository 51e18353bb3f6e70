"""What ``keyq pause``, ``keyq resume`` and ``keyq stream set|show`` set and read in Redis, for
workers to honour at their next tick: keys (or a whole stream) paused, a stream's policy."""

from __future__ import annotations

from typing import Any

from keyq.broker.key_control import KeyControl
from keyq.broker.key_wake import wake_keys
from keyq.broker.stream_policy import StreamPolicies, StreamPolicy
from keyq.ops.context import OperatorContext


def pause(ctx: OperatorContext, keys: list[str], *, whole_stream: bool) -> list[str]:
    """Pause ``keys`` (or the whole stream); the keys that were not paused already."""
    with ctx.services():
        if whole_stream:
            StreamPolicies(ctx.redis, ctx.stream).set_paused(True)
            return []
        return KeyControl(ctx.redis, ctx.stream).pause(keys)


def resume(
    ctx: OperatorContext, keys: list[str], *, whole_stream: bool
) -> tuple[list[str], list[str]]:
    """Resume ``keys`` (or the whole stream) and wake their queues: (resumed, woken)."""
    with ctx.services():
        if whole_stream:
            StreamPolicies(ctx.redis, ctx.stream).set_paused(False)
            return [], []
        connection = ctx.amqp()  # before any change: RabbitMQ down changes nothing
        changed = KeyControl(ctx.redis, ctx.stream).resume(keys)
        return changed, wake_keys(ctx.redis, connection, ctx.config, changed)


def set_policy(
    ctx: OperatorContext,
    *,
    poison_policy: str | None,
    rate_limit: float | None,
    set_rate_limit: bool,
    dedupe_window: int | None,
) -> StreamPolicy:
    """Change what is given of the stream's policy; the policy as it now stands."""
    with ctx.services():
        policies = StreamPolicies(ctx.redis, ctx.stream)
        if poison_policy is not None:
            policies.set_poison_policy(poison_policy)
        if set_rate_limit:
            policies.set_rate_limit(rate_limit)
        if dedupe_window is not None:
            policies.set_dedupe_window(dedupe_window)
        return policies.load()


def stream_view(ctx: OperatorContext) -> tuple[dict[str, Any], StreamPolicy]:
    """The stream's layout and policy, and how many keys are paused or parked."""
    with ctx.services():
        policy = StreamPolicies(ctx.redis, ctx.stream).load()
        control = KeyControl(ctx.redis, ctx.stream)
        paused, parked = control.paused(), control.parked()
    config = ctx.config
    shown = {
        "stream": ctx.stream,
        "mode": config.mode.value,
        "buckets": config.buckets,
        "queue_type": config.queue_type,
        "poison_policy": policy.poison_policy,
        "rate_limit": policy.rate_limit,
        "dedupe_window_s": policy.dedupe_window_s,
        "paused": policy.paused,
        "paused_keys": len(paused),
        "parked_keys": len(parked),
    }
    return shown, policy
