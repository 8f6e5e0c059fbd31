# The image of saga's application services (docker-compose.yml, profile `app`):
#   docker build -t saga-olep:local .
#   docker run --rm saga-olep:local --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A Java runtime for pyspark (the reconciliation job runs Spark in the JVM).
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends default-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*

# Only what the package needs: no virtual environment, caches or local service data.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY coordinator ./coordinator
COPY participants ./participants
COPY streams ./streams
# The tools (saga demo, saga bench) ship in the same distribution; their drivers
# come with the tools extra, which the image does not install.
COPY sagatools ./sagatools
RUN pip install . && cd / && rm -rf /src

RUN useradd --create-home --uid 10001 saga
USER saga
WORKDIR /home/saga

ENTRYPOINT ["saga"]
CMD ["--help"]
