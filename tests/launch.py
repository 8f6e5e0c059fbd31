"""The test suite's own entry point for saga processes: ``python -m tests.launch <args>``.

It runs the ``saga`` command line exactly as installed, except that it reads the
test-only variables the installed command refuses (:mod:`streams._faults`):
``SAGA_FAULTS`` (crash points that SIGKILL the process) and
``SAGA_UNSAFE_TEST_SWITCHES`` (``barrier-off``, ``auto-commit``: the chaos suite's
negative controls). ``tests/`` is not installed, so no deployment can reach them.
Every test that starts a saga process with either variable starts it through here
(``tests._system.Proc``, ``tests.chaos.cluster.Proc``); run from the repository's root.
"""

from __future__ import annotations


def main() -> None:
    from saga.coordinator._cli_common import enable_test_faults
    from saga.coordinator.cli import run
    from saga.streams._faults import faults_from_env

    enable_test_faults(faults_from_env)
    run()


if __name__ == "__main__":
    main()
