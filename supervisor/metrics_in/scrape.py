"""`ScrapeSource`: the watchdog's metrics scraped from the workers' endpoints directly (the
embedded default when no Prometheus server is configured), parsed by prometheus_client.

A node whose endpoint alone fails is reported beside the view, with how long its answering
peers have stood still, rather than failing the whole view: as `dark_nodes` when its host
answers nothing (frozen, dead, cut off), as `exited_nodes` when the host refuses the
connection (its training processes are gone, the host is not).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from supervisor.metrics_in.samples import (
    NONFINITE_GRADS,
    PRIMARY_MARKER,
    STEP_ENTERED,
    STEP_TIME,
    SampleHistory,
    build_sample,
)
from supervisor.metrics_in.types import MetricSample, MetricsView, RunKey, SourceHealth

log = logging.getLogger("nightwatch.metrics_in")

#: How long a probe waits for an endpoint (`scrape_round`'s `probe`): a training node answers
#: on loopback or its network in milliseconds, and a probe that waited as long as a scrape
#: for a frozen host would hold the tick that asked, and the verdict, that much longer.
PROBE_TIMEOUT_S = 0.5


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


@dataclass
class ScrapeRound:
    """What one scrape of the endpoints of some attempts found, per attempt."""

    #: The sample of the attempt's primary node (run-level values, each node's step time).
    samples: dict[RunKey, MetricSample] = field(default_factory=dict)
    #: Nodes whose own gradients went non-finite (their counter is > 0).
    nonfinite: dict[RunKey, list[str]] = field(default_factory=dict)
    #: Nodes that had begun an earlier step than the attempt's furthest node.
    lagging: dict[RunKey, list[str]] = field(default_factory=dict)
    #: Nodes whose scrape failed while others answered, with how long the scrape took, and
    #: the furthest step those that answered had begun.
    failing: dict[RunKey, dict[str, float]] = field(default_factory=dict)
    peer_steps: dict[RunKey, float] = field(default_factory=dict)
    #: Attempts none of whose endpoints answered.
    down: set[RunKey] = field(default_factory=set)


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

    def _scrape(
        self, target: Target, timeout_s: float | None = None
    ) -> tuple[dict[str, float] | None, float]:
        """The endpoint's values (None when the scrape failed) and how long it took."""
        started = time.monotonic()
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        try:
            resp = self._client.get(f"http://{target.host}:{target.port}/metrics", timeout=timeout)
            resp.raise_for_status()
            return parse_exposition(resp.text), time.monotonic() - started
        except (httpx.HTTPError, ValueError) as exc:
            log.info(
                f"scrape of {target.node} failed: {exc}",
                extra={"run_id": target.run_id, "attempt": target.attempt},
            )
            return None, time.monotonic() - started

    def scrape_round(self, keys: Sequence[RunKey], probe: Collection[RunKey] = ()) -> ScrapeRound:
        """Scrape every registered endpoint of `keys` once (in parallel), those of the `probe`
        attempts with PROBE_TIMEOUT_S."""
        wanted = set(keys)
        targets = [t for t in self.targets() if t.key in wanted]

        def scrape(target: Target) -> tuple[dict[str, float] | None, float]:
            return self._scrape(target, PROBE_TIMEOUT_S if target.key in probe else None)

        with ThreadPoolExecutor(self._parallel) as pool:
            scraped = list(pool.map(scrape, targets))
        t = time.time()
        by_key: dict[RunKey, list[tuple[Target, dict[str, float] | None]]] = {}
        took: dict[Target, float] = {}
        for target, (values, seconds) in zip(targets, scraped, strict=True):
            by_key.setdefault(target.key, []).append((target, values))
            took[target] = seconds
        out = ScrapeRound()
        for key, results in by_key.items():
            ok = [(tg, v) for tg, v in results if v is not None]
            if not ok:
                out.down.add(key)
                continue
            entered = {tg.node: v[STEP_ENTERED] for tg, v in ok if STEP_ENTERED in v}
            furthest = max(entered.values(), default=None)
            if len(ok) < len(results):
                out.failing[key] = {tg.node: took[tg] for tg, v in results if v is None}
                if furthest is not None:
                    out.peer_steps[key] = furthest
            # A node that is not the primary exports its own run-level values; only with every
            # node answering may the first stand in for a primary not yet marked.
            primary = next((v for _, v in ok if PRIMARY_MARKER in v), None)
            if primary is None and key not in out.failing:
                primary = ok[0][1]
            if primary is not None:
                step_time = {tg.node: v[STEP_TIME] for tg, v in ok if STEP_TIME in v}
                out.samples[key] = build_sample(t, primary, step_time)
            out.nonfinite[key] = [tg.node for tg, v in ok if v.get(NONFINITE_GRADS, 0) > 0]
            if furthest is not None:
                out.lagging[key] = [node for node, step in entered.items() if step < furthest]
        return out

    def collect(
        self, keys: Sequence[RunKey], now: float, probe: Collection[RunKey] = ()
    ) -> dict[RunKey, MetricsView]:
        """Scrape every endpoint of `keys` (so `probe` asks nothing more)."""
        scraped = self.scrape_round(keys)
        for key, sample in scraped.samples.items():
            self.history.add(key, sample)
        for key, nodes in scraped.nonfinite.items():
            self.history.add_nonfinite_nodes(key, nodes)
        self.history.set_lagging_nodes(scraped.lagging)
        self.history.set_dark(scraped.failing, scraped.peer_steps, now)
        self.history.forget_except(keys)
        return {
            k: self.history.view(
                k, now, SourceHealth.DOWN if k in scraped.down else SourceHealth.UP
            )
            for k in keys
        }
