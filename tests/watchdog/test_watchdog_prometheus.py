"""Metric sources against a real Prometheus (and real worker-style endpoints) on loopback."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prom_harness import Exporter, PrometheusServer

from contracts.spec import RecoverySpec
from supervisor.metrics_in import (
    DARK_AFTER_S,
    DARK_AFTER_SCRAPES,
    MetricSample,
    MetricsView,
    PrometheusSource,
    PrometheusUnavailable,
    ScrapeSource,
    SourceHealth,
    Target,
)
from supervisor.metrics_in.promql import (
    Series,
    assemble,
    failing_since,
    failing_since_query,
    parse_series,
)
from supervisor.metrics_in.samples import REFUSED_WITHIN_S, SampleHistory
from supervisor.metrics_in.scrape import PROBE_TIMEOUT_S
from supervisor.models import AttemptState
from supervisor.watchdog.detectors import detect_all, detect_nonfinite
from supervisor.watchdog.policy import decide
from supervisor.watchdog.snapshot import (
    Cause,
    FindingKind,
    JobView,
    RemedyKind,
    RunHistory,
    Snapshot,
)

pytestmark = pytest.mark.integration

R1 = ("r1", 1)


class FakeTrainer:
    """Drives two node endpoints like a 2-node run would: steps every `dt` seconds."""

    def __init__(
        self,
        primary: Exporter,
        other: Exporter,
        attempt: int = 1,
        dt: float = 0.1,
        run_id: str = "r1",
    ) -> None:
        self.primary, self.other, self.attempt, self.dt = primary, other, attempt, dt
        self.run_id = run_id
        self.step = 0
        self.nan_from: int | None = None
        self.nan_grads_node: str | None = None  # from nan_from: NaN grads made on this node
        self.hung_node: str | None = None  # steps stop; this node never began the next one
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> FakeTrainer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        a = str(self.attempt)
        n1, n2 = (self.run_id, a, "n1"), (self.run_id, a, "n2")
        while not self._stop.is_set():
            stepping = self.hung_node is None
            self.step += stepping
            bad = self.nan_from is not None and self.step >= self.nan_from
            grads_only = bad and self.nan_grads_node is not None
            loss = math.nan if bad and not grads_only else 3.0 + 5.0 * math.exp(-self.step / 50)
            p = self.primary
            for exp, labels in ((p, n1), (self.other, n2)):
                exp.set("nightwatch_train_step", labels, self.step)
                if stepping:
                    exp.set("nightwatch_train_last_step_timestamp_seconds", labels, time.time())
                exp.set("nightwatch_train_step_time_window_avg_seconds", labels, self.dt)
                exp.set("nightwatch_train_up", labels, 1)
                hung_here = labels[2] == self.hung_node
                exp.set("nightwatch_train_step_entered", labels, self.step + (not hung_here))
                made_nan = grads_only and labels[2] == self.nan_grads_node
                exp.inc("nightwatch_train_nonfinite_grads_total", labels, 1.0 if made_nan else 0.0)
            p.set("nightwatch_train_loss", n1, loss)
            p.set("nightwatch_train_loss_window_max", n1, loss)
            p.set("nightwatch_train_loss_window_min", n1, loss)
            p.set("nightwatch_train_grad_norm", n1, math.nan if bad else 1.0)
            p.set("nightwatch_train_grad_norm_window_max", n1, math.nan if bad else 1.0)
            p.set("nightwatch_train_samples_consumed", n1, self.step * 8)
            p.set("nightwatch_train_tokens_per_second", n1, 1000.0)
            p.set("nightwatch_train_checkpoint_step", n1, (self.step // 50) * 50)
            p.inc("nightwatch_train_nonfinite_steps_total", n1, 1.0 if bad else 0.0)
            time.sleep(self.dt)


@pytest.fixture
def exporters() -> Iterator[tuple[Exporter, Exporter]]:
    e1, e2 = Exporter().start(), Exporter().start()
    yield e1, e2
    e1.stop()
    e2.stop()


@pytest.fixture
def prometheus(tmp_path: Path, exporters: tuple[Exporter, Exporter]) -> Iterator[PrometheusServer]:
    server = PrometheusServer(tmp_path, [e.port for e in exporters])
    server.start()
    yield server
    server.stop()


def _snapshot(key: tuple[str, int], view, now: float) -> Snapshot:  # type: ignore[no-untyped-def]
    job = JobView(health=SourceHealth.UP, state=AttemptState.RUNNING, nodes=("n1", "n2"))
    return Snapshot(key[0], key[1], now, view, job, global_batch_size=8)


def test_prometheus_source_observes_detects_and_reports_down(
    prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter]
) -> None:
    rc = RecoverySpec()
    source = PrometheusSource(prometheus.url, stale_after_s=5.0, window_s=120.0)
    with FakeTrainer(*exporters) as trainer:
        prometheus.wait_for_series('nightwatch_train_step{node="n2"}')
        time.sleep(2.5)
        views = source.collect([R1, ("r9", 1)], time.time())
        # Two queries for all runs, none per run: every metric, and the nodes the finders name.
        assert source.queries == 2
        r1 = views[R1]
        assert r1.health is SourceHealth.UP, r1
        assert views[("r9", 1)].health is SourceHealth.MISSING
        steps = [s.step for s in r1.samples]
        assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] > steps[0]
        latest = r1.samples[-1]
        assert set(latest.step_time) == {"n1", "n2"}
        assert latest.samples_consumed == latest.step * 8  # type: ignore[operator]
        assert detect_all(_snapshot(R1, r1, time.time()), rc) == []

        # NaN from a known step: found within one scrape interval + one tick.
        trainer.nan_from = trainer.step + 2
        injected = time.time()
        finding = None
        while time.time() - injected < 10 and finding is None:
            time.sleep(0.5)
            now = time.time()
            found = detect_nonfinite(_snapshot(R1, source.collect([R1], now)[R1], now), rc)
            finding = found[0] if found else None
        latency = time.time() - injected
        assert finding is not None
        assert finding.last_healthy_step < trainer.nan_from <= finding.first_bad_step  # type: ignore[operator]
        lo, hi = finding.sample_window  # type: ignore[misc]
        assert lo < trainer.nan_from * 8 <= hi
        print(f"\nnonfinite detection latency via Prometheus: {latency:.2f} s")
        # Target: one scrape interval (1 s) + one tick (0.5 s); a loaded CI box gets slack.
        assert latency < 5.0

        # Prometheus stopped: every view DOWN, nothing convicts, no destructive remedy.
        prometheus.stop()
        for _ in range(3):
            now = time.time()
            view = source.collect([R1], now)[R1]
            assert view.health is SourceHealth.DOWN
            snap = _snapshot(R1, view, now)
            assert detect_all(snap, rc) == []
            assert decide(snap, [], RunHistory(), rc).kind is RemedyKind.NONE
        trainer.nan_from = None
        restarted = time.time()
        prometheus.start()
        deadline = restarted + 20  # Prometheus syncs its targets a few seconds after start
        view = source.collect([R1], time.time())[R1]
        while time.time() < deadline and not (
            view.health is SourceHealth.UP and view.samples[-1].t > restarted
        ):
            time.sleep(0.5)
            view = source.collect([R1], time.time())[R1]
        assert view.health is SourceHealth.UP and view.samples[-1].t > restarted


def test_nan_grads_are_pinned_on_the_node_that_made_them(
    prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter]
) -> None:
    """n2 makes NaN gradients (the loss stays finite): its own counter, scraped by Prometheus
    on its own schedule, names it, and the policy excludes n2 at once instead of rolling
    back first."""
    rc = RecoverySpec()
    source = PrometheusSource(prometheus.url, stale_after_s=5.0, window_s=120.0)
    with FakeTrainer(*exporters) as trainer:
        prometheus.wait_for_series('nightwatch_train_step{node="n2"}')
        time.sleep(2.0)
        now = time.time()
        assert detect_all(_snapshot(R1, source.collect([R1], now)[R1], now), rc) == []
        trainer.nan_grads_node = "n2"
        trainer.nan_from = trainer.step + 2
        injected = time.time()
        found: list = []
        while time.time() - injected < 15 and not found:
            time.sleep(0.5)
            now = time.time()
            found = detect_nonfinite(_snapshot(R1, source.collect([R1], now)[R1], now), rc)
        latency = time.time() - injected
    assert found, "no finding"
    (finding,) = found
    assert finding.nodes == ("n2",) and finding.cause is Cause.NODE, finding
    assert finding.last_healthy_step < trainer.nan_from <= finding.first_bad_step  # type: ignore[operator]
    snap = _snapshot(R1, MetricsView(SourceHealth.UP), time.time())
    remedy = decide(snap, found, RunHistory(), rc)
    assert remedy.kind is RemedyKind.EXCLUDE_NODE and remedy.exclude_nodes == ("n2",)
    print(f"\nNaN-making node named via Prometheus in {latency:.2f} s")
    assert latency < 5.0 + rc.nan_attribution_wait_seconds


def test_prometheus_source_keeps_attempts_apart_and_goes_stale(
    prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter]
) -> None:
    source = PrometheusSource(prometheus.url, stale_after_s=3.0, window_s=120.0)
    with FakeTrainer(*exporters, attempt=2):
        prometheus.wait_for_series('nightwatch_train_step{attempt="2"}', count=2)
        time.sleep(1.5)
        views = source.collect([("r1", 1), ("r1", 2)], time.time())
    assert views[("r1", 2)].health is SourceHealth.UP
    assert views[("r1", 1)].health is SourceHealth.MISSING
    # The endpoints vanish: Prometheus marks the series stale, the window stays but is not UP.
    for e in exporters:
        e.stop()
    time.sleep(4.0)
    later = source.collect([("r1", 2)], time.time())[("r1", 2)]
    assert later.health is SourceHealth.STALE
    assert later.samples  # the window is still there, only not trusted


def test_attempt_not_yet_in_prometheus_is_bridged_by_direct_scrapes(
    tmp_path: Path, prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter]
) -> None:
    """A new attempt's endpoints are registered before Prometheus scrapes them (its discovery
    updates come at most every 5 s): the source scrapes them directly meanwhile, into the same
    window, and stops as soon as Prometheus has the attempt's series."""
    e1, e2 = exporters
    lookups: list[int] = []

    def registered() -> list[Target]:
        lookups.append(1)
        return [
            Target("r1", 2, "n1", "127.0.0.1", e1.port),
            Target("r1", 2, "n2", "127.0.0.1", e2.port),
        ]

    blind_dir = tmp_path / "blind"
    blind_dir.mkdir()
    blind = PrometheusServer(blind_dir, [])  # up, but it never scrapes these endpoints
    blind.start()
    try:
        bridged = PrometheusSource(
            blind.url, stale_after_s=5.0, bridge=ScrapeSource(registered, stale_after_s=5.0)
        )
        seeing = PrometheusSource(
            prometheus.url, stale_after_s=5.0, bridge=ScrapeSource(registered, stale_after_s=5.0)
        )
        with FakeTrainer(e1, e2, attempt=2, dt=0.05) as trainer:
            time.sleep(0.3)
            bridged.collect([("r1", 2)], time.time())
            time.sleep(0.3)
            view = bridged.collect([("r1", 2)], time.time())[("r1", 2)]
            assert len(lookups) == 2
            trainer.hung_node = "n1"  # the hang's node, from the direct scrape too
            time.sleep(0.3)
            assert bridged.collect([("r1", 2)], time.time())[("r1", 2)].lagging_nodes == ("n1",)
            trainer.hung_node = None
            lookups.clear()
            prometheus.wait_for_series('nightwatch_train_step{attempt="2"}', count=2)
            time.sleep(1.5)
            seen = seeing.collect([("r1", 2)], time.time())[("r1", 2)]
            assert seen.health is SourceHealth.UP and not lookups  # Prometheus had it
            # A host that froze before Prometheus scraped its attempt: failing from the
            # direct scrape, dark once it has failed long enough (the clock is passed in).
            e2.freeze()
            now = time.time()
            failing = bridged.collect([("r1", 2)], now)[("r1", 2)]
            dark = bridged.collect([("r1", 2)], now + 15)[("r1", 2)]
    finally:
        blind.stop()
    assert view.health is SourceHealth.UP and len(view.samples) == 2
    first, second = view.samples
    assert first.step < second.step and set(second.step_time) == {"n1", "n2"}  # type: ignore[operator]
    assert failing.failing_nodes == ("n2",) and failing.dark_nodes == ()
    assert dark.dark_nodes == ("n2",) and dark.peers_steady_s is not None


