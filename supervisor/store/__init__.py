"""The one data-access package: every write to the database goes through a function here.

Each write function commits (routes and the reconciler never commit on their own) and records
the matching event in the same transaction, so the timeline can never disagree with the state.
State changes are compare-and-set (`UPDATE … WHERE state = expected`), which keeps the API's
cancel and the reconciler's submit from overwriting each other.

Modules by concern: `runs`, `attempts`, `events`, `actions` (actions, incidents, node
health), `nodes` (the nodes' view, operator exclude / restore), `tokens`, `endpoints`, `leases`,
`errors`, `operator`; the names below are the package's API.
"""

from supervisor.store.actions import (
    abandon_actions,
    action_key,
    begin_action,
    finish_action,
    incident_counts,
    open_incident,
    recorded_incident_keys,
    set_node_health,
    update_incident,
)
from supervisor.store.attempts import (
    create_attempt,
    get_attempts,
    record_checkpoint,
    update_attempt,
)
from supervisor.store.endpoints import active_endpoints, register_endpoint
from supervisor.store.errors import (
    CheckpointDirInUse,
    Conflict,
    IdempotencyConflict,
    NotFound,
    StoreError,
)
from supervisor.store.events import add_event, last_checkpoint_interval, record_event
from supervisor.store.leases import acquire_lease, db_now, renew_lease
from supervisor.store.nodes import (
    add_nodes,
    finish_node_action,
    fleet_excluded_nodes,
    get_node,
    list_nodes,
    node_names,
    pending_node_actions,
    request_node_action,
)
from supervisor.store.operator import (
    clear_operator_request,
    operator_action_recorded,
    request_operator_action,
)
from supervisor.store.runs import (
    NewRun,
    Page,
    add_runs,
    count_runs_by_state,
    create_run,
    get_run,
    list_events,
    list_runs,
    request_cancel,
    run_states,
    run_with_attempts,
    runs_in_states,
    set_progress,
    spec_hash,
    transition_run,
    update_run,
)
from supervisor.store.tokens import (
    create_token,
    list_tokens,
    revoke_run_tokens,
    revoke_token,
    token_for_secret,
)

__all__ = [
    "CheckpointDirInUse",
    "Conflict",
    "IdempotencyConflict",
    "NewRun",
    "NotFound",
    "Page",
    "StoreError",
    "abandon_actions",
    "acquire_lease",
    "action_key",
    "active_endpoints",
    "add_event",
    "add_nodes",
    "add_runs",
    "begin_action",
    "clear_operator_request",
    "count_runs_by_state",
    "create_attempt",
    "create_run",
    "create_token",
    "db_now",
    "finish_action",
    "finish_node_action",
    "fleet_excluded_nodes",
    "get_attempts",
    "get_node",
    "get_run",
    "incident_counts",
    "last_checkpoint_interval",
    "list_events",
    "list_nodes",
    "list_runs",
    "list_tokens",
    "node_names",
    "open_incident",
    "operator_action_recorded",
    "pending_node_actions",
    "record_checkpoint",
    "record_event",
    "recorded_incident_keys",
    "register_endpoint",
    "renew_lease",
    "request_cancel",
    "request_node_action",
    "request_operator_action",
    "revoke_run_tokens",
    "revoke_token",
    "run_states",
    "run_with_attempts",
    "runs_in_states",
    "set_node_health",
    "set_progress",
    "spec_hash",
    "token_for_secret",
    "transition_run",
    "update_attempt",
    "update_incident",
    "update_run",
]
