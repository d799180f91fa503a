"""The exact reference: a fault-free run that trains what Nightwatch's final model trained.

docs/contracts.md (data order, checkpoints): the samples a step consumes are a pure function
of the data cursor, the global batch and the skip ranges (`megatron_runs.sampling.take_step`),
and a resumed run consumes exactly what a clean run with the same skips would. The model
has no dropout and every reduction sums the same values in the same order, so training is
deterministic: two runs that consume the same samples and apply the same updates log the
same loss at every step, bit for bit (the trainer writes the loss with `json.dumps`, whose
`repr` is the shortest text that reads back as the same double, so the printed values are
equal exactly when the computed ones are).

So the reference is planned from what Nightwatch's final trajectory did (pure):
- its *lineage*: the process groups whose steps the final model carries, each with the step it
  resumed at and the skip ranges it trained with. Adjacent groups are merged when a run with
  the later group's skips consumes, over the earlier group's steps, exactly what that group
  consumed (a skip range that starts past the samples trained so far changes nothing before
  it); the rest become segments of a chained run (`--stop-at-step`, then `--resume-step`),
  so the reference resumes where Nightwatch resumed and nowhere else;
- its *updates*: poisoned data is a property of the samples, so the reference carries the
  spec's `poison_data` faults and meets the poisoned samples Nightwatch trained (a contained
  NaN batch, an unseen spike) exactly as Nightwatch did, and skips those it skipped. A
  skipped update that no poisoned sample explains (a NaN node whose step stayed in the
  history) is re-created with a `nan` poison over that step's samples: the update is thrown
  away the same way (non-finite gradients, `optimizer.step()` returns before touching
  parameters or optimizer state, and the learning rate depends on the step alone), so
  the states after it are equal; only that step's own loss differs (finite on the NaN node,
  NaN from the poison), and `compare_losses` compares such a step by both updates having
  been skipped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.soak.progress import Progress, StepEvent, final_trajectory
from megatron_runs.sampling import normalize_skips, take_step

Skips = tuple[tuple[int, int], ...]


class PlanError(ValueError):
    """Nightwatch's history cannot be replayed: the log and the skips disagree."""


@dataclass(frozen=True)
class Segment:
    """Train from `resume_step` (0: from scratch) to `stop_step` with `skips`."""

    resume_step: int
    stop_step: int
    skips: Skips = ()

    def train_args(self, last: bool) -> list[str]:
        """The training program's CLI for this segment."""
        args = ["--resume-step", str(self.resume_step)] if self.resume_step else []
        for start, end in self.skips:
            args += ["--skip", f"{start}:{end}"]
        return args if last else [*args, "--stop-at-step", str(self.stop_step)]


@dataclass(frozen=True)
class ReferencePlan:
    segments: tuple[Segment, ...]
    #: `spec.faults` for the reference: the spec's data faults plus re-created skipped updates.
    faults: tuple[dict[str, Any], ...] = ()
    emulated_steps: tuple[int, ...] = ()  # steps whose skipped update `faults` re-creates

    def to_dict(self) -> dict[str, Any]:
        return {
            "segments": [{**asdict(s), "skips": [list(r) for r in s.skips]} for s in self.segments],
            "faults": list(self.faults),
            "emulated_steps": list(self.emulated_steps),
        }


def lineage(progress: Progress) -> list[Segment]:
    """The final trajectory as consecutive stretches of one process group each."""
    traj = final_trajectory(progress)
    starts = {s.incarnation: s for s in progress.starts}
    segments: list[Segment] = []
    current: str | None = None
    for expected, step in enumerate(sorted(traj), start=1):
        if step != expected:
            raise PlanError(f"step {expected} is missing from the log")
        inc = traj[step].incarnation
        if inc != current:
            start = starts.get(inc)
            if start is None or start.step != step - 1:
                raise PlanError(
                    f"step {step}: its process group {inc} did not resume at {step - 1}"
                )
            segments.append(Segment(step - 1, step, tuple(map(tuple, start.skips))))
            current = inc
        else:
            segments[-1] = Segment(segments[-1].resume_step, step, segments[-1].skips)
    return segments


def consumed(segments: Sequence[Segment], global_batch: int) -> dict[int, tuple[int, ...]]:
    """The global sample indices each step of a chained run consumes."""
    out: dict[int, tuple[int, ...]] = {}
    cursor = 0
    for seg in segments:
        for step in range(seg.resume_step + 1, seg.stop_step + 1):
            taken = take_step(cursor, global_batch, seg.skips)
            out[step] = taken.indices
            cursor = taken.next_cursor
    return out


