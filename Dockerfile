# syntax=docker/dockerfile:1
# One image for every gpufleet process: the entrypoint is `python -m`, the command names the module.
#
#   docker build -t gpufleet:dev .
#   docker run --rm gpufleet:dev gpufleet.services.placer --nats-url nats://nats-1:4222
#   docker run --rm gpufleet:dev gpufleet.shared.read.readmodel --nats nats://nats-1:4222 --dsn postgresql://...
#   docker run --rm gpufleet:dev gpufleet.cli --help
#
# See deploy/README.md for docker-compose.yml and the Kubernetes manifests.

ARG PYTHON_IMAGE=python:3.11-slim

# ---------------------------------------------------------------- build: the package in a venv
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
# Every dependency ships manylinux wheels for CPython 3.11 (amd64, arm64): no compiler needed.
RUN python -m venv /opt/gpufleet
WORKDIR /src
# .dockerignore lets in only what the package needs (pyproject.toml, gpufleet/, shared/,
# services/, deploy/healthcheck.py, README/LICENSE if present).
COPY . .
RUN /opt/gpufleet/bin/pip install . \
 && /opt/gpufleet/bin/python -c "import gpufleet.shared.runtime.service, gpufleet.shared.read.readmodel, gpufleet.services.placer.core"

# ---------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpufleet" \
      org.opencontainers.image.description="gpufleet control-plane services (python -m gpufleet.services.<name>)"
ENV PATH=/opt/gpufleet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GPUFLEET_DATA_DIR=/home/gpufleet/.gpufleet
COPY --from=build /opt/gpufleet /opt/gpufleet
COPY deploy/healthcheck.py /opt/gpufleet-deploy/healthcheck.py
# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can check it.
RUN groupadd --system --gid 10001 gpufleet \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/gpufleet --create-home \
            --shell /usr/sbin/nologin gpufleet
USER 10001:10001
WORKDIR /home/gpufleet
# The services handle SIGTERM themselves (shared/runtime/service.py) and stop cleanly; docker-compose.yml
# adds an init process (init: true) in front of them.
ENTRYPOINT ["python", "-m"]
CMD ["gpufleet.cli", "--help"]
