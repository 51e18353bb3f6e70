"""``keyq console``'s routes through Starlette's TestClient on the real RabbitMQ and Redis: who
may read and change, escaping, and that every button does what it says, audited, on the console."""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import orjson
import pytest
from starlette.testclient import TestClient

from keyq.broker.dead_letter_index import DeadLetterIndex
from keyq.broker.envelope import HEADER_KEY, HEADER_REDRIVE_ID, HEADER_SEQ
from keyq.broker.key_control import KeyControl, ParkedKey
from keyq.broker.naming import dead_letter_queue_name
from keyq.broker.redis_keys import StreamKeys
from keyq.broker.settings import load_settings
from keyq.broker.stream_policy import StreamPolicies, StreamPolicy
from keyq.console.access import SESSION_COOKIE, Access, ConsoleExposed
from keyq.console.app import create_app
from keyq.console.audit import AuditLog
from keyq.console.settings import ConsoleSettings
from tests.conftest import StreamFixture
from tests.helpers import queue_depth
from tests.operator_helpers import dead_letter, keyq_delivery, letters_for, peek_all
from tests.operator_helpers import record_stream as record

LOOPBACK = "http://127.0.0.1"
TOKEN = "t0ken-" + uuid.uuid4().hex
EVIL = "<script>alert(1)</script>"
POST_FORM = re.compile(r"<form[^>]*method=\"post\"", re.IGNORECASE)


@dataclass
class Console:
    """A client of one console app, with the form plumbing a browser does."""

    client: TestClient
    access: Access
    stream: str

    def session(self) -> str:
        if SESSION_COOKIE not in self.client.cookies:
            assert self.client.get("/audit").status_code == 200
        return str(self.client.cookies[SESSION_COOKIE])

    def csrf(self) -> str:
        return self.access.csrf_token(self.session())

    def post(self, action: str, **fields: str) -> Any:
        fields.setdefault("csrf", self.csrf())
        fields.setdefault("next", f"/streams/{self.stream}")
        return self.submit(action, fields)

    def submit(self, action: str, fields: dict[str, str]) -> Any:
        url = f"/streams/{self.stream}/actions/{action}"
        return self.client.post(url, data=fields, follow_redirects=False)

    def press(self, page: str, action: str, button: str | None = None, **extra: str) -> Any:
        """Submit ``action``'s form (of ``button``) as ``page`` renders it, ``extra`` filled in."""
        shown = self.client.get(page)
        assert shown.status_code == 200, shown.text
        return self.submit(action, form_fields(shown.text, self.stream, action, button) | extra)


@contextmanager
def console(access: Access, stream: StreamFixture, base_url: str = LOOPBACK) -> Iterator[Console]:
    """A console of ``stream`` (recorded as a key-mode stream first)."""
    record(stream)
    app = create_app(stream.settings, access, [stream.name])
    with TestClient(app, base_url=base_url) as client:
        yield Console(client, access, stream.name)


def form_fields(page: str, stream: str, action: str, button: str | None = None) -> dict[str, str]:
    """The hidden inputs and textareas of the form posting ``action`` from button ``button``."""
    url = f"/streams/{re.escape(stream)}/actions/{re.escape(action)}"
    forms = re.findall(rf'<form[^>]*action="{url}"[^>]*>(.*?)</form>', page, re.DOTALL)
    chosen = [form for form in forms if f'data-action="{button or action}"' in form]
    assert len(chosen) == 1, f"{len(chosen)} forms for {action} on the page"
    inputs = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', chosen[0])
    fields = {name: html.unescape(value) for name, value in inputs}
    areas = re.findall(r'<textarea name="([^"]+)"[^>]*>(.*?)</textarea>', chosen[0], re.DOTALL)
    # as a browser parses it: a newline right after <textarea> is not part of its text
    return fields | {name: html.unescape(value.removeprefix("\n")) for name, value in areas}


def outcome(response: Any) -> tuple[str, dict[str, list[str]]]:
    """A 303's path and its query (``done`` or ``failed``)."""
    assert response.status_code == 303, (response.status_code, response.text)
    location = urlsplit(response.headers["location"])
    assert not location.scheme and not location.netloc, response.headers["location"]
    return location.path, parse_qs(location.query)


