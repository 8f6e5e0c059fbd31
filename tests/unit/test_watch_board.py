"""``saga watch`` keeps its counts from the records as they come, not by re-reading the topic."""

from __future__ import annotations

import pytest

from saga.coordinator._cli_client import _Board
from saga.streams import SagaState, SagaStatus

pytestmark = pytest.mark.unit


def _status(tx_id: str, state: SagaState, updated_ms: int) -> SagaStatus:
    return SagaStatus(tx_id, "transfer", state, (), None, 0, updated_ms, 60_000)


def test_a_transaction_moves_between_counts_and_the_first_read_never_wins_over_news() -> None:
    board = _Board()
    board.take(_status("a", SagaState.PENDING, 1))
    board.take(_status("a", SagaState.COMMITTED, 5))
    board.take(_status("a", SagaState.PENDING, 1), older=True)  # the first read, behind
    board.take(_status("b", SagaState.ROLLED_BACK, 3), older=True)
    counts, latest = board.read()
    assert counts == {"committed": 1, "rolled_back": 1}
    assert [s.tx_id for s in latest] == ["a", "b"]


def test_it_keeps_only_the_latest_few_in_full() -> None:
    board = _Board()
    for i in range(1_000):
        board.take(_status(f"tx-{i}", SagaState.COMMITTED, i))
    counts, latest = board.read()
    assert counts == {"committed": 1_000}
    assert [s.tx_id for s in latest] == [f"tx-{i}" for i in range(999, 984, -1)]
    assert len(board._latest) <= 4 * _Board.LATEST
