"""The fault-injection ("chaos") suite: a runner, its workload, fault injectors and checker.

``make chaos-short`` (CI) and ``make chaos`` (the long profile) run it through
pytest (``tests/chaos/test_chaos.py``, marked ``chaos``); ``python -m tests.chaos``
runs a profile directly. See :mod:`tests.chaos.runner`.
"""
