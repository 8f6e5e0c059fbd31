"""The isolation tier's workload: contention on a few hot records per store.

Every store (PostgreSQL, the MongoDB-wire server, Redis; participants ``bank-sql``,
``bank-mongo``, ``bank-redis`` as in :mod:`tests.chaos.workload`) holds
:data:`HOT_ACCOUNTS` records ``accounts/h<i>`` (one integer field ``balance``, opening
:data:`OPENING`, bounded to ``[0, CAP]`` by every increment) and :data:`HOT_SLOTS`
records ``slots/k<i>`` (one text field ``writer``; the first half exist at the start,
written by ``init``). That is :data:`HOT_RECORDS_PER_STORE` records per store, and
every saga of the run touches only them.

Values identify their writers, so a reader's sample can be judged from the log alone:

* ``insert``, ``put`` and ``update`` on a slot write the saga's ``tx_id`` into
  ``writer``; ``delete`` removes the slot. A sample showing ``writer = T`` was produced
  by saga T, and by nothing else.
* ``increment`` on an account moves ``balance`` by ``by``; a sample's value must be the
  opening plus the ``by`` of a set of *committed* sagas that may have been applied at
  that moment (see :mod:`tests.chaos.iso_checker`).

Kinds of saga (each with 2-4 steps, parallel or sequential):

``transfer``  debit one account, credit another (either may break a bound: rejected);
``write``     update a slot, plus a transfer;
``churn``     insert, delete, put or update a slot, plus a transfer;
``doomed``    a write whose last step credits ``accounts/nobody``, which exists in no
              store: always rejected, after the other steps may have been applied.

A share of sagas is aborted (``saga.abort`` sent a moment after the request), and
contention rejects more: a record held by another saga, an escrow bound.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from saga.streams import Step
from tests.chaos.workload import PARTICIPANTS, STORES

ACCOUNTS: Final = "accounts"
BALANCE: Final = "balance"
SLOTS: Final = "slots"
WRITER: Final = "writer"
TARGETS: Final = (ACCOUNTS, SLOTS)
HOT_ACCOUNTS: Final = 6
HOT_SLOTS: Final = 14
HOT_RECORDS_PER_STORE: Final = HOT_ACCOUNTS + HOT_SLOTS
OPENING: Final = 500
CAP: Final = 1200
"""Every increment carries ``min: 0`` and ``max: CAP``."""
MAX_AMOUNT: Final = 60
INIT_WRITER: Final = "init"
MISSING: Final = "nobody"
"""An account in no store: an increment of it is a business rejection."""

KIND_WEIGHTS: Final = (("transfer", 0.4), ("write", 0.2), ("churn", 0.25), ("doomed", 0.15))
ABORT_SHARE: Final = 0.1
ABORT_AFTER_S: Final = (0.0, 0.15)
SEQUENTIAL_SHARE: Final = 0.25

Record = tuple[str, str, str]
"""``(store, target, key)``."""


def accounts() -> list[str]:
    return [f"h{i}" for i in range(HOT_ACCOUNTS)]


def slots() -> list[str]:
    return [f"k{i}" for i in range(HOT_SLOTS)]


def hot_records(stores: tuple[str, ...] = STORES) -> list[Record]:
    return [(s, ACCOUNTS, k) for s in stores for k in accounts()] + [
        (s, SLOTS, k) for s in stores for k in slots()
    ]


def opening_accounts(stores: tuple[str, ...] = STORES) -> dict[Record, int]:
    return {(s, ACCOUNTS, k): OPENING for s in stores for k in accounts()}


def opening_slots(stores: tuple[str, ...] = STORES) -> dict[Record, str | None]:
    """The slots' writers at the start (``None``: the slot does not exist)."""
    half = HOT_SLOTS // 2
    return {
        (s, SLOTS, k): (INIT_WRITER if i < half else None)
        for s in stores
        for i, k in enumerate(slots())
    }


