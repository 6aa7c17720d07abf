# One image for the API, the worker, Flower and migrations; the command picks the role.
FROM python:3.12-slim
# Triton builds each kernel's launcher with a C compiler (and Python's headers, which this image has) the first
# time the kernel runs on a GPU: without one the worker would fail at its first kernel (`convoq doctor` says so).
# The CUDA libraries come with torch's wheels, the driver from the host.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY jobs jobs
COPY store store
COPY broker broker
COPY process process
COPY api api
COPY worker worker
COPY engine engine
COPY kernels kernels
COPY cli cli
COPY bench bench
COPY migrations migrations
RUN pip install .
ENTRYPOINT ["convoq"]
