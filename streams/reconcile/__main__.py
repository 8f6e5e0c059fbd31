"""``python -m streams.reconcile`` (and ``spark-submit streams/reconcile/__main__.py``) run
``saga reconcile``."""

from saga.streams.reconcile.cli import main

main()
