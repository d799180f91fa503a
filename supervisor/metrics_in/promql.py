"""`PrometheusSource`: the watchdog's metrics from a Prometheus server, in batched PromQL.

Each tick it sends ONE instant query for every metric of all runs at once, with a range
selector (`{__name__=~"…"}[Δs]`) so the answer holds the raw scraped samples with their true
scrape timestamps (not re-evaluated values), covering only what arrived since the previous tick
(the whole trailing window on the first tick), and one more for the nodes its finders name.
One query is one read of the TSDB: a scrape is in it whole or not at all (Prometheus isolates
queries from half-appended scrapes), where one query per metric could see a scrape's loss and
not yet its step. Failures make a view DOWN, old data makes it STALE, no data makes it
MISSING: never UP. Also the report's loss curve (`loss_history`).
"""

from __future__ import annotations

import bisect
import logging
import math
import re
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from supervisor.metrics_in.samples import (
    NONFINITE_GRADS,
    PRIMARY_MARKER,
    RUN_FIELDS,
    STEP_ENTERED,
    STEP_TIME,
    SampleHistory,
    build_sample,
)
from supervisor.metrics_in.scrape import ScrapeRound, ScrapeSource
from supervisor.metrics_in.types import LossPoint, MetricSample, MetricsView, RunKey, SourceHealth

#: One series of a Prometheus matrix answer, as JSON.
Row = Mapping[str, Any]

log = logging.getLogger("nightwatch.metrics_in")

#: Only the nodes behind their attempt's furthest node: nothing on most ticks.
LAGGING_QUERY = (
    f"{STEP_ENTERED} < on(run_id, attempt) group_left max by (run_id, attempt) ({STEP_ENTERED})"
)
#: Scrape targets of runs that failed their latest scrape, valued by how long that scrape
#: took (`up` and `scrape_duration_seconds` are Prometheus's own series).
DARK_QUERY = 'scrape_duration_seconds{run_id!=""} and up{run_id!=""} == 0'
#: How far back the first failed scrape of a failing node's current streak is looked for
#: (`failing_since`); a streak longer than this counts from here, which only ever delays.
FAILING_LOOKBACK_S = 60
#: What a run id may hold to go into a label regex unescaped (the store's `r-<hex>`).
_PLAIN_ID = re.compile(r"[A-Za-z0-9_-]+")
#: The furthest step the answering nodes began, only for attempts with a dark node.
PEER_STEP_QUERY = (
    f"max by (run_id, attempt) ({STEP_ENTERED}) and on(run_id, attempt) ({DARK_QUERY})"
)
#: What the detectors need; PrometheusSource reads them all in one range query a tick.
QUERIED_FIELDS = (
    "step",
    "last_step_ts",
    "step_gap_max",
    "save_started_ts",
    "loss",
    "loss_window_max",
    "loss_window_min",
    "grad_norm",
    "grad_norm_window_max",
    "nonfinite_total",
    "tokens_per_second",
    "samples_consumed",
    "checkpoint_step",
    "checkpoint_ts",
    "checkpoint_failures_total",
    "replica_mismatches_total",
    "eval_loss",
    "eval_step",
    "eval_resumed_loss",
)
#: The label `FINDERS_QUERY` tags each finder's series with.
FINDER_LABEL = "nw_finder"
#: The instant queries that find nodes, by name: the nodes whose NaN-gradient counter moved
#: (a filter, so a healthy fleet answers with nothing), nodes behind their peers, dark nodes,
#: and the steps their peers began.
FINDERS = {
    "nonfinite": f"{NONFINITE_GRADS} > 0",
    "lagging": LAGGING_QUERY,
    "dark": DARK_QUERY,
    "peers": PEER_STEP_QUERY,
}
#: All finders in one query, each series tagged with its finder's name (`or` keeps them all:
#: the tags differ, so no label sets match).
FINDERS_QUERY = " or ".join(
    f'label_replace({query}, "{FINDER_LABEL}", "{name}", "", "")' for name, query in FINDERS.items()
)


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