def test_scrape_source_reads_endpoints_names_dark_nodes_and_fails_down(
    exporters: tuple[Exporter, Exporter],
) -> None:
    e1, e2 = exporters
    targets = [
        Target("r1", 1, "n1", "127.0.0.1", e1.port),
        Target("r1", 1, "n2", "127.0.0.1", e2.port),
    ]
    source = ScrapeSource(lambda: targets, stale_after_s=5.0)
    with FakeTrainer(e1, e2, dt=0.05):
        time.sleep(0.5)
        first = source.collect([R1, ("r2", 1)], time.time())
        time.sleep(0.5)
        second = source.collect([R1], time.time())[R1]
    assert first[("r2", 1)].health is SourceHealth.MISSING
    assert second.health is SourceHealth.UP and len(second.samples) == 2
    latest = second.samples[-1]
    assert latest.loss is not None and latest.nonfinite_total == 0
    assert set(latest.step_time) == {"n1", "n2"}
    assert second.samples[0].step < latest.step  # type: ignore[operator]
    # n2's host freezes: the primary's values still come, n2 is dark once it has failed
    # every scrape for its dark time (the view's clock is passed in, not slept).
    e2.freeze()
    now = time.time()
    view = source.collect([R1], now)[R1]
    assert view.health is SourceHealth.UP and view.dark_nodes == ()
    assert view.failing_nodes == ("n2",)
    # The frozen host's scrapes take their 2 s timeout, which widens the scrape interval
    # and so the dark time (2 intervals): 15 s is past it. The view is STALE by then (the
    # source's allowance is 5 s), and a STALE view still says which node is dark.
    later = source.collect([R1], now + 15)[R1]
    assert later.dark_after_s < 15 and later.health is SourceHealth.STALE
    assert later.dark_nodes == ("n2",) and later.peers_steady_s is not None
    # n2's processes exit instead: its host refuses the scrape, and n2 is exited, not dark.
    e2.stop()
    gone = source.collect([R1], now + 16)[R1]
    assert gone.exited_nodes == ("n2",) and gone.dark_nodes == ()
    e1.stop()
    down = source.collect([R1], time.time())[R1]
    assert down.health is SourceHealth.DOWN and down.dark_nodes == ()


