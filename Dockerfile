# The Narwhal router image that deploy/kubernetes/deployment.yaml runs:
#
#   docker build -t ghcr.io/narwhal-router/narwhal:0.1.0 .
#   docker run --rm -p 8700:8700 -v "$PWD/narwhal.toml:/etc/narwhal/narwhal.toml:ro" ghcr.io/narwhal-router/narwhal:0.1.0
#
# The first stage builds wheels for Narwhal and every dependency; the final stage installs only
# those (--no-index: it never reaches a registry), so it has no compiler, no source tree and no
# pip cache. The settings file is not in the image: mount it at /etc/narwhal/narwhal.toml (the
# Kubernetes ConfigMap does). The image binds 0.0.0.0:8700 (NARWHAL_SERVER__BIND below, which wins
# over the file's server.bind); the HEALTHCHECK asks the port that variable names.
# tests/unit/deploy/test_image.py ties these values to pyproject.toml and the Kubernetes manifests.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY narwhal ./narwhal
# With the tracing extra: [tracing] enabled = true works in the image (README "Tracing").
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[tracing]'

FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="narwhal-router" \
      org.opencontainers.image.description="Router for disaggregated (prefill/decode) vLLM serving" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/narwhal-router/narwhal"
# No .pyc written at run time (the Kubernetes pod's root filesystem is read-only; pip compiled
# them at install), log lines leave the process as they are written, and the router listens on
# all interfaces: 127.0.0.1, the settings' default, is unreachable from outside the container.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NARWHAL_SERVER__BIND=0.0.0.0:8700
COPY --from=build /wheels /wheels
# DL3013 (pin versions): /wheels holds exactly the narwhal-router (and its tracing extra) built
# above, and --no-index keeps pip from looking anywhere else.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --no-index --find-links /wheels 'narwhal-router[tracing]' \
    && rm -rf /wheels \
    && groupadd --system --gid 10001 narwhal \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin narwhal
# `narwhal serve` uses the gunicorn configuration inside the package; this copy is for running
# gunicorn by hand: gunicorn -c /opt/narwhal/gunicorn.conf.py (with NARWHAL_CONFIG set).
WORKDIR /opt/narwhal
COPY gunicorn.conf.py ./gunicorn.conf.py
USER 10001:10001
EXPOSE 8700
STOPSIGNAL SIGTERM
# Liveness only (/ready depends on the engines): the start runs the preflight checks first.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ['NARWHAL_SERVER__BIND'].rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=4)"]
ENTRYPOINT ["narwhal"]
CMD ["serve", "--config", "/etc/narwhal/narwhal.toml"]
