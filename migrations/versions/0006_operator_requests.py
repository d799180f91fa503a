"""An operator's request on a run (resume, roll back), for the reconciler to carry out.

`runs.operator_request_json` holds at most one pending request: the API writes it, the
reconciler applies it through the actuator (intent first, keyed by the request id, so a
supervisor killed at any point neither loses nor repeats it) and clears it.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("operator_request_json", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("operator_request_json")
