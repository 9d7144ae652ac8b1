# cosystream server image: `cosystream serve` with the embedded English model and the Google Cloud Speech and
# NVIDIA Riva protocols (the compat extra) and the second pass's Whisper finals (the whisper extra), running as
# an unprivileged user.
#
#   docker build -t cosystream .                                  # CUDA (needs the NVIDIA container toolkit)
#   docker build -t cosystream:cpu --build-arg DEVICE=cpu .       # CPU only, on Debian 12
#   docker run --gpus all -p 50051:50051 -p 9090:9090 -p 8080:8080 cosystream [serve flags...]
#
# Build arguments:
#   DEVICE           cuda (default) or cpu: picks the base image and where torch comes from.
#   BASE_CUDA        base image of the CUDA build (torch's wheels carry the CUDA libraries; the base adds the
#                    settings that let the NVIDIA container toolkit mount the driver).
#   BASE_CPU         base image of the CPU build. Any Debian or Ubuntu image with python3 >= 3.11 in apt.
#   TORCH_VERSION    the torch release installed (the one the tests run with).
#   TORCH_CUDA       PyTorch's name for the CUDA build of torch in the CUDA image (cu126, cu128, ...); keep it
#                    in step with BASE_CUDA.
#   TORCH_INDEX_URL  the package index torch comes from (default: PyTorch's, for DEVICE and TORCH_CUDA).
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_NO_INDEX
#                    handed to pip as they are, for a mirror or a build with no index at all.
#   COMPILE_STEPS    CPU image: 1 (default) compiles the model step's shapes for `serve`'s default flags at
#                    build time (`serve --compile-only`, about 8 minutes on 2 cores, about 290 MB more image)
#                    into /opt/cosystream/compiled-steps, for the build machine's CPU; a host whose CPU (its
#                    vector ISA) differs runs the step eager, said in one log line (the image has no compiler
#                    to compile it there). 0: no packages, every shape eager.
# Build secrets:
#   pip-ca           a CA bundle for pip to trust instead of the base's, for an index behind a TLS-inspecting
#                    proxy or a private CA: --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt
#
# Wheels from a folder instead of an index (air-gapped builds, a mirror of torch, a torch of your own):
#   docker build --build-context wheels=/path/to/wheels ...
# pip looks in that folder first for every package; a wheel of torch TORCH_VERSION there is installed from
# there and TORCH_INDEX_URL is not asked. With --build-arg PIP_NO_INDEX=1 pip asks no index at all and the
# folder must hold everything: `pip download -d /path/to/wheels torch==VERSION '.[compat,whisper,codecs,vocabulary,gpu,tracing]' 'setuptools>=77'`
# fills it, run from this directory on a connected machine with the image's Python (3.11 on Debian 12, 3.12
# on Ubuntu 24.04) and torch build.
ARG DEVICE=cuda
ARG BASE_CUDA=nvidia/cuda:12.6.3-base-ubuntu24.04
ARG BASE_CPU=debian:bookworm-slim

# Empty unless replaced by --build-context wheels=DIR. (Each stage has an instruction: buildah 1.28 leaves the
# working container of a stage with none behind.)
FROM scratch AS wheels
LABEL org.opencontainers.image.description="wheels for pip to take first: none"

FROM ${BASE_CUDA} AS base-cuda
ARG BASE_CUDA
LABEL org.opencontainers.image.base.name="${BASE_CUDA}"

FROM ${BASE_CPU} AS base-cpu
ARG BASE_CPU
LABEL org.opencontainers.image.base.name="${BASE_CPU}"

FROM base-${DEVICE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# --- builder: compilers, pip and its cache stay here; only /opt/venv leaves ------------------------------
FROM base AS builder
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV"
ARG DEVICE
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu126
ARG TORCH_INDEX_URL
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_NO_INDEX
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_FIND_LINKS=/wheels
# torch first, so that the package's loose `torch>=2.4` is already met. From the wheels folder when it holds
# torch (only torch from there, then its dependencies as usual), else from TORCH_INDEX_URL.
RUN --mount=type=bind,from=wheels,target=/wheels \
    --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip-ca \
    set -e; if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    if ls /wheels/torch-"${TORCH_VERSION}"[+-]*.whl >/dev/null 2>&1; then \
      pip install --no-index --no-deps "torch==${TORCH_VERSION}" && pip install "torch==${TORCH_VERSION}"; \
    else \
      if [ "$DEVICE" = cpu ]; then flavor=cpu; else flavor="$TORCH_CUDA"; fi; \
      index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/$flavor}"; \
      pip install --index-url "$index" "torch==${TORCH_VERSION}"; \
    fi
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cosystream ./cosystream
# Then the package with the compat, whisper, codecs, vocabulary, tracing (serve --otlp-endpoint) and gpu (the GPU gauges: NVML's bindings, pure
# Python; the toolkit mounts the driver's library) extras, checked to import and to find the packaged Whisper
# model; then torch's test binaries and C++ headers go (headers are for compiling extensions, and the runtime
# stage has no compiler): ~190 MB.
RUN --mount=type=bind,from=wheels,target=/wheels \
    --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip-ca \
    set -e; if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi; \
    pip install '.[compat,whisper,codecs,vocabulary,gpu,tracing]' \
 && python -c "import cosystream.server.compat.google_speech, cosystream.server.compat.riva_asr" \
 && python -c "from cosystream.secondpass.whisper import EMBEDDED_WHISPER as m, resolve_model; resolve_model(m)"
# The CPU image's compiled step (COMPILE_STEPS above), while the compiler and torch's headers are here; the
# folder is root's and read-only to the image's user, as the cache's trust rules want (docs/DEPLOY.md).
ARG COMPILE_STEPS=1
RUN mkdir -p -m 0755 /opt/cosystream/compiled-steps \
 && if [ "$DEVICE" = cpu ] && [ "$COMPILE_STEPS" = 1 ]; then \
      COSYSTREAM_COMPILE_CACHE=/opt/cosystream/compiled-steps cosystream serve --compile-only; \
    fi \
 && chmod -R a+rX,go-w /opt/cosystream
RUN site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
 && rm -rf "$site"/torch/test "$site"/torch/include \
 && find "$site"/torch/bin -mindepth 1 -not -name torch_shm_manager -delete

# --- runtime: the base, Python, the venv; no compiler, no pip cache, no source tree -----------------------
FROM base AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && apt-get clean && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --user-group --create-home --home-dir /home/cosystream cosystream
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/cosystream /opt/cosystream
ENV COSYSTREAM_COMPILE_CACHE=/opt/cosystream/compiled-steps
# Numeric, so that Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /home/cosystream
# gRPC (native, Google and Riva protocols, health, reflection), Prometheus /metrics, HTTP.
EXPOSE 50051 9090 8080
# Readiness is gRPC health (SERVING once the engine is warm); this checks the same from inside, on port 50051.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s CMD python -c "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; sys.exit(g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=2).status != h.HealthCheckResponse.SERVING)"
# SIGTERM drains: open sessions get their finals, then the server exits 0 (give it --drain-grace-s + 6 s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["cosystream", "serve"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9090", "--http-port", "8080"]
