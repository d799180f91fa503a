"""Alertmanager's configuration, rendered from the environment (`nightwatch alertmanager-config`).

Alertmanager 0.25 (Debian 12's) reads receiver URLs only from its own file, and those URLs are
secrets (a Slack webhook URL is a credential), so the file is rendered at deploy time from
variables rather than kept in the repository. Routing: alerts are grouped per alert and run;
`severity=page` goes to every configured receiver, `severity=ticket` to the generic webhook only
(a chat channel is for what needs a human now). With no receiver configured every alert lands in
`discard`, which the command reports, so a silent deployment is a visible choice.

Each alert rule carries two annotations (dashboards/prometheus/alerts.yml): `runbook` (a path in
this repository, docs/runbooks/) and, where the alert concerns one run, `dashboard` (a Grafana
path with the run selected). The Slack message joins them to `NIGHTWATCH_RUNBOOK_BASE_URL` and
`NIGHTWATCH_GRAFANA_URL`; the generic webhook receives them as they are, beside Alertmanager's
own payload.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

DISCARD = "discard"
WEBHOOK = "webhook"
SLACK = "slack"

#: Variable → field of `AlertRouting`.
ENV = {
    "webhook_url": "NIGHTWATCH_ALERT_WEBHOOK_URL",
    "slack_url": "NIGHTWATCH_ALERT_SLACK_URL",
    "slack_channel": "NIGHTWATCH_ALERT_SLACK_CHANNEL",
    "runbook_base_url": "NIGHTWATCH_RUNBOOK_BASE_URL",
    "grafana_url": "NIGHTWATCH_GRAFANA_URL",
}


@dataclass(frozen=True)
class AlertRouting:
    """Where alerts go. Timings follow Alertmanager's defaults except a shorter first wait."""

    webhook_url: str | None = None
    slack_url: str | None = None
    slack_channel: str = "#nightwatch"
    runbook_base_url: str = ""
    grafana_url: str = "http://127.0.0.1:3000"
    group_wait_s: float = 10.0
    group_interval_s: float = 300.0
    repeat_interval_s: float = 4 * 3600.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AlertRouting:
        env = os.environ if env is None else env
        return cls(**{field: env[var] for field, var in ENV.items() if env.get(var)})

    @property
    def receivers(self) -> tuple[str, ...]:
        """The configured receivers, in routing order."""
        return tuple(name for name, url in ((WEBHOOK, self.webhook_url),
                                            (SLACK, self.slack_url)) if url)  # fmt: skip


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _slack_text(routing: AlertRouting) -> str:
    runbook = routing.runbook_base_url.rstrip("/")
    runbook = f"{runbook}/" if runbook else ""
    grafana = routing.grafana_url.rstrip("/")
    return (
        "{{ range .Alerts }}*{{ .Annotations.summary }}*\n"
        "{{ if .Annotations.description }}{{ .Annotations.description }}\n{{ end }}"
        f"Runbook: {runbook}{{{{ .Annotations.runbook }}}}\n"
        f"{{{{ if .Annotations.dashboard }}}}Dashboard: {grafana}{{{{ .Annotations.dashboard }}}}\n"
        "{{ end }}{{ end }}"
    )


def _receiver(name: str, routing: AlertRouting) -> dict[str, Any]:
    if name == WEBHOOK:
        return {"name": WEBHOOK, "webhook_configs": [
            {"url": routing.webhook_url, "send_resolved": True}]}  # fmt: skip
    if name == SLACK:
        return {
            "name": SLACK,
            "slack_configs": [{
                "api_url": routing.slack_url,
                "channel": routing.slack_channel,
                "send_resolved": True,
                "title": "[{{ .Status | toUpper }}] {{ .CommonLabels.alertname }}"
                         "{{ if .CommonLabels.run_id }} run {{ .CommonLabels.run_id }}{{ end }}",
                "text": _slack_text(routing),
            }],
        }  # fmt: skip
    return {"name": DISCARD}


def _routes(routing: AlertRouting) -> list[dict[str, Any]]:
    """Pages to every receiver, tickets to the webhook; `continue` lets one alert reach several."""
    routes = []
    for name in routing.receivers:
        severities = ["page", "ticket"] if name == WEBHOOK else ["page"]
        routes.append({
            "receiver": name,
            "matchers": [f"severity=~\"{'|'.join(severities)}\""],
            "continue": True,
        })  # fmt: skip
    return routes


def render(routing: AlertRouting) -> dict[str, Any]:
    """The Alertmanager configuration as a mapping (YAML-ready)."""
    return {
        "route": {
            "receiver": DISCARD,
            "group_by": ["alertname", "run_id"],
            "group_wait": _seconds(routing.group_wait_s),
            "group_interval": _seconds(routing.group_interval_s),
            "repeat_interval": _seconds(routing.repeat_interval_s),
            "routes": _routes(routing),
        },
        "receivers": [_receiver(DISCARD, routing)]
        + [_receiver(name, routing) for name in routing.receivers],
    }


def render_yaml(routing: AlertRouting) -> str:
    return yaml.safe_dump(render(routing), sort_keys=False, width=1000)
