"""Fixtures shared by the integration tests of this folder."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from saga.streams import KafkaSettings
from tests._infra import Services


@pytest.fixture(scope="module")
def spark(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local Spark session for one test module's audits (``local[2]``, 1 GB driver)."""
    from saga.streams.reconcile import ReconcileConfig
    from saga.streams.reconcile._spark import check_jars, start_spark

    config = ReconcileConfig(
        settings=KafkaSettings(bootstrap=services.kafka_bootstrap),
        out=tmp_path_factory.mktemp("unused"),
        master="local[2]",
        driver_memory="1g",
        shuffle_partitions=4,
    )
    session = start_spark(config, check_jars(services.spark_jars_dir))
    yield session
    session.stop()