def test_parse_series_and_assemble_on_recorded_answers() -> None:
    payload = {
        "status": "success",
        "data": {
            "resultType": "matrix",
            "result": [
                {
                    "metric": {"run_id": "r1", "attempt": "1", "node": "n1"},
                    "values": [[100.0, "5"], [101.0, "6"]],
                },
                {
                    "metric": {"run_id": "r1", "attempt": "0", "node": "n1"},
                    "values": [[100.0, "99"]],
                },
            ],
        },
    }
    step = parse_series(payload)
    loss = parse_series(
        {
            "status": "success",
            "data": {
                "resultType": "matrix",
                "result": [
                    {
                        "metric": {"run_id": "r1", "attempt": "1", "node": "n1"},
                        "values": [[100.0, "NaN"], [101.0, "2.5"]],
                    }
                ],
            },
        }
    )
    out = assemble({"nightwatch_train_step": step, "nightwatch_train_loss": loss}, [R1])
    (s1, s2) = out[R1]
    assert (s1.step, s2.step, s2.loss) == (5, 6, 2.5) and math.isnan(s1.loss)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="query failed"):
        parse_series({"status": "error", "error": "bad"})
    vector = {"resultType": "vector", "result": [{"metric": {"node": "n2"}, "value": [9.5, "3"]}]}
    (only,) = parse_series({"status": "success", "data": vector})
    assert only.labels["node"] == "n2" and only.points == ((9.5, 3.0),)
    broken = {"resultType": "vector", "result": [{"metric": {"node": "n2"}}]}
    with pytest.raises(PrometheusUnavailable, match="malformed vector"):
        parse_series({"status": "success", "data": broken})


