"""Operator actions on nodes: exclude a node from the whole fleet, restore it.

`nodes.excluded` (with who and since when) is an operator's fleet-wide exclusion: every run's
next submission passes it to SLURM's `--exclude`. `node_actions` holds each request with its
evidence, written by the API before anything happens (intent), carried out by the reconciler
and finished there (outcome), so a supervisor killed in between neither loses nor repeats it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(
            sa.Column("excluded", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(sa.Column("excluded_by", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("excluded_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "node_actions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=32), nullable=False),
        sa.Column("requested_by", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("evidence_json", sa.JSON(), nullable=False),
        sa.Column("result_json", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key"),
    )
    op.create_index("ix_node_actions_node", "node_actions", ["node"], unique=False)
    op.create_index("ix_node_actions_state", "node_actions", ["state"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_node_actions_state", table_name="node_actions")
    op.drop_index("ix_node_actions_node", table_name="node_actions")
    op.drop_table("node_actions")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("excluded_at")
        batch.drop_column("excluded_by")
        batch.drop_column("excluded")
