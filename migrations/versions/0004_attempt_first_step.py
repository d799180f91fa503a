"""Attempts' start-up time.

`attempts.first_step_s` is how long an attempt took from start to its first step. The slowest
of a run's attempts sets its start-up hang limit, so it has to outlive the supervisor process
that measured it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("first_step_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("first_step_s")
