"""Reading JSON-lines logs back (`contracts.logs.json_records`), as a node's shared log holds
them: other output, records behind another rank's torn output, and older record shapes."""

from __future__ import annotations

import json

from contracts.logs import json_records, log_events


def test_records_are_found_behind_torn_output_and_without_ts() -> None:
    step = {"ts": 1.5, "event": "step", "step": 3, "loss": 7.9}
    lines = [
        "W1130 some C++ warning",
        "a traceback cut in the mid" + json.dumps(step),  # another rank's unterminated line
        json.dumps({"event": "injected_hang", "step": 4}),  # a whole line without ts
        '{"ts": 2.0, "event": "step", "step": 5, "loss"',  # torn by a kill
        json.dumps({"ts": 3.0, "level": "info", "msg": "waiting"}),  # no event
    ]
    assert list(json_records(lines)) == [step, {"event": "injected_hang", "step": 4}]
    assert [r["msg"] for r in json_records(lines, "msg")] == ["waiting"]
    assert log_events("\n".join(lines)) == list(json_records(lines))
