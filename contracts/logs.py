"""JSON-lines logging carrying run_id / attempt / job_id when the caller knows them.

Pass context with `extra={"run_id": ..., "attempt": ..., "job_id": ...}`. Nothing here ever
formats request headers, so bearer tokens cannot reach a log line. `json_records` reads such
lines back (`log_events`: the trainer's own events in a rank's log).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable, Iterator

CONTEXT_FIELDS = ("run_id", "attempt", "job_id", "method", "path", "status", "duration_ms")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


#: uvicorn's own loggers (start-up, errors, access) in the same JSON lines on stderr: pass as
#: `log_config=` to `uvicorn.run` / `uvicorn.Config`.
UVICORN_LOG_CONFIG: dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "formatter": "json",
            "stream": "ext://sys.stderr",
        }
    },
    "loggers": {
        name: {"handlers": ["stderr"], "level": "INFO", "propagate": False}
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
    },
}


def configure_logging(level: int = logging.INFO) -> None:
    """Send the nightwatch loggers to stderr as JSON lines (idempotent)."""
    root = logging.getLogger("nightwatch")
    if any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    logging.Formatter.converter = time.gmtime


def json_records(lines: Iterable[str], key: str = "event") -> Iterator[dict]:
    """The JSON-lines records among `lines` that carry `key`: other output and torn lines
    skipped. A record opens with `"ts"` (as `JsonFormatter` and the trainer's event log write
    it), so it is found even behind another rank's unterminated output on its line (a node's
    ranks share its log: a C++ warning, a traceback written in pieces); a line that is one
    record without `"ts"` (an older trainer's) is read too."""
    for line in lines:
        if f'"{key}"' not in line:
            continue
        start = line.find('{"ts"')
        if start < 0:
            if not line.startswith("{"):
                continue
            start = 0
        try:
            yield json.loads(line[start:])
        except json.JSONDecodeError:
            continue


def log_events(text: str) -> list[dict]:
    """The trainer's JSON-lines events (`{"event": ...}`) in a rank's log."""
    return list(json_records(text.splitlines()))
