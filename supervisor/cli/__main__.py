"""`python -m supervisor.cli …` is the same as the `nightwatch` console script."""

from supervisor.cli import app

app()
