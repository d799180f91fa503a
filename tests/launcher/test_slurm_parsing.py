"""Pure SLURM parsing and sbatch parameters, on captured command output (no SLURM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.models import AttemptState
from supervisor.slurm import (
    JobRequest,
    JobState,
    LiveJob,
    NodeInfo,
    NodeState,
    SlurmCluster,
    SourceUnavailable,
    render_sbatch,
    sbatch_parameters,
)
from supervisor.slurm.local import task_exit_code
from supervisor.slurm.parse import (
    expand_hostlist,
    parse_live_jobs,
    parse_node_state,
    parse_sacct,
    parse_sinfo,
    parse_squeue,
    parse_state,
    parse_time_left,
    with_failed_nodes,
)


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1,3]", ["n1", "n3"]),
        ("gpu[007-009,012],login1", ["gpu007", "gpu008", "gpu009", "gpu012", "login1"]),
        ("rack[1-2]-a", ["rack1-a", "rack2-a"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("None assigned", []),
        ("", []),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("raw", "state"),
    [
        ("CANCELLED by 0", JobState.CANCELLED),
        ("NODE_FAIL", JobState.NODE_FAIL),
        ("COMPLETING", JobState.RUNNING),
        ("OUT_OF_MEMORY", JobState.OUT_OF_MEMORY),
        ("REQUEUE_HOLD", JobState.REQUEUED),
        ("RUNNING+", JobState.RUNNING),
        ("SOMETHING_NEW", JobState.UNKNOWN),
    ],
)
def test_parse_state(raw, state):
    assert parse_state(raw) is state


def test_terminal_and_active_states():
    assert not JobState.UNKNOWN.terminal and not JobState.UNKNOWN.active
    assert JobState.PENDING.active and JobState.REQUEUED.active
    assert all(s.terminal for s in (JobState.NODE_FAIL, JobState.TIMEOUT, JobState.COMPLETED))


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (JobState.PENDING, AttemptState.SUBMITTED),
        (JobState.REQUEUED, AttemptState.SUBMITTED),
        (JobState.RUNNING, AttemptState.RUNNING),
        (JobState.COMPLETED, AttemptState.COMPLETED),
        (JobState.FAILED, AttemptState.FAILED),
        (JobState.CANCELLED, AttemptState.CANCELLED),
        (JobState.NODE_FAIL, AttemptState.NODE_FAIL),
        (JobState.BOOT_FAIL, AttemptState.NODE_FAIL),
        (JobState.PREEMPTED, AttemptState.PREEMPTED),
        (JobState.TIMEOUT, AttemptState.TIMEOUT),
        (JobState.DEADLINE, AttemptState.TIMEOUT),
        (JobState.OUT_OF_MEMORY, AttemptState.OUT_OF_MEMORY),
        (JobState.UNKNOWN, None),
    ],
)
def test_each_slurm_state_means_one_attempt_state(state, expected):
    """The one translation of SLURM's words; UNKNOWN changes nothing (the list covers every
    state, so a new one must be given its meaning here)."""
    assert state.attempt_state is expected


def test_every_slurm_state_but_unknown_has_an_attempt_state():
    assert [s for s in JobState if s.attempt_state is None] == [JobState.UNKNOWN]


# Captured from the local cluster: sacct -X -P -n -o JobIDRaw,State,ExitCode,NodeList,Reason
SACCT = """\
41|NODE_FAIL|0:0|n[1-2]|None
42|FAILED|75:0|n[1,3]|NonZeroExitCode
43|CANCELLED by 0|0:15|n3|None
44|PENDING|0:0|None assigned|Resources
44|RUNNING|0:0|n2|None
"""


def test_parse_sacct():
    jobs = parse_sacct(SACCT)
    assert jobs["41"].state is JobState.NODE_FAIL and jobs["41"].nodes == ("n1", "n2")
    assert (jobs["42"].state, jobs["42"].exit_code) == (JobState.FAILED, 75)
    assert jobs["43"].exit_signal == 15
    # a requeued job shows one line per start: the last one is current
    assert jobs["44"].state is JobState.RUNNING and jobs["44"].nodes == ("n2",)


def test_parse_sacct_rejects_garbage():
    with pytest.raises(SourceUnavailable):
        parse_sacct("sacct: error: Problem talking to the database\n")


# Captured: squeue -h -t all -j ... -O JobID:|,State:|,NodeList:|,Reason:|,exit_code:|
SQUEUE = """\
61|CANCELLED||JobHeldUser|0|INVALID|
5|COMPLETED|n[1,3]|None|0|0:00|
64|FAILED|n1|NonZeroExitCode|768|
1|TIMEOUT|n1|TimeLimit|15|
70|PENDING||Resources|0|UNLIMITED|
2|COMPLETING|n1|NodeDown|0|
3|RUNNING|n[3-4]|None|0|1-02:03:04|
"""


def test_squeue_time_left_in_seconds_none_without_a_limit():
    jobs = parse_squeue(SQUEUE)
    assert jobs["3"].time_left_s == 86400 + 2 * 3600 + 3 * 60 + 4
    assert jobs["5"].time_left_s == 0
    assert jobs["70"].time_left_s is None and jobs["61"].time_left_s is None
    assert jobs["64"].time_left_s is None  # a squeue that printed no such column
    assert [parse_time_left(t) for t in ("1:35", "12:00:00", "NOT_SET", "5", "a-1:00")] == [
        95,
        43200,
        None,
        None,
        None,
    ]


def test_parse_squeue_decodes_wait_status():
    jobs = parse_squeue(SQUEUE)
    assert (jobs["64"].state, jobs["64"].exit_code, jobs["64"].exit_signal) == (
        JobState.FAILED,
        3,
        0,
    )
    assert (jobs["1"].state, jobs["1"].exit_signal) == (JobState.TIMEOUT, 15)
    assert jobs["5"].nodes == ("n1", "n3")
    assert jobs["70"].state is JobState.PENDING and jobs["70"].reason == "Resources"
    assert jobs["61"].nodes == ()
    # A 2-node job whose n2 froze, as squeue shows it 2 s after SLURM set n2 DOWN: still
    # "running", but ending, with only the node left to clean up.
    assert jobs["2"].state is JobState.RUNNING and jobs["2"].completing
    assert jobs["2"].nodes == ("n1",)
    assert not jobs["3"].completing and not jobs["5"].completing


class ScriptedSlurm(SlurmCluster):
    """The CLI's answers, captured from the devcluster 1 s after SLURM set a frozen n2 DOWN:
    squeue shows job 2 COMPLETING on n1 alone, sacct already NODE_FAIL on n[1-2]."""

    def __init__(self, sacct: str) -> None:
        super().__init__()
        self.answers = {
            "squeue": "2|COMPLETING|n1|None|0|\n3|COMPLETING|n3|None|0|\n4|RUNNING|n5|None|0|\n",
            "sacct": sacct,
            "sinfo": "n1|alloc|\nn2|down*|Not responding\nn3|idle|\nn5|alloc|\n",
        }
        self.asked: list[list[str]] = []

    def _run(self, cmd: list[str]) -> str:
        self.asked.append(cmd)
        return self.answers[cmd[0]]


def test_a_completing_job_that_lost_a_node_is_a_node_failure_at_once():
    """Job 2 lost n2 (NODE_FAIL in sacct): that, with the whole allocation and n2 named,
    without waiting out the teardown of n1. Job 3 was cancelled: it stays COMPLETING (its
    ending waits for the teardown, whose logs the crash blame reads)."""
    slurm = ScriptedSlurm("2|NODE_FAIL|0:0|n[1-2]|None\n3|CANCELLED by 0|0:15|n[3-4]|None\n")
    jobs = slurm.poll(["2", "3", "4"])
    assert jobs["2"].state is JobState.NODE_FAIL and jobs["2"].nodes == ("n1", "n2")
    assert jobs["2"].failed_nodes == ("n2",)
    assert jobs["3"].state is JobState.RUNNING and jobs["3"].completing
    assert jobs["4"].state is JobState.RUNNING and not jobs["4"].completing
    sacct = next(cmd for cmd in slurm.asked if cmd[0] == "sacct")
    assert sacct[sacct.index("-j") + 1] == "2,3"  # the completing jobs only, in one call
    # slurmdbd lagging (sacct has no ending yet): squeue's COMPLETING stands.
    lagging = ScriptedSlurm("2|RUNNING|0:0|n[1-2]|None\n").poll(["2"])
    assert lagging["2"].state is JobState.RUNNING and lagging["2"].completing


def test_failed_nodes_are_the_jobs_nodes_now_down():
    jobs = parse_sacct(SACCT)
    nodes = parse_sinfo("n1|idle|\nn2|down*|Not responding\nn3|alloc|\n")
    assert nodes["n2"].down and not nodes["n1"].down and nodes["n1"].idle
    marked = with_failed_nodes(jobs, nodes)
    assert marked["41"].failed_nodes == ("n2",)
    assert marked["42"].failed_nodes == ()  # not a NODE_FAIL: no blame
    drained = NodeInfo("n9", NodeState.DRAINED)
    assert drained.down is False and drained.drained and not drained.usable


@pytest.mark.parametrize(
    ("text", "state", "flags", "down", "usable"),
    [
        ("idle", NodeState.IDLE, "", False, True),
        ("mix", NodeState.MIXED, "", False, True),
        ("alloc*", NodeState.ALLOCATED, "*", True, False),
        ("down*", NodeState.DOWN, "*", True, False),
        ("fail", NodeState.FAIL, "", True, False),
        ("failg", NodeState.FAILING, "", True, False),
        ("drain", NodeState.DRAINED, "", False, False),
        ("drng", NodeState.DRAINING, "", False, False),
        ("idle~", NodeState.IDLE, "~", False, True),
        ("pow_dn", NodeState.POWERING_DOWN, "", False, True),
        ("npc", NodeState.UNKNOWN, "", False, True),
    ],
)
def test_node_states_from_sinfo(text, state, flags, down, usable):
    assert parse_node_state(text) == (state, flags)
    node = NodeInfo("n1", state, flags=flags)
    assert (node.down, node.usable) == (down, usable)
    assert node.idle is (text == "idle")


def test_sbatch_parameters():
    request = JobRequest(
        job_name="nw-r-a2",
        log_dir=Path("/tmp/x"),
        nodes=2,
        tasks_per_node=4,
        cpus_per_task=8,
        gpus_per_node=4,
        time_limit_minutes=90,
        partition="gpu",
        account="proj",
        exclude=("n2", "n5"),
    )
    params = sbatch_parameters(request)
    assert params["nodes"] == 2 and params["ntasks_per_node"] == 4 and params["gpus_per_node"] == 4
    assert params["exclude"] == "n2,n5" and params["partition"] == "gpu"
    assert params["time"] == 90 and params["signal_delay_s"] == 90
    assert params["additional_parameters"] == {"no-requeue": True}
    assert "qos" not in params
    cpu = sbatch_parameters(JobRequest("j", Path("/tmp"), 1, 2, requeue=True))
    assert "gpus_per_node" not in cpu and cpu["additional_parameters"] == {"requeue": True}
    assert not {"mem", "exclusive", "setup", "srun_args"} & set(cpu)
    spared = sbatch_parameters(JobRequest("j", Path("/tmp"), 3, 1, no_kill=True))
    assert spared["additional_parameters"] == {"no-requeue": True, "no-kill": True}
    assert spared["srun_args"] == ["--no-kill"]  # the step, too, goes on without the node


def test_a_job_with_spares_may_start_on_its_own_nodes_alone():
    """`--nodes=2-4`: SLURM starts it once two nodes are free, with as many more as are free
    then; submitit still counts its tasks from the largest size. No `--ntasks-per-node`: with
    it SLURM sizes the job to the range's minimum (one task per node is its default)."""
    request = JobRequest("j", Path("/tmp"), 4, 1, no_kill=True, min_nodes=2)
    params = sbatch_parameters(request)
    assert params["nodes"] == 4 and params["additional_parameters"]["nodes"] == "2-4"
    script = render_sbatch(request)
    assert "#SBATCH --nodes=2-4" in script.splitlines() and "--ntasks" not in script
    fixed = sbatch_parameters(JobRequest("j", Path("/tmp"), 2, 1, min_nodes=2))
    assert "nodes" not in fixed["additional_parameters"]


