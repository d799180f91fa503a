"""Metrics in: the only module that speaks PromQL or scrapes workers' /metrics.

Two sources give the watchdog the same thing — a `MetricsView` per (run, attempt) with a
trailing window of samples and an honest health — so detectors cannot tell them apart:

- `PrometheusSource` asks a Prometheus server. Each tick it sends ONE instant query per metric
  for all runs at once, with a range selector (`metric[Δs]`) so the answer holds the raw
  scraped samples with their true scrape timestamps (not re-evaluated values), covering only
  what arrived since the previous tick (the whole trailing window on the first tick).
- `ScrapeSource` scrapes the workers' registered endpoints directly (the embedded default when
  no Prometheus server is configured), parsing with prometheus_client's text parser.

Failures make a view DOWN, old data makes it STALE, no data makes it MISSING: never UP.
A node whose endpoint alone fails is reported beside the view, with how long its answering
peers have stood still, rather than failing the whole view: as `dark_nodes` when its host
answers nothing (frozen, dead, cut off), as `exited_nodes` when the host refuses the
connection (its training processes are gone, the host is not).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from supervisor.report import LossPoint, loss_from_matrix
from supervisor.watchdog.snapshot import DARK_AFTER_S, MetricSample, MetricsView, SourceHealth

log = logging.getLogger("nightwatch.prometheus")

RunKey = tuple[str, int]  # (run_id, attempt)

#: MetricSample field → exposed sample name (docs/contracts.md, "Metrics").
RUN_FIELDS: dict[str, str] = {
    "step": "nightwatch_train_step",
    "last_step_ts": "nightwatch_train_last_step_timestamp_seconds",
    "steps_total": "nightwatch_train_steps_total",
    "target_steps": "nightwatch_train_target_steps",
    "loss": "nightwatch_train_loss",
    "loss_sum": "nightwatch_train_loss_sum",
    "loss_window_max": "nightwatch_train_loss_window_max",
    "loss_window_min": "nightwatch_train_loss_window_min",
    "grad_norm": "nightwatch_train_grad_norm",
    "grad_norm_window_max": "nightwatch_train_grad_norm_window_max",
    "nonfinite_total": "nightwatch_train_nonfinite_steps_total",
    "tokens_total": "nightwatch_train_tokens_total",
    "tokens_per_second": "nightwatch_train_tokens_per_second",
    "samples_consumed": "nightwatch_train_samples_consumed",
    "checkpoint_step": "nightwatch_train_checkpoint_step",
    "checkpoint_ts": "nightwatch_train_checkpoint_last_timestamp_seconds",
    "checkpoint_failures_total": "nightwatch_train_checkpoint_failures_total",
    "replica_checks_total": "nightwatch_train_replica_checks_total",
    "replica_mismatches_total": "nightwatch_train_replica_mismatches_total",
    "up": "nightwatch_train_up",
}
STEP_TIME = "nightwatch_train_step_time_window_avg_seconds"
NONFINITE_GRADS = "nightwatch_train_nonfinite_grads_total"
STEP_ENTERED = "nightwatch_train_step_entered"
#: Only the nodes behind their attempt's furthest node: nothing on most ticks.
LAGGING_QUERY = (
    f"{STEP_ENTERED} < on(run_id, attempt) group_left max by (run_id, attempt) ({STEP_ENTERED})"
)
#: Scrape targets of runs that failed their latest scrape, valued by how long that scrape
#: took (`up` and `scrape_duration_seconds` are Prometheus's own series).
DARK_QUERY = 'scrape_duration_seconds{run_id!=""} and up{run_id!=""} == 0'
#: The furthest step the answering nodes began, only for attempts with a dark node.
PEER_STEP_QUERY = (
    f"max by (run_id, attempt) ({STEP_ENTERED}) and on(run_id, attempt) ({DARK_QUERY})"
)
#: A failed scrape quicker than this was refused: the host answered, but nothing listened
#: (the node's training processes exited, as after a rank crash). A frozen or dead host
#: answers nothing, and its scrape fails at the scrape timeout (1 s and more).
REFUSED_WITHIN_S = 0.25
#: The run-level metrics come from the node that exports this one (global rank 0's).
PRIMARY_MARKER = "nightwatch_train_loss"
#: What the detectors need; PrometheusSource queries only these (one query each).
QUERIED_FIELDS = (
    "step",
    "last_step_ts",
    "loss",
    "loss_window_max",
    "loss_window_min",
    "grad_norm",
    "grad_norm_window_max",
    "nonfinite_total",
    "tokens_per_second",
    "samples_consumed",
    "checkpoint_step",
    "checkpoint_failures_total",
    "replica_mismatches_total",
)
_INT_FIELDS = frozenset({"step", "target_steps", "samples_consumed", "checkpoint_step"})
_NAME_TO_FIELD = {name: f for f, name in RUN_FIELDS.items()}


class MetricSource(Protocol):
    """What the reconciler asks each tick: views for the active (run, attempt) pairs."""

    name: str

    def collect(self, keys: Sequence[RunKey], now: float) -> dict[RunKey, MetricsView]: ...


def build_sample(
    t: float, values: Mapping[str, float], step_time: Mapping[str, float]
) -> MetricSample:
    """A MetricSample from exposed-name → value (unknown names ignored)."""
    fields: dict[str, Any] = {}
    for name, value in values.items():
        field = _NAME_TO_FIELD.get(name)
        if field is None:
            continue
        if field in _INT_FIELDS:
            if not math.isfinite(value):
                continue
            fields[field] = int(value)
        else:
            fields[field] = value
    return MetricSample(t=t, step_time=dict(step_time), **fields)


#: Earlier attempts' samples kept per run as a fresh attempt's loss baseline.
PRIOR_SAMPLES = 256


def _first_step(samples: Iterable[MetricSample]) -> int | None:
    """The first step an attempt completed (placeholders before its first step excluded)."""
    return next((s.step for s in samples if s.step is not None and s.last_step_ts), None)


def _chain(
    prior: Iterable[MetricSample], later: Sequence[MetricSample]
) -> tuple[MetricSample, ...]:
    """One step-ordered history: `prior` below `later`'s first step, then `later` (capped)."""
    first = _first_step(later)
    kept = [s for s in prior if first is None or (s.step is not None and s.step < first)]
    return (*kept, *later)[-PRIOR_SAMPLES:]


