"""``python -m tests.chaos [--profile short|long|hostile|isolation|isolation-long] [--seed N]
[--report PATH] [--keep]``.

Runs a chaos profile against the services ``infra/services.sh`` started (their
addresses from the ``SAGA_*`` variables, else from ``infra/services.sh env``),
prints the report and writes it as JSON. Exit status 0 when the run passed (no
violation, both negative controls detected, every requirement of the profile
met), 1 when it did not, 2 when it could not run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from tests._infra import local_services, unreachable, unreachable_message
from tests.chaos.iso_runner import ISO_PROFILES, run_isolation
from tests.chaos.runner import DEFAULT_REPORT, PROFILES, run_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    isolation = {f"isolation-{n}" if n != "short" else "isolation": n for n in ISO_PROFILES}
    parser.add_argument("--profile", choices=[*sorted(PROFILES), *isolation], default="short")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT)
    parser.add_argument("--keep", action="store_true", help="keep the topics and store data")
    args = parser.parse_args(argv)
    try:
        services = local_services()
    except pytest.UsageError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    down = unreachable(services)
    if down:
        print(f"chaos: {unreachable_message(down, 'local')}", file=sys.stderr)
        return 2
    if args.profile in isolation:
        path = args.report if args.report != DEFAULT_REPORT else None
        report = run_isolation(
            services, ISO_PROFILES[isolation[args.profile]], seed=args.seed, keep=args.keep,
            **({"report_path": path} if path else {}),
        )  # fmt: skip
        return 0 if report["passed"] else 1
    report = run_profile(
        services, PROFILES[args.profile], seed=args.seed, report_path=args.report, keep=args.keep
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
