"""What a string must look like before it reaches sbatch or scontrol: the one definition.

Why strict: submitit writes these values into `#SBATCH --key=value` lines of a bash script, so
a quote, a newline or a `#` in one of them can end the directive early, drop every later one,
or run a command. SLURM itself allows more, but names made of letters, digits, `_`, `-` and
`.` cover every real partition, account, QOS and node, and leave nothing a shell or SLURM's
option parser treats specially. The spec checks them on input (a 422 naming the field) and
`supervisor.slurm` checks them again before sbatch, for anything stored before these rules.
"""

from __future__ import annotations

import re

import hostlist

#: A partition, account or QOS name.
SLURM_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
#: One node (host) name.
NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
#: A job name (Nightwatch builds them: `nw-<run id>-a<attempt>`).
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
#: A hostlist expression (`n[01-04,7],gpu3`) before expansion.
MAX_HOSTLIST_CHARS = 256
#: Node names one exclude list may expand to (far beyond any real exclusion).
MAX_EXCLUDED_NODES = 1024

_SLURM_NAME = re.compile(SLURM_NAME_PATTERN)
_NODE_NAME = re.compile(NODE_NAME_PATTERN)
_JOB_NAME = re.compile(JOB_NAME_PATTERN)


def check_slurm_name(value: str) -> str:
    if not _SLURM_NAME.fullmatch(value):
        raise ValueError(
            f"{value[:80]!r} is not a SLURM name (1-64 of letters, digits, '_', '-', '.')"
        )
    return value


def check_node_name(value: str) -> str:
    if not _NODE_NAME.fullmatch(value):
        raise ValueError(
            f"{value[:80]!r} is not a node name (1-64 of letters, digits, '_', '-', '.', "
            "starting with a letter or digit)"
        )
    return value


def check_job_name(value: str) -> str:
    if not _JOB_NAME.fullmatch(value):
        raise ValueError(f"{value[:80]!r} is not a job name")
    return value


def expand_nodes(expressions: list[str] | tuple[str, ...]) -> list[str]:
    """Node names of SLURM hostlist expressions, in order (a name listed twice stays twice:
    the layout check reports it).

    python-hostlist parses the brackets and ranges; every name it yields must then be a
    node name. ValueError names the expression that is not one.
    """
    names: list[str] = []
    for expression in expressions:
        if len(expression) > MAX_HOSTLIST_CHARS:
            raise ValueError(f"a hostlist expression is at most {MAX_HOSTLIST_CHARS} characters")
        try:
            expanded = hostlist.expand_hostlist(expression)
        except hostlist.BadHostlist as exc:
            raise ValueError(f"{expression[:80]!r} is not a hostlist expression: {exc}") from exc
        if not expanded:
            raise ValueError("an empty hostlist expression")
        names.extend(check_node_name(name) for name in expanded)
        if len(names) > MAX_EXCLUDED_NODES:
            raise ValueError(f"more than {MAX_EXCLUDED_NODES} nodes")
    return names
