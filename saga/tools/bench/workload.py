"""The bench's workload: three-step transfers, an exact share of them designed to fail, at
one isolation level, on every record or on a few hot ones."""

from __future__ import annotations

import math
import random
from fractions import Fraction

from saga.streams import Isolation, Mode, SagaRequest, Step
from saga.streams._lifecycle import wall_clock_ms
from saga.tools.bench.config import MAX_AMOUNT, PARTICIPANTS, account


class Workload:
    """Transfers of three steps; exactly ``fail_share`` of them rejected (a missing key).

    ``hot``: every step addresses one of the first ``hot`` records of its store (the
    hot-record phase), instead of any of the ``accounts``. ``isolation``: the level
    each request asks for.
    """

    def __init__(
        self,
        *,
        accounts: int,
        fail_share: float,
        seed: int,
        tx_prefix: str,
        timeout_s: float,
        isolation: str = "read_committed",
        hot: int | None = None,
    ) -> None:
        self.accounts = min(accounts, hot) if hot else accounts
        self.isolation = Isolation(isolation)
        self.share = Fraction(fail_share).limit_denominator(10_000)
        self.rng = random.Random(seed)
        self.tx_prefix = tx_prefix
        self.timeout_ms = int(timeout_s * 1000)
        self.n = 0
        self.failures = 0

    def next(self) -> tuple[SagaRequest, int, bool]:
        """A request, its amount and whether it is designed to fail."""
        n = self.n
        self.n += 1
        share = self.share
        fails = math.floor((n + 1) * share) > math.floor(n * share)
        rng = self.rng
        amount = rng.randint(1, MAX_AMOUNT)
        keys = [account(rng.randrange(self.accounts)) for _ in PARTICIPANTS]
        if fails:
            keys[self.failures % 3] = f"missing-{n}"
            self.failures += 1
        steps = (
            Step(
                "bank",
                "increment",
                {"target": "accounts", "key": keys[0], "field": "balance", "by": -amount, "min": 0},
            ),
            Step(
                "wallet",
                "increment",
                {"target": "wallets", "key": keys[1], "field": "balance", "by": amount},
            ),
            Step(
                "rewards",
                "increment",
                {"target": "points", "key": keys[2], "field": "points", "by": amount},
            ),
        )
        now = wall_clock_ms()
        request = SagaRequest(
            tx_id=f"{self.tx_prefix}-{n}",
            saga="bench-transfer",
            mode=Mode.PARALLEL,
            steps=steps,
            deadline_ms=now + self.timeout_ms,
            created_ms=now,
            isolation=self.isolation,
        )
        return request, amount, fails
