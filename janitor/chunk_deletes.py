"""Deleting a chunk of queues marked retiring, a slice at a time, each slice right after a
check that what protects its deletes still holds: for classic queues the janitor's marks
(renewed as it goes), for quorum queues also every node of the cluster answering."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import redis

from keyq.broker.locks import FencedLocks
from keyq.broker.retirement import Mark, RetirementFence
from keyq.janitor.cluster_probe import unreachable_nodes
from keyq.janitor.config import JanitorSettings
from keyq.janitor.deleter import Outcome, QueueDeleter

log = logging.getLogger("keyq.janitor")

# A mark outlives the grace period by this much, in case the janitor dies mid-pass.
MARK_MARGIN_MS = 60_000
# Quorum queues are deleted this many at a time (over the deleter's lanes), each slice right
# after a fresh probe of the cluster's nodes, so a node that goes down during the grace or the
# deletes stops them within one slice (see janitor/cluster_probe.py). A probe per delete would
# hold the marked queues' keys back several times longer, for no event's sake: a queue deleted
# while a node was lost never comes back under its name (broker.naming.incarnation_name).
QUORUM_DELETES_PER_PROBE = 8
# Classic queues are deleted this many at a time (over the deleter's lanes), each slice right
# after checking that the janitor's marks on it are still there (and renewing them): a
# loaded broker can take longer over one chunk's deletes than a mark lives, and a lapsed mark
# no longer keeps producers away from a queue being deleted.
DELETES_PER_MARK_CHECK = 400


@dataclass(frozen=True)
class Marks:
    """A janitor's retirement marks on the chunk being deleted, and on the chunks after it."""

    fence: RetirementFence
    owner: str
    ttl_ms: int
    ahead: list[str]

    def still_held(self, queues: list[str]) -> tuple[list[str], dict[str, Outcome]]:
        """The queues whose marks still stand (renewed, with those ``ahead``), and the
        others as outcomes: lapsed (the grace protects a delete only while the mark that
        started it stands), or kept because their key has had events set aside since."""
        marks = self.fence.still_marked([*queues, *self.ahead], self.owner, self.ttl_ms)
        kept = [queue for queue in queues if marks[queue] is Mark.MARKED]
        lapsed = {queue: Outcome.LAPSED for queue in queues if marks[queue] is Mark.TAKEN}
        if lapsed:
            log.warning(
                "%d retirement marks lapsed before their queues' deletes (the janitor was "
                "slower than their ttl); those queues are kept for a later pass",
                len(lapsed),
            )
        aside = {queue: Outcome.ASIDE for queue in queues if marks[queue] is Mark.ASIDE}
        return kept, {**lapsed, **aside}


def delete_marked(deleter: QueueDeleter, queues: list[str], marks: Marks) -> dict[str, Outcome]:
    """Classic queues, a slice at a time, each right after its marks are checked."""
    outcomes: dict[str, Outcome] = {}
    for start in range(0, len(queues), DELETES_PER_MARK_CHECK):
        held, lapsed = marks.still_held(queues[start : start + DELETES_PER_MARK_CHECK])
        outcomes.update(lapsed)
        outcomes.update(deleter.delete(held))
    return outcomes


def delete_locked(
    *,
    settings: JanitorSettings,
    client: redis.Redis,
    stream: str,
    deleter: QueueDeleter,
    queues: list[str],
    marks: Marks,
    stats: Counter[str],
) -> tuple[dict[str, Outcome], list[str] | None]:
    """Quorum queues refuse conditional deletes: take each queue's lock, as a worker
    would, so no worker can start consuming, then check and delete (``QueueDeleter``).

    Every node is probed before each slice of deletes (the probe at the start of the pass
    is a grace period old by now) and after the last: a quorum queue deleted while one of
    its nodes is down can leave that node's replica behind (janitor/cluster_probe.py), so
    a node found down right after a slice is reported with its queues, loudly. Queues not
    deleted because a node stopped answering are unreachable, and the nodes found down then
    are returned with the outcomes. Before the marks go, deleted queues move to their next
    incarnation: a name is never declared again (broker.naming.incarnation_name)."""
    locks = FencedLocks(client, stream)
    ttl_ms = settings.retire_grace_ms + MARK_MARGIN_MS
    outcomes: dict[str, Outcome] = {}
    just_deleted: list[str] = []
    kept_for: list[str] | None = None  # the nodes down that kept the rest of the queues
    slices = [*range(0, len(queues), QUORUM_DELETES_PER_PROBE), len(queues)]
    for start in slices:  # the last, past the end, only probes after the deletes
        down = unreachable_nodes(settings)
        if down and just_deleted:
            _report_deleted_during_outage(just_deleted, down, stats)
        if start >= len(queues):
            break
        if down:
            log.info(
                "stream %s: %d quorum queues kept: %s stopped answering before the delete",
                stream,
                len(queues) - start,
                ", ".join(down),
            )
            outcomes.update(dict.fromkeys(queues[start:], Outcome.UNREACHABLE))
            kept_for = down
            break
        # The locks first, then the marks: with a queue's lock held no worker can set its
        # key's events aside, so a check that finds none aside stays true until the delete.
        part = queues[start : start + QUORUM_DELETES_PER_PROBE]
        taken = {queue: locks.acquire(queue, marks.owner, ttl_ms) for queue in part}
        held = [lease for lease in taken.values() if lease is not None]
        outcomes.update({queue: Outcome.IN_USE for queue, lease in taken.items() if lease is None})
        try:
            kept, lapsed = marks.still_held([lease.queue for lease in held])
            outcomes.update(lapsed)
            done = deleter.delete(kept, checked=True)
        finally:
            locks.release(held)
        outcomes.update(done)
        just_deleted = [q for q, outcome in done.items() if outcome is Outcome.DELETED]
    gone = [q for q, outcome in outcomes.items() if outcome in (Outcome.DELETED, Outcome.GONE)]
    marks.fence.advance_incarnations(gone)
    return outcomes, kept_for


def _report_deleted_during_outage(queues: list[str], down: list[str], stats: Counter[str]) -> None:
    """A node stopped answering while these quorum queues were being deleted: RabbitMQ
    may have left that node's replica of each behind. Harmless to events (the name is
    never declared again), but an operator should know. Said at ERROR."""
    stats["deleted_during_outage"] += len(queues)
    for queue in queues:
        log.error(
            "quorum queue %s was deleted while %s stopped answering: RabbitMQ can leave "
            "that node's replica of it behind ('Force delete of' in that node's log). keyq "
            "never declares that name again, so no event is at risk, but the leftover "
            "takes disk on that node until removed by hand (docs/operations.md, "
            "'Deleting quorum queues')",
            queue,
            ", ".join(down),
        )
