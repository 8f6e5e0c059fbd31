"""``saga bench --profile DIR``: py-spy records every product process during a main phase.

For each process the bench started (the coordinator, each participant worker) and
for the bench's own client process, one ``py-spy record --format raw`` runs for the
measured window (sampling at :data:`RATE` Hz, ``--nonblocking``: the process is
not paused to be sampled, so it runs at its normal speed). Each writes
``<DIR>/<phase>/<process>.raw``, collapsed stacks (one line per stack: frames
joined by ``;``, then the count), which speedscope (https://www.speedscope.app)
and ``flamegraph.pl`` draw as flame graphs. From them the bench writes
``summary.txt`` next to them: per process, the share of samples per function where
the time is spent (*self*) and, among the product's own functions, under which the
time is spent (*total*).

py-spy samples the Python threads of a process only when they are not idle (it
leaves out threads waiting in a system call), so a process's samples divided by
``RATE`` times the window is roughly the cores its Python threads used;
librdkafka's own threads are not Python threads and do not appear.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from saga.streams import ConfigurationError

RATE: Final = 50
"""Samples per second per process: on the 2-core machine, five recorders at 100 Hz fell
behind and cut the profiled phase's throughput by about two thirds; at 25-50 Hz about
a half. A profiled phase's throughput is therefore not the bench's figure (``make
profile`` writes its own report); what it shows is where the time goes."""
TOP: Final = 15
"""Functions listed per process in the summary."""
_OURS: Final = ("coordinator/", "participants/", "streams/", "saga/tools/")
"""The product's own files: the *total* list names only their functions (the others'
time shows up under the product function that called them)."""
_LOOP_SHARE: Final = 0.9
"""A function on the stack this often is a process's main loop or start-up: not listed."""


def py_spy() -> str:
    """The py-spy executable (next to this Python first: the virtualenv's)."""
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise ConfigurationError(
            "--profile needs py-spy: install it with `pip install py-spy` (it is in the "
            "dev extra: pip install -e '.[dev]')"
        )
    return found


def _file_name(process: str) -> str:
    """``bank#0 (sql)`` -> ``bank-0``; ``client (bench)`` -> ``client``."""
    head = process.split(" (", maxsplit=1)[0]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", head).strip("-") or "process"


class Profiler:
    """One py-spy recorder per process, started together for ``duration`` seconds."""

    def __init__(self, folder: Path, pids: Mapping[str, int], duration: float) -> None:
        self.folder = folder
        self.pids = dict(pids)
        self.duration = duration
        self.exe = py_spy()
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}

    def start(self) -> None:
        """Attach to every process; each recorder stops by itself after ``duration``."""
        self.folder.mkdir(parents=True, exist_ok=True)
        seconds = str(max(1, round(self.duration)))
        for name, pid in self.pids.items():
            out = self.folder / f"{_file_name(name)}.raw"
            err = self.folder / f"{_file_name(name)}.py-spy.log"
            with err.open("wb") as log:
                self.procs[name] = (
                    subprocess.Popen(
                        [
                            *(self.exe, "record", "--pid", str(pid), "--duration", seconds),
                            *("--rate", str(RATE), "--format", "raw", "--output", str(out)),
                            "--nonblocking",
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    ),
                    out,
                    err,
                )

    def finish(self) -> dict[str, Any]:
        """Wait for the recorders; write ``summary.txt``; return what the report keeps."""
        figures: dict[str, Any] = {"folder": str(self.folder), "rate_hz": RATE, "processes": {}}
        lines: list[str] = [
            f"py-spy, {RATE} samples/s per process over {self.duration:g} s "
            "(self: the function was running; total: it was on the stack)",
        ]
        for name, (proc, out, err) in self.procs.items():
            try:
                proc.wait(self.duration + 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            entry: dict[str, Any] = {"file": str(out)}
            if not out.exists():
                problem = err.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                entry["error"] = f"py-spy did not record (see {err}): {problem[0]}"
                figures["processes"][name] = entry
                lines += ["", f"== {name}: {entry['error']}"]
                continue
            selfs, totals, samples = summarise(out.read_text(errors="replace"))
            busy = samples / (RATE * self.duration) if self.duration > 0 else 0.0
            entry.update(
                samples=samples,
                cores_busy=round(busy, 3),
                top_self=[(f, round(n / samples, 4)) for f, n in selfs.most_common(TOP)]
                if samples
                else [],
                top_total=_top_total(totals, samples),
            )
            figures["processes"][name] = entry
            lines += ["", f"== {name}: {samples:,} samples (~{busy:.2f} cores of Python)"]
            lines += [f"  self  {share:6.1%}  {f}" for f, share in entry["top_self"]]
            lines += [f"  total {share:6.1%}  {f}" for f, share in entry["top_total"]]
        summary = self.folder / "summary.txt"
        summary.write_text("\n".join(lines) + "\n")
        figures["summary"] = str(summary)
        return figures


def summarise(raw: str) -> tuple[Counter[str], Counter[str], int]:
    """Collapsed stacks -> samples per leaf function (self), per function on the stack
    (total, each function once per stack) and the number of samples.

    py-spy's raw lines are ``thread;frame;...;frame COUNT`` with the outermost frame
    first; a frame reads ``function (file:line)``. Lines are grouped by function and
    file (the line number dropped), so one function's lines add up.
    """
    selfs: Counter[str] = Counter()
    totals: Counter[str] = Counter()
    samples = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_function(f) for f in stack.split(";") if "(" in f]
        if not frames:
            continue
        samples += n
        selfs[frames[-1]] += n
        for f in set(frames):
            totals[f] += n
    return selfs, totals, samples


def _top_total(totals: Counter[str], samples: int) -> list[tuple[str, float]]:
    """The product's functions most often on the stack, main loops left out."""
    shares = [
        (f, round(n / samples, 4))
        for f, n in totals.most_common()
        if n < _LOOP_SHARE * samples and any(f"({p}" in f for p in _OURS)
    ]
    return shares[:TOP]


def _function(frame: str) -> str:
    """``run (participants/sql/_adapter.py:210)`` -> ``run (participants/sql/_adapter.py)``."""
    return re.sub(r":\d+\)$", ")", frame.strip())