def test_rendered_batch_script_is_what_sbatch_gets():
    request = JobRequest(
        job_name="nw-r-a1",
        log_dir=Path("/runs/r/logs/a1"),
        nodes=2,
        tasks_per_node=1,
        cpus_per_task=32,
        gpus_per_node=4,
        memory_gib=480,
        exclusive=True,
        python="/opt/nw/bin/python",
        setup=("module load cuda/12.4", "source /opt/nw/bin/activate"),
    )
    script = render_sbatch(request)
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for expected in (
        "--gpus-per-node=4",
        "--mem=480G",
        "--exclusive",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=32",
        "--job-name=nw-r-a1",
    ):
        assert f"#SBATCH {expected}" in directives, (expected, directives)  # fmt: skip
    setup = script.index("module load cuda/12.4")
    assert setup < script.index("source /opt/nw/bin/activate") < script.index("srun")
    assert "/opt/nw/bin/python -u -m submitit.core._submit /runs/r/logs/a1/%j" in script


@pytest.mark.parametrize(
    ("codes", "tasks", "expected"),
    [([0, 0], 2, 0), ([75, 75], 2, 75), ([75, 1], 2, 1), ([0, 76], 2, 76), ([75], 2, None)],
)
def test_task_exit_code(codes, tasks, expected):
    assert task_exit_code(codes, tasks) == expected


def test_live_jobs_are_the_queued_and_running_ones_with_the_prefix() -> None:
    text = (
        "101|nw-r-1-a1|RUNNING|n[1-2]\n"
        "102|nw-r-1-a2|PENDING|\n"
        "103|nw-r-2-a1|COMPLETING|n3\n"
        "104|someone-else|RUNNING|n4\n"
        "105|nw-a|b-a3|SUSPENDED|n5\n"
    )
    assert parse_live_jobs(text, "nw-") == {
        "101": LiveJob("nw-r-1-a1", ("n1", "n2")),
        "102": LiveJob("nw-r-1-a2"),
        "105": LiveJob("nw-a|b-a3", ("n5",)),
    }
    with pytest.raises(SourceUnavailable):
        parse_live_jobs("squeue: error: slurm_load_jobs\n", "nw-")
    with pytest.raises(SourceUnavailable):
        parse_live_jobs("101|nw-r-1-a1|RUNNING\n", "nw-")
