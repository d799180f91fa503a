"""Alembic environment: always called with a connection from `supervisor.db.upgrade`."""

from alembic import context

from supervisor.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
