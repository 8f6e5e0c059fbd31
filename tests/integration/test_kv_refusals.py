"""What Redis or the MongoDB wire server refuses in a custom handler belongs to that step
(issue 31, item 2): it fails the step with the store's words while the batch goes on,
instead of stopping the participant (a configuration error) or retrying forever."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import pymongo.database
import pytest
import redis

from saga.participants._barrier import LedgerStatus, Requested
from saga.participants._handlers import Handler
from saga.participants.mongo import MongoSession, MongoStorage
from saga.participants.redis import RedisSession, RedisStorage
from saga.streams import Isolation, StepStatus
from tests._infra import Services
from tests.integration.test_sql_storage import requested as requested_at

pytestmark = pytest.mark.integration


def requested(tx_id: str, action: str, args: Mapping[str, Any]) -> Requested:
    return replace(requested_at(tx_id, action, args), isolation=Isolation.NONE)


def _cancel(native: Any, args: Mapping[str, Any], before: Any) -> None:
    return None


BUMP = {"target": "accounts", "key": 1, "field": "balance", "by": 5}


def test_redis_refusals_in_handlers_fail_their_step(
    services: Services, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = redis_prefix.rstrip(":")
    client = redis.Redis.from_url(services.redis_url, decode_responses=True)
    client.set(f"{prefix}:accounts:text", "not a hash")
    client.hset(f"{prefix}:accounts:1", mapping={"balance": "10"})

    def arity(native: RedisSession, args: Mapping[str, Any]) -> None:
        native.queue("HSET", native.key("accounts", 1))  # refused when queued: EXEC runs nothing

    def wrongtype(native: RedisSession, args: Mapping[str, Any]) -> None:
        native.client.hgetall(native.key("accounts", "text"))

    def partly(native: RedisSession, args: Mapping[str, Any]) -> None:
        native.queue("INCR", native.key("accounts", "text"))  # refused while EXEC runs
        native.queue("HSET", native.key("accounts", 1), "note", "seen")

    handlers = {
        "arity": Handler(arity, _cancel),
        "wrongtype": Handler(wrongtype, _cancel),
        "partly": Handler(partly, _cancel),
    }
    storage = RedisStorage(
        "bank", services.redis_url, ["accounts"], prefix=prefix, handlers=handlers
    )
    storage.refusal_backoff_s = 0.01
    try:
        with caplog.at_level(logging.ERROR, logger="saga.participant"):
            got = storage.execute(
                [
                    requested("tx-1", "arity", {}),
                    requested("tx-2", "wrongtype", {}),
                    requested("tx-3", "increment", BUMP),
                    requested("tx-4", "partly", {}),
                ]
            )
        assert [(r.tx_id, r.status) for r in got] == [
            ("tx-1", StepStatus.FAILED),
            ("tx-2", StepStatus.FAILED),
            ("tx-3", StepStatus.APPLIED),
            ("tx-4", StepStatus.APPLIED),  # Redis undoes nothing: the step stays as recorded
        ]
        assert got[0].reason is not None and got[0].reason.startswith(
            "Redis refused the arity step: "
        )
        assert "wrong number of arguments" in got[0].reason
        assert got[1].reason is not None and got[1].reason.startswith(
            "Redis refused the wrongtype step: WRONGTYPE"
        )
        assert [e.status for e in storage.ledger("tx-1")] == [LedgerStatus.FAILED]
        assert client.hgetall(f"{prefix}:accounts:1") == {"balance": "15", "note": "seen"}
        assert "the partly step of tx-4 ran only in part" in caplog.text
    finally:
        storage.close()
        client.close()


def test_a_mongodb_write_error_in_a_handler_fails_its_step(
    services: Services, mongo_db: pymongo.database.Database[dict[str, Any]]
) -> None:
    mongo_db["orders"].insert_one({"_id": "o-1", "item": "book"})
    mongo_db["accounts"].insert_one({"_id": 1, "balance": 10})

    def duplicate(native: MongoSession, args: Mapping[str, Any]) -> None:
        native.collection("orders").insert_one({"_id": "o-1"}, session=native.session)

    storage = MongoStorage(
        "bank",
        services.mongo_url,
        ["accounts", "orders"],
        database=mongo_db.name,
        handlers={"duplicate": Handler(duplicate, _cancel)},
    )
    try:
        got = storage.execute(
            [requested("tx-1", "duplicate", {}), requested("tx-2", "increment", BUMP)]
        )
        assert [(r.tx_id, r.status) for r in got] == [
            ("tx-1", StepStatus.FAILED),
            ("tx-2", StepStatus.APPLIED),
        ]
        assert got[0].reason is not None
        assert re.fullmatch(
            r"(FerretDB|MongoDB) refused the duplicate step: .*duplicate key.*\(11000\)",
            got[0].reason,
        ), got[0].reason
    finally:
        storage.close()
