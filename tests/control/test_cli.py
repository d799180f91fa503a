"""The `nightwatch` CLI: local commands against a temp NIGHTWATCH_HOME, API commands against a
real server; errors are one line with a non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from supervisor import store
from supervisor.cli import app
from supervisor.db import Database
from supervisor.models import EventKind, RunState

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
runner = CliRunner()


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return runner.invoke(app, list(args), env=env, catch_exceptions=False)


def one_line_error(result: Any) -> str:
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("name", ["tiny-cpu", "gpt-1.3b-4gpu", "llama-8b-32gpu"])
def test_validate_examples(name: str) -> None:
    result = invoke("validate", str(EXAMPLES / f"{name}.yaml"))
    assert result.exit_code == 0, result.output
    assert "tokens / step" in result.stdout


def test_submit_dry_run_shows_the_gpu_request_and_submits_nothing() -> None:
    result = invoke("submit", "--dry-run", str(EXAMPLES / "gpt-1.3b-4gpu.yaml"))
    assert result.exit_code == 0, result.output
    assert "#   gpus_per_node = 4" in result.stdout
    assert "#SBATCH --gpus-per-node=4" in result.stdout.splitlines()
    assert "-m submitit.core._submit" in result.stdout
    cpu = invoke("submit", "--dry-run", str(EXAMPLES / "tiny-cpu.yaml"))
    assert cpu.exit_code == 0 and "--gpus-per-node" not in cpu.stdout
    preview = json.loads(
        invoke("submit", "--dry-run", "--json", str(EXAMPLES / "gpt-1.3b-4gpu.yaml")).stdout
    )
    assert preview["parameters"]["gpus_per_node"] == 4
    assert "#SBATCH --gpus-per-node=4" in preview["script"].splitlines()


def test_validate_reports_the_8b_worked_example() -> None:
    result = invoke("validate", "--json", str(EXAMPLES / "llama-8b-32gpu.yaml"))
    report = json.loads(result.stdout)
    assert report["tokens_per_step"] == 131_072 and report["ok"]


def test_validate_rejects_bad_layouts_and_bad_files(tmp_path: Path) -> None:
    spec = (EXAMPLES / "tiny-cpu.yaml").read_text().replace("tensor: 2", "tensor: 3")
    (tmp_path / "bad.yaml").write_text(spec)
    result = invoke("validate", str(tmp_path / "bad.yaml"))
    assert result.exit_code == 1
    assert "error: resources: nodes × gpus_per_node = 1 × 4 = 4 GPUs" in result.stdout

    (tmp_path / "typo.yaml").write_text(spec.replace("num_layers", "num_layer"))
    line = one_line_error(invoke("validate", str(tmp_path / "typo.yaml")))
    assert "model.num_layers: Field required" in line and "model.num_layer:" in line
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    assert "broken.yaml" in one_line_error(invoke("validate", str(tmp_path / "broken.yaml")))
    assert "No such file" in one_line_error(invoke("validate", str(tmp_path / "nope.yaml")))


def test_db_upgrade_and_token_create_work_locally(tmp_path: Path) -> None:
    env = {"NIGHTWATCH_HOME": str(tmp_path / "home"), "NIGHTWATCH_DATABASE_URL": ""}
    result = invoke("db", "upgrade", env=env)
    assert result.exit_code == 0 and "up to date" in result.stdout
    assert (tmp_path / "home" / "nightwatch.db").exists()
    created = invoke("token", "create", "--name", "ci", "--scope", "submit", env=env)
    assert created.exit_code == 0
    secret = created.stdout.strip()
    assert secret.startswith("nw_") and "\n" not in secret
    assert "shown only once" in created.stderr and secret not in created.stderr
    db = Database(f"sqlite:///{tmp_path / 'home' / 'nightwatch.db'}")
    with db.session() as s:
        token = store.token_for_secret(s, secret)
        assert token is not None and token.scopes == ["submit"] and token.name == "ci"
    db.dispose()
    bad = invoke("token", "create", "--name", "x", "--scope", "root", env=env)
    assert "unknown scope" in one_line_error(bad)


def test_token_list_and_revoke_by_id_or_name(tmp_path: Path) -> None:
    env = {"NIGHTWATCH_HOME": str(tmp_path / "home"), "NIGHTWATCH_DATABASE_URL": ""}
    ci = invoke(
        "token", "create", "--name", "ci", "--scope", "submit", "--owner", "vision", env=env
    )
    ops = invoke("token", "create", "--name", "ops", "--scope", "admin", env=env)
    secrets_ = [ci.stdout.strip(), ops.stdout.strip()]
    ci_id = ci.stderr.split("created token ")[1].split()[0]

    listed = invoke("token", "list", env=env)
    assert listed.exit_code == 0
    header, *rows = [line.split("\t") for line in listed.stdout.splitlines()]
    assert header == ["id", "name", "owner", "scopes", "run", "created", "revoked"]
    assert [(r[0] == ci_id, r[1], r[2], r[3], r[4], r[6]) for r in rows] == [
        (True, "ci", "vision", "submit", "-", "no"),
        (False, "ops", "ops", "admin", "-", "no"),
    ]
    assert not any(secret in listed.stdout for secret in secrets_)
    as_json = json.loads(invoke("token", "list", "--json", env=env).stdout)
    assert [(t["id"] == ci_id, t["name"], t["owner"], t["scopes"], t["run"], t["revoked"])
            for t in as_json] == [(True, "ci", "vision", ["submit"], None, False),
                                  (False, "ops", "ops", ["admin"], None, False)]  # fmt: skip
    assert all(t["created"] for t in as_json)

    assert invoke("token", "revoke", ci_id, env=env).stdout.startswith(f"revoked token {ci_id}")
    assert invoke("token", "revoke", "ops", env=env).exit_code == 0
    revoked = [line.split("\t")[6] for line in invoke("token", "list", env=env).stdout.splitlines()]
    assert revoked[1:] == ["yes", "yes"]
    assert "no token named 'nobody'" in one_line_error(invoke("token", "revoke", "nobody", env=env))
    too_long = invoke(
        "token", "create", "--name", "x", "--scope", "read", "--owner", "o" * 65, env=env
    )
    assert "--owner must be 1 to 64 characters" in one_line_error(too_long)


def test_unreachable_database_is_one_line(tmp_path: Path) -> None:
    env = {"NIGHTWATCH_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none"}
    assert "database" in one_line_error(invoke("db", "upgrade", env=env))


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_submit_list_status_events_cancel_over_http(
    live_server: Any, tokens: Any, database: Database
) -> None:
    env = {"NIGHTWATCH_URL": live_server.url, "NIGHTWATCH_TOKEN": tokens.submit}
    spec = str(EXAMPLES / "tiny-cpu.yaml")
    submitted = invoke("submit", spec, "--idempotency-key", "k-1", env=env)
    assert submitted.exit_code == 0, submitted.output
    run_id = submitted.stdout.strip()
    assert invoke("submit", spec, "--idempotency-key", "k-1", env=env).stdout.strip() == run_id
    replay = invoke("submit", spec, "--idempotency-key", "k-1", "--json", env=env).stdout
    replay = json.loads(replay)
    assert (replay["id"], replay["state"], replay["name"]) == (run_id, "pending", "tiny-cpu")

    listing = invoke("runs", "--state", "pending", env=env)
    assert run_id in listing.stdout and "tiny-cpu" in listing.stdout
    assert run_id not in invoke("runs", "--state", "running", env=env).stdout
    status = invoke("status", run_id, "--json", env=env)
    assert json.loads(status.stdout)["state"] == "pending"

    assert f"{run_id}: cancelled" in invoke("cancel", run_id, env=env).stdout
    events = invoke("events", run_id, env=env).stdout.splitlines()
    assert "run created (pending)" in events[0] and "pending → cancelled" in events[1]

    line = one_line_error(invoke("status", "r-000000000000", env=env))
    assert "HTTP 404" in line and "r-000000000000 not found" in line
    no_token = one_line_error(invoke("runs", env={"NIGHTWATCH_URL": live_server.url}))
    assert "HTTP 401" in no_token and "NIGHTWATCH_TOKEN" in no_token


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_submit_wait_follows_the_run_to_its_end(
    live_server: Any, tokens: Any, database: Database
) -> None:
    """The run is finished by a thread playing the reconciler while the CLI polls."""
    import threading

    env = {"NIGHTWATCH_URL": live_server.url, "NIGHTWATCH_TOKEN": tokens.submit}

    def finish_first_pending_run() -> None:
        for _ in range(200):
            with database.write_session() as s:
                pending = store.runs_in_states(s, [RunState.PENDING])
                if pending:
                    run_id = pending[0].id
                    store.transition_run(s, run_id, RunState.SUBMITTED)
                    store.transition_run(s, run_id, RunState.RUNNING)
                    store.set_progress(s, {run_id: {
                        "step": 30, "target_steps": 60, "loss": 3.25, "grad_norm": None,
                        "tokens_per_second": None, "step_seconds": 0.5, "eta_seconds": 15.0,
                        "checkpoint_step": None, "ettr": None, "observed_at": 1.0}})  # fmt: skip
                    store.add_event(s, run_id, EventKind.INCIDENT, "loss_spike at step 29")
                    threading.Event().wait(0.5)
                    store.transition_run(s, run_id, RunState.FAILED, reason="exit 1")
                    return
            threading.Event().wait(0.05)

    worker = threading.Thread(target=finish_first_pending_run)
    worker.start()
    result = invoke(
        "submit", str(EXAMPLES / "tiny-cpu.yaml"), "--wait", "--poll-seconds", "0.1", "--json",
        env=env,
    )  # fmt: skip
    worker.join()
    assert result.exit_code == 1
    assert json.loads(result.stdout)["state"] == "failed"  # --json: the run as it ended
    progress = result.stderr.strip().splitlines()
    assert progress[-1].startswith("error: ") and progress[-1].endswith("ended failed")
    assert any(line.endswith("incident: loss_spike at step 29") for line in progress)
    assert any(line.endswith("running  step 30/60 (50%)  loss 3.25  ETA 0m15s")
               for line in progress)  # fmt: skip


def test_unreachable_server_is_one_line() -> None:
    env = {"NIGHTWATCH_URL": "http://127.0.0.1:9", "NIGHTWATCH_TOKEN": "nw_x"}
    assert "cannot reach the supervisor" in one_line_error(invoke("runs", env=env))


def test_cli_import_is_light() -> None:
    code = (
        "import sys, supervisor.cli; "
        "heavy = [m for m in ('torch', 'megatron', 'matplotlib') if m in sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_data_prepare_is_wired_to_megatron_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake data_prep module records the call: the command must pass input, out, vocab."""
    import types
    from dataclasses import dataclass

    calls: list[tuple[Any, ...]] = []

    @dataclass
    class Prepared:
        prefix: Path
        tokenizer_path: Path

    def prepare(input_jsonl: Path | None, out_dir: Path, vocab_size: int) -> Prepared:
        calls.append((input_jsonl, out_dir, vocab_size))
        return Prepared(out_dir / "demo_text_document", out_dir / "tokenizer.json")

    fake = types.ModuleType("megatron_runs.data_prep")
    fake.prepare = prepare  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron_runs.data_prep", fake)
    result = invoke("data", "prepare", "--out", str(tmp_path), "--vocab-size", "512")
    assert result.exit_code == 0, result.output
    assert calls == [(None, tmp_path, 512)]
    assert f"data.prefix: {tmp_path / 'demo_text_document'}" in result.stdout
    missing = invoke("data", "prepare", "--input", str(tmp_path / "none.jsonl"))
    assert "no such file" in one_line_error(missing)


