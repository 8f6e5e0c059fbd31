"""The console's JSON API and its guards, over HTTP on loopback, without a browser.

The view and the abort's client run on the in-memory log; the server is the real
one (``make_server`` on port 0). A POST without the page's token, from another
origin, or under a foreign Host header is refused and sends nothing.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from saga.coordinator._console import Console, Operations, StatusTable, ViewStore, make_server
from saga.coordinator._console._server import TOKEN_HEADER
from saga.streams import (
    KafkaSettings,
    SagaAbort,
    SagaState,
    SagaStatus,
    StepProgress,
    StepStatus,
    decode,
    encode,
)
from saga.streams.testing import InMemoryLog

pytestmark = pytest.mark.unit

SETTINGS = KafkaSettings(bootstrap="memory:9092", prefix="api")


@dataclass
class Running:
    log: InMemoryLog
    console: Console
    base: str

    def call(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        token: bool = True,
    ) -> tuple[int, Any]:
        sent = dict(headers or {})
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            sent.setdefault("Content-Type", "application/json")
            if token:
                sent[TOKEN_HEADER] = self.console.token
        request = urllib.request.Request(self.base + path, data=data, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                raw = response.read()
                kind = response.headers.get("Content-Type", "")
                return response.status, json.loads(raw) if "json" in kind else raw.decode()
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def aborts(self) -> list[SagaAbort]:
        found = [decode(m.value) for m in self.log.records(SETTINGS.topics.requests) if m.value]
        return [r for r in found if isinstance(r, SagaAbort)]

    def drain(self) -> None:
        while self.console.table.step(timeout=0.01):
            pass


def status(tx_id: str, state: SagaState) -> SagaStatus:
    return SagaStatus(
        tx_id=tx_id,
        saga="transfer",
        state=state,
        steps=(
            StepProgress("ledger", StepStatus.APPLIED),
            StepProgress("shop", StepStatus.PENDING),
        ),
        reason=None,
        created_ms=1_000,
        updated_ms=2_000,
        deadline_ms=60_000,
    )


def start(*, disabled: str | None = None, user_header: str | None = None) -> Iterator[Running]:
    log = InMemoryLog(SETTINGS)
    log.create_topics(partitions=2)
    with log.producer() as producer:
        for record in (
            status("tx-pending", SagaState.PENDING),
            status("tx-done", SagaState.COMMITTED),
        ):
            producer.produce(SETTINGS.topics.status, record.tx_id, encode(record))
    store = ViewStore(":memory:")
    table = StatusTable(log, store)
    # No coordinator runs here: an abort is sent and its wait ends at once with "timeout".
    operations = Operations(
        log, store, verify_keys=None, signing_keys=None, actions_disabled=disabled, wait_s=0.01
    )
    console = Console(
        store=store,
        table=table,
        operations=operations,
        operator="alice",
        prefix="api",
        user_header=user_header,
    )
    server = make_server(console, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    running = Running(log, console, f"http://127.0.0.1:{server.server_address[1]}")
    running.drain()
    try:
        yield running
    finally:
        server.shutdown()
        server.server_close()
        store.close()


@pytest.fixture
def running() -> Iterator[Running]:
    yield from start()


def test_the_page_embeds_a_token_and_forbids_framing(running: Running) -> None:
    request = urllib.request.Request(running.base + "/")
    with urllib.request.urlopen(request, timeout=10) as response:
        page = response.read().decode()
        assert "frame-ancestors 'none'" in response.headers["Content-Security-Policy"]
    assert f'content="{running.console.token}"' in page
    assert 'content="alice"' in page
    code, script = running.call("/static/app.js")
    assert code == 200 and "X-Saga-Console-Token" in script


def test_the_json_endpoints_answer_from_the_view(running: Running) -> None:
    code, body = running.call("/api/sagas?q=tx-p")
    assert code == 200
    assert [s["tx_id"] for s in body["sagas"]] == ["tx-pending"]
    assert body["sagas"][0]["steps"][1] == {"participant": "shop", "status": "pending"}
    code, body = running.call("/api/sagas?state=committed")
    assert [s["tx_id"] for s in body["sagas"]] == ["tx-done"]
    code, body = running.call("/api/sagas/tx-done")
    assert code == 200 and body["saga"]["state"] == "committed" and body["dead_letters"] == []
    code, body = running.call("/api/metrics")
    assert code == 200
    assert body["counts"]["pending"] == 1 and body["counts"]["committed"] == 1
    assert body["view"] == "ok" and body["capabilities"]["abort"] is True
    assert running.call("/api/dlq") == (200, {"dead_letters": []})
    assert running.call("/api/audit") == (200, {"audit": []})
    code, body = running.call("/api/participants")
    assert code == 200 and isinstance(body["available"], bool)


def test_bad_queries_get_one_sentence_and_a_4xx(running: Running) -> None:
    code, body = running.call("/api/sagas?state=lost")
    assert code == 400 and "unknown state" in body["error"]
    code, body = running.call("/api/sagas/nope")
    assert code == 404 and "no saga" in body["error"]
    code, body = running.call("/api/nothing")
    assert code == 404


def test_an_abort_goes_through_the_client_and_lands_in_the_audit_trail(running: Running) -> None:
    code, body = running.call("/api/sagas/tx-pending/abort", {"reason": "stuck on shop"})
    assert code == 200, body
    assert (body["verdict"], body["sent"]) == ("timeout", True)
    [sent] = running.aborts()
    assert (sent.tx_id, sent.reason, sent.by) == (
        "tx-pending",
        "stuck on shop",
        "alice (saga console)",
    )
    [line] = running.call("/api/audit")[1]["audit"]
    assert (line["operator"], line["action"], line["tx_id"], line["detail"]) == (
        "alice",
        "abort",
        "tx-pending",
        "stuck on shop",
    )
    assert line["outcome"] == "timeout (state pending)"


def test_an_abort_of_a_decided_saga_is_refused_and_audited(running: Running) -> None:
    code, body = running.call("/api/sagas/tx-done/abort", {"reason": ""})
    assert code == 409 and "already committed" in body["error"]
    assert running.aborts() == []
    [line] = running.call("/api/audit")[1]["audit"]
    assert line["outcome"] == "not_honoured (state committed)"


@pytest.mark.parametrize(
    ("headers", "token", "why"),
    [
        ({}, False, "console token"),
        ({TOKEN_HEADER: "guessed"}, False, "console token"),
        ({"Origin": "http://evil.example"}, True, "another site"),
        ({"Content-Type": "text/plain"}, True, "application/json"),
    ],
)
def test_a_post_without_the_pages_token_or_from_elsewhere_is_refused(
    running: Running, headers: dict[str, str], token: bool, why: str
) -> None:
    code, body = running.call("/api/sagas/tx-pending/abort", {"reason": "x"}, headers, token)
    assert code in (403, 415) and why in body["error"]
    assert running.aborts() == []
    assert running.call("/api/audit")[1]["audit"] == []


def test_a_foreign_host_header_is_refused(running: Running) -> None:
    code, body = running.call("/api/sagas", headers={"Host": "rebound.example:80"})
    assert code == 421 and "--public-host" in body["error"]


def test_bad_action_input_is_refused(running: Running) -> None:
    code, body = running.call("/api/sagas/bad%20id/abort", {"reason": "x"})
    assert code == 400 and "not a transaction id" in body["error"]
    code, body = running.call("/api/sagas/tx-pending/abort", {"reason": "x" * 501})
    assert code == 400 and "too long" in body["error"]
    code, body = running.call("/api/sagas/tx-pending/resolve", {"step": "one", "note": ""})
    assert code == 400
    assert running.aborts() == []


def test_a_read_only_console_acts_on_nothing() -> None:
    for running in start(disabled="the console runs with --read-only"):
        code, body = running.call("/api/sagas/tx-pending/abort", {"reason": "x"})
        assert code == 403 and "--read-only" in body["error"]
        assert running.aborts() == []
        assert running.call("/api/metrics")[1]["capabilities"]["abort"] is False


def test_behind_a_proxy_the_operator_comes_from_its_header() -> None:
    for running in start(user_header="X-Forwarded-User"):
        code, body = running.call("/api/sagas/tx-pending/abort", {"reason": "x"})
        assert code == 403 and "X-Forwarded-User" in body["error"]
        code, _ = running.call(
            "/api/sagas/tx-pending/abort", {"reason": "x"}, {"X-Forwarded-User": "bob"}
        )
        assert code == 200
        assert [a.by for a in running.aborts()] == ["bob (saga console)"]
        assert running.call("/api/audit")[1]["audit"][0]["operator"] == "bob"


def test_the_timeline_is_the_sagas_history(running: Running) -> None:
    code, body = running.call("/api/sagas/tx-pending/history")
    assert code == 200, body
    assert [(e["kind"], e["topic"]) for e in body["entries"]] == [
        ("saga.status", SETTINGS.topics.status)
    ]


def test_a_dead_letter_is_redriven_and_audited(running: Running) -> None:
    with running.log.producer() as producer:
        producer.produce(
            SETTINGS.topics.dlq,
            "tx-9",
            b'{"v": 1}',
            headers=[
                ("saga.error", b"missing fields"),
                ("saga.source.topic", SETTINGS.topics.requests.encode()),
            ],
        )
    running.drain()
    [letter] = running.call("/api/dlq")[1]["dead_letters"]
    where = {"partition": letter["partition"], "offset": letter["offset"]}
    code, body = running.call("/api/dlq/redrive", where)
    assert code == 200, body
    copies = [m for m in running.log.records(SETTINGS.topics.requests) if m.key == b"tx-9"]
    assert [m.value for m in copies] == [b'{"v": 1}']
    assert copies[0].header("saga.redriven.by") == b"alice (saga console)"
    [line] = running.call("/api/audit")[1]["audit"]
    assert (line["action"], line["tx_id"], line["operator"]) == ("redrive", "tx-9", "alice")
    code, body = running.call("/api/dlq/redrive", {"partition": 0, "offset": 999})
    assert code == 404 and "no dead letter" in body["error"]


def test_a_resolve_is_sent_for_a_failed_compensation_only(running: Running) -> None:
    failed = SagaStatus(
        tx_id="tx-failed",
        saga="transfer",
        state=SagaState.FAILED,
        steps=(StepProgress("ledger", StepStatus.COMPENSATION_FAILED),),
        reason="step 0 compensation failed",
        created_ms=1_000,
        updated_ms=2_000,
        deadline_ms=60_000,
    )
    with running.log.producer() as producer:
        producer.produce(SETTINGS.topics.status, failed.tx_id, encode(failed))
    running.drain()
    code, body = running.call("/api/sagas/tx-pending/resolve", {"step": 0, "note": "by hand"})
    assert code == 409 and "not failed" in body["error"]
    code, body = running.call("/api/sagas/tx-failed/resolve", {"step": 0, "note": ""})
    assert code == 400 and "note" in body["error"]
    code, body = running.call("/api/sagas/tx-failed/resolve", {"step": 0, "note": "refunded"})
    assert code == 200 and body["sent"] is True, body
    sent = [decode(m.value) for m in running.log.records(SETTINGS.topics.requests) if m.value]
    assert [(r.TYPE, r.step, r.note, r.by) for r in sent] == [
        ("saga.resolve", 0, "refunded", "alice (saga console)")
    ]
    outcomes = [
        (a["action"], a["tx_id"], a["outcome"]) for a in running.call("/api/audit")[1]["audit"]
    ]
    assert ("resolve", "tx-failed", "timeout (state failed)") in outcomes
    assert ("resolve", "tx-pending", "refused (state pending)") in outcomes