def test_history_lends_a_superseded_attempt_to_the_next_as_its_prior() -> None:
    """Attempt 1 ran to step 40 and was rolled back to 30: attempt 2's view carries attempt
    1's samples below its first step, and nothing once the run is no longer watched."""
    history = SampleHistory(window_s=600, stale_after_s=30)
    r2 = (R1[0], 2)
    for step in range(1, 41):
        history.add(R1, MetricSample(t=float(step), step=step, loss=5.0, last_step_ts=step))
    history.forget_except([R1])
    assert history.view(R1, 41).prior == ()
    history.forget_except([r2])
    assert history.view(r2, 41).health is SourceHealth.MISSING
    history.add(r2, MetricSample(t=50.0, step=30, loss=4.0, last_step_ts=0))  # not stepped yet
    assert history.view(r2, 51).prior == ()
    history.add(r2, MetricSample(t=51.0, step=31, loss=4.0, last_step_ts=51))
    view = history.view(r2, 52)
    assert [s.step for s in view.prior] == list(range(1, 31))
    assert [s.step for s in view.samples] == [30, 31]
    history.forget_except([])
    history.add(r2, MetricSample(t=60.0, step=32, loss=4.0, last_step_ts=60))
    assert history.view(r2, 61).prior == ()


def test_reconciler_with_prometheus_stopped_takes_no_remedy(
    prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter], tmp_path: Path
) -> None:
    """A healthy run; Prometheus goes away for several ticks and comes back: zero remedies,
    the source reported down meanwhile, and normal service after."""
    from prometheus_client import CollectorRegistry, generate_latest
    from watchdog_fakes import TINY_SPEC, FakeCluster

    from contracts.spec import RunSpec
    from supervisor import store
    from supervisor.db import Database
    from supervisor.models import Action, RunState
    from supervisor.slurm import JobState
    from supervisor.watchdog.reconciler import Reconciler, WatchdogConfig

    db = Database(f"sqlite:///{tmp_path / 'nw.db'}")
    db.upgrade()
    with db.write_session() as s:
        run, _ = store.create_run(s, RunSpec.model_validate(TINY_SPEC))
    cluster = FakeCluster()
    source = PrometheusSource(prometheus.url, stale_after_s=3.0, window_s=120.0)
    rec = Reconciler(
        db,
        cluster,
        source,
        WatchdogConfig(home=tmp_path / "home", tick_seconds=0.5),
        registry=CollectorRegistry(),
    )
    rec.tick()
    cluster.set(cluster.submitted[-1][0], JobState.RUNNING)
    with FakeTrainer(*exporters, dt=0.1, run_id=run.id):
        prometheus.wait_for_series(f'nightwatch_train_step{{run_id="{run.id}"}}', count=2)
        ups = []
        # Prometheus needs a few seconds after (re)start before it scrapes (target sync).
        for phase, seconds in (("before", 3.0), ("down", 4.0), ("after", 20.0)):
            if phase == "down":
                prometheus.stop()
            if phase == "after":
                prometheus.start()
            deadline = time.time() + seconds
            while time.time() < deadline:
                result = rec.tick()
                health = source.history.view((run.id, 1), time.time()).health
                ups.append((phase, result.metrics_up and health is SourceHealth.UP))
                assert result.remedies == {} and result.findings == {}, (phase, result)
                if phase == "after" and ups[-3:] == [("after", True)] * 3:
                    break
                time.sleep(0.5)
        text = generate_latest(rec.registry).decode()
    assert all(up for phase, up in ups if phase == "before")
    assert not any(up for phase, up in ups if phase == "down")
    assert ups[-3:] == [("after", True)] * 3, ups
    assert 'nightwatch_supervisor_source_up{source="prometheus"} 1.0' in text
    with db.session() as s:
        assert store.get_run(s, run.id).state is RunState.RUNNING
        kinds = [a.kind for a in s.query(Action).filter(Action.run_id == run.id)]
    assert kinds == ["submit"]
    db.dispose()


