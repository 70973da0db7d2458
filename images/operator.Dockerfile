# The Tessera operator. Build from the repository root:
#   docker build -f images/operator.Dockerfile -t localhost/tessera/operator:0.1.0 .
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY runtime ./runtime
COPY operator ./operator
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade pip==24.3.1 \
    && /opt/venv/bin/pip install --no-cache-dir -c constraints.txt ".[operator]"

FROM python:3.11.11-slim-bookworm
# openssl: the webhook's self-signed development certificate.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssl \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 65532 tessera \
    && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin tessera
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 65532:65532
EXPOSE 8080 9443
ENTRYPOINT ["tessera-operator"]
