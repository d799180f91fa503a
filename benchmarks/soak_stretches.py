"""Where a chaos soak's time went, fault by fault: each stretch between two faults' steps,
for Nightwatch and for its fault-free reference, as its time beyond its steps at its own pace
(`benchmarks.soak.score.pace_s`, the median 10-step window inside the stretch), the reading
`ettr_vs_reference_local` sums. A stretch is named after the fault at its start, whose
recovery it holds.

Then the 10-step windows of one process group, a stop in one counted as a pace, as their time
beyond the whole run's pace: those that overlap an idle node task's import (a spare's, a
standby successor's or a reserve's node importing the training program at the lowest
priority, `worker.priority`; on the dev cluster beside the training on the same cores) and
the others, for Nightwatch and its reference (which has no idle nodes).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/soak_stretches.py /tmp/soaks/x/<run folder>
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from benchmarks.soak.progress import Progress, parse_lines
from benchmarks.soak.score import pace_s
from contracts.logs import json_records
from worker.priority import IMPORTING_LAST

#: Steps a pace window spans (the soak's `pace_window`).
WINDOW = 10
#: An interval between two step completions longer than this many paces is a stop (a restart,
#: a requeue), not a slow step: longer than a whole pace window, which holds one save.
STOP_PACES = 10


def read_progress(paths: Iterable[Path]) -> Progress:
    lines: list[str] = []
    for path in sorted(paths):
        lines += path.read_text(errors="replace").splitlines()
    return parse_lines(lines)


def stretches(progress: Progress, bounds: Sequence[int]) -> list[float | None]:
    """Each stretch's seconds beyond its steps at its own pace, from the first step on (the
    first stretch leaves out the start-up); None past the run's last step."""
    whole = pace_s(progress, WINDOW)
    out: list[float | None] = []
    if whole is None or not progress.steps:
        return [None] * len(bounds)
    step, t = progress.steps[0].step, progress.steps[0].t
    for bound in bounds:
        reached = progress.first_reaching(bound)
        if reached is None:
            out.append(None)
            continue
        stretch = Progress(steps=[e for e in progress.steps if step < e.step <= bound])
        out.append(reached.t - t - (bound - step) * (pace_s(stretch, WINDOW) or whole))
        step, t = bound, reached.t
    return out


@dataclass(frozen=True)
class Parts:
    """A stretch's excess split three ways: stops (intervals between step completions over
    `STOP_PACES` paces, beyond one pace each), steps trained again (after a rollback or a
    restart, at the pace), and the rest (steps slower than the pace)."""

    stops_s: float
    redone_s: float
    slow_s: float


def parts(progress: Progress, bounds: Sequence[int]) -> list[Parts | None]:
    """`stretches`' excess of each stretch, split into `Parts`."""
    whole = pace_s(progress, WINDOW)
    out: list[Parts | None] = []
    if whole is None or not progress.steps:
        return [None] * len(bounds)
    step, t = progress.steps[0].step, progress.steps[0].t
    for bound, excess in zip(bounds, stretches(progress, bounds), strict=True):
        reached = progress.first_reaching(bound)
        if reached is None or excess is None:
            out.append(None)
            continue
        stretch = Progress(steps=[e for e in progress.steps if step < e.step <= bound])
        pace = pace_s(stretch, WINDOW) or whole
        timed = [e.t for e in progress.steps if t <= e.t <= reached.t]
        gaps = [b - a for a, b in pairwise(timed)]
        stops = sum(g - pace for g in gaps if g > STOP_PACES * pace)
        redone = (len(timed) - 1 - (bound - step)) * pace
        out.append(Parts(stops, redone, excess - stops - redone))
        step, t = bound, reached.t
    return out


