# syntax=docker/dockerfile:1
# pagedserve: one image for the router, prefill and decode workers (`pagedserve <role> ...`).
#
#   CPU (default):   docker build -t pagedserve:0.1.0 .
#   torch-free router and gateway (the Helm chart's router.image / gateway.image):
#                    docker build --target slim -t pagedserve:0.1.0-slim .
#   CUDA:            docker build -t pagedserve:0.1.0-cu128 \
#                      --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#                    (CUDA torch wheels carry their CUDA libraries; the node provides the driver)
#   other base:      --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
#                    (any Debian/Ubuntu image; python3 >= 3.11 is installed with apt if missing)
#
# The image runs as an unprivileged user and writes only under /tmp (HOME and every cache point
# there), so it runs with a read-only root filesystem and an emptyDir on /tmp. Models are mounted,
# never downloaded (HF_HUB_OFFLINE=1).
ARG BASE_IMAGE=python:3.11-slim
# NOTE: the slim target never takes a CUDA base: router and gateway need no GPU
ARG SLIM_BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# NOTE: torch is installed first and pinned (as in the Makefile) so that no dependency range can
# pull another build; the index decides CPU or CUDA.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -m venv --help >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/pagedserve
ENV PATH=/opt/pagedserve/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY clients/python ./clients/python
RUN pip install ./clients/python
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
COPY protos ./protos
COPY router ./router
COPY prefill_worker ./prefill_worker
COPY decode_worker ./decode_worker
COPY kvstore ./kvstore
COPY model ./model
COPY kernels ./kernels
COPY bench ./bench
COPY gateway ./gateway
RUN pip install . && python -c "import pagedserve.cli; pagedserve.cli.build_parser()"

# The slim target: router and gateway only (no torch, triton, transformers or xgrammar: they
# import none, see the import-linter contracts). pagedserve's own dependencies would pull torch,
# so it is installed --no-deps over requirements-slim.txt (what the two roles import).
FROM ${SLIM_BASE_IMAGE} AS slim-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/pagedserve
ENV PATH=/opt/pagedserve/bin:$PATH
WORKDIR /src
COPY requirements-slim.txt ./
RUN pip install -r requirements-slim.txt
COPY clients/python ./clients/python
RUN pip install --no-deps ./clients/python
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
COPY protos ./protos
COPY router ./router
COPY prefill_worker ./prefill_worker
COPY decode_worker ./decode_worker
COPY kvstore ./kvstore
COPY model ./model
COPY kernels ./kernels
COPY bench ./bench
COPY gateway ./gateway
# NOTE: the check fails the build if either role's import path ever reaches torch
RUN pip install --no-deps . \
    && python -c "import sys, pagedserve.cli, pagedserve.router.server, pagedserve.gateway.server; \
pagedserve.cli.build_parser(); \
heavy = {'torch', 'triton', 'transformers', 'xgrammar'} & set(sys.modules); \
sys.exit(f'slim image imports {heavy}' if heavy else 0)"

FROM ${SLIM_BASE_IMAGE} AS slim
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve
COPY --from=slim-build /opt/pagedserve /opt/pagedserve
ENV PATH=/opt/pagedserve/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# router, gateway (the chart sets --port; these are the CLI defaults)
EXPOSE 50051 8000
ENTRYPOINT ["pagedserve"]
CMD ["--help"]

# The full image (the default target, the last stage): every role.
FROM ${BASE_IMAGE} AS full
ENV DEBIAN_FRONTEND=noninteractive
# NOTE: a C compiler at run time: the native CPU decode kernel is built for the pod's own CPU on
# first use (kernels/cpu_native.py, into $XDG_CACHE_HOME); without one, CPU decode falls back to
# torch's attention (slower, same tokens). Not built or run here: no docker on the dev machines
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && if ! command -v python3 >/dev/null 2>&1; then \
      apt-get update && apt-get install -y --no-install-recommends python3 \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && (command -v useradd >/dev/null 2>&1 || (apt-get update && apt-get install -y --no-install-recommends passwd)) \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve
COPY --from=build /opt/pagedserve /opt/pagedserve
# NOTE: everything a process may write goes under /tmp (an emptyDir in Kubernetes).
ENV PATH=/opt/pagedserve/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor \
    MPLCONFIGDIR=/tmp/.cache/matplotlib \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /tmp
USER 10001:10001
# router, prefill, decode (the chart sets --port; these are the CLI defaults)
EXPOSE 50051 50061 50071 8000
ENTRYPOINT ["pagedserve"]
CMD ["--help"]
