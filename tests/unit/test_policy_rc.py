"""``make infra-up`` leaves the host's /usr/sbin/policy-rc.d as it was (issue 31, item 6).

``infra/services.sh`` installs Debian packages with their own system services held back
by a policy-rc.d that answers 101; ``infra/policy_rc.sh`` (``with_services_held``) puts
a policy-rc.d the host already had back afterwards, whether the installation worked or
not, and removes its own when there was none. Run here on a temporary path
(``SAGA_POLICY_RC``), with ``as_root`` as a plain call.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests._infra import ROOT

pytestmark = pytest.mark.unit

HOSTS_OWN = "#!/bin/sh\n# the host's own policy\nexit 0\n"


def held(policy: Path, command: str) -> subprocess.CompletedProcess[str]:
    """``with_services_held sh -c COMMAND`` with ``policy`` as the policy-rc.d path."""
    script = (
        'as_root() { "$@"; }; die() { echo "$*" >&2; exit 1; }; '
        "source infra/policy_rc.sh; "
        'with_services_held sh -c "$1"'
    )
    return subprocess.run(
        ["bash", "-c", script, "bash", command],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "SAGA_POLICY_RC": str(policy)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize("works", [True, False])
def test_a_policy_rc_the_host_had_is_held_aside_and_put_back(tmp_path: Path, works: bool) -> None:
    policy = tmp_path / "policy-rc.d"
    policy.write_text(HOSTS_OWN)
    policy.chmod(0o750)
    done = held(policy, f'cat "{policy}"; "{policy}"; echo "answer $?"; exit {0 if works else 7}')
    assert done.returncode == (0 if works else 7), done.stderr
    assert "exit 101" in done.stdout and "answer 101" in done.stdout  # services held back
    assert policy.read_text() == HOSTS_OWN
    assert policy.stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-rc.d"]  # nothing left over


def test_without_a_policy_rc_of_the_host_none_is_left(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    done = held(policy, f'"{policy}"; echo "answer $?"')
    assert done.returncode == 0 and "answer 101" in done.stdout, done.stderr
    assert not policy.exists() and list(tmp_path.iterdir()) == []