def audited(stream: StreamFixture) -> list[dict[str, Any]]:
    newest = reversed(AuditLog(stream.redis).newest(1000))
    return [entry for entry in newest if entry["stream"] == stream.name]


def letters_shown(page: str, stream: str) -> int:
    return page.count(f'href="/streams/{stream}/dead-letters/letter?')


@pytest.fixture
def ui(stream: StreamFixture) -> Iterator[Console]:
    with console(Access(), stream) as made:
        yield made


def test_a_token_console_asks_for_its_token(stream: StreamFixture) -> None:
    with console(Access(token=TOKEN), stream) as guarded:
        client = guarded.client
        refused = client.get("/")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Basic realm=")
        assert SESSION_COOKIE not in refused.cookies
        assert client.get("/healthz").status_code == 200  # probes need no password
        bearer = client.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert bearer.status_code == 200 and stream.name in bearer.text
        assert bearer.headers["x-frame-options"] == "DENY"
        assert "script-src 'self'" in bearer.headers["content-security-policy"]
        basic = client.get("/", auth=("alice", TOKEN))
        assert basic.status_code == 200 and "alice" in basic.text
        for wrong in (
            {"Authorization": f"Bearer {TOKEN}x"},
            {"Authorization": "Bearer "},
            {"Authorization": "Basic !!!not-base64"},
        ):
            assert client.get("/", headers=wrong).status_code == 401, wrong
        assert client.get("/", auth=("alice", "nope")).status_code == 401
    # guarded, it answers the names it was given, and no other even with the token: a site
    # whose name is rebound to its address must not read it
    with console(Access(token=TOKEN), stream, "http://rebound.example") as named:
        assert named.client.get("/", auth=("", TOKEN)).status_code == 403
    named_access = Access(token=TOKEN, allowed_hosts=frozenset({"console.example"}))
    with console(named_access, stream, "http://console.example") as named:
        assert named.client.get("/", auth=("", TOKEN)).status_code == 200


def test_a_basic_auth_console_and_who_is_audited(stream: StreamFixture) -> None:
    access = Access(basic_user="ops", basic_password="pa:ss")
    with console(access, stream) as guarded:
        client = guarded.client
        assert client.get("/audit").status_code == 401
        assert client.get("/audit", auth=("ops", "wrong")).status_code == 401
        assert client.get("/audit", auth=("other", "pa:ss")).status_code == 401
        assert client.get("/audit", headers={"Authorization": "Bearer pa:ss"}).status_code == 401
        client.auth = ("ops", "pa:ss")
        assert client.get("/audit").status_code == 200
        _path, query = outcome(guarded.post("pause", key="a"))
        assert query["done"] == ["paused a"]
    assert set(KeyControl(stream.redis, stream.name).paused()) == {"a"}
    [entry] = audited(stream)
    assert (entry["who"], entry["action"], entry["target"]) == ("ops", "pause", "a")


def test_an_open_console_answers_loopback_names_only_and_not_through_a_proxy(
    stream: StreamFixture,
) -> None:
    for name in ("http://localhost", "http://[::1]", LOOPBACK):
        with console(Access(), stream, name) as local:
            assert local.client.get("/").status_code == 200, name
    for name in ("http://evil.example", "http://10.1.2.3", "http://127.0.0.1.evil.example"):
        with console(Access(), stream, name) as rebound:
            answer = rebound.client.get(f"/streams/{stream.name}")
            assert answer.status_code == 403, name
            assert stream.name not in answer.text
            assert rebound.client.get("/healthz").status_code == 200
    with console(Access(), stream) as local:
        for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
            assert local.client.get("/", headers={header: "203.0.113.9"}).status_code == 403, header


def test_an_exposed_console_without_credentials_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KEYQ_CONSOLE_TOKEN", raising=False)
    monkeypatch.delenv("KEYQ_CONSOLE_BASIC_AUTH", raising=False)

    def access(host: str, read_only: bool = False) -> Access:
        return Access.from_settings(load_settings(ConsoleSettings), host, read_only=read_only)

    with pytest.raises(ConsoleExposed):
        access("0.0.0.0")
    with pytest.raises(ConsoleExposed):
        access("::", read_only=True)
    assert not access("127.0.0.1").guarded
    monkeypatch.setenv("KEYQ_CONSOLE_TOKEN", TOKEN)
    assert access("0.0.0.0").token == TOKEN
    monkeypatch.delenv("KEYQ_CONSOLE_TOKEN")
    monkeypatch.setenv("KEYQ_CONSOLE_BASIC_AUTH", "ops:pw")
    basic = access("0.0.0.0")
    assert (basic.basic_user, basic.basic_password, basic.token) == ("ops", "pw", None)