def merged(segments: Sequence[Segment], global_batch: int) -> list[Segment]:
    """Fewest segments that consume what `segments` consume, step for step."""
    want = consumed(segments, global_batch)
    out: list[Segment] = []
    for seg in segments:
        if out:
            joined = Segment(out[-1].resume_step, seg.stop_step, seg.skips)
            trial = [*out[:-1], joined]
            if all(want[s] == got for s, got in consumed(trial, global_batch).items()):
                out[-1] = joined
                continue
        out.append(seg)
    return out


def check_cursors(segments: Sequence[Segment], progress: Progress, global_batch: int) -> None:
    """The plan's data cursor must be the one the trainer logged after every step it ran."""
    traj = final_trajectory(progress)
    cursor = 0
    for seg in segments:
        for step in range(seg.resume_step + 1, seg.stop_step + 1):
            cursor = take_step(cursor, global_batch, seg.skips).next_cursor
            logged = traj[step].consumed if step in traj else None
            if logged is not None and logged != cursor:
                raise PlanError(f"step {step}: the trainer's cursor {logged}, the plan's {cursor}")


def _poisoned(indices: Sequence[int], faults: Sequence[Mapping[str, Any]], effect: str) -> bool:
    return any(
        f.get("kind") == "poison_data"
        and f.get("effect") == effect
        and any(f["start_sample"] <= g < f["end_sample"] for g in indices)
        for f in faults
    )


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous half-open ranges covering `indices` (sorted)."""
    out: list[tuple[int, int]] = []
    for g in sorted(indices):
        if out and out[-1][1] == g:
            out[-1] = (out[-1][0], g + 1)
        else:
            out.append((g, g + 1))
    return out


def plan(
    progress: Progress, spec_faults: Sequence[Mapping[str, Any]], global_batch: int
) -> ReferencePlan:
    """The reference for the run that `progress` records (its starts carry their skips)."""
    segments = lineage(progress)
    if not segments:
        raise PlanError("no step was trained")
    check_cursors(segments, progress, global_batch)
    samples = consumed(segments, global_batch)
    data_faults = [dict(f) for f in spec_faults if f.get("kind") == "poison_data"]
    traj = final_trajectory(progress)
    emulated = [
        step
        for step, ev in sorted(traj.items())
        if ev.skipped_update and not _poisoned(samples[step], data_faults, "nan")
    ]
    extra = [
        {"kind": "poison_data", "start_sample": a, "end_sample": b, "effect": "nan"}
        for step in emulated
        for a, b in _runs(samples[step])
    ]
    return ReferencePlan(
        tuple(merged(segments, global_batch)), tuple(data_faults + extra), tuple(emulated)
    )


@dataclass(frozen=True)
class LossMatch:
    """Step-by-step comparison of two final trajectories."""

    compared: int
    mismatches: tuple[tuple[int, float | None, float | None], ...] = field(default=())

    @property
    def equal(self) -> bool:
        return self.compared > 0 and not self.mismatches


def _same(a: StepEvent, b: StepEvent, emulated: bool) -> bool:
    if emulated:  # a NaN node's finite loss, the poison's NaN: both threw the update away
        return a.skipped_update and b.skipped_update
    both_nan = not math.isfinite(a.loss) and not math.isfinite(b.loss)
    return (a.loss == b.loss or both_nan) and a.skipped_update == b.skipped_update


def compare_losses(
    progress: Progress, reference: Progress, emulated: Sequence[int] = ()
) -> LossMatch:
    """Every step of the final trajectory against the reference's, exactly."""
    mine, ref = final_trajectory(progress), final_trajectory(reference)
    bad: list[tuple[int, float | None, float | None]] = []
    for step, ev in sorted(mine.items()):
        other = ref.get(step)
        if other is None or not _same(ev, other, step in emulated):
            bad.append((step, ev.loss, other.loss if other else None))
    return LossMatch(len(mine), tuple(bad))


def normalized(skips: Sequence[Sequence[int]]) -> Skips:
    """Skip ranges as the trainer merges them, as tuples (from JSON lists)."""
    return tuple(normalize_skips([(int(a), int(b)) for a, b in skips]))
