"""A run's latest observed progress.

`runs.progress_json` holds what the watchdog last saw of the run (step, loss, grad norm,
tokens/s, ETA, newest checkpoint, ETTR, when), written once per tick for the runs that moved,
so the API and the CLI show a training run's progress while it trains.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("progress_json", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("progress_json")