def test_a_change_needs_the_sessions_csrf_token_and_this_sites_origin(
    stream: StreamFixture,
) -> None:
    control = KeyControl(stream.redis, stream.name)
    with console(Access(), stream) as mine, console(Access(), stream) as other_app:
        session = mine.session()
        other = TestClient(mine.client.app, base_url=LOOPBACK)  # the same app, another session
        assert other.get("/audit").status_code == 200
        other_token = mine.access.csrf_token(str(other.cookies[SESSION_COOKIE]))
        assert other.cookies[SESSION_COOKIE] != session
        foreign = other_app.access.csrf_token(session)
        refusals = {
            "no token": mine.post("pause", key="a", csrf=""),
            "a wrong token": mine.post("pause", key="a", csrf="0" * 64),
            "another session's": mine.post("pause", key="a", csrf=other_token),
            # the same session id signed by another console process (its own secret)
            "another process's": mine.post("pause", key="a", csrf=foreign),
        }

        def pause_a(client: TestClient, headers: dict[str, str] | None = None) -> Any:
            data = {"key": "a", "csrf": mine.csrf()}
            action = f"/streams/{stream.name}/actions/pause"
            return client.post(action, data=data, headers=headers, follow_redirects=False)

        # no session cookie yet
        refusals["no session"] = pause_a(TestClient(mine.client.app, base_url=LOOPBACK))
        for origin in ("https://evil.example", "null", "http://127.0.0.1:9999"):
            refusals[origin] = pause_a(mine.client, {"Origin": origin})
        for why, answer in refusals.items():
            assert answer.status_code == 403, why
            assert "location" not in answer.headers, why
        assert control.paused() == {}
        assert audited(stream) == []
        assert outcome(pause_a(mine.client, {"Origin": LOOPBACK}))[1]["done"] == ["paused a"]
        assert set(control.paused()) == {"a"}
        assert mine.post("no-such-action", key="a").status_code == 404


def test_a_read_only_console_shows_no_form_and_refuses_changes(
    stream: StreamFixture, amqp: Any
) -> None:
    control = KeyControl(stream.redis, stream.name)
    control.park("a", ParkedKey(at_ms=1, reason="poison", producer="p1", seq=1))
    dead_letter(amqp, stream.name, letters_for(stream.name, [("a", 1)]))
    with console(Access(read_only=True), stream) as viewer:
        pages = [
            f"/streams/{stream.name}",
            f"/streams/{stream.name}/key?key=a",
            f"/streams/{stream.name}/dead-letters?key=a",
            f"/streams/{stream.name}/dead-letters/letter?id=p1:1&key=a",
        ]
        for page in pages:
            shown = viewer.client.get(page)
            assert shown.status_code == 200, (page, shown.text)
            assert "read-only" in shown.text
            assert not POST_FORM.search(shown.text), page
        for action, fields in (("pause", {"key": "a"}), ("skip", {"key": "a"})):
            refused = viewer.post(action, **fields)
            assert refused.status_code == 403 and "read-only" in refused.text
    assert control.paused() == {} and set(control.parked()) == {"a"}
    assert audited(stream) == []
    # the same pages of a console that may change things do have the forms
    with console(Access(), stream) as operator:
        shown = operator.client.get(f"/streams/{stream.name}/key?key=a")
        assert POST_FORM.search(shown.text)


