"""CPU time of processes and their trees, read from ``/proc`` (Linux).

A process's CPU is ``utime + stime`` of its ``/proc/<pid>/stat`` (every thread included), in
clock ticks. A tree is a process and its descendants, found by each process's parent id in
one scan of ``/proc``. The tree's CPU also counts ``cutime + cstime`` of each live member:
the time of children that have exited and been waited for, so a child that ends between two
readings keeps counting (its time moves from its own line to its parent's).

Also here: the process listening on a TCP port (``/proc/net/tcp*`` socket inodes matched
against ``/proc/<pid>/fd``), to find the broker or Redis a benchmark talks to.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's ``st`` column


@dataclass(frozen=True)
class ProcStat:
    """What one ``/proc/<pid>/stat`` says about CPU: own and waited-for children's ticks."""

    pid: int
    ppid: int
    comm: str
    ticks: int  # utime + stime
    child_ticks: int  # cutime + cstime: children that exited and were waited for

    @property
    def seconds(self) -> float:
        return (self.ticks + self.child_ticks) / TICKS_PER_S


def parse_stat(pid: int, text: str) -> ProcStat:
    """One ``/proc/<pid>/stat`` line. ``comm`` may hold spaces and parentheses: it runs from
    the first ``(`` to the last ``)``; the fields after it are numbered from ``state`` (3)."""
    head, _, tail = text.rpartition(")")
    comm = head.split("(", 1)[1] if "(" in head else head
    fields = tail.split()
    # fields[0] is field 3 (state): ppid is 4, utime 14, stime 15, cutime 16, cstime 17
    return ProcStat(
        pid=pid,
        ppid=int(fields[1]),
        comm=comm,
        ticks=int(fields[11]) + int(fields[12]),
        child_ticks=int(fields[13]) + int(fields[14]),
    )


def read_stat(pid: int) -> ProcStat | None:
    """``pid``'s CPU, or None when it is gone."""
    try:
        return parse_stat(pid, (PROC / str(pid) / "stat").read_text())
    except (OSError, IndexError, ValueError):
        return None


def snapshot() -> dict[int, ProcStat]:
    """Every process's CPU, in one pass over ``/proc``."""
    table: dict[int, ProcStat] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name))
            if stat is not None:
                table[stat.pid] = stat
    return table


def tree(root: int, table: Mapping[int, ProcStat]) -> list[int]:
    """``root`` and its descendants that ``table`` holds (root first; [] if root is gone)."""
    if root not in table:
        return []
    children: dict[int, list[int]] = {}
    for stat in table.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def is_jvm(stat: ProcStat) -> bool:
    return stat.comm == "java"


def tree_seconds(
    root: int,
    table: Mapping[int, ProcStat],
    kinds: Mapping[str, Callable[[ProcStat], bool]] | None = None,
) -> dict[str, float]:
    """CPU seconds of ``root``'s tree: ``total``, and per kind the members it matches (each
    member counted under the first kind that matches it, or under none)."""
    totals = {"total": 0.0, **{name: 0.0 for name in kinds or {}}}
    for pid in tree(root, table):
        stat = table[pid]
        totals["total"] += stat.seconds
        for name, matches in (kinds or {}).items():
            if matches(stat):
                totals[name] += stat.seconds
                break
    return totals


def spent(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """``after - before`` for each name of ``after``."""
    return {name: after[name] - before.get(name, 0.0) for name in after}


# --------------------------------------------------------------------------- listeners
def listening_inodes(port: int, tables: Iterable[Path] | None = None) -> set[int]:
    """Inodes of the sockets listening on TCP ``port`` (any address, IPv4 or IPv6)."""
    inodes: set[int] = set()
    for path in tables or (PROC / "net" / "tcp", PROC / "net" / "tcp6"):
        try:
            lines = path.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(int(fields[9]))
    return inodes


def listener_pid(port: int) -> int | None:
    """The process that holds the socket listening on TCP ``port``, or None (nobody listens,
    or its ``/proc/<pid>/fd`` cannot be read: another user's process, not being root)."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    if not wanted:
        return None
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(entry.name)
        except OSError:
            continue
    return None


def pids_named(comm: str, needle: str | None = None) -> list[int]:
    """Processes called ``comm`` whose command line (or, readable, environment) contains
    ``needle`` when given."""
    found = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        stat = read_stat(int(entry.name))
        if stat is None or stat.comm != comm:
            continue
        if needle is not None:
            text = b""
            for name in ("cmdline", "environ"):
                try:
                    text += (entry / name).read_bytes()
                except OSError:
                    continue
            if needle.encode() not in text:
                continue
        found.append(stat.pid)
    return sorted(found)
