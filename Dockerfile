# syntax=docker/dockerfile:1
# pagedserve: one image for the router, prefill and decode workers (`pagedserve <role> ...`).
#
#   CPU (default):   docker build -t pagedserve:0.1.0 .
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

FROM ${BASE_IMAGE}
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