def test_a_hostile_key_reason_and_payload_are_shown_escaped(
    ui: Console, stream: StreamFixture, amqp: Any
) -> None:
    control = KeyControl(stream.redis, stream.name)
    hostile = ParkedKey(at_ms=1, reason="<img src=x onerror=alert(2)>", producer="<b>", seq=3)
    control.park(EVIL, hostile)
    control.pause([EVIL])
    state = orjson.dumps({"<script>": "</pre><script>"}).decode()
    stream.redis.hset(stream.keys.state, EVIL, state)
    client = ui.client
    fragment = client.get("/fragments/overview")
    assert fragment.status_code == 200
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in fragment.text
    assert "key=%3Cscript%3Ealert%281%29%3C%2Fscript%3E" in fragment.text
    page = client.get(f"/streams/{stream.name}/key", params={"key": EVIL})
    assert page.status_code == 200
    assert 'data-field="parked"' in page.text and 'data-field="paused"' in page.text
    for shown in (fragment.text, page.text):
        assert "<script>alert" not in shown and "<img" not in shown
        assert "</pre><script>" not in shown
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    assert "&lt;img src=x onerror=alert(2)&gt;" in page.text
    assert form_fields(page.text, stream.name, "resume")["key"] == EVIL
    found = client.get(f"/streams/{stream.name}/key", params={"key": "<scr", "prefix": "1"})
    assert "&lt;script&gt;alert(1)&lt;/script&gt;</a>" in found.text
    assert "<script>alert" not in found.text
    # a hostile payload and dead-letter reason
    body = orjson.dumps({"html": "<script>alert(3)</script>"})
    letters = [keyq_delivery(f"keyq.{stream.name}.k.a", "a", "p1", 1, body)]
    dead_letter(amqp, stream.name, letters, reason="poison: <script>alert(4)</script>")
    letter = client.get(f"/streams/{stream.name}/dead-letters/letter", params={"id": "p1:1"})
    listing = client.get(f"/streams/{stream.name}/dead-letters")
    for shown in (letter, listing):
        assert shown.status_code == 200
        assert "<script>alert" not in shown.text
        assert "&lt;script&gt;alert(4)&lt;/script&gt;" in shown.text
    assert "&lt;script&gt;alert(3)&lt;/script&gt;" in letter.text
    assert "&lt;script&gt;alert(3)&lt;/script&gt;" in listing.text  # the preview


def test_pause_and_resume_a_key_from_its_page(ui: Console, stream: StreamFixture) -> None:
    control = KeyControl(stream.redis, stream.name)
    page = f"/streams/{stream.name}/key?key=a"
    path, query = outcome(ui.press(page, "pause"))
    assert path == f"/streams/{stream.name}/key" and query["key"] == ["a"]
    assert query["done"] == ["paused a"]
    assert set(control.paused()) == {"a"}
    back = ui.client.get(f"{path}?key=a&done=paused+a")
    assert 'data-field="paused"' in back.text and "paused a" in back.text
    # the next form returns to the page, not to the last action's outcome
    assert form_fields(back.text, stream.name, "resume")["next"] == page
    path, query = outcome(ui.press(page, "resume"))
    assert query["done"] == ["resumed a"]
    assert control.paused() == {}
    path, query = outcome(ui.post("resume", key="a"))
    assert query["done"] == ["a was not paused"]
    entries = audited(stream)
    assert [(e["who"], e["action"], e["target"], e["outcome"]) for e in entries] == [
        ("local", "pause", "a", "paused a"),
        ("local", "resume", "a", "resumed a"),
        ("local", "resume", "a", "a was not paused"),
    ]
    assert all(e["address"] for e in entries)
    audit_page = ui.client.get("/audit").text
    assert f"<td>{stream.name}</td>" in audit_page and "resumed a" in audit_page
    # next never leads off the console
    offsite = ("//evil.example/x", "https://evil.example", "/\\evil.example", "javascript:alert(1)")
    for away in (*offsite, ""):
        path, _query = outcome(ui.post("pause", key="a", next=away))
        assert path == f"/streams/{stream.name}", away
    path, _query = outcome(ui.post("pause", key="a", next="/audit"))
    assert path == "/audit"


