"""``python -m coordinator`` runs the saga command line."""

from saga.coordinator.cli import run

run()
