# cosystream server image.
#   docker build -t cosystream .                          # CUDA (needs the NVIDIA container toolkit to use a GPU)
#   docker build -t cosystream:cpu --build-arg DEVICE=cpu .
#   docker run --gpus all -p 50051:50051 -p 9090:9090 cosystream
ARG DEVICE=cuda

FROM nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 AS base-cuda
ENV TORCH_INDEX=https://download.pytorch.org/whl/cu126

FROM ubuntu:24.04 AS base-cpu
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM base-${DEVICE}
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/venv
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv $VIRTUAL_ENV
ENV PATH=$VIRTUAL_ENV/bin:$PATH
RUN pip install --upgrade pip && pip install torch --index-url $TORCH_INDEX
WORKDIR /app
COPY pyproject.toml README.md ./
COPY cosystream ./cosystream
RUN pip install . && useradd --system --uid 10001 cosystream
USER cosystream
EXPOSE 50051 9090
# Readiness is gRPC health (SERVING once the engine is warm); this checks the same from inside.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s CMD python -c "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; sys.exit(g.HealthStub(grpc.insecure_channel('127.0.0.1:50051')).Check(h.HealthCheckRequest(), timeout=2).status != h.HealthCheckResponse.SERVING)"
# SIGTERM drains: open sessions get their finals, then the server exits 0 (give it --drain-grace-s).
STOPSIGNAL SIGTERM
ENTRYPOINT ["cosystream", "serve"]
CMD ["--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9090"]
