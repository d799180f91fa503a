"""`megatron_runs.handover`: which stop signal the ranks' summed codes carry, how long they
may train on after it, and when rank 0 says leave."""

from __future__ import annotations

import signal

import pytest

from megatron_runs import handover as h


@pytest.mark.parametrize("world", [1, 2, 7, 4096])
def test_the_summed_codes_say_which_signal_any_rank_saw(world: int) -> None:
    usr2, term = h.signal_code(signal.SIGUSR2, world), h.signal_code(signal.SIGTERM, world)
    assert h.signal_code(0, world) == 0.0
    assert h.signal_seen(0.0, world) == 0
    for n in range(1, world + 1):
        assert h.signal_seen(n * usr2, world) == signal.SIGUSR2
        # TERM outranks USR2 whatever the mix: its kill comes first
        assert h.signal_seen(term + (n - 1) * usr2, world) == signal.SIGTERM
        assert h.signal_seen(n * term, world) == signal.SIGTERM


def test_usr2_gets_the_lead_term_the_grace_anything_else_nothing() -> None:
    assert h.allowed_seconds(signal.SIGUSR2, 60.0, 30.0) == 60.0
    assert h.allowed_seconds(signal.SIGTERM, 60.0, 30.0) == 30.0
    assert h.allowed_seconds(signal.SIGINT, 60.0, 30.0) == 0.0


def test_the_time_to_train_on_keeps_two_saves_two_steps_and_the_margin() -> None:
    assert h.train_on_seconds(60.0, 4.0, 1.0) == 60.0 - 10.0 - h.MARGIN_S
    assert h.train_on_seconds(h.MARGIN_S, 0.0, 0.0) == 0.0
    assert h.train_on_seconds(12.0, 4.0, 1.0) == 0.0  # too little: leave now
    assert h.train_on_seconds(0.0, 0.0, 0.0) == 0.0


def test_rank_0_leaves_at_the_deadline_or_once_the_successor_is_ready() -> None:
    ready = [False]
    watch = h.Handover(lambda: ready[0])
    assert not watch.due(1e9)  # no signal yet: never, whatever the successor says
    watch.begin(100.0, 20.0)
    assert not watch.due(119.9)
    assert watch.due(120.0)
    ready[0] = True
    assert watch.due(100.0)


def test_a_later_signal_only_brings_the_deadline_nearer() -> None:
    watch = h.Handover(None)
    watch.begin(100.0, 40.0)
    watch.begin(110.0, 50.0)
    assert watch.deadline == 140.0
    watch.begin(110.0, 5.0)
    assert watch.deadline == 115.0
    assert not watch.due(114.0) and watch.due(115.0)


def test_leaving_right_after_a_save_trains_its_few_steps_again_instead_of_saving() -> None:
    # an interval save of 12.5 s one step of 0.3 s back: leave on it
    assert h.leave_code(1, 0.3, 12.5) == h.LEAVE_UNSAVED
    assert h.leave_code(41, 0.3, 12.5) == h.LEAVE_UNSAVED  # 12.3 s of steps < 12.5 s
    assert h.leave_code(42, 0.3, 12.5) == h.SAVE_AND_LEAVE
    # a CPU step as long as its save: save
    assert h.leave_code(1, 0.1, 0.1) == h.SAVE_AND_LEAVE
