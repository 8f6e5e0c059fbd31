"""``python -m coordinator`` runs the saga command line."""

from coordinator.cli import run

run()
