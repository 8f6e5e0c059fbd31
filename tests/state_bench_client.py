"""The state bench's client: a ``SagaClient`` with default settings, in a process of its own.

``python -m tests.state_bench_client OLD_TX FOLLOW`` (Kafka and the prefix from the
``SAGA_*`` variables, as ``SagaClient.from_env()`` reads them). It prints one JSON line per
stage on standard output, so the bench can read them and measure the process:

1. ``ready``: the client made and its status reader started (``wait_caught_up``);
2. ``lookup``: the status of ``OLD_TX``, a saga of the history no one sent from here,
   looked up in the status topic on demand;
3. ``sent``: ``FOLLOW`` requests sent (``p`` ids), 1,000 at a time, as a client that
   submits that many (a burst of all at once would add librdkafka's queue of them);
   then it waits for a line on standard input: the bench has published their statuses
   (at a coordinator's pace) and says where the status topic ends;
4. ``followed``: the reader has read to there (every status followed, the latest
   :data:`~coordinator._status_view.STATUSES_KEPT` decoded);
5. ``result_recent`` and ``result_older``: ``result()`` of the last 1,000 (held) and of
   the first 100 (read again, each by its offset).

Each line carries the seconds the stage took and the resident memory after it.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from saga.coordinator import SagaClient
from tests.state_bench_history import request, tx_name


def rss_mb() -> float:
    text = Path("/proc/self/status").read_text()
    kb = int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1))  # type: ignore[union-attr]
    return round(kb / 1024, 1)


def peak_mb() -> float:
    text = Path("/proc/self/status").read_text()
    kb = int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1))  # type: ignore[union-attr]
    return round(kb / 1024, 1)


def stage(name: str, started: float, **more: Any) -> None:
    line = {"stage": name, "s": round(time.monotonic() - started, 2), "rss_mb": rss_mb(), **more}
    print(json.dumps(line), flush=True)


def main() -> None:
    old_tx, follow = sys.argv[1], int(sys.argv[2])
    started = time.monotonic()
    client = SagaClient.from_env()
    try:
        if not client.wait_caught_up(600):
            raise SystemExit("the status reader did not start")
        stage("ready", started)

        started = time.monotonic()
        found = client.status(old_tx)
        stage("lookup", started, state=found.state.value if found else None)

        started = time.monotonic()
        now = int(time.time() * 1000)
        sent = [tx_name(n, "p") for n in range(follow)]
        for first in range(0, len(sent), 1000):  # a steady sender: 1,000 in flight at most
            for tx in sent[first : first + 1000]:
                client.send(request(tx, now, now + 3_600_000), wait_delivery=False)
            client.flush(300)
        stage("sent", started, sent=len(sent))
        # The bench publishes their statuses, then says where the status topic ends.
        ends = {int(p): end for p, end in json.loads(sys.stdin.readline()).items()}

        started = time.monotonic()
        view = client._view
        while any(view._done.get(p, 0) < end for p, end in ends.items()):
            time.sleep(0.1)
        stage("followed", started, followed=len(view._known), decoded=len(view._statuses))

        started = time.monotonic()
        recent = {client.result(tx, timeout=60).state.value for tx in sent[-1000:]}
        stage("result_recent", started, results=1000, states=sorted(recent))
        started = time.monotonic()
        older = {client.result(tx, timeout=60).state.value for tx in sent[:100]}
        stage("result_older", started, results=100, states=sorted(older), peak_mb=peak_mb())
    finally:
        client.close()


if __name__ == "__main__":
    main()
