"""The Redis batch path's planning, without a server (:mod:`participants._redis_batch`).

What the script receives must splice back into exactly the ledger entries the per-step
path writes, the in-flight/finished flags must be the ones :class:`RedisUnit` computes,
and everything the script does not handle must be left to the per-step path.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest

from saga.participants._actions import READ_COMMITTED_BEFORE
from saga.participants._barrier import LedgerEntry, LedgerStatus, Requested
from saga.participants._handlers import Handler
from saga.participants._ledger import entry_json, entry_of_json, field_of_step
from saga.participants._storage import DecisionArrived
from saga.participants.redis._adapter import RedisStorage
from saga.participants.redis._batch import Done, Planner, Prepared, _hash_flags
from saga.participants.redis._unit import may_wait, steps_of, tx_finished_ms
from saga.streams import Isolation, Mode, Outcome, StepStatus

pytestmark = pytest.mark.unit

NOW = 1_700_000_000_000
DEADLINE = NOW + 60_000


def planner(**options: Any) -> Planner:
    storage = RedisStorage("bank", "redis://127.0.0.1:1/0", ["accounts"], **options)
    assert storage.batch_script is not None  # building it does not connect
    return storage.batch_script.planner


def request(args: dict[str, Any], **extra: Any) -> Requested:
    return Requested("tx-1", 0, "increment", args, Mode.PARALLEL, 1, DEADLINE, NOW, **extra)


BUMP: dict[str, Any] = {"target": "accounts", "key": 7, "field": "balance", "by": 5, "min": 0}


def test_the_spliced_entries_are_the_per_step_paths() -> None:
    prepared = planner().request(request(BUMP, fingerprint="fp", isolation=Isolation.NONE))
    assert isinstance(prepared, Prepared)
    args = prepared.args
    assert args[0] == "inc" and prepared.keys == (
        "saga:ledger:bank:tx:tx-1",
        "saga:accounts:7",
        "saga:ledger:+isolation:accounts:7",
    )
    applied = entry_of_json(args[4] + json.dumps("100") + args[5])
    assert applied.status is LedgerStatus.APPLIED and applied.effect
    assert applied.before == {"balance": "100"} and applied.fingerprint == "fp"
    failed = entry_of_json(args[6] + json.dumps("why") + args[7])
    assert (failed.status, failed.effect, failed.reason, failed.before) == (
        LedgerStatus.FAILED,
        False,
        "why",
        None,
    )
    assert args[8:12] == ("balance", "5", "0", "")
    assert all(isinstance(arg, str) for arg in args)


@pytest.mark.parametrize(
    "item",
    [
        request({**BUMP, "by": 0.5}),
        request({**BUMP, "min": 0.5}),
        request({**BUMP, "max": 1.5}),
        replace(request({"target": "accounts", "key": 1, "value": {"a": 1}}), action="put"),
        request(BUMP, fail_reason="the storage failed"),
    ],
    ids=["decimal-by", "float-min", "float-max", "other-action", "fail-reason"],
)
@pytest.mark.parametrize("isolation", list(Isolation))
def test_what_the_script_does_not_do_goes_per_step(item: Any, isolation: Isolation) -> None:
    assert planner().request(replace(item, isolation=isolation)) is None


def test_a_custom_handler_named_like_a_builtin_goes_per_step() -> None:
    handler = Handler(lambda session, args: None, lambda session, args, before: None)
    assert planner(handlers={"increment": handler}).request(request(BUMP)) is None
    assert planner(handlers={"other": handler}).request(request(BUMP)) is not None


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        ({**BUMP, "target": "secrets"}, "secrets"),
        ({**BUMP, "by": 2**63}, "does not fit in 64 bits"),
        ({**BUMP, "key": "a b"}, "may not contain whitespace"),
    ],
)
def test_a_rejected_argument_is_written_failed_without_the_script_deciding(
    args: dict[str, Any], reason: str
) -> None:
    prepared = planner().request(request(args))
    assert prepared is not None and prepared.args[0] == "put"
    assert prepared.emit is not None and reason in (prepared.emit.reason or "")
    written = entry_of_json(prepared.args[4])
    assert (written.status, written.reason) == (LedgerStatus.FAILED, prepared.emit.reason)


def test_hash_flags_are_what_the_per_step_write_computes() -> None:
    rng = random.Random(14)
    statuses = list(LedgerStatus)
    for _ in range(500):
        fields: dict[str, LedgerEntry] = {}
        for step in rng.sample(range(-2, 4), rng.randint(1, 4)):
            fields[field_of_step(step)] = LedgerEntry(
                "tx-1",
                step,
                rng.choice(statuses),
                mode=rng.choice(list(Mode)),
                deadline_ms=rng.randint(0, 10),
                updated_ms=rng.randint(0, 10),
                rollback_pending=rng.random() < 0.3,
            )
        texts = {name: entry_json(entry) for name, entry in fields.items()}
        done = tx_finished_ms(texts)
        wait = any(may_wait(step) for step in steps_of(texts))
        expected = ("w" if wait else "n") + ("-" if done is None else str(done))
        assert _hash_flags(fields) == expected


def test_a_rollback_is_planned_on_the_hash_it_read() -> None:
    applied = entry_json(
        LedgerEntry(
            "tx-1",
            0,
            LedgerStatus.APPLIED,
            "increment",
            BUMP,
            deadline_ms=DEADLINE,
            effect=True,
            before={"balance": "100"},
            updated_ms=NOW,
        )
    )
    prepared = planner().decision(
        DecisionArrived("tx-1", Outcome.ROLLBACK, NOW + 1), {"0": applied}
    )
    assert isinstance(prepared, Prepared) and prepared.args[0] == "dec"
    assert prepared.args[9] == "-5" and prepared.args[10:12] == ("", "")
    count, line = prepared.args[14].split("\n")
    assert count == "1" and line.startswith("0\t") and len(line) == 2 + 40
    assert entry_of_json(prepared.args[4]).status is LedgerStatus.COMPENSATED
    marker = planner().decision(DecisionArrived("tx-2", Outcome.ROLLBACK, NOW), {})
    assert isinstance(marker, Prepared)
    assert marker.args[2] == "rolled_back" and marker.args[14] == "0"
    two = planner().decision(
        DecisionArrived("tx-1", Outcome.ROLLBACK, NOW), {"0": applied, "1": applied}
    )
    assert two is None  # two steps here: per step


def held_entry(status: LedgerStatus = LedgerStatus.APPLIED, step: int = 0) -> str:
    return entry_json(
        LedgerEntry(
            "tx-1",
            step,
            status,
            "increment",
            BUMP,
            deadline_ms=DEADLINE,
            effect=True,
            before=dict(READ_COMMITTED_BEFORE),
            updated_ms=NOW,
        )
    )


def test_read_committed_reserves_commits_and_releases_in_the_script() -> None:
    prepared = planner().request(request(BUMP, fingerprint="fp"))
    assert isinstance(prepared, Prepared) and prepared.args[0] == "res"
    applied = entry_of_json(prepared.args[4] + prepared.args[5])
    assert applied.before == READ_COMMITTED_BEFORE and applied.status is LedgerStatus.APPLIED
    assert prepared.emit is not None and prepared.emit.confirm  # a commit will write
    assert prepared.args[12].startswith("n-;")  # applied and held: not finished, not pruned
    for outcome, kind, status in (
        (Outcome.COMMIT, "cmt", LedgerStatus.COMMITTED),
        (Outcome.ROLLBACK, "rel", LedgerStatus.COMPENSATED),
    ):
        decided = planner().decision(DecisionArrived("tx-1", outcome, NOW + 1), {"0": held_entry()})
        assert isinstance(decided, Prepared) and decided.args[0] == kind
        assert decided.args[9] == "5"  # the reservation's own amount, either way
        assert entry_of_json(decided.args[4]).status is status
        assert decided.emit is not None and decided.emit.status.value == status.value


def test_a_commit_with_nothing_to_confirm_needs_no_script() -> None:
    none_step = entry_json(
        LedgerEntry(
            "tx-1", 0, LedgerStatus.APPLIED, "increment", BUMP, deadline_ms=DEADLINE, effect=True
        )
    )
    commit = DecisionArrived("tx-1", Outcome.COMMIT, NOW + 1)
    assert planner().decision(commit, {}) == Done(commit, ())
    assert planner().decision(commit, {"0": none_step, "1": none_step}) == Done(commit, ())
    committed = held_entry(LedgerStatus.COMMITTED)
    again = planner().decision(commit, {"0": committed})
    assert isinstance(again, Done) and [r.status for r in again.reports] == [StepStatus.COMMITTED]
    assert planner().decision(commit, {"0": held_entry(), "1": held_entry(step=1)}) is None
