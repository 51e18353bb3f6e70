"""bench.proc_cpu: the CPU of a process tree as /proc tells it, against real processes that
burn a known amount of CPU (children alive, children exited and waited for), and the process
listening on a port; and the KEYQ_ settings a benchmark records with its figures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from bench import proc_cpu

# A child that starts a grandchild burning GRAND seconds of CPU, burns OWN seconds itself,
# says "burnt", then (on a line from stdin) lets the grandchild finish and waits for it.
GRAND, OWN = 0.6, 0.3
CHILD = textwrap.dedent(
    f"""
    import subprocess, sys, time
    def burn(seconds):
        while time.process_time() < seconds:
            pass
    grand = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\\n"
         "while time.process_time() < {GRAND}: pass\\n"
         "print('burnt', flush=True)\\n"
         "sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert grand.stdout.readline().strip() == "burnt"
    burn({OWN})
    print(grand.pid, flush=True)
    sys.stdin.readline()
    grand.communicate("go\\n")
    print("reaped", flush=True)
    sys.stdin.readline()
    """
)


def test_parse_stat_takes_a_name_with_spaces_and_parentheses() -> None:
    line = "42 (a (b) c) S 7 42 42 0 -1 4194560 1 0 0 0 150 25 3 4 20 0 1 0 1 1 1"
    stat = proc_cpu.parse_stat(42, line)
    assert (stat.ppid, stat.comm, stat.ticks, stat.child_ticks) == (7, "a (b) c", 175, 7)
    assert stat.seconds == pytest.approx(182 / proc_cpu.TICKS_PER_S)


def test_a_tree_counts_its_children_alive_and_exited_but_not_its_parent() -> None:
    before_self = proc_cpu.read_stat(os.getpid())
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        grand = int(child.stdout.readline())
        table = proc_cpu.snapshot()
        assert proc_cpu.tree(child.pid, table) == [child.pid, grand]
        alive = proc_cpu.tree_seconds(child.pid, table, {"grand": lambda s: s.pid == grand})
        # interpreter start-up adds a little to each; ticks are 10 ms apart
        assert GRAND + OWN - 0.05 <= alive["total"] <= GRAND + OWN + 0.6
        assert GRAND - 0.03 <= alive["grand"] <= GRAND + 0.3
        assert proc_cpu.tree(os.getpid(), table)[0] == os.getpid()

        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "reaped"
        table = proc_cpu.snapshot()
        assert grand not in table
        after = proc_cpu.tree_seconds(child.pid, table)
        # the grandchild's CPU moved to the child's cutime: the tree lost none of it
        assert after["total"] >= alive["total"]
        assert proc_cpu.spent(alive, after)["total"] < 0.2
        assert proc_cpu.tree(os.getpid() + 10_000_000, table) == []
    finally:
        child.kill()
        child.wait(5)
    # this process burnt little meanwhile; none of the child's CPU is counted as its own
    after_self = proc_cpu.read_stat(os.getpid())
    assert before_self is not None and after_self is not None
    assert after_self.ticks - before_self.ticks < (GRAND + OWN) * proc_cpu.TICKS_PER_S


def test_listener_pid_finds_this_process_by_its_listening_port() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        assert proc_cpu.listener_pid(port) is None  # bound, not yet listening
        server.listen()
        assert proc_cpu.listener_pid(port) == os.getpid()
    assert proc_cpu.listener_pid(port) is None


def test_a_benchmark_records_its_keyq_settings_without_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench.common import keyq_settings_from_env

    monkeypatch.setenv("KEYQ_BATCH_MAX_EVENTS", "20000")
    monkeypatch.setenv("KEYQ_AMQP_URL", "amqp://user:s3cret@host:5672/%2F")
    monkeypatch.setenv("KEYQ_CONSOLE_TOKEN", "t0ken")
    monkeypatch.setenv("NOT_KEYQ", "x")
    recorded = keyq_settings_from_env()
    assert recorded["KEYQ_BATCH_MAX_EVENTS"] == "20000"
    assert recorded["KEYQ_AMQP_URL"] == recorded["KEYQ_CONSOLE_TOKEN"] == "(set)"
    assert "NOT_KEYQ" not in recorded
    assert "s3cret" not in repr(recorded) and "t0ken" not in repr(recorded)