def test_the_policy_form_sets_the_streams_policy_and_refuses_bad_values(
    ui: Console, stream: StreamFixture
) -> None:
    policies = StreamPolicies(stream.redis, stream.name)
    page = f"/streams/{stream.name}"
    shown = ui.client.get(page).text
    assert 'data-field="poison_policy">skip<' in shown
    # the stream page's own form, as a browser submits it, with the operator's values
    form = form_fields(shown, stream.name, "policy")
    form |= {"poison_policy": "park", "rate_limit": "2.5", "dedupe_window": "3600"}
    path, query = outcome(ui.submit("policy", form))
    assert path == page
    assert query["done"] == ["poison policy park, rate limit 2.5/s, dedupe window 3600 s"]
    wanted = StreamPolicy(poison_policy="park", rate_limit=2.5, dedupe_window_s=3600)
    assert policies.load() == wanted
    shown = ui.client.get(page).text
    assert 'data-field="rate_limit">2.5/s<' in shown
    bad = [{"rate_limit": limit} for limit in ("abc", "-1", "nan")]
    bad += [{"dedupe_window": "10"}, {"dedupe_window": "1.5"}, {"poison_policy": "explode"}]
    for fields in bad:
        sent = {"poison_policy": "skip", "rate_limit": "", "dedupe_window": "7200"} | fields
        path, query = outcome(ui.post("policy", **sent))
        assert "failed" in query and "done" not in query, fields
        assert policies.load() == wanted, fields
    entries = audited(stream)
    assert [e["action"] for e in entries] == ["policy"] * (1 + len(bad))
    assert all(e["outcome"].startswith("InvalidInput") for e in entries[1:])
    path, query = outcome(ui.post("policy", poison_policy="skip", rate_limit=""))
    assert policies.load() == StreamPolicy(dedupe_window_s=3600)  # an empty limit lifts it


