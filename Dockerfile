# The image of saga's application services (docker-compose.yml, profile `app`):
#   docker build -t saga-olep:local .
#   docker run --rm saga-olep:local --help

# ---------------------------------------------------------------- Spark jars
# The jars `saga reconcile` adds to pyspark (the Kafka source and the PostgreSQL and
# MariaDB JDBC drivers), fetched from Maven Central exactly as infra/services.sh does for the
# local setup: the same pom, the same settings, the same versions (infra/config.env).
FROM maven:3.9-eclipse-temurin-17 AS spark-jars
ARG SPARK_VERSION=4.0.0
ARG KAFKA_CLIENTS_FOR_SPARK=3.9.0
ARG COMMONS_POOL2_VERSION=2.12.0
ARG POSTGRES_JDBC_VERSION=42.7.14
ARG MARIADB_JDBC_VERSION=3.5.7
WORKDIR /build
COPY infra/spark/pom.xml infra/spark/pom.xml
COPY infra/maven-settings.xml infra/maven-settings.xml
RUN mvn -s infra/maven-settings.xml -B -q -f infra/spark/pom.xml dependency:copy-dependencies \
        -DoutputDirectory=/spark-jars -DexcludeTransitive=true \
        -Dspark.version="$SPARK_VERSION" \
        -Dkafka.clients.version="$KAFKA_CLIENTS_FOR_SPARK" \
        -Dcommons.pool2.version="$COMMONS_POOL2_VERSION" \
        -Dpostgres.jdbc.version="$POSTGRES_JDBC_VERSION" \
        -Dmariadb.jdbc.version="$MARIADB_JDBC_VERSION" \
    && ls /spark-jars/spark-sql-kafka-0-10_2.13-*.jar

# ---------------------------------------------------------------- the application
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SAGA_SPARK_JARS=/opt/saga/spark-jars

# A Java runtime for pyspark (the reconciliation job runs Spark in the JVM).
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends default-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*

COPY --from=spark-jars /spark-jars /opt/saga/spark-jars

# Only what the package needs: no virtual environment, caches or local service data.
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY coordinator ./coordinator
COPY participants ./participants
COPY streams ./streams
COPY saga ./saga
# Every extra: the three storages' drivers (participants), pyspark (saga reconcile)
# and the tools (saga demo --setup-only, the init step of the compose app profile).
RUN pip install '.[all]' && cd / && rm -rf /src

RUN useradd --create-home --uid 10001 saga
USER saga
WORKDIR /home/saga

ENTRYPOINT ["saga"]
CMD ["--help"]