class SampleHistory:
    """Trailing window of samples per (run, attempt); the sources' only state.

    Why keep history at all: a scrape is a point, while the spike detector needs a window.
    Losing it (supervisor restart) only delays judgement: an empty window convicts nothing.
    When a run moves to a new attempt, the old attempt's samples become that run's `prior`
    (see `MetricsView.prior`), capped at PRIOR_SAMPLES.
    """

    def __init__(self, window_s: float, stale_after_s: float) -> None:
        self.window_s = window_s
        self.stale_after_s = stale_after_s
        self._samples: dict[RunKey, deque[MetricSample]] = {}
        self._prior: dict[str, tuple[MetricSample, ...]] = {}
        self._nonfinite_nodes: dict[RunKey, frozenset[str]] = {}
        self._lagging_nodes: dict[RunKey, tuple[str, ...]] = {}
        self._dark_since: dict[RunKey, dict[str, float]] = {}
        self._refused: dict[RunKey, frozenset[str]] = {}
        self._peer_step: dict[RunKey, tuple[float, float]] = {}

    def add(self, key: RunKey, sample: MetricSample) -> None:
        buf = self._samples.setdefault(key, deque())
        if buf and sample.t <= buf[-1].t:
            if sample.t == buf[-1].t:
                buf[-1] = sample
            return
        buf.append(sample)

    def add_nonfinite_nodes(self, key: RunKey, nodes: Iterable[str]) -> None:
        """Nodes seen with non-finite local gradients (a counter: once seen, kept)."""
        nodes = frozenset(nodes)
        if nodes:
            self._nonfinite_nodes[key] = self._nonfinite_nodes.get(key, frozenset()) | nodes

    def set_lagging_nodes(self, lagging: Mapping[RunKey, Iterable[str]]) -> None:
        """The nodes behind their peers at this answer (a gauge: replaced every tick)."""
        self._lagging_nodes = {k: tuple(sorted(set(v))) for k, v in lagging.items() if v}

    def set_dark(
        self,
        failing: Mapping[RunKey, Mapping[str, float]],
        peer_steps: Mapping[RunKey, float],
        now: float,
    ) -> None:
        """The nodes whose endpoint failed at this answer, with how long that scrape took
        (failing from the first answer that showed it so until one shows it answering), and
        the furthest step the answering nodes of such an attempt had begun (steady from the
        first answer with that value)."""
        since: dict[RunKey, dict[str, float]] = {}
        for key, nodes in failing.items():
            seen = self._dark_since.get(key, {})
            since[key] = {n: seen.get(n, now) for n in nodes}
        self._dark_since = {k: v for k, v in since.items() if v}
        self._refused = {
            key: frozenset(n for n, s in nodes.items() if s < REFUSED_WITHIN_S)
            for key, nodes in failing.items()
        }
        steps: dict[RunKey, tuple[float, float]] = {}
        for key, step in peer_steps.items():
            seen_step = self._peer_step.get(key)
            steps[key] = seen_step if seen_step and seen_step[0] == step else (step, now)
        self._peer_step = steps

    def _dark(self, key: RunKey, now: float) -> dict[str, Any]:
        """The view's nodes failing their scrapes: dark or exited once they have for
        DARK_AFTER_S, failing before; and how long their peers stood still."""
        since = self._dark_since.get(key, {})
        settled = {n for n, t in since.items() if now - t >= DARK_AFTER_S}
        refused = self._refused.get(key, frozenset())
        peer = self._peer_step.get(key)
        return {
            "dark_nodes": tuple(sorted(settled - refused)),
            "exited_nodes": tuple(sorted(settled & refused)),
            "failing_nodes": tuple(sorted(set(since) - settled)),
            "peers_steady_s": now - peer[1] if settled and peer else None,
        }

    def view(self, key: RunKey, now: float, health: SourceHealth = SourceHealth.UP) -> MetricsView:
        """The key's window; UP only when the source answered and its newest sample is fresh."""
        buf = self._samples.get(key)
        while buf and buf[0].t < now - self.window_s:
            buf.popleft()
        samples = tuple(buf) if buf else ()
        if health is not SourceHealth.UP:
            return MetricsView(health=health, samples=samples)
        if not samples:
            return MetricsView(health=SourceHealth.MISSING)
        if now - samples[-1].t > self.stale_after_s:
            age = now - samples[-1].t
            return MetricsView(
                SourceHealth.STALE,
                samples,
                f"newest sample {age:.1f} s old",
                **self._dark(key, now),
            )
        return MetricsView(
            SourceHealth.UP,
            samples,
            prior=self._prior_below(key[0], samples),
            nonfinite_grad_nodes=tuple(sorted(self._nonfinite_nodes.get(key, ()))),
            lagging_nodes=self._lagging_nodes.get(key, ()),
            **self._dark(key, now),
        )

    def _prior_below(
        self, run_id: str, samples: tuple[MetricSample, ...]
    ) -> tuple[MetricSample, ...]:
        """Earlier attempts' samples at steps below this attempt's first (those above it were
        rolled back or redone, and may be the very fault that caused the restart)."""
        prior = self._prior.get(run_id)
        if not prior:
            return ()
        first = _first_step(samples)
        if first is None:
            return ()
        return tuple(s for s in prior if s.step is not None and s.step < first)

    def newest(self) -> dict[RunKey, float]:
        """Time of the newest sample held per key (what a source need not rebuild)."""
        return {k: buf[-1].t for k, buf in self._samples.items() if buf}

    def forget_except(self, keys: Iterable[RunKey]) -> None:
        """Drop keys no longer watched; a run's superseded attempt becomes its prior."""
        current = dict(keys)
        for key in [k for k in self._nonfinite_nodes if current.get(k[0]) != k[1]]:
            del self._nonfinite_nodes[key]
        for key in [k for k in self._samples if current.get(k[0]) != k[1]]:
            buf = self._samples.pop(key)
            run_id, attempt = key
            if current.get(run_id, 0) > attempt:
                self._prior[run_id] = _chain(self._prior.get(run_id, ()), buf)
        for run_id in [r for r in self._prior if r not in current]:
            del self._prior[run_id]


