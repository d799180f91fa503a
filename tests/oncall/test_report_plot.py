"""The PNG: written, a real image, and the marked windows actually drawn."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
from matplotlib.image import imread
from report_scenario import scenario

from supervisor.metrics_in import LossPoint
from supervisor.report import build_report, loss_from_checkpoints
from supervisor.report_plot import render_png


def _pixels(path: Path) -> np.ndarray:
    return imread(path)[..., :3]


def test_png_shows_curves_and_marked_windows(tmp_path: Path) -> None:
    out = render_png(build_report(scenario()), tmp_path / "report.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000
    px = _pixels(out)
    assert px.shape[:2] == (550, 1100)
    colours = {tuple(c) for c in (px.reshape(-1, 3) * 20).round().astype(int)}
    assert len(colours) > 50  # lines, shading, text: not a blank canvas
    # the skipped-window hatch is red-tinted and the rollback shading orange-tinted
    reddish = (px[..., 0] > 0.85) & (px[..., 1] < 0.8) & (px[..., 2] < 0.8)
    assert reddish.sum() > 2_000


def test_without_windows_the_shading_is_gone(tmp_path: Path) -> None:
    report = build_report(scenario())
    plain = replace(report, windows=[], incidents=[])
    marked = _pixels(render_png(report, tmp_path / "marked.png"))
    bare = _pixels(render_png(plain, tmp_path / "bare.png"))
    reddish = lambda px: ((px[..., 0] > 0.85) & (px[..., 1] < 0.8) & (px[..., 2] < 0.8)).sum()  # noqa: E731
    assert reddish(marked) > 5 * max(1, reddish(bare))


def test_checkpoint_only_history_still_plots(tmp_path: Path) -> None:
    data = scenario()
    sparse = replace(data, loss=loss_from_checkpoints(data.checkpoints))
    out = render_png(build_report(sparse), tmp_path / "sparse.png")
    assert out.stat().st_size > 10_000


def test_against_wall_time_the_downtime_and_the_incidents_show(tmp_path: Path) -> None:
    report = build_report(scenario())
    wall = render_png(report, tmp_path / "wall.png", x="wall")
    assert wall.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    marked = _pixels(wall)
    bare = _pixels(render_png(replace(report, incidents=[]), tmp_path / "bare.png", x="wall"))
    reddish = lambda px: ((px[..., 0] > 0.85) & (px[..., 1] < 0.8) & (px[..., 2] < 0.8)).sum()  # noqa: E731
    assert reddish(marked) > 5 * max(1, reddish(bare))  # fault → recovery shaded
    # Between the attempts nothing trained: a grey band that the steps plot does not have.
    steps = _pixels(render_png(report, tmp_path / "steps.png"))
    assert _grey(bare) > _grey(steps) + 1_000


def _grey(px: np.ndarray) -> int:
    """Pixels of the light grey a 25 % grey band leaves on white."""
    r, g, b = px[..., 0], px[..., 1], px[..., 2]
    return int(((abs(r - g) < 0.02) & (abs(g - b) < 0.02) & (r > 0.78) & (r < 0.86)).sum())


def test_the_validation_loss_is_drawn_in_purple(tmp_path: Path) -> None:
    data = scenario()
    evals = [LossPoint(s, 6.0 - s / 100, 1, None, "eval") for s in range(5, 45, 5)]
    plain = _pixels(render_png(build_report(data), tmp_path / "plain.png"))
    shown = _pixels(render_png(build_report(replace(data, eval_loss=evals)), tmp_path / "eval.png"))
    purple = lambda px: ((px[..., 0] > 0.45) & (px[..., 0] < 0.7) & (px[..., 1] < 0.5)  # noqa: E731
                         & (px[..., 2] > 0.6)).sum()  # fmt: skip
    assert purple(shown) > 200 + purple(plain)
