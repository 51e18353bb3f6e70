"""The console in a real browser against real RabbitMQ, Redis, a worker and a janitor: a key parked
at a poison event shows on the live overview, the operator opens it and its dead letter, the fix
is deployed, the operator clicks redrive, and the key's state reaches its last event in order,
each once. Then what an attacker would try: markup in a key, a form posted from another site,
actions on a read-only console. Screenshots of the overview, parked key and letters go to docs/."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from keyq import Producer
from keyq.broker.key_control import KeyControl, ParkedKey
from keyq.ops.context import OperatorContext
from keyq.ops.control import set_policy
from keyq.worker.batch.state_store import StateStore
from tests.browser import ConsoleProcess, chromium, free_port, screenshot
from tests.conftest import StreamFixture
from tests.workers import REPO, JanitorProcess, wait_until

pytestmark = pytest.mark.slow

DOCS = REPO / "docs"
EVENTS = 20
POISON = 8
MARKUP_KEY = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>"


def seen(store: StateStore, key: str, producer: Producer) -> list[int]:
    state = store.get(key) or {"seen": {}}
    return list(state["seen"].get(producer.producer_id, []))


def publish(producer: Producer, key: str, numbers: range, poison: int | None) -> None:
    for n in numbers:
        event: dict[str, Any] = {"n": n, "producer": producer.producer_id}
        if n == poison:
            event["poison"] = True
        producer.publish(key, event)
    producer.flush(timeout=30)


def wait_for(session: Any, css: str, text: str | None = None, timeout: float = 60) -> Any:
    """The first element matching ``css`` (holding ``text``), once the page's refresh brings it."""
    from selenium.webdriver.common.by import By

    def found() -> Any:
        for element in session.find_elements(By.CSS_SELECTOR, css):
            if text is None or text in element.text:
                return element
        return None

    return wait_until(found, timeout, f"{css} {text or ''} on {session.current_url}", every=0.25)


def test_an_operator_finds_a_parked_key_and_redrives_it_after_the_fix(
    stream: StreamFixture, workers: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    fixed = tmp_path / "pipeline-fixed"
    env = {"KEYQ_TEST_FIXED_MARKER": str(fixed), "KEYQ_MAX_ATTEMPTS": "2"}
    key = f"order-{uuid.uuid4().hex[:6]}"
    producer = Producer(stream.name, mode="key", settings=stream.settings)
    publish(producer, "warm-up", range(1, 2), poison=None)  # records the stream's config
    with OperatorContext(stream.name, stream.settings) as ctx:
        set_policy(
            ctx, poison_policy="park", rate_limit=None, set_rate_limit=False, dedupe_window=None
        )
    worker = workers(stream.name, pipeline="tests.pipelines:ledger_until_fixed", env=env)
    janitor_args = ("--stream", stream.name, "--metrics-port", str(free_port()))
    every_second = {"KEYQ_JANITOR_INTERVAL_S": "1"}
    janitor = JanitorProcess(stream.settings, tmp_path, *janitor_args, env=every_second)
    console = ConsoleProcess(stream.settings, tmp_path, "--stream", stream.name)
    store = StateStore(stream.redis, stream.name)
    control = KeyControl(stream.redis, stream.name)
    try:
        worker.wait_ready()
        with chromium() as session:
            session.get(console.url + "/")  # open before the key parks: the page refreshes
            publish(producer, key, range(1, EVENTS + 1), poison=POISON)
            link = wait_for(session, "a.key.parked", key, timeout=90)
            assert seen(store, key, producer) == list(range(1, POISON))
            wait_for(session, "p.muted", "measured", timeout=30)  # the janitor's figures
            screenshot(session, DOCS / "console-overview.png")

            link.click()
            wait_for(session, "[data-field=parked]")
            assert "planted poison event" in session.find_element(By.CSS_SELECTOR, "dd.reason").text
            screenshot(session, DOCS / "console-parked-key.png")

            session.find_element(By.LINK_TEXT, "all of them, paged").click()
            wait_for(session, "table.letters td.reason", "planted poison event")
            screenshot(session, DOCS / "console-dead-letters.png")

            # The fix is deployed: the worker restarts with a pipeline that takes the event.
            assert worker.terminate() == 0, worker.log()[-3000:]
            fixed.touch()
            workers(stream.name, pipeline="tests.pipelines:ledger_until_fixed", env=env)

            session.find_element(By.CSS_SELECTOR, "table.letters td a").click()  # the letter
            wait_for(session, "pre.payload.json", '"poison": true')
            session.find_element(By.LINK_TEXT, key).click()
            session.find_element(By.CSS_SELECTOR, "button[data-action=redrive]").click()
            wait_for(session, "p.flash.done", "put back 1 dead letters")
            wait_until(
                lambda: seen(store, key, producer) == list(range(1, EVENTS + 1)),
                90,
                "the key's events, the redriven one first, each once in order",
            )
            session.refresh()
            wait_for(session, "[data-field=flowing]")
            state = session.find_element(By.CSS_SELECTOR, "pre[data-field=state]").text
            assert f'"{producer.producer_id}"' in state
            session.get(console.url + "/audit")
            wait_for(session, "table.audit td", "redrive")
    finally:
        producer.close(timeout=10)
        console.close()
        janitor.close()
    assert key not in control.parked()


def test_markup_in_a_key_is_text_and_forged_or_read_only_actions_change_nothing(
    stream: StreamFixture, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    producer = Producer(stream.name, mode="key", settings=stream.settings)
    publish(producer, MARKUP_KEY, range(1, 3), poison=None)
    producer.close(timeout=10)
    control = KeyControl(stream.redis, stream.name)
    control.park(MARKUP_KEY, ParkedKey(at_ms=1, reason="<b>bold</b> reason", producer="p", seq=1))
    console = ConsoleProcess(stream.settings, tmp_path, "--stream", stream.name)
    read_only = ConsoleProcess(stream.settings, tmp_path, "--stream", stream.name, "--read-only")
    forged = tmp_path / "forged.html"
    try:
        with chromium() as session:
            session.get(console.url + "/")
            link = wait_for(session, "a.key.parked")
            assert link.text == MARKUP_KEY  # drawn as text, not as elements
            link.click()
            wait_for(session, "code.key-name")
            assert session.find_element(By.CSS_SELECTOR, "code.key-name").text == MARKUP_KEY
            assert session.find_element(By.CSS_SELECTOR, "dd.reason").text == "<b>bold</b> reason"
            assert session.execute_script("return window.pwned === undefined")
            assert not session.find_elements(By.CSS_SELECTOR, "main img, main b, main script")

            # Another site's page posts a pause to the console on the operator's behalf.
            forged.write_text(
                f'<form id="f" method="post" action="{console.url}/streams/{stream.name}'
                '/actions/pause"><input name="key" value="victim"></form>'
                '<script>document.getElementById("f").submit()</script>'
            )
            session.get(forged.as_uri())
            wait_for(session, "body", "forbidden")
            assert "victim" not in control.paused()

            # A read-only console offers no action, and refuses one posted anyway.
            session.get(f"{read_only.url}/streams/{stream.name}/key?key=victim")
            wait_for(session, "h1", "victim")
            assert not session.find_elements(By.CSS_SELECTOR, "form[method=post], button")
            status = session.execute_script(
                "return fetch(arguments[0], {method: 'POST', body: new URLSearchParams("
                "{key: 'victim', csrf: 'x'})}).then(r => r.status)",
                f"{read_only.url}/streams/{stream.name}/actions/pause",
            )
            assert status == 403
            assert "victim" not in control.paused()
    finally:
        console.close()
        read_only.close()
