"""I7, isolation: a step whose effect reached its store before its saga's commit, where
the ledgers can tell (docs/architecture.md §9, DESIGN §6 I7).

A participant records each step's isolation level in its ledger entry: under
``read_committed`` the entry's ``before`` is only the level's mark (the record did
not change at apply, there is nothing to restore); under ``none`` it is the plain
before-image. The ledger readers (:mod:`._sources`) turn that into the entry's
``level``. With it the ledgers tell two things the log alone cannot:

* **written without a commit**: a ``read_committed`` step writes its store only when
  its saga's ``commit`` is applied, and its entry turns ``committed`` then. Such an
  entry in a saga whose log has no ``commit`` decision (a rollback, or no decision at
  all) wrote what no commit allowed. Judged once the entry has been quiet for the
  grace period, as I4 is: a decision published after the log's snapshot may have
  reached the participant before its ledger was read.
* **written at apply**: a built-in step of a saga that asked for ``read_committed``
  whose entry has an effect and a plain before-image was applied at level ``none``:
  its store showed the change from apply on, whatever the decision. Only requests
  that say their level are judged so: one without the field is older than it, and
  the participants of its time applied every step at once.

Not judged: ``none`` sagas (their steps write at apply, by choice), custom actions
(a handler gets isolation by holding in ``try`` and writing in ``confirm``, which no
ledger entry shows), entries with an unresolved intent (MongoDB without
transactions), and writers that bypass the product.

A transaction with an I7 finding and no other is classed ``early_effect``; with
another invariant broken too it is a ``violation`` (naming both).
"""

from __future__ import annotations

from typing import Final

__all__ = ["EARLY_EFFECT", "I7", "LEVEL_KEY", "classed", "early_effects", "level_of"]

I7: Final = "I7"
EARLY_EFFECT: Final = "early_effect"
LEVEL_KEY: Final = "saga.isolation"
"""The key of a ``read_committed`` step's before-image mark
(``participants._barrier.ISOLATION_KEY``; a unit test keeps the two equal)."""
_BUILTIN: Final = ("delete", "increment", "insert", "put", "update")
"""The built-in actions (``participants._actions.BUILTIN_ACTIONS``; a unit test keeps
the two equal)."""


def level_of(before: object) -> str:
    """The level a ledger entry's ``before`` records: ``read_committed`` or ``none``
    (as ``participants._barrier.isolation_of`` reads it)."""
    if isinstance(before, dict) and before.get(LEVEL_KEY) == "read_committed":
        return "read_committed"
    return "none"


def early_effects(quiet_ms: int) -> str:
    """SQL: the I7 findings of a transaction row, an array of ``(invariant, reason)``.

    The row has ``ledger`` (its entries, each with ``level``, ``status``, ``effect``,
    ``pending``, ``updated_ms``, ``participant``, ``step``, ``source``), ``req`` (with
    ``isolation``, ``parts`` and ``actions``; NULL when the log has no request) and
    ``outcomes`` (the decisions' outcomes; NULL for a transaction only the ledgers
    know). ``quiet_ms``: entries updated after it are not judged for a missing commit.
    """
    builtin = ", ".join(f"'{a}'" for a in _BUILTIN)
    entries = "coalesce(ledger, array())"
    outcomes = "coalesce(outcomes, array())"
    without_commit = f"""transform(filter({entries}, l -> l.level = 'read_committed'
            AND l.status = 'committed' AND NOT l.pending AND l.updated_ms <= {quiet_ms}
            AND NOT array_contains({outcomes}, 'commit')),
        l -> named_struct('invariant', '{I7}', 'reason', concat('step ', l.step,
            ' (read_committed) was written in ', l.source, ' (participant ', l.participant,
            ', ledger status committed) but the log has ',
            CASE WHEN size({outcomes}) = 0 THEN 'no decision' ELSE 'a rollback decision' END,
            ' for its saga: its effect reached the store without a commit')))"""
    at_apply = f"""transform(filter({entries}, l -> req IS NOT NULL
            AND req.isolation = 'read_committed' AND l.level = 'none' AND l.effect
            AND NOT l.pending
            AND coalesce(try_element_at(req.parts, l.step + 1) = l.participant, false)
            AND coalesce(try_element_at(req.actions, l.step + 1) IN ({builtin}), false)),
        l -> named_struct('invariant', '{I7}', 'reason', concat('step ', l.step,
            ' of a read_committed saga was written in ', l.source, ' at apply (participant ',
            l.participant, ' recorded level none for it, ledger status ', l.status,
            '): readers saw its effect before the commit of its saga')))"""
    return f"concat({without_commit}, {at_apply})"


def classed(findings: str, progress: str) -> str:
    """SQL: a transaction's class from its ``findings`` (all invariants) and ``progress``."""
    return f"""CASE WHEN exists({findings}, f -> f.invariant != '{I7}') THEN 'violation'
        WHEN size({findings}) > 0 THEN '{EARLY_EFFECT}'
        ELSE coalesce({progress}, 'ok') END"""