def test_history_keeps_a_node_dark_until_it_answers_and_times_its_peers_stillness() -> None:
    history = SampleHistory(window_s=600, stale_after_s=30)
    history.add(R1, MetricSample(t=100.0, step=7, loss=3.0, last_step_ts=100.0))
    timed_out = {"n1": 1.0}  # the scrape failed at its timeout: the host answered nothing
    history.set_dark({R1: timed_out}, {R1: 8}, now=100.0)
    first = history.view(R1, 100.0 + DARK_AFTER_S / 2)  # one failed scrape
    assert first.dark_nodes == () and first.failing_nodes == ("n1",)
    history.set_dark({R1: timed_out}, {R1: 8}, now=103.0)
    view = history.view(R1, 100.0 + DARK_AFTER_S)
    assert view.dark_nodes == ("n1",) and view.peers_steady_s == DARK_AFTER_S
    assert view.failing_nodes == () and view.exited_nodes == ()
    history.set_dark({R1: timed_out}, {R1: 9}, now=106.0)  # the peers began a step
    assert history.view(R1, 107.0).peers_steady_s == 1.0
    # Stale with the dark node: the view keeps saying which node and for how long.
    stale = history.view(R1, 140.0)
    assert stale.health is SourceHealth.STALE and stale.dark_nodes == ("n1",)
    history.set_dark({}, {}, now=141.0)  # it answered: dark again only after a fresh spell
    assert history.view(R1, 142.0).dark_nodes == ()
    history.set_dark({R1: timed_out}, {R1: 9}, now=143.0)
    assert history.view(R1, 144.0).dark_nodes == ()


