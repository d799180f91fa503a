"""The training program's heavy import: no collections on the way, its objects frozen after."""

from __future__ import annotations

import gc
import importlib
from pathlib import Path

import pytest

from megatron_runs.train import import_frozen


def test_training_loop_is_imported_without_collections_then_frozen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An import that builds 200,000 lasting objects: a plain import collects on the way,
    `import_frozen` does not, and leaves them frozen out of later collections."""
    for name in ("plain_entry", "frozen_entry"):
        (tmp_path / f"{name}.py").write_text("DATA = [[i] for i in range(200_000)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    collections: list[str] = []

    def count(phase: str, info: dict) -> None:
        collections.append(phase)

    gc.callbacks.append(count)
    try:
        importlib.import_module("plain_entry")
        plain = collections.count("start")
        collections.clear()
        frozen_before = gc.get_freeze_count()
        module = import_frozen("frozen_entry")
        during = collections.count("start")
        frozen = gc.get_freeze_count() - frozen_before
        enabled = gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()
    assert len(module.DATA) == 200_000
    assert plain > 0 and during == 0
    assert enabled and frozen >= 200_000
