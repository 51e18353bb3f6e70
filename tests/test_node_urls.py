"""Several AMQP URLs, a cluster's nodes: connections take them in turn, and every URL is
checked and shown without its password."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from keyq.broker.connections import amqp_parameters
from keyq.broker.errors import ConfigurationError
from keyq.broker.settings import load_settings

NODES = "amqp://u:pw-one@127.0.0.1:5681/%2F, amqp://u:pw-two@127.0.0.1:5682/%2F"


def test_connections_take_the_nodes_in_turn_and_each_is_shown_without_its_password() -> None:
    settings = load_settings(amqp_url=NODES)
    ports = [amqp_parameters(settings, "t").port for _ in range(6)]
    assert set(ports) == {5681, 5682}
    assert all(a != b for a, b in itertools.pairwise(ports))  # never twice in a row
    shown = settings.describe()["amqp_url"]
    assert "pw-one" not in shown and "pw-two" not in shown
    assert "127.0.0.1:5681" in shown and "127.0.0.1:5682" in shown


def test_a_bad_node_url_is_refused_without_the_password() -> None:
    with pytest.raises(ConfigurationError, match="KEYQ_AMQP_URL") as refused:
        load_settings(amqp_url="amqp://u:pw-one@127.0.0.1:5681/%2F,http://u:pw-two@h/")
    assert "pw-one" not in str(refused.value) and "pw-two" not in str(refused.value)
    with pytest.raises(ConfigurationError, match="empty"):
        load_settings(amqp_url=" , ")


def test_processes_start_at_different_nodes() -> None:
    """Each process starts at a node of its own, so that a cluster's clients (every worker
    and producer) do not all connect to the first URL. Ten processes over three nodes all
    starting at one node would happen once in about 20,000 runs."""
    three = ",".join(f"amqp://u:p@127.0.0.1:{port}/%2F" for port in (5681, 5682, 5683))
    script = (
        "from keyq.broker.connections import amqp_parameters\n"
        "from keyq.broker.settings import load_settings\n"
        f"print(amqp_parameters(load_settings(amqp_url={three!r}), 't').port)\n"
    )
    firsts = {
        subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(10)
    }
    assert len(firsts) > 1, firsts


@pytest.mark.services
def test_a_node_that_is_down_is_passed_over_not_reported() -> None:
    """A control connection tries every node once before the broker counts as unavailable,
    and only then fails, naming every node without its password."""
    from keyq.broker.connections import open_blocking_connection
    from keyq.broker.errors import BrokerUnavailable
    from tests.servers import free_port

    live = load_settings().amqp_url
    down = f"amqp://guest:pw-down@127.0.0.1:{free_port()}/%2F"
    settings = load_settings(amqp_url=f"{down},{live}")
    for _ in range(4):  # whichever node each call starts at
        open_blocking_connection(settings, "node-urls-test").close()
    with pytest.raises(BrokerUnavailable) as failed:
        open_blocking_connection(load_settings(amqp_url=f"{down},{down}"), "node-urls-test")
    assert "pw-down" not in str(failed.value)
