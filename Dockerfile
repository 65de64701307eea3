# The evenflow CPU image (deploy/compose.yaml and deploy/kuberay.yaml run it as evenflow:latest):
#   docker build -t evenflow:latest .
# torch comes from PyTorch's CPU index (the default index would pull a multi-GB CUDA build).
# A GPU image: start FROM a CUDA runtime base and install torch from the matching cu12x index
# instead; evenflow's engine has no CUDA-specific path yet beyond NCCL collectives.
FROM python:3.11-slim

WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY evenflow ./evenflow
RUN pip install . && useradd --create-home evenflow
USER evenflow

EXPOSE 8000 9100
# `evenflow up` by default: the whole local mesh in one container (NATS and Redis from the
# wheels). compose and KubeRay run each service on its own instead.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/live', timeout=3)"
CMD ["evenflow", "up", "--host", "0.0.0.0", "--port", "8000"]
