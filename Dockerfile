# One image for every batchwire role (gateway, batcher, worker); the command picks the role.
FROM python:3.11-slim

ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PATH=/opt/batchwire/bin:$PATH
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
# The same script the core-install smoke test runs (tests/smoke), so the image installs what is tested.
RUN sh infra/install.sh /opt/batchwire "${EXTRAS}"
RUN useradd --create-home batchwire
USER batchwire
EXPOSE 8000 9100
ENTRYPOINT ["batchwire"]
CMD ["--help"]
