"""The one package that talks to SLURM (submitit, sbatch, squeue, sacct, sinfo, scontrol,
scancel), and its one-node stand-in.

`types` holds the words every backend shares (the `Cluster` protocol, job and node states,
requests and answers); `parse` the pure parsers of SLURM's text; `cli` the `SlurmCluster`;
`local` the `LocalCluster` over submitit's LocalExecutor; `files` a job's folder and logs;
`connect` the choice between the two backends (log text → cause lives in
`supervisor.watchdog.blame`).
The names below are the package's API.
"""

from supervisor.slurm.cli import SlurmCluster, detect_slurm, render_sbatch, sbatch_parameters
from supervisor.slurm.connect import make_cluster, wait_for
from supervisor.slurm.files import last_lines, read_from, tail
from supervisor.slurm.local import LocalCluster
from supervisor.slurm.types import (
    Cluster,
    InvalidRequest,
    JobRequest,
    JobState,
    JobStatus,
    LiveJob,
    NodeInfo,
    NodeState,
    SourceUnavailable,
    Submission,
    Unsupported,
)

__all__ = [
    "Cluster",
    "InvalidRequest",
    "JobRequest",
    "JobState",
    "JobStatus",
    "LiveJob",
    "LocalCluster",
    "NodeInfo",
    "NodeState",
    "SlurmCluster",
    "SourceUnavailable",
    "Submission",
    "Unsupported",
    "detect_slurm",
    "last_lines",
    "make_cluster",
    "read_from",
    "render_sbatch",
    "sbatch_parameters",
    "tail",
    "wait_for",
]