@dataclass(frozen=True)
class IsoSaga:
    """One saga of the plan: its steps, and when (if at all) it is aborted."""

    tx_id: str
    kind: str
    mode: str  # "parallel" or "sequential"
    steps: tuple[Step, ...]
    abort_after_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "tx_id": self.tx_id,
            "kind": self.kind,
            "mode": self.mode,
            "abort_after_s": self.abort_after_s,
            "steps": [{"participant": s.participant, **s.args, "action": s.action}
                      for s in self.steps],
        }  # fmt: skip


def store_of_step(step: Step) -> str:
    return next(s for s, name in PARTICIPANTS.items() if name == step.participant)


def record_of_step(step: Step) -> Record:
    return (store_of_step(step), str(step.args["target"]), str(step.args["key"]))


def increment(store: str, key: str, by: int) -> Step:
    args = {"target": ACCOUNTS, "key": key, "field": BALANCE, "by": by, "min": 0, "max": CAP}
    return Step(PARTICIPANTS[store], "increment", args)


def slot_step(store: str, action: str, key: str, tx_id: str) -> Step:
    args: dict[str, Any] = {"target": SLOTS, "key": key}
    if action == "update":
        args["set"] = {WRITER: tx_id}
    elif action in ("insert", "put"):
        args["value"] = {WRITER: tx_id}
    return Step(PARTICIPANTS[store], action, args)


class Planner:
    """Sagas of the isolation workload, the same sequence for one seed and tag."""

    def __init__(self, seed: int, tag: str, stores: tuple[str, ...] = STORES) -> None:
        self.rnd = random.Random(f"{seed}:iso:{tag}")
        self.tag = tag
        self.stores = stores
        self.n = 0

    def _account(self, avoid: set[Record]) -> Record:
        while True:
            rec = (self.rnd.choice(self.stores), ACCOUNTS, self.rnd.choice(accounts()))
            if rec not in avoid:
                avoid.add(rec)
                return rec

    def _slot(self, avoid: set[Record]) -> Record:
        while True:
            rec = (self.rnd.choice(self.stores), SLOTS, self.rnd.choice(slots()))
            if rec not in avoid:
                avoid.add(rec)
                return rec

    def _transfer(self, used: set[Record]) -> list[Step]:
        src, dst = self._account(used), self._account(used)
        amount = self.rnd.randint(1, MAX_AMOUNT)
        return [increment(src[0], src[2], -amount), increment(dst[0], dst[2], amount)]

    def _steps(self, kind: str, tx_id: str) -> list[Step]:
        rnd = self.rnd
        used: set[Record] = set()  # a saga touches each record at most once
        if kind == "transfer":
            return self._transfer(used)
        if kind in ("write", "doomed"):
            store, _, key = self._slot(used)
            steps = [slot_step(store, "update", key, tx_id), *self._transfer(used)]
            rnd.shuffle(steps)
            if kind == "doomed":  # last, so that in sequence the others are applied first
                steps.append(increment(rnd.choice(self.stores), MISSING, 1))
            return steps
        store, _, key = self._slot(used)
        action = rnd.choice(("insert", "delete", "put", "update"))
        steps = [slot_step(store, action, key, tx_id), *self._transfer(used)]
        rnd.shuffle(steps)
        return steps

    def next(self) -> IsoSaga:
        rnd = self.rnd
        tx_id = f"{self.tag}-{self.n:06d}"
        self.n += 1
        roll, kind = rnd.random(), KIND_WEIGHTS[-1][0]
        for name, weight in KIND_WEIGHTS:
            if roll < weight:
                kind = name
                break
            roll -= weight
        mode = "sequential" if rnd.random() < SEQUENTIAL_SHARE else "parallel"
        abort = rnd.uniform(*ABORT_AFTER_S) if rnd.random() < ABORT_SHARE else None
        return IsoSaga(tx_id, kind, mode, tuple(self._steps(kind, tx_id)), abort)

    def __iter__(self) -> Iterator[IsoSaga]:
        while True:
            yield self.next()
