"""What the console's buttons do: each action is one operator function of ``keyq.ops`` (the same
the CLI calls), given a stream's context and the form's fields, and answers with one line for
the operator. A field missing or malformed is ``InvalidInput``, shown on the page, changing
nothing."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from keyq.broker.errors import InvalidInput
from keyq.broker.stream_policy import check_dedupe_window, check_rate_limit
from keyq.ops.bulk_redrive import BulkRequest, redrive_many
from keyq.ops.context import OperatorContext, check_keys
from keyq.ops.control import pause, resume, set_policy
from keyq.ops.dead_letter_selection import drop
from keyq.ops.redrive import RedriveRequest, redrive

DEAD_LETTER_WAIT_S = 10.0  # for the dead-letter lock, held by another redrive or walk

Form = Mapping[str, str]


@dataclass(frozen=True)
class Action:
    """One button: what it does, and the field naming its target (for the audit list)."""

    run: Callable[[OperatorContext, Form], str]
    target_field: str


def _field(form: Form, name: str) -> str:
    value = form.get(name)
    if value is None or value == "":
        raise InvalidInput(f"the form lacks {name}")
    return value


def _key(form: Form) -> str:
    return check_keys([_field(form, "key")])[0]


def _optional_key(form: Form) -> str | None:
    return _key(form) if form.get("key") else None


def _pause(ctx: OperatorContext, form: Form) -> str:
    key = _key(form)
    changed = pause(ctx, [key], whole_stream=False)
    return f"paused {key}" if changed else f"{key} was paused already"


def _resume(ctx: OperatorContext, form: Form) -> str:
    key = _key(form)
    changed, _woken = resume(ctx, [key], whole_stream=False)
    return f"resumed {key}" if changed else f"{key} was not paused"


def _redrive_key(ctx: OperatorContext, form: Form) -> str:
    result = redrive(ctx, RedriveRequest(key=_key(form), wait_s=DEAD_LETTER_WAIT_S))
    return f"put back {result.letters} dead letters of {result.key} ahead of its events"


def _skip(ctx: OperatorContext, form: Form) -> str:
    key = _key(form)
    result = redrive(ctx, RedriveRequest(key=key, skip=True))
    return (
        f"unparked {key}, its dead letters left where they are"
        if result.unparked
        else (f"{key} was not parked")
    )


def _redrive_letter(ctx: OperatorContext, form: Form) -> str:
    payload = form.get("payload")
    request = RedriveRequest(
        letter_id=_field(form, "id"),
        key=_optional_key(form),
        payload=None if payload is None else _as_sent(payload, crlf=form.get("crlf") == "1"),
        wait_s=DEAD_LETTER_WAIT_S,
    )
    result = redrive(ctx, request)
    edited = " with the edited payload" if payload is not None else ""
    return f"put back letter {request.letter_id} to {result.key}{edited}"


def _as_sent(payload: str, *, crlf: bool) -> bytes:
    """A browser sends a text area's lines ended by CRLF: back to LF unless the letter's own
    payload had CRLF."""
    return (payload if crlf else payload.replace("\r\n", "\n")).encode()


def _redrive_reason(ctx: OperatorContext, form: Form) -> str:
    request = BulkRequest(reason=_field(form, "reason"), wait_s=DEAD_LETTER_WAIT_S)
    result = redrive_many(ctx, request)
    return f"put back {result.letters} dead letters of {len(result.redriven)} keys"


def _drop(ctx: OperatorContext, form: Form) -> str:
    letter_id = _field(form, "id")
    dropped = drop(ctx, _optional_key(form), [letter_id], DEAD_LETTER_WAIT_S)
    return f"dropped {len(dropped)} copies of letter {letter_id} for good"


def _policy(ctx: OperatorContext, form: Form) -> str:
    rate = form.get("rate_limit", "").strip()
    window = form.get("dedupe_window", "").strip()
    try:
        rate_limit = check_rate_limit(float(rate)) if rate else None
        dedupe_window = check_dedupe_window(int(window)) if window else None
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    policy = set_policy(
        ctx,
        poison_policy=form.get("poison_policy") or None,
        rate_limit=rate_limit,
        set_rate_limit=True,
        dedupe_window=dedupe_window,
    )
    limit = "none" if policy.rate_limit is None else f"{policy.rate_limit:g}/s"
    return (
        f"poison policy {policy.poison_policy}, rate limit {limit}, "
        f"dedupe window {policy.dedupe_window_s} s"
    )


ACTIONS: dict[str, Action] = {
    "pause": Action(_pause, "key"),
    "resume": Action(_resume, "key"),
    "redrive": Action(_redrive_key, "key"),
    "skip": Action(_skip, "key"),
    "redrive-letter": Action(_redrive_letter, "id"),
    "redrive-reason": Action(_redrive_reason, "reason"),
    "drop-letter": Action(_drop, "id"),
    "policy": Action(_policy, "poison_policy"),
}