def test_a_node_is_dark_after_two_of_its_scrape_intervals() -> None:
    """Dark after DARK_AFTER_SCRAPES scrape intervals (the median gap between the attempt's
    samples), at least DARK_AFTER_S: a fixed 5 s was five failed scrapes at 1 s, while at a
    15 s interval one timed-out scrape of a busy exporter made a host dark. The view says
    when the failing node will settle (the reconciler's tick is due then)."""
    for interval in (1.0, 15.0):
        history = SampleHistory(window_s=600, stale_after_s=300)
        for i in range(10):
            history.add(R1, MetricSample(t=100.0 + i * interval, step=i, last_step_ts=100.0))
        start = 100.0 + 10 * interval
        history.set_dark({R1: {"n1": 1.0}}, {R1: 9}, now=start)
        after = max(DARK_AFTER_S, DARK_AFTER_SCRAPES * interval)
        assert after == (DARK_AFTER_S if interval == 1.0 else 30.0)
        failing = history.view(R1, start + after - 0.01)
        assert failing.failing_nodes == ("n1",) and failing.dark_nodes == ()
        assert failing.dark_after_s == after and failing.dark_settles_at == start + after
        settled = history.view(R1, start + after)
        assert settled.dark_nodes == ("n1",) and settled.dark_settles_at is None


def test_history_tells_a_refused_endpoint_from_a_silent_host() -> None:
    """A scrape refused within REFUSED_WITHIN_S: the host is up and its processes are gone
    (exited), not dark; the node whose scrape timed out beside it is dark."""
    history = SampleHistory(window_s=600, stale_after_s=30)
    history.add(R1, MetricSample(t=100.0, step=7, loss=3.0, last_step_ts=100.0))
    failing = {"n1": REFUSED_WITHIN_S / 10, "n2": 1.0}
    history.set_dark({R1: failing}, {R1: 8}, now=100.0)
    view = history.view(R1, 100.0 + DARK_AFTER_S)
    assert view.exited_nodes == ("n1",) and view.dark_nodes == ("n2",)
    assert view.peers_steady_s == DARK_AFTER_S


@pytest.fixture
def labelled_prometheus(
    tmp_path: Path, exporters: tuple[Exporter, Exporter]
) -> Iterator[PrometheusServer]:
    """Targets labelled as the supervisor's service discovery labels them: `up` says which
    run, attempt and node an endpoint is."""
    labels = [{"run_id": R1[0], "attempt": str(R1[1]), "node": n} for n in ("n1", "n2")]
    server = PrometheusServer(tmp_path, [e.port for e in exporters], labels=labels)
    server.start()
    yield server
    server.stop()


def _hang_after(source: PrometheusSource, rc: RecoverySpec, within_s: float) -> list:
    """Hang findings from ticks every 0.5 s until one comes or `within_s` passes."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = time.time()
        found = detect_all(_snapshot(R1, source.collect([R1], now)[R1], now), rc)
        hangs = [f for f in found if f.kind is FindingKind.HANG]
        if hangs:
            return hangs
    return []


def _watching_up(server: PrometheusServer) -> PrometheusSource:
    """A source over `server` once both nodes' series are in and the run reads UP."""
    source = PrometheusSource(server.url, stale_after_s=2.0, window_s=120.0)
    server.wait_for_series('nightwatch_train_step_entered{node="n2"}')
    time.sleep(1.5)
    assert source.collect([R1], time.time())[R1].health is SourceHealth.UP
    return source


