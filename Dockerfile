# One image for every batchwire role (gateway, batcher, worker); the command picks the role.
FROM python:3.11-slim

ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY batchwire ./batchwire
COPY gateway ./gateway
COPY batcher ./batcher
COPY gpu_worker ./gpu_worker
COPY transport ./transport
COPY telemetry ./telemetry
COPY schemas ./schemas
COPY infra ./infra
RUN pip install ".${EXTRAS}"
RUN useradd --create-home batchwire
USER batchwire
EXPOSE 8000 9100
ENTRYPOINT ["batchwire"]
CMD ["--help"]