def _by_label(
    series: Iterable[Series], label: str, names: Iterable[str]
) -> dict[str, list[Series]]:
    """The series of one answer split by a label's value, for each of `names` (pure)."""
    out: dict[str, list[Series]] = {name: [] for name in names}
    for s in series:
        group = out.get(s.labels.get(label, ""))
        if group is not None:
            group.append(s)
    return out


def failing_since_query(run_ids: Iterable[str]) -> str | None:
    """The raw `up` samples of these runs' targets over FAILING_LOOKBACK_S (None: none)."""
    plain = sorted({r for r in run_ids if _PLAIN_ID.fullmatch(r)})
    if not plain:
        return None
    return f'up{{run_id=~"{"|".join(plain)}"}}[{FAILING_LOOKBACK_S}s]'


def failing_since(
    series: Iterable[Series], failing: Mapping[RunKey, Iterable[str]]
) -> dict[RunKey, dict[str, float]]:
    """Node → the scrape time of the first failure of its current streak (pure): the oldest
    `up == 0` sample after its newest `up == 1`, for the failing nodes whose newest sample
    failed. Timed from Prometheus's own scrapes, not from the tick that first saw them."""
    wanted = {key: set(nodes) for key, nodes in failing.items()}
    keys = set(wanted)
    out: dict[RunKey, dict[str, float]] = {}
    for s in series:
        key = _key(s.labels, keys)
        node = s.labels.get("node", "")
        points = sorted(s.points)
        if key is None or node not in wanted[key] or not points or points[-1][1] != 0:
            continue
        first = points[-1][0]
        for t, v in reversed(points):
            if v != 0:
                break
            first = t
        out.setdefault(key, {})[node] = first
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
    """PromQL over HTTP: two queries a tick for all runs (the metrics, the finders), retried
    with tenacity.

    With a `bridge` (a ScrapeSource over the registered endpoints), an attempt that Prometheus
    has not scraped yet is scraped directly: Prometheus passes service-discovery updates to its
    scrape loops at most every 5 s, so a new attempt's first scrape came 1-6 s after its
    endpoint registered, and every restart's recovery (and any fault early in the attempt)
    was seen that much later. The bridged samples go into the same window; once Prometheus
    has the attempt's series the bridge stops for it. A probed attempt (`collect`'s `probe`:
    its hang limit ran out) is scraped through the bridge too, so its stillness is read when
    the limit ends instead of up to a scrape interval later.
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
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="promql")
        self._last_query_t: float | None = None
        self.last_error: str | None = None
        self.queries = 0

    def close(self) -> None:
        self._pool.shutdown()
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

    def collect(
        self, keys: Sequence[RunKey], now: float, probe: Collection[RunKey] = ()
    ) -> dict[RunKey, MetricsView]:
        """Fetch what arrived since the previous tick, and scrape directly the attempts
        Prometheus has not scraped yet and those in `probe`; DOWN for every key if a query
        fails."""
        since = self._last_query_t
        if since is None:
            since = now - self.history.window_s
        span = max(1, math.ceil(now - since + 1))  # overlap one second; duplicates are dropped
        names = [RUN_FIELDS[f] for f in QUERIED_FIELDS] + [STEP_TIME]
        # Two queries a tick, whatever the metrics: each is a round trip and an evaluation on
        # the server, which cost both ends more than the samples they carry.
        queries = [f'{{__name__=~"{"|".join(names)}"}}[{span}s]', FINDERS_QUERY]
        try:
            scraped, found = self._pool.map(lambda q: self._query(q, now), queries)
        except (httpx.HTTPError, PrometheusUnavailable, ValueError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.warning(f"prometheus query failed: {self.last_error}")
            return {k: self.history.view(k, now, SourceHealth.DOWN) for k in keys}
        self.last_error = None
        self._last_query_t = now
        per_metric = _by_label(scraped, "__name__", names)
        by_finder = _by_label(found, FINDER_LABEL, FINDERS)
        nonfinite, lagging, dark, peers = (by_finder[name] for name in FINDERS)
        for key, samples_of_key in assemble(per_metric, keys, self.history.newest()).items():
            if samples_of_key:
                self._scraped_by_prometheus.add(key)
            for s in samples_of_key:
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
        failed = _failed_scrapes(dark, wanted)
        first_failed = self._failing_since(failed, now)
        self._scraped_by_prometheus &= set(keys)
        unseen = [k for k in keys if k not in self._scraped_by_prometheus]
        bridged = self._bridge(unseen, [k for k in keys if k in probe and k not in unseen])
        if bridged is not None:
            behind |= bridged.lagging
            # A host that froze before Prometheus scraped its attempt fails all the same.
            failed = {**bridged.failing, **failed}
            peer_steps = {**bridged.peer_steps, **peer_steps}
        self.history.set_dark(failed, peer_steps, now, first_failed)
        self.history.set_lagging_nodes(behind)
        self.history.forget_except(keys)
        return {k: self.history.view(k, now) for k in keys}

    def _failing_since(
        self, failed: Mapping[RunKey, Mapping[str, float]], now: float
    ) -> dict[RunKey, dict[str, float]]:
        """When each failing node's streak of failed scrapes began, by Prometheus's scrape
        times (one more query, only on ticks where a node fails; {} if it cannot be asked)."""
        query = failing_since_query(key[0] for key in failed)
        if query is None:
            return {}
        try:
            return failing_since(self._query(query, now), failed)
        except (httpx.HTTPError, PrometheusUnavailable, ValueError) as exc:
            log.warning(f"prometheus query failed: {type(exc).__name__}: {exc}")
            return {}

    def _bridge(self, unseen: Sequence[RunKey], probed: Sequence[RunKey]) -> ScrapeRound | None:
        """Scrape the attempts Prometheus has not yet, and the probed ones (with the probe's
        short timeout); their samples go into the same window (what else the round found,
        the caller merges: lagging nodes are a gauge, replaced every tick, and failing nodes
        go with Prometheus's own)."""
        if self.bridge is None or not (unseen or probed):
            return None
        scraped = self.bridge.scrape_round([*unseen, *probed], probe=probed)
        for key, sample in scraped.samples.items():
            self.history.add(key, sample)
        for key, nodes in scraped.nonfinite.items():
            self.history.add_nonfinite_nodes(key, nodes)
        return scraped


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


def loss_from_matrix(
    step_result: Sequence[Row], loss_result: Sequence[Row], last_step_result: Sequence[Row] = ()
) -> list[LossPoint]:
    """Join Prometheus range-query matrices of `nightwatch_train_step` and `..._loss`.

    Both come from the same scrapes of the same endpoint, so samples pair by (attempt, time).
    Scrapes that saw the same step twice yield one point; non-finite losses are kept out (the
    plot marks NaN incidents from the incident rows instead). A process exports its gauges from
    its start, before its first step: those scrapes (`nightwatch_train_last_step_timestamp_
    seconds` still 0, `last_step_result`) hold a placeholder loss of 0 at the resume step, not
    a measurement, and are left out, as the watchdog leaves them out.
    """
    placeholders = {
        (series["metric"].get("attempt", ""), float(t))
        for series in last_step_result
        for t, v in series["values"]
        if float(v) == 0
    }
    steps: dict[tuple[str, float], int] = {}
    for series in step_result:
        attempt = series["metric"].get("attempt", "")
        for t, v in series["values"]:
            steps[(attempt, float(t))] = int(float(v))
    points: dict[tuple[str, int], LossPoint] = {}
    for series in loss_result:
        attempt = series["metric"].get("attempt", "")
        for t, v in series["values"]:
            step = steps.get((attempt, float(t)))
            loss = float(v)
            if step is None or not math.isfinite(loss) or (attempt, float(t)) in placeholders:
                continue
            points.setdefault(
                (attempt, step),
                LossPoint(step, loss, int(attempt) if attempt.isdigit() else None, float(t)),
            )
    return sorted(points.values(), key=lambda p: (p.t or 0.0, p.step))