def test_prometheus_source_blames_a_host_gone_dark_while_its_peers_wait(
    labelled_prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter]
) -> None:
    """n1 exports the run's metrics. Its endpoint goes dark: while n2 still begins steps that
    is a dead exporter, not a hang; once n2 stands still too it is a hang on n1, found from a
    STALE view, and the policy excludes n1 (SLURM would say so only after its node timeout)."""
    rc = RecoverySpec(hang_floor_seconds=6.0)
    e1, _ = exporters
    with FakeTrainer(*exporters) as trainer:
        source = _watching_up(labelled_prometheus)
        e1.freeze()
        assert _hang_after(source, rc, within_s=rc.hang_floor_seconds + DARK_AFTER_S + 3) == []
        trainer.hung_node = "n1"
        stopped = time.monotonic()
        (hang,) = _hang_after(source, rc, within_s=20)
        found_s = time.monotonic() - stopped
    assert hang.nodes == ("n1",) and hang.cause is Cause.NODE, hang
    assert "n1 went dark" in hang.summary
    snap = _snapshot(R1, source.collect([R1], time.time())[R1], time.time())
    assert snap.metrics.health is SourceHealth.STALE
    remedy = decide(snap, [hang], RunHistory(), rc)
    assert remedy.kind is RemedyKind.EXCLUDE_NODE and remedy.exclude_nodes == ("n1",)
    print(f"\nhang on a dark node found {found_s:.1f} s after its peers stood still")


def test_prometheus_source_times_a_failing_node_from_its_first_failed_scrape(
    labelled_prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter]
) -> None:
    """A node's failing streak counts from Prometheus's first failed scrape of it, not from
    the tick that first saw it: the first tick 5 s after the freeze finds n1 already dark
    (2 scrape intervals of 1 s), where counting from that tick would wait 2 s more."""
    e1, _ = exporters
    with FakeTrainer(*exporters):
        source = _watching_up(labelled_prometheus)
        e1.freeze()
        time.sleep(5.0)
        view = source.collect([R1], time.time())[R1]
    assert view.dark_nodes == ("n1",) and view.failing_nodes == ()


def test_failing_since_is_the_first_failed_scrape_of_the_current_streak() -> None:
    """From raw `up` samples: the oldest 0 after the newest 1; a node answering at its newest
    scrape, or not asked about, has no streak."""

    def up(run_id: str, node: str, *points: tuple[float, float]) -> Series:
        return Series({"run_id": run_id, "attempt": "1", "node": node}, points)

    series = [
        up("r1", "n1", (10, 1), (11, 0), (12, 1), (13, 0), (14, 0)),
        up("r1", "n2", (10, 0), (11, 0), (12, 1)),
        up("r1", "n3", (12, 0), (13, 0)),
        up("r2", "n1", (12, 0)),
    ]
    failing = {R1: ("n1", "n2", "n3")}
    assert failing_since(series, failing) == {R1: {"n1": 13, "n3": 12}}
    assert failing_since_query(["r1", "r-0a"]) == 'up{run_id=~"r-0a|r1"}[60s]'
    assert failing_since_query(['r1"} or vector(1) #']) is None  # never into PromQL


def test_prometheus_source_restarts_a_hang_whose_node_processes_exited(
    labelled_prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter]
) -> None:
    """n1 exports the run's metrics, and its processes exit (a crashed rank whose local peer
    failed after it): its host refuses the scrape. n2 waits in the collective for good. That
    is a hang, found from a STALE view, but no node's fault: the remedy is a restart, and the
    exclusion budget is kept for hosts that do go silent."""
    rc = RecoverySpec(hang_floor_seconds=4.0)
    e1, _ = exporters
    with FakeTrainer(*exporters) as trainer:
        source = _watching_up(labelled_prometheus)
        e1.stop()
        trainer.hung_node = "n1"
        (hang,) = _hang_after(source, rc, within_s=20)
    assert hang.cause is Cause.UNKNOWN and hang.nodes == (), hang
    assert hang.evidence["exited_nodes"] == ["n1"] and hang.evidence["dark_nodes"] == []
    snap = _snapshot(R1, source.collect([R1], time.time())[R1], time.time())
    assert snap.metrics.health is SourceHealth.STALE
    assert decide(snap, [hang], RunHistory(), rc).kind is RemedyKind.RESTART