def test_data_prepare_builds_a_dataset_from_jsonl(tmp_path: Path) -> None:
    """End to end with the real megatron_runs.data_prep on a small corpus."""
    corpus = tmp_path / "corpus.jsonl"
    lines = [
        json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) for i in range(300)
    ]
    corpus.write_text("\n".join(lines) + "\n")
    result = invoke("data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "out"),
                    "--vocab-size", "512")  # fmt: skip
    assert result.exit_code == 0, result.output
    prefix = result.stdout.split("data.prefix: ")[1].split("\n")[0]
    tokenizer = result.stdout.split("data.tokenizer: ")[1].strip()
    assert Path(prefix + ".bin").stat().st_size > 0 and Path(prefix + ".idx").exists()
    assert Path(tokenizer).exists()


def test_serve_migrates_and_answers(tmp_path: Path) -> None:
    """`serve` as a real process: applies migrations on start, serves, stops on SIGTERM."""
    import os
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NIGHTWATCH_HOME": str(tmp_path), "NIGHTWATCH_PORT": str(port)}
    env.pop("NIGHTWATCH_DATABASE_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "serve", "--no-reconciler"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120  # a fresh interpreter imports slowly on a busy box
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
                time.sleep(0.1)
        assert health.json() == {"status": "ok", "database": "ok"}
        assert httpx.get(f"http://127.0.0.1:{port}/v1/runs").status_code == 401
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=20)
    assert (tmp_path / "nightwatch.db").exists()
    access = [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]
    (request,) = [a for a in access if a["msg"] == "request" and a.get("path") == "/v1/runs"]
    assert request["status"] == 401
    # uvicorn's own lines are JSON lines too, like the access log.
    (started,) = [a for a in access if a["msg"].startswith("Uvicorn running on")]
    assert started["logger"] == "uvicorn.error" and started["level"] == "info"
    (chosen,) = [line for line in stderr.decode().splitlines() if "nightwatch serving" in line]
    assert f"http://127.0.0.1:{port} (1 API process(es))" in chosen
    assert f"database sqlite:///{tmp_path / 'nightwatch.db'}" in chosen
    assert "jobs: none (--no-reconciler)" in chosen and "metrics: direct scrape" in chosen


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.strip().startswith("nightwatch 0.")