def idle_imports(logs: Iterable[Path]) -> list[tuple[float, float]]:
    """(start, end) of each idle node task's import in its log: from its `IMPORTING_LAST`
    line to the next line the task logs (waiting for an order, or ranks it forks)."""
    out = []
    for path in logs:
        start = None
        for rec in json_records(path.read_text(errors="replace").splitlines(), "msg"):
            if str(rec["msg"]).startswith(IMPORTING_LAST):
                start = float(rec["ts"])
            elif start is not None:
                out.append((start, float(rec["ts"])))
                start = None
    return sorted(out)


@dataclass(frozen=True)
class Beside:
    """10-step windows beside an idle import and the others: count and seconds beyond pace."""

    windows: int
    excess_s: float
    other_windows: int
    other_excess_s: float


def beside_imports(progress: Progress, imports: Sequence[tuple[float, float]]) -> Beside | None:
    """The run's 10-step windows of one process group, a stop in one (an interval over
    `STOP_PACES` paces) counted as one pace, beyond the whole run's pace, split by whether
    an import overlaps."""
    whole = pace_s(progress, WINDOW)
    if whole is None:
        return None
    sums = {True: [0, 0.0], False: [0, 0.0]}
    steps = progress.steps
    for i in range(0, len(steps) - WINDOW, WINDOW):
        window = steps[i : i + WINDOW + 1]
        first, last = window[0], window[-1]
        if last.incarnation != first.incarnation or last.step != first.step + WINDOW:
            continue
        gaps = [b.t - a.t for a, b in pairwise(window)]
        seconds = sum(whole if g > STOP_PACES * whole else g for g in gaps)
        beside = any(a < last.t and b > first.t for a, b in imports)
        sums[beside][0] += 1
        sums[beside][1] += seconds - WINDOW * whole
    return Beside(sums[True][0], sums[True][1], sums[False][0], sums[False][1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a soak's run folder (holds result.json)")
    args = parser.parse_args()
    result = json.loads((args.run / "result.json").read_text())
    faults = sorted(result["scores"][0]["faults"], key=lambda f: f["at_step"])
    bounds = [f["at_step"] for f in faults] + [result["scores"][0]["target_steps"]]
    names = ["(start)"] + [f["kind"] for f in faults]
    nightwatch = read_progress(args.run.glob("home/runs/*/logs/a*/*/*_0_log.out"))
    reference = read_progress((args.run / "reference").rglob("*_log.out"))
    head = ("stretch after", "to step", "nightwatch s", "stops", "redone", "slow", "reference s")
    print("{:20s} {:>7s} {:>12s} {:>6s} {:>6s} {:>6s} {:>11s}".format(*head))
    nw_s, ref_s = stretches(nightwatch, bounds), stretches(reference, bounds)
    rows = zip(names, bounds, nw_s, parts(nightwatch, bounds), ref_s, strict=True)
    for name, bound, nw, split, ref in rows:
        split_s = (split.stops_s, split.redone_s, split.slow_s) if split else (None,) * 3
        shown = [f"{v:.1f}" if v is not None else "-" for v in (nw, *split_s, ref)]
        print("{:20s} {:7d} {:>12s} {:>6s} {:>6s} {:>6s} {:>11s}".format(name, bound, *shown))
    imports = idle_imports(args.run.glob("home/runs/*/logs/**/*_log.out"))
    print(f"\nidle node imports: {len(imports)}, {sum(b - a for a, b in imports):.1f} s in all")
    print("{:12s} {:>16s} {:>10s} {:>15s} {:>10s}".format(
        "10-step windows", "beside an import", "beyond s", "the others", "beyond s"))  # fmt: skip
    for system, progress in (("nightwatch", nightwatch), ("reference", reference)):
        split = beside_imports(progress, imports if system == "nightwatch" else [])
        if split is not None:
            row = (system, split.windows, split.excess_s, split.other_windows, split.other_excess_s)
            print("{:12s} {:16d} {:10.1f} {:15d} {:10.1f}".format(*row))


if __name__ == "__main__":
    main()
