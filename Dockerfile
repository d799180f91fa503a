# The supervisor image (API + watchdog): `nightwatch serve`. Used by docker-compose.yml.
# SLURM client tools and munge are included so the same image can submit to an existing
# cluster when the login node's /etc/slurm and munge socket are mounted (see docs/deploy.md);
# keep the Debian release close to the cluster's SLURM version (clients talk to slurmctld of
# the same or the two previous major releases).
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      slurm-client munge curl \
 && rm -rf /var/lib/apt/lists/*

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 \
    NIGHTWATCH_HOME=/var/lib/nightwatch NIGHTWATCH_HOST=0.0.0.0 NIGHTWATCH_PORT=8787
WORKDIR /opt/nightwatch

# Dependencies first (the layer survives code changes); same pins and order as the Makefile.
COPY pyproject.toml README.md ./
RUN pip install torch==2.13.0 \
 && pip install --only-binary=:all: 'numpy>=1.26' \
 && pip install --ignore-requires-python megatron-core==0.19.2

COPY contracts contracts
COPY supervisor supervisor
COPY worker worker
COPY megatron_runs megatron_runs
COPY migrations migrations
# Editable, so supervisor.db finds migrations/ beside the package.
RUN pip install -e '.[train,postgres,plot]' \
 && useradd --system --create-home --home-dir /var/lib/nightwatch nightwatch

USER nightwatch
EXPOSE 8787
HEALTHCHECK --interval=15s --timeout=5s --retries=5 \
  CMD curl -fsS http://127.0.0.1:8787/healthz || exit 1
ENTRYPOINT ["nightwatch"]
CMD ["serve"]