# --------------------------------------------------------------------------- Prometheus


class PrometheusUnavailable(RuntimeError):
    """The server could not be asked, or answered with an error."""


@dataclass(frozen=True)
class Series:
    labels: Mapping[str, str]
    points: tuple[tuple[float, float], ...]  # (unix time, value)


def parse_series(payload: Mapping[str, Any]) -> list[Series]:
    """Parse an /api/v1/query answer (pure; tested on recorded JSON): a matrix (range
    selectors), or a vector (instant queries), whose series then hold one point each."""
    if payload.get("status") != "success":
        raise PrometheusUnavailable(f"query failed: {payload.get('error', payload)}")
    data = payload.get("data") or {}
    kind = data.get("resultType")
    if kind not in ("matrix", "vector"):
        raise PrometheusUnavailable(f"expected a matrix or a vector, got {kind}")
    try:
        return [
            Series(
                labels=item.get("metric", {}),
                points=tuple(
                    (float(t), float(v))
                    for t, v in (item["values"] if kind == "matrix" else [item["value"]])
                ),
            )
            for item in data.get("result", ())
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise PrometheusUnavailable(f"malformed {kind}: {exc!r}") from exc


def assemble(
    per_metric: Mapping[str, Sequence[Series]],
    keys: Iterable[RunKey],
    after: Mapping[RunKey, float] | None = None,
) -> dict[RunKey, list[MetricSample]]:
    """Join per-metric series into per-run samples newer than `after[key]` (pure).

    Samples of one scrape share its timestamp, so run-level values are joined on the scrape
    times of the primary node (the one exporting the loss); each node's step time is its
    newest value at or before that time. Other nodes' run-level series are ignored.
    """
    wanted = set(keys)
    after = after or {}
    rows: dict[RunKey, dict[float, dict[str, float]]] = {}
    primary: dict[RunKey, str] = {}
    for s in per_metric.get(PRIMARY_MARKER, ()):
        key = _key(s.labels, wanted)
        if key is None or key in primary:
            continue
        primary[key] = s.labels.get("node", "")
        since = after.get(key, -math.inf)
        rows[key] = {t: {PRIMARY_MARKER: v} for t, v in s.points if t > since}
    step_times: dict[RunKey, dict[str, list[tuple[float, float]]]] = {}
    for name, series in per_metric.items():
        if name == PRIMARY_MARKER:
            continue
        for s in series:
            key = _key(s.labels, wanted)
            if key is None or key not in primary:
                continue
            node = s.labels.get("node", "")
            if name == STEP_TIME:
                step_times.setdefault(key, {})[node] = sorted(s.points)
                continue
            if node != primary[key]:
                continue
            by_t = rows[key]
            for t, v in s.points:
                point = by_t.get(t)
                if point is not None:
                    point[name] = v
    out: dict[RunKey, list[MetricSample]] = {}
    for key, by_t in rows.items():
        nodes = step_times.get(key, {})
        samples = []
        for t in sorted(by_t):
            per_node = {}
            for n, pts in nodes.items():
                i = bisect.bisect_right(pts, (t, math.inf))
                if i:
                    per_node[n] = pts[i - 1][1]
            samples.append(build_sample(t, by_t[t], per_node))
        out[key] = samples
    return out


def _nodes_by_key(series: Iterable[Series], wanted: set[RunKey]) -> dict[RunKey, list[str]]:
    """The `node` labels of per-node series, by the watched attempt they belong to."""
    out: dict[RunKey, list[str]] = {}
    for s in series:
        key = _key(s.labels, wanted)
        if key is not None:
            out.setdefault(key, []).append(s.labels.get("node", ""))
    return out


def _failed_scrapes(
    series: Iterable[Series], wanted: set[RunKey]
) -> dict[RunKey, dict[str, float]]:
    """Node → how long its failed scrape took, by the watched attempt it belongs to."""
    out: dict[RunKey, dict[str, float]] = {}
    for s in series:
        key = _key(s.labels, wanted)
        if key is not None and s.points:
            out.setdefault(key, {})[s.labels.get("node", "")] = s.points[-1][1]
    return out


def _key(labels: Mapping[str, str], wanted: set[RunKey]) -> RunKey | None:
    try:
        key = (labels["run_id"], int(labels["attempt"]))
    except (KeyError, ValueError):
        return None
    return key if key in wanted else None


class PrometheusSource:
    """PromQL over HTTP: one query per metric for all runs per tick, retried with tenacity.

    With a `bridge` (a ScrapeSource over the registered endpoints), an attempt that Prometheus
    has not scraped yet is scraped directly: Prometheus passes service-discovery updates to its
    scrape loops at most every 5 s, so a new attempt's first scrape came 1-6 s after its
    endpoint registered, and every restart's recovery (and any fault early in the attempt)
    was seen that much later. The bridged samples go into the same window; once Prometheus
    has the attempt's series the bridge stops for it.
    """

    name = "prometheus"

    def __init__(
        self,
        url: str,
        *,
        window_s: float = 600.0,
        stale_after_s: float = 30.0,
        timeout_s: float = 5.0,
        attempts: int = 2,
        parallel: int = 4,
        client: httpx.Client | None = None,
        bridge: ScrapeSource | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.history = SampleHistory(window_s, stale_after_s)
        self.bridge = bridge
        self._scraped_by_prometheus: set[RunKey] = set()
        # Uncompressed: gzip of a tick's answers (megabytes at 1,000 runs) cost both ends more
        # CPU than the bytes cost the network next to a supervisor.
        self._client = client or httpx.Client(
            timeout=timeout_s, headers={"Accept-Encoding": "identity"}
        )
        self._attempts = attempts
        self._parallel = parallel
        self._last_query_t: float | None = None
        self.last_error: str | None = None
        self.queries = 0

    def close(self) -> None:
        self._client.close()

    def _query(self, promql: str, at: float) -> list[Series]:
        @retry(
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential(multiplier=0.1, max=1.0),
            retry=retry_if_exception_type((httpx.TransportError, PrometheusUnavailable)),
            reraise=True,
        )
        def once() -> list[Series]:
            self.queries += 1
            resp = self._client.get(
                f"{self.url}/api/v1/query", params={"query": promql, "time": f"{at:.3f}"}
            )
            if resp.status_code >= 500:
                raise PrometheusUnavailable(f"HTTP {resp.status_code}")
            return parse_series(resp.json())

        return once()

    def collect(self, keys: Sequence[RunKey], now: float) -> dict[RunKey, MetricsView]:
        """Fetch what arrived since the previous tick; DOWN for every key if a query fails."""
        since = self._last_query_t
        if since is None:
            since = now - self.history.window_s
        span = max(1, math.ceil(now - since + 1))  # overlap one second; duplicates are dropped
        names = [RUN_FIELDS[f] for f in QUERIED_FIELDS] + [STEP_TIME]
        # Only the nodes whose counter moved: an instant query with a filter answers with
        # nothing on a healthy fleet, where a range query would list every node.
        queries = [f"{n}[{span}s]" for n in names]
        queries += [f"{NONFINITE_GRADS} > 0", LAGGING_QUERY, DARK_QUERY, PEER_STEP_QUERY]
        try:
            with ThreadPoolExecutor(self._parallel) as pool:
                *results, nonfinite, lagging, dark, peers = pool.map(
                    lambda q: self._query(q, now), queries
                )
        except (httpx.HTTPError, PrometheusUnavailable, ValueError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning(f"prometheus query failed: {self.last_error}")
            return {k: self.history.view(k, now, SourceHealth.DOWN) for k in keys}
        self.last_error = None
        self._last_query_t = now
        per_metric = dict(zip(names, results, strict=True))
        for key, samples in assemble(per_metric, keys, self.history.newest()).items():
            if samples:
                self._scraped_by_prometheus.add(key)
            for s in samples:
                self.history.add(key, s)
        wanted = set(keys)
        for key, nodes in _nodes_by_key(nonfinite, wanted).items():
            self.history.add_nonfinite_nodes(key, nodes)
        behind = _nodes_by_key(lagging, wanted)
        peer_steps = {
            key: s.points[-1][1]
            for s in peers
            if (key := _key(s.labels, wanted)) is not None and s.points
        }
        self.history.set_dark(_failed_scrapes(dark, wanted), peer_steps, now)
        self._scraped_by_prometheus &= set(keys)
        behind |= self._bridge([k for k in keys if k not in self._scraped_by_prometheus], now)
        self.history.set_lagging_nodes(behind)
        self.history.forget_except(keys)
        return {k: self.history.view(k, now) for k in keys}

    def _bridge(self, unseen: Sequence[RunKey], now: float) -> dict[RunKey, list[str]]:
        """Scrape the attempts Prometheus has not yet; their lagging nodes (a gauge: returned
        for this tick's set, not kept)."""
        if self.bridge is None or not unseen:
            return {}
        behind: dict[RunKey, list[str]] = {}
        for key, view in self.bridge.collect(unseen, now).items():
            if view.health is SourceHealth.UP:
                self.history.add(key, view.samples[-1])
                self.history.add_nonfinite_nodes(key, view.nonfinite_grad_nodes)
                behind[key] = list(view.lagging_nodes)
        return behind


def loss_history(
    url: str, run_id: str, since: float, *, client: httpx.Client | None = None
) -> list[LossPoint]:
    """The run's loss curve since `since` (unix s), for the report (docs/contracts.md, Report).

    Raw scraped samples of `nightwatch_train_step`, `nightwatch_train_loss` and the last-step
    time that marks placeholders (range selectors, so all keep their scrape timestamps)
    joined by `loss_from_matrix`. An
    unreachable or failing Prometheus gives an empty curve: the report then falls back to the
    checkpoints' losses rather than failing.
    """
    span = max(1, math.ceil(time.time() - since))
    own = client or httpx.Client(timeout=10.0)
    try:
        matrices = []
        for name in (RUN_FIELDS["step"], RUN_FIELDS["loss"], RUN_FIELDS["last_step_ts"]):
            payload = own.get(
                f"{url.rstrip('/')}/api/v1/query",
                params={"query": f'{name}{{run_id="{run_id}"}}[{span}s]'},
            ).json()
            parse_series(payload)  # raises PrometheusUnavailable on an error answer
            matrices.append(payload["data"]["result"])
    except (httpx.HTTPError, PrometheusUnavailable, ValueError) as exc:
        log.warning(f"loss history of {run_id} unavailable: {type(exc).__name__}: {exc}")
        return []
    finally:
        if client is None:
            own.close()
    return loss_from_matrix(*matrices)


# --------------------------------------------------------------------------- direct scrape


@dataclass(frozen=True)
class Target:
    """One worker node's registered metrics endpoint."""

    run_id: str
    attempt: int
    node: str
    host: str
    port: int

    @property
    def key(self) -> RunKey:
        return (self.run_id, self.attempt)


def parse_exposition(text: str) -> dict[str, float]:
    """Sample name → value of one endpoint's text exposition (pure)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = s.value
    return out


class ScrapeSource:
    """Scrape the registered worker endpoints directly; one sample per run per tick."""

    name = "scrape"

    def __init__(
        self,
        targets: Callable[[], Sequence[Target]],
        *,
        window_s: float = 600.0,
        stale_after_s: float = 30.0,
        timeout_s: float = 2.0,
        parallel: int = 8,
        client: httpx.Client | None = None,
    ) -> None:
        self.targets = targets
        self.history = SampleHistory(window_s, stale_after_s)
        self._client = client or httpx.Client(timeout=timeout_s)
        self._parallel = parallel

    def close(self) -> None:
        self._client.close()

    def _scrape(self, target: Target) -> tuple[dict[str, float] | None, float]:
        """The endpoint's values (None when the scrape failed) and how long it took."""
        started = time.monotonic()
        try:
            resp = self._client.get(f"http://{target.host}:{target.port}/metrics")
            resp.raise_for_status()
            return parse_exposition(resp.text), time.monotonic() - started
        except (httpx.HTTPError, ValueError) as exc:
            log.info(
                f"scrape of {target.node} failed: {exc}",
                extra={"run_id": target.run_id, "attempt": target.attempt},
            )
            return None, time.monotonic() - started

    def collect(self, keys: Sequence[RunKey], now: float) -> dict[RunKey, MetricsView]:
        wanted = set(keys)
        targets = [t for t in self.targets() if t.key in wanted]
        with ThreadPoolExecutor(self._parallel) as pool:
            scraped = list(pool.map(self._scrape, targets))
        t = time.time()
        by_key: dict[RunKey, list[tuple[Target, dict[str, float] | None]]] = {}
        took: dict[Target, float] = {}
        for target, (values, seconds) in zip(targets, scraped, strict=True):
            by_key.setdefault(target.key, []).append((target, values))
            took[target] = seconds
        failed: set[RunKey] = set()
        behind: dict[RunKey, list[str]] = {}
        dark: dict[RunKey, dict[str, float]] = {}
        peer_steps: dict[RunKey, float] = {}
        for key, results in by_key.items():
            ok = [(tg, v) for tg, v in results if v is not None]
            if not ok:
                failed.add(key)
                continue
            entered = {tg.node: v[STEP_ENTERED] for tg, v in ok if STEP_ENTERED in v}
            furthest = max(entered.values(), default=None)
            if len(ok) < len(results):
                dark[key] = {tg.node: took[tg] for tg, v in results if v is None}
                if furthest is not None:
                    peer_steps[key] = furthest
            # A node that is not the primary exports its own run-level values; only with every
            # node answering may the first stand in for a primary not yet marked.
            primary = next((v for _, v in ok if PRIMARY_MARKER in v), None)
            if primary is None and key not in dark:
                primary = ok[0][1]
            if primary is not None:
                step_time = {tg.node: v[STEP_TIME] for tg, v in ok if STEP_TIME in v}
                self.history.add(key, build_sample(t, primary, step_time))
            self.history.add_nonfinite_nodes(
                key, (tg.node for tg, v in ok if v.get(NONFINITE_GRADS, 0) > 0)
            )
            if furthest is not None:
                behind[key] = [node for node, step in entered.items() if step < furthest]
        self.history.set_lagging_nodes(behind)
        self.history.set_dark(dark, peer_steps, now)
        self.history.forget_except(keys)
        return {
            k: self.history.view(k, now, SourceHealth.DOWN if k in failed else SourceHealth.UP)
            for k in keys
        }
