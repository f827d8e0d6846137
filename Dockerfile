# The image aggnet k8s render's manifests run (aggnet:VERSION):
#   docker build -t aggnet:0.1.0 .
# torch==2.13.0 resolves to the CUDA build on PyPI; the aggregators need no
# GPU, the training pods use one where the node has it.
FROM python:3.11-slim
WORKDIR /opt/aggnet
COPY pyproject.toml README.md ./
COPY aggnet aggnet
COPY transport transport
COPY hosts hosts
COPY emulation emulation
COPY p4 p4
RUN pip install --no-cache-dir ".[torch,k8s]"
ENTRYPOINT []
CMD ["aggnet", "--help"]
