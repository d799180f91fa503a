"""The training program's Prometheus metrics: names, kinds and meaning (docs/contracts.md).

The trainer exports them (`megatron_runs.metrics`), the supervisor reads them (PromQL or a
direct scrape, `supervisor.metrics_in`), dashboards and alert rules query them: the names are
written here once.
"""

from __future__ import annotations

PREFIX = "nightwatch_train_"
LABELS = ("run_id", "attempt", "node")

#: Steps covered by the `*_window_max` / `*_window_min` / `*_window_avg` gauges.
WINDOW_STEPS = 16

NODE_METRICS = {
    "step": ("gauge", "last completed step"),
    "step_entered": ("gauge", "step this node's local rank 0 last began (past its faults)"),
    "last_step_timestamp_seconds": ("gauge", "unix time the last step finished"),
    "steps": ("counter", "steps completed by this process"),
    "step_time_seconds": ("gauge", "this node's last step wall time"),
    "step_time_window_avg_seconds": ("gauge", "mean step time over the last 16 steps"),
    "step_gap_max_seconds": (
        "gauge",
        "longest wall time between two consecutive steps this process completed (saves, "
        "evaluations and stalls between them included; the start-up before its first step not)",
    ),
    "up": ("gauge", "1 while the training loop runs"),
    "save_started_timestamp_seconds": (
        "gauge",
        "unix time the save the training loop waits on began (0: it waits on none): between "
        "two steps, a loop in a save is busy, not hung",
    ),
    "nonfinite_grads": ("counter", "steps whose local gradients were NaN/Inf before reduction"),
}
RUN_METRICS = {
    "target_steps": ("gauge", "train_steps of the spec"),
    "loss": ("gauge", "loss of the last step"),
    "loss_summed": ("counter", "sum of the losses of all steps"),
    "loss_window_max": ("gauge", "max loss over the last 16 steps"),
    "loss_window_min": ("gauge", "min loss over the last 16 steps"),
    "grad_norm": ("gauge", "grad norm of the last step"),
    "grad_norm_window_max": ("gauge", "max grad norm over the last 16 steps"),
    "nonfinite_steps": ("counter", "steps with NaN/Inf loss or grad norm"),
    "anomalous_steps": (
        "counter",
        "steps the trainer judged bad (non-finite or a loss spike), each named with its samples "
        "in .health/anomalies.jsonl",
    ),
    "learning_rate": ("gauge", "learning rate of the last step"),
    "tokens": ("counter", "tokens consumed"),
    "samples_consumed": ("gauge", "global sample index consumed so far"),
    "skipped_samples": ("counter", "samples skipped by skip ranges"),
    "tokens_per_second": ("gauge", "tokens per second of the last step"),
    "mfu_ratio": ("gauge", "model FLOPs utilisation (0-1; 0 on CPU)"),
    "checkpoint_step": ("gauge", "step of the newest published checkpoint"),
    "checkpoint_last_timestamp_seconds": ("gauge", "when it was published"),
    "checkpoint_duration_seconds": ("gauge", "how long the last save took"),
    "checkpoint_failures": ("counter", "failed saves"),
    "replica_checks": ("counter", "replica checksum comparisons made"),
    "replica_mismatches": ("counter", "comparisons where replicas differed"),
    "eval_loss": ("gauge", "validation loss of the last evaluation (NaN before the first)"),
    "eval_step": ("gauge", "step of the last evaluation (NaN before the first)"),
    "eval_resumed_loss": (
        "gauge",
        "validation loss of the newest evaluation the resumed checkpoint recorded (NaN: none)",
    ),
}


def exposed(key: str) -> str:
    """The sample name Prometheus sees for a metric of the tables above (counters end in
    `_total`)."""
    kind, _ = {**NODE_METRICS, **RUN_METRICS}[key]
    return PREFIX + key + ("_total" if kind == "counter" else "")


def metric_names(run_level: bool = True) -> list[str]:
    """Exposed sample names of a node's endpoint (the run-level ones on global rank 0 only)."""
    table = {**NODE_METRICS, **(RUN_METRICS if run_level else {})}
    return [exposed(key) for key in table]
