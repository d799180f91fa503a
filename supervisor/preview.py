"""What the launcher would submit for a spec's first attempt, without submitting it.

A CI system or an operator checks the GPU request, the partition and the set-up lines before
the queue wait, not after: `nightwatch submit --dry-run` and `POST /v1/specs/validate?render=
sbatch` both show this.
"""

from __future__ import annotations

from typing import Any

from contracts.paths import attempt_log_dir, checkpoint_dir
from contracts.spec import RunSpec
from supervisor.launcher import NodeSetup, SubmitPlan, job_env, job_request
from supervisor.settings import Settings
from supervisor.slurm import render_sbatch, sbatch_parameters

#: Stands in for the id the run would be given; paths and the job name show where it goes.
PREVIEW_RUN_ID = "r-dry-run"


def sbatch_preview(spec: RunSpec, settings: Settings) -> dict[str, Any]:
    """sbatch parameters, the batch script and the job's environment (without secrets: the
    worker token is minted at submission)."""
    plan = SubmitPlan(
        run_id=PREVIEW_RUN_ID,
        attempt=1,
        spec=spec,
        checkpoint_dir=checkpoint_dir(settings.home, PREVIEW_RUN_ID, spec),
        log_dir=attempt_log_dir(settings.home, PREVIEW_RUN_ID, 1),
        supervisor_url=settings.public_url,
        node_setup=NodeSetup.from_settings(settings),
    )
    request = job_request(plan)
    return {
        "run_id": PREVIEW_RUN_ID,
        "parameters": sbatch_parameters(request),
        "script": render_sbatch(request),
        "environment": job_env(plan),
    }