def test_prometheus_source_names_the_node_that_never_began_the_step(
    prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter]
) -> None:
    """A hang on n2: n1 began the next step and waits in its collective, n2 never began it.
    The source names n2 (one instant query for the whole fleet), and the hang finding with it."""
    rc = RecoverySpec(hang_floor_seconds=1.0)
    source = PrometheusSource(prometheus.url, stale_after_s=5.0, window_s=120.0)
    with FakeTrainer(*exporters) as trainer:
        prometheus.wait_for_series('nightwatch_train_step_entered{node="n2"}')
        time.sleep(1.5)
        trainer.hung_node = "n2"
        deadline = time.monotonic() + 20
        while True:
            now = time.time()
            view = source.collect([R1], now)[R1]
            if view.lagging_nodes and now - (view.samples[-1].last_step_ts or now) > 2.0:
                break
            assert time.monotonic() < deadline, view.lagging_nodes
            time.sleep(0.5)
    assert view.lagging_nodes == ("n2",)
    (hang,) = [f for f in detect_all(_snapshot(R1, view, now), rc) if f.kind is FindingKind.HANG]
    assert hang.nodes == ("n2",) and "n2 never began it" in hang.summary


def test_a_probe_reads_a_stall_from_the_endpoints_before_the_next_scrape(
    prometheus: PrometheusServer, exporters: tuple[Exporter, Exporter]
) -> None:
    """A hang's limit runs out between two of Prometheus's scrapes. Probed, the source reads
    the attempt's endpoints at once: the view's newest sample is the probe's (taken after
    the call began, so later than any scrape Prometheus holds), it names the node that never
    began the step, and the hang finding follows with it."""
    e1, e2 = exporters

    def registered() -> list[Target]:
        return [
            Target("r1", 1, "n1", "127.0.0.1", e1.port),
            Target("r1", 1, "n2", "127.0.0.1", e2.port),
        ]

    rc = RecoverySpec(hang_floor_seconds=0.1, hang_factor=2.0)  # limit: 2 steps of 0.1 s
    source = PrometheusSource(
        prometheus.url, stale_after_s=5.0, bridge=ScrapeSource(registered, stale_after_s=5.0)
    )
    with FakeTrainer(*exporters) as trainer:
        prometheus.wait_for_series('nightwatch_train_step_entered{node="n2"}')
        time.sleep(1.5)
        assert source.collect([R1], time.time())[R1].health is SourceHealth.UP
        trainer.hung_node = "n2"
        time.sleep(0.5)
        asked = time.time()
        view = source.collect([R1], asked, probe=[R1])[R1]
    newest = view.samples[-1]
    assert newest.t >= asked and view.lagging_nodes == ("n2",)
    (hang,) = [f for f in detect_all(_snapshot(R1, view, asked), rc) if f.kind is FindingKind.HANG]
    assert hang.nodes == ("n2",)


def test_a_probe_waits_less_for_an_endpoint_than_a_scrape() -> None:
    """A probe's requests carry PROBE_TIMEOUT_S (a frozen host must not hold the tick for a
    scrape's timeout), the other attempts' the client's own."""
    asked: dict[int, float] = {}

    def answer(request: httpx.Request) -> httpx.Response:
        asked[request.url.port] = request.extensions["timeout"]["read"]  # type: ignore[index]
        return httpx.Response(200, text="nightwatch_train_step 1\n")

    client = httpx.Client(transport=httpx.MockTransport(answer), timeout=2.0)
    targets = [Target("r1", 1, "n1", "127.0.0.1", 9001), Target("r2", 1, "n1", "127.0.0.1", 9002)]
    ScrapeSource(lambda: targets, client=client).scrape_round([R1, ("r2", 1)], probe=[R1])
    assert asked == {9001: PROBE_TIMEOUT_S, 9002: 2.0}