def test_runs_and_status_show_live_progress(
    live_server: Any, tokens: Any, database: Database
) -> None:
    """What the watchdog stored this tick is what `runs`, `status` and the API show."""
    from contracts.spec import RunSpec

    with database.write_session() as s:
        run, _ = store.create_run(s, RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml"))
        seen = {"step": 30, "target_steps": run.target_steps, "loss": 3.25, "grad_norm": 1.5,
                "tokens_per_second": 2048.0, "step_seconds": 0.5, "eta_seconds": 3725.0,
                "checkpoint_step": 20, "ettr": 0.95, "observed_at": 1_800_000_000.0}  # fmt: skip
        store.set_progress(s, {run.id: seen})
    env = {"NIGHTWATCH_URL": live_server.url, "NIGHTWATCH_TOKEN": tokens.read}
    status = invoke("status", run.id, env=env)
    line = next(x for x in status.stdout.splitlines() if x.startswith("progress"))
    assert line.split(None, 1)[1] == (
        f"step 30/{run.target_steps} ({3000 // run.target_steps}%)  loss 3.25  2,048 tok/s  "
        "ETA 1h02m  ckpt 20  ETTR 0.95"
    )
    listing = invoke("runs", env=env).stdout.splitlines()
    assert listing[0].split() == ["RUN", "STATE", "NAME", "STEP", "ETA", "ATTEMPT", "CREATED"]
    assert f"30/{run.target_steps}" in listing[1] and "1h02m" in listing[1]
    detail = json.loads(invoke("status", run.id, "--json", env=env).stdout)
    assert detail["progress"] == seen


def test_resume_and_rollback_are_requested_by_the_owner(
    live_server: Any, tokens: Any, database: Database
) -> None:
    """The CLI and the API record the request; the reconciler carries it out (tested in
    tests/watchdog/test_watchdog_operator.py). Read tokens and wrong states are refused."""
    env = {"NIGHTWATCH_URL": live_server.url, "NIGHTWATCH_TOKEN": tokens.submit}
    run_id = invoke("submit", str(EXAMPLES / "tiny-cpu.yaml"), env=env).stdout.strip()
    early = one_line_error(invoke("resume", run_id, env=env))
    assert "HTTP 409" in early and "resume needs it needs_attention" in early
    reader = one_line_error(invoke("resume", run_id, env={**env, "NIGHTWATCH_TOKEN": tokens.read}))
    assert "HTTP 403" in reader
    with database.write_session() as s:
        for state in (RunState.SUBMITTED, RunState.RUNNING, RunState.NEEDS_ATTENTION):
            store.transition_run(s, run_id, state)
    done = invoke("resume", run_id, env=env)
    assert done.exit_code == 0 and "resume requested" in done.stdout
    with database.session() as s:
        request = store.get_run(s, run_id).operator_request_json
    assert (request["kind"], request["to_step"]) == ("resume", None)
    missing = one_line_error(invoke("rollback", run_id, "--to-step", "40", env=env))
    assert "HTTP 409" in missing and "pending resume" in missing
    bad = one_line_error(
        invoke("rollback", run_id, "--to-step", "4", "--skip-samples", "9", env=env)
    )
    assert "START:END" in bad


def test_events_follow_prints_new_events_until_the_run_ends(
    live_server: Any, tokens: Any, database: Database
) -> None:
    import threading

    env = {"NIGHTWATCH_URL": live_server.url, "NIGHTWATCH_TOKEN": tokens.submit}
    run_id = invoke("submit", str(EXAMPLES / "tiny-cpu.yaml"), env=env).stdout.strip()

    def later() -> None:
        threading.Event().wait(0.4)
        with database.write_session() as s:
            store.add_event(s, run_id, EventKind.INCIDENT, "hang on n2")
            store.transition_run(s, run_id, RunState.CANCELLED, reason="test")

    writer = threading.Thread(target=later)
    writer.start()
    result = invoke("events", run_id, "--follow", "--poll-seconds", "0.1", env=env)
    writer.join()
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert any("hang on n2" in line for line in lines)
    assert "cancelled" in lines[-1]


def test_every_read_command_prints_json_with_the_fields_its_table_shows(
    live_server: Any, tokens: Any, database: Database, app_settings: Any, tmp_path: Path
) -> None:
    """`--json` is the same flag on runs, status, events, logs, report, validate, nodes: one
    JSON document on stdout (with --follow, one per line), and the exit code unchanged."""
    from contracts.paths import attempt_log_dir
    from contracts.spec import RunSpec

    with database.write_session() as s:
        run, _ = store.create_run(s, RunSpec.from_file(EXAMPLES / "tiny-cpu.yaml"))
        store.create_attempt(s, run.id, executor="slurm", job_id="4242")
        store.update_attempt(s, run.id, 1, nodes_json=["n1"])
        store.transition_run(s, run.id, RunState.SUBMITTED)
        store.add_event(s, run.id, EventKind.INCIDENT, "hang on n1")
        store.set_progress(s, {run.id: {
            "step": 30, "target_steps": run.target_steps, "loss": 3.25, "grad_norm": None,
            "tokens_per_second": None, "step_seconds": 0.5, "eta_seconds": 15.0,
            "checkpoint_step": None, "ettr": None, "observed_at": 1.0}})  # fmt: skip
    log = attempt_log_dir(app_settings.home, run.id, 1) / "4242" / "4242_0_log.out"
    log.parent.mkdir(parents=True)
    log.write_text("line 1\nline 2\n")
    env = {"NIGHTWATCH_URL": live_server.url, "NIGHTWATCH_TOKEN": tokens.read}

    def as_json(*args: str, code: int = 0) -> Any:
        result = invoke(*args, "--json", env=env)
        assert result.exit_code == code, result.output
        return json.loads(result.stdout)

    (row,) = as_json("runs")["items"]
    assert {k: row[k] for k in ("id", "state", "name", "current_attempt")} == {
        "id": run.id, "state": "submitted", "name": "tiny-cpu", "current_attempt": 1}  # fmt: skip
    assert (row["progress"]["step"], row["progress"]["eta_seconds"], row["target_steps"]) == (
        30, 15.0, run.target_steps)  # fmt: skip
    assert row["created_at"]
    detail = as_json("status", run.id)
    assert {"state_reason", "cancel_requested", "skip_ranges", "excluded_nodes"} <= detail.keys()
    assert [(a["number"], a["job_id"], a["nodes"]) for a in detail["attempts"]] == [
        (1, "4242", ["n1"])]  # fmt: skip
    events = as_json("events", run.id)["items"]
    assert {"ts", "kind", "attempt", "message", "data"} <= events[-1].keys()
    assert events[-1]["message"] == "hang on n1"
    chunk = as_json("logs", run.id)
    assert (chunk["text"], chunk["attempt"], chunk["node"]) == ("line 1\nline 2\n", 1, "n1")
    report = as_json("report", run.id)
    assert (report["run_id"], report["state"], report["target_steps"]) == (
        run.id, "submitted", run.target_steps)  # fmt: skip
    assert {"timeline", "incidents", "ettr", "downtime_s", "steps_lost"} <= report.keys()
    assert as_json("validate", str(EXAMPLES / "tiny-cpu.yaml"))["ok"] is True
    spec = (EXAMPLES / "tiny-cpu.yaml").read_text().replace("tensor: 2", "tensor: 3")
    (tmp_path / "bad.yaml").write_text(spec)
    assert as_json("validate", str(tmp_path / "bad.yaml"), code=1)["ok"] is False
    (node,) = as_json("nodes")["items"]
    assert (node["name"], node["health"], node["strikes"], node["excluded"]) == (
        "n1", "healthy", 0, False)  # fmt: skip

    with database.write_session() as s:
        store.transition_run(s, run.id, RunState.CANCELLED, reason="test")
    follow = invoke("events", run.id, "--follow", "--json", env=env)
    lines = [json.loads(line) for line in follow.stdout.splitlines()]
    assert follow.exit_code == 0 and lines[-1]["data"]["to"] == "cancelled"
