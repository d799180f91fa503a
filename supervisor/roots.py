"""Where a spec's paths may point: inside the folders the operator configured.

The spec checks a path's shape (absolute, no `..`, no control characters); only the server
knows where runs may read data and write checkpoints. Here each path is resolved
(`os.path.realpath`, so a symlink cannot lead out) and must lie strictly inside one of its
roots (`Settings.checkpoint_roots`, `Settings.data_roots`; default NIGHTWATCH_HOME). A
checkpoint.dir must also stay clear of `$NIGHTWATCH_HOME/runs`, where the supervisor keeps each
run's logs and default checkpoint folder. Whether another run already uses the folder is the
database's question (`supervisor.store`), asked with the resolved path this returns.
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath

from contracts.spec import RunSpec
from supervisor.layout import Problem
from supervisor.settings import Settings


def overlaps(a: str, b: str) -> bool:
    """The same folder, or one inside the other (both resolved, absolute)."""
    pa, pb = PurePosixPath(a), PurePosixPath(b)
    return pa == pb or pa.is_relative_to(pb) or pb.is_relative_to(pa)


def ancestors(path: str) -> list[str]:
    """Every folder above `path`, nearest first (`/a/b/c` → `/a/b`, `/a`, `/`)."""
    return [str(p) for p in PurePosixPath(path).parents]


def _inside(path: str, roots: list[str]) -> bool:
    return any(PurePosixPath(path).is_relative_to(r) and path != r for r in roots)


def confine(spec: RunSpec, settings: Settings) -> tuple[RunSpec, list[Problem]]:
    """The spec with its paths resolved, and a problem per path outside its roots."""
    problems: list[Problem] = []
    checkpoint, data = spec.checkpoint, spec.data
    ckpt_roots = [os.path.realpath(r) for r in settings.checkpoint_root_dirs]
    data_roots = [os.path.realpath(r) for r in settings.data_root_dirs]
    if checkpoint.dir is not None:
        folder = os.path.realpath(checkpoint.dir)
        runs = os.path.realpath(settings.home / "runs")
        if not _inside(folder, ckpt_roots):
            problems.append(_outside("checkpoint.dir", folder, ckpt_roots))
        elif overlaps(folder, runs):
            problems.append(
                Problem("checkpoint.dir", f"{folder} overlaps {runs}, the supervisor's own")
            )
        checkpoint = checkpoint.model_copy(update={"dir": folder})
    resolved: dict[str, str] = {}
    for name in ("prefix", "tokenizer"):
        value = getattr(data, name)
        if value is not None:
            resolved[name] = os.path.realpath(value)
            if not _inside(resolved[name], data_roots):
                problems.append(_outside(f"data.{name}", resolved[name], data_roots))
    blend = None
    if data.blend is not None:
        blend = []
        for i, part in enumerate(data.blend):
            folder = os.path.realpath(part.prefix)
            if not _inside(folder, data_roots):
                problems.append(_outside(f"data.blend[{i}].prefix", folder, data_roots))
            blend.append(part.model_copy(update={"prefix": folder}))
    data = data.model_copy(update={**resolved, "blend": blend})
    return spec.model_copy(update={"checkpoint": checkpoint, "data": data}), problems


def _outside(field: str, path: str, roots: list[str]) -> Problem:
    return Problem(field, f"{path} is not inside an allowed root ({os.pathsep.join(roots)})")
