"""The console with signing on, through its JSON API (no browser), on real processes.

The console gets the key folder (``SAGA_KEYS_DIR``): it believes only status records
the coordinator signed, so a forged one for a made-up transaction never becomes a
row, and it signs its abort with the ``operator`` key, which the coordinator honours.
A console without the operator's private key shows everything and acts on nothing.
"""

from __future__ import annotations

import shutil
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

from saga.streams import SagaState, SagaStatus, StepProgress, StepStatus, encode
from tests._console import ConsoleApi, bank_system, shop, start_console, stuck_saga
from tests._infra import Services, eventually
from tests._system import SagaSystem

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with bank_system(services, pg_schema[1], tmp_path, signing=["ledger", "shop"]) as made:
        yield made


def test_a_signed_console_skips_forged_statuses_and_signs_its_abort(system: SagaSystem) -> None:
    stuck = stuck_saga(system)
    forged = SagaStatus(
        tx_id="forged-1",
        saga="order",
        state=SagaState.FAILED,
        steps=(StepProgress("ledger", StepStatus.COMPENSATION_FAILED),),
        reason="made up",
        created_ms=1,
        updated_ms=2,
        deadline_ms=3,
    )
    with system.producer() as producer:  # a plain producer: no signature
        producer.produce(system.settings.topics.status, forged.tx_id, encode(forged))
        producer.flush(30)

    _, url = start_console(system, "--operator", "carol")
    api = ConsoleApi(url)
    eventually(lambda: api.state(stuck) == "pending", timeout=60, message="no pending row")
    metrics = eventually(
        lambda: (m := api.get("/api/metrics"))["forged_skipped"] >= 1 and m,
        timeout=60,
        message="the forged status record was not reported",
    )
    assert metrics["actions_disabled"] is None
    assert api.state("forged-1") is None

    answer = api.post(f"/api/sagas/{stuck}/abort", {"reason": "signed abort"})
    # "timeout": the coordinator had not decided within the console's wait (a slow machine).
    assert answer["verdict"] in ("honoured", "timeout"), answer
    shop(system)
    eventually(lambda: api.state(stuck) == "rolled_back", timeout=60, message="not rolled back")
    row = api.get(f"/api/sagas/{stuck}")["saga"]
    assert row["reason"] == "aborted by operator carol (saga console): signed abort"
    [entry] = [
        e for e in api.get(f"/api/sagas/{stuck}/history")["entries"] if e["kind"] == "saga.abort"
    ]
    assert entry["signer"] == "operator", entry


def test_without_the_operator_key_the_console_acts_on_nothing(
    system: SagaSystem, tmp_path: Path
) -> None:
    stuck = stuck_saga(system)
    public_only = tmp_path / "public-keys"
    shutil.copytree(system.keys_dir, public_only)
    (public_only / "operator.key").unlink()  # the public half (<kid>.pub) stays
    system.extra_env["SAGA_KEYS_DIR"] = str(public_only)
    _, url = start_console(system)
    api = ConsoleApi(url)
    eventually(lambda: api.state(stuck) == "pending", timeout=60, message="no pending row")
    assert api.get("/api/metrics")["capabilities"]["abort"] is False
    with pytest.raises(urllib.error.HTTPError) as refused:
        api.post(f"/api/sagas/{stuck}/abort", {"reason": "no key"})
    assert refused.value.code == 403
    assert api.state(stuck) == "pending"
