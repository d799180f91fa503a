"""The `nightwatch` command (console script `supervisor.cli:app`).

Each command module registers itself on `app` when imported. To add commands (e.g. `report`,
`demo`), write `supervisor/cli/<name>.py` and add <name> to the import line below.
"""

from supervisor.cli import alerts, data, demo, logs, nodes, report, runs, server  # noqa: F401
from supervisor.cli._app import app

__all__ = ["app"]
