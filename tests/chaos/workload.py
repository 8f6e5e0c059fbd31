"""The chaos workload: bank transfers across PostgreSQL, the MongoDB wire server and Redis.

Every store holds an ``accounts`` target (a PostgreSQL table, a Mongo collection,
Redis hashes ``<prefix>:accounts:<key>``) with one integer field ``balance``, and
one participant serves it: ``bank-sql``, ``bank-mongo`` and ``bank-redis``.

A transfer saga debits one store and credits another::

    0  bank-<src>  increment accounts/<src_key> balance -amount (min 0)
    1  bank-<dst>  increment accounts/<dst_key> balance +amount

Accounts are laid out so that the checker can tell how often each step took
effect without trusting the log:

* every transfer debits an account of its own, ``s<tag>x<index>`` (opening balance
  :data:`OWN_OPENING`), in its source store: ``(opening - balance) / amount`` is
  the number of times the debit is in effect;
* half the transfers credit an account of their own, ``d<tag>x<index>`` (opening 0),
  the other half one of a few shared *hot* accounts per store (opening
  :data:`HOT_OPENING`), so concurrent sagas contend for the same records.

A share is designed to be rejected, the same way whatever runs at the same time:
``funds`` debits more than the source account holds (step 0 fails; a credit that
was applied is compensated), ``missing`` credits an account that never exists
(step 1 fails; the debit is compensated). Some transfers run in sequential mode.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from saga.streams import Step

STORES = ("sql", "mongo", "redis")
PARTICIPANTS = {"sql": "bank-sql", "mongo": "bank-mongo", "redis": "bank-redis"}
STORE_OF = {name: store for store, name in PARTICIPANTS.items()}
TARGET = "accounts"
FIELD = "balance"
OWN_OPENING = 1_000
HOT_OPENING = 1_000_000
HOT_ACCOUNTS = 6
MISSING_ACCOUNT = "nobody"
"""An account that exists in no store: crediting it is a business rejection."""

KINDS = ("ok", "funds", "missing")


@dataclass(frozen=True)
class Transfer:
    """One transfer saga of the plan, and what the checker needs to judge it."""

    tx_id: str
    index: int
    src: str  # store
    dst: str  # store
    src_key: str
    dst_key: str
    amount: int
    kind: str  # "ok", "funds" (step 0 rejected) or "missing" (step 1 rejected)
    mode: str  # "parallel" or "sequential"

    @property
    def dst_own(self) -> bool:
        """Whether the credited account belongs to this transfer alone."""
        return not (self.dst_key == MISSING_ACCOUNT or self.dst_key.startswith("h"))

    def steps(self) -> list[Step]:
        return [
            Step(
                PARTICIPANTS[self.src],
                "increment",
                {
                    "target": TARGET,
                    "key": self.src_key,
                    "field": FIELD,
                    "by": -self.amount,
                    "min": 0,
                },
            ),
            Step(
                PARTICIPANTS[self.dst],
                "increment",
                {"target": TARGET, "key": self.dst_key, "field": FIELD, "by": self.amount},
            ),
        ]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Transfer:
        return cls(**data)


def plan(
    n: int,
    *,
    seed: int,
    tag: str,
    start: int = 0,
    stores: tuple[str, ...] = STORES,
    reject_share: float = 0.2,
    sequential_share: float = 0.2,
) -> list[Transfer]:
    """``n`` transfers numbered from ``start`` between ``stores``, the same for one seed."""
    rnd = random.Random(f"{seed}:{tag}:{start}")
    out = []
    for index in range(start, start + n):
        src, dst = rnd.sample(stores, 2)
        roll = rnd.random()
        kind = "ok"
        if roll < reject_share / 2:
            kind = "funds"
        elif roll < reject_share:
            kind = "missing"
        amount = rnd.randint(1, 100)
        if kind == "funds":
            amount += OWN_OPENING
        if kind == "missing":
            dst_key = MISSING_ACCOUNT
        elif rnd.random() < 0.5:
            dst_key = f"d{tag}x{index}"
        else:
            dst_key = f"h{rnd.randrange(HOT_ACCOUNTS)}"
        mode = "sequential" if rnd.random() < sequential_share else "parallel"
        out.append(
            Transfer(
                tx_id=f"{tag}-{index:06d}",
                index=index,
                src=src,
                dst=dst,
                src_key=f"s{tag}x{index}",
                dst_key=dst_key,
                amount=amount,
                kind=kind,
                mode=mode,
            )
        )
    return out


def openings(
    transfers: Iterable[Transfer], stores: tuple[str, ...] = STORES
) -> dict[str, dict[str, int]]:
    """The opening balance of every account the transfers touch, per store."""
    accounts: dict[str, dict[str, int]] = {
        s: {f"h{i}": HOT_OPENING for i in range(HOT_ACCOUNTS)} for s in stores
    }
    for t in transfers:
        accounts[t.src][t.src_key] = OWN_OPENING
        if t.dst_own:
            accounts[t.dst][t.dst_key] = 0
    return accounts