def test_dead_letters_are_paged_and_filtered(ui: Console, stream: StreamFixture, amqp: Any) -> None:
    # 120 letters, 30 of each of keys k0-k3: the first 80 poison, the last 40 timeouts
    deliveries = letters_for(stream.name, [(f"k{n % 4}", n // 4 + 1) for n in range(120)])
    dead_letter(amqp, stream.name, deliveries[:80], reason="poison: bad payload")
    dead_letter(amqp, stream.name, deliveries[80:], reason="timeout: too slow")
    client, base = ui.client, f"/streams/{stream.name}/dead-letters"
    for page, rows in ((0, 50), (1, 50), (2, 20), (3, 0)):
        answer = client.get(base, params={"page": page})
        assert answer.status_code == 200
        assert "120 indexed" in answer.text and "120 shown by this filter" in answer.text
        assert letters_shown(answer.text, stream.name) == rows, page
    first = client.get(base).text
    assert "page 1 of 3" in first and "next</a>" in first and "previous</a>" not in first
    last = client.get(base, params={"page": 2}).text
    assert "page 3 of 3" in last and "previous</a>" in last and "next</a>" not in last
    assert client.get(base, params={"page": "x"}).status_code == 400
    of_k1 = client.get(base, params={"key": "k1"}).text
    assert "30 shown by this filter" in of_k1 and letters_shown(of_k1, stream.name) == 30
    assert ">k0</a>" not in of_k1 and ">k1</a>" in of_k1
    timeouts = client.get(base, params={"reason": "timeout"}).text
    assert "40 shown by this filter" in timeouts and letters_shown(timeouts, stream.name) == 40
    assert "poison: bad payload" not in timeouts
    both = client.get(base, params={"reason": "timeout", "key": "k2"}).text
    assert "10 shown by this filter" in both and letters_shown(both, stream.name) == 10
    nothing = client.get(base, params={"reason": "no such reason"}).text
    assert "0 shown by this filter" in nothing and "no dead letters" in nothing


def test_a_letters_page_draws_its_payload_and_drops_and_redrives_it(
    ui: Console, stream: StreamFixture, amqp: Any
) -> None:
    # keys a and b poison, c two timeouts, and one binary letter of key d
    dead_letter(amqp, stream.name, letters_for(stream.name, [("a", 1), ("a", 2), ("b", 1)]))
    timeouts = letters_for(stream.name, [("c", 1), ("c", 2)])
    dead_letter(amqp, stream.name, timeouts, reason="timeout: slow")
    binary = b"\x00\x01\xff\xfe<script>alert(5)</script>" + bytes(range(8))
    dead_letter(amqp, stream.name, [keyq_delivery(f"keyq.{stream.name}.k.d", "d", "p2", 1, binary)])
    client, base = ui.client, f"/streams/{stream.name}/dead-letters/letter"
    shown = client.get(base, params={"id": "p1:2", "key": "a"})
    assert shown.status_code == 200
    [pre] = re.findall(r'<pre class="payload json">(.*?)</pre>', shown.text, re.DOTALL)
    assert html.unescape(pre) == '{\n  "k": "a",\n  "s": 2\n}'
    editable = form_fields(shown.text, stream.name, "redrive-letter", "edit-redrive")
    assert editable["payload"] == '{"k":"a","s":2}'
    binary = client.get(base, params={"id": "p2:1"})
    assert binary.status_code == 200
    [hexed] = re.findall(r'<pre class="payload hex">(.*?)</pre>', binary.text, re.DOTALL)
    rows = html.unescape(hexed).splitlines()
    assert rows[0].startswith("00000000  00 01 ff fe 3c 73 63 72 69 70 74 3e")
    assert rows[0].endswith("  ....<script>aler")
    assert rows[1].startswith("00000010  74 28 35 29 3c 2f") and len(rows) == 3
    assert "<script>alert" not in binary.text
    assert 'name="payload"' not in binary.text  # a binary payload is not edited as text
    ambiguous = client.get(base, params={"id": "p1:1"})  # keys a, b and c have a p1:1
    assert ambiguous.status_code == 400 and "keys" in ambiguous.text
    assert client.get(base, params={"id": "p9:9"}).status_code == 404
    assert client.get(base, params={"id": "p1:1", "key": "d"}).status_code == 404, "wrong key"
    assert client.get(base, params={"id": "p1:1", "key": "c"}).status_code == 200

    index = DeadLetterIndex(stream.redis, stream.name)
    control = KeyControl(stream.redis, stream.name)
    dlq = dead_letter_queue_name(stream.name)
    page = f"/streams/{stream.name}/dead-letters/letter?id=p1:2&key=a"

    path, query = outcome(ui.press(page, "drop-letter"))
    assert query["done"] == ["dropped 1 copies of letter p1:2 for good"]
    assert [row["key"] for row in index.by_id("p1:2")] == ["c"] and index.counts() == (5, 5)
    left = [(h[HEADER_KEY], h[HEADER_SEQ]) for h, _b in peek_all(amqp, dlq)]
    assert ("a", 2) not in left and len(left) == 5

    # an edited payload that is not JSON (the letter is JSON) changes nothing
    of_p1_1 = page.replace("p1:2", "p1:1")
    edit = (of_p1_1, "redrive-letter", "edit-redrive")
    path, query = outcome(ui.press(*edit, payload="{nope"))
    assert "failed" in query and "JSON" in query["failed"][0]
    assert queue_depth(amqp, dlq) == 5 and control.keys_aside() == {}

    fixed = '{"k": "a", "s": 1, "fixed": true}\r\n'
    path, query = outcome(ui.press(*edit, payload=fixed))
    assert path == f"/streams/{stream.name}/key" and query["key"] == ["a"]
    assert query["done"] == ["put back letter p1:1 to a with the edited payload"]
    [redriven] = control.status("a").aside
    [(headers, body)] = peek_all(amqp, redriven)
    assert body == fixed.replace("\r\n", "\n").encode()
    assert headers[HEADER_REDRIVE_ID] == "p1:1" and headers[HEADER_KEY] == "a"
    assert [row["key"] for row in index.by_id("p1:1")] == ["b", "c"]
    assert queue_depth(amqp, dlq) == 4

    path, query = outcome(ui.post("redrive-reason", reason="timeout"))
    assert query["done"] == ["put back 2 dead letters of 1 keys"]
    [to_c] = control.status("c").aside
    put_back = [orjson.loads(b) for _h, b in peek_all(amqp, to_c)]
    assert put_back == [{"k": "c", "s": 1}, {"k": "c", "s": 2}]
    assert index.counts() == (2, 2) and queue_depth(amqp, dlq) == 2
    path, query = outcome(ui.post("redrive-reason", reason="timeout"))
    assert query["failed"][0].startswith("NothingToRedrive: no dead letters to put back")
    assert index.counts() == (2, 2) and queue_depth(amqp, dlq) == 2

    entries = audited(stream)
    assert [(e["action"], e["target"], e["outcome"].split(":")[0]) for e in entries] == [
        ("drop-letter", "p1:2", "dropped 1 copies of letter p1"),
        ("redrive-letter", "p1:1", "InvalidInput"),
        ("redrive-letter", "p1:1", "put back letter p1"),
        ("redrive-reason", "timeout", "put back 2 dead letters of 1 keys"),
        ("redrive-reason", "timeout", "NothingToRedrive"),
    ]


def test_a_prefix_search_lists_the_keys_known(ui: Console, stream: StreamFixture) -> None:
    for key in ("pre-a", "pre-b", "other"):
        stream.redis.hset(stream.keys.state, key, orjson.dumps({"total": 1}).decode())
    control = KeyControl(stream.redis, stream.name)
    control.pause(["pre-c", "also-other"])
    control.park("pre-d", ParkedKey(at_ms=1, reason="poison", producer="p1", seq=1))
    stream.redis.hset(stream.keys.queue_keys, f"keyq.{stream.name}.k.pre-e", "pre-e")
    client, base = ui.client, f"/streams/{stream.name}/key"

    def found(prefix: str) -> list[str]:
        answer = client.get(base, params={"key": prefix, "prefix": "1"})
        assert answer.status_code == 200
        return re.findall(r'<li><a href="[^"]*">([^<]*)</a></li>', answer.text)

    assert found("pre") == ["pre-a", "pre-b", "pre-c", "pre-d", "pre-e"]
    assert found("pre-d") == ["pre-d"]
    assert found("pr*") == [] and found("zzz") == []
    picture = client.get(base, params={"key": "pre-a"}).text
    assert 'data-field="state"' in picture and "&#34;total&#34;: 1" in picture


def test_unknown_streams_streams_not_given_and_bad_keys(ui: Console, stream: StreamFixture) -> None:
    client = ui.client
    unknown = f"t-nothing-{uuid.uuid4().hex[:8]}"
    for page in (
        f"/streams/{unknown}",
        f"/streams/{unknown}/key?key=a",
        f"/streams/{unknown}/dead-letters/letter?id=p1:1",
        f"/streams/{unknown}/dead-letters",
    ):
        answer = client.get(page)
        assert answer.status_code == 404, page
        assert "does not exist" in answer.text
    assert client.get(f"/streams/{stream.name}/key?key=").status_code == 400
    assert client.get(f"/streams/{stream.name}/key").status_code == 400
    assert client.get(f"/streams/{stream.name}/dead-letters?key=").status_code == 200
    bad_key = client.get(f"/streams/{stream.name}/dead-letters", params={"key": "x" * 5000})
    assert bad_key.status_code == 400 and "page must be a number" not in bad_key.text
    assert client.get("/streams/bad.name").status_code == 400
    path, query = outcome(ui.post("pause", key=""))
    assert "failed" in query
    path, query = outcome(ui.post("pause", key="x" * 5000))
    assert "failed" in query
    assert path == f"/streams/{stream.name}"
    # an action on a stream that does not exist fails on the page, changing nothing
    gone = Console(client, ui.access, unknown)
    path, query = outcome(gone.post("pause", key="a"))
    assert "failed" in query and "does not exist" in query["failed"][0]
    # a stream that exists but was not given to the console is not served either
    other = f"{stream.name}-other"
    for path in (f"/streams/{other}", f"/streams/{other}/key?key=a"):
        assert client.get(path).status_code == 404, path
    _path, query = outcome(Console(client, ui.access, other).post("pause", key="a"))
    assert "failed" in query
    assert not stream.redis.exists(StreamKeys(other).paused_keys)


def test_other_sites_may_link_to_a_page_but_not_load_it(ui: Console) -> None:
    client, page = ui.client, f"/streams/{ui.stream}"
    linked = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"}
    assert client.get(page, headers=linked).status_code == 200
    for mode in ("no-cors", "cors"):  # an <img>, a script, a fetch from another site's page
        loaded = client.get(page, headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": mode})
        assert loaded.status_code == 403, mode
    # a read that walks the dead-letter queue, only from the console's own pages
    walk = f"{page}/dead-letters/letter?id=p1:1&whole=1"
    assert client.get(walk, headers=linked).status_code == 403
    own = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "navigate"}
    assert client.get(page, headers=own).status_code == 200
