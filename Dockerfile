# One image for the API, the worker, Flower and migrations; the command picks the role.
FROM python:3.12-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY jobs jobs
COPY api api
COPY worker worker
COPY engine engine
COPY kernels kernels
COPY cli cli
COPY bench bench
COPY migrations migrations
RUN pip install .
ENTRYPOINT ["convoq"]
