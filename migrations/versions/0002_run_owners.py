"""Run ownership: tokens name an owner, runs record theirs, and Idempotency-Keys are scoped
to the owner (unique per (owner, key) instead of globally).

Existing tokens are owned by their name; existing runs by the owner of the token that
submitted them ('' when none, which leaves them to admin).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: 0001 left the key's unique constraint unnamed; PostgreSQL calls it this, and SQLite's
#: batch mode reflects it under the same name through this convention.
NAMING = {"uq": "%(table_name)s_%(column_0_name)s_key"}
OLD_KEY_CONSTRAINT = "runs_idempotency_key_key"
KEY_INDEX = "uq_runs_owner_idempotency_key"


def upgrade() -> None:
    with op.batch_alter_table("tokens") as batch:
        batch.add_column(sa.Column("owner", sa.String(length=64), nullable=True))
    op.execute("UPDATE tokens SET owner = name")
    with op.batch_alter_table("tokens") as batch:
        batch.alter_column("owner", existing_type=sa.String(length=64), nullable=False)

    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner", sa.String(length=64), nullable=True))
    op.execute(
        "UPDATE runs SET owner = COALESCE("
        "(SELECT tokens.owner FROM tokens WHERE tokens.id = runs.created_by), '')"
    )
    with op.batch_alter_table("runs", naming_convention=NAMING) as batch:
        batch.alter_column("owner", existing_type=sa.String(length=64), nullable=False)
        batch.drop_constraint(OLD_KEY_CONSTRAINT, type_="unique")
    op.create_index(KEY_INDEX, "runs", ["owner", "idempotency_key"], unique=True)


def downgrade() -> None:
    """Fails where two owners used the same key, which the old global constraint forbids."""
    op.drop_index(KEY_INDEX, table_name="runs")
    with op.batch_alter_table("runs", naming_convention=NAMING) as batch:
        batch.create_unique_constraint(OLD_KEY_CONSTRAINT, ["idempotency_key"])
        batch.drop_column("owner")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("owner")
