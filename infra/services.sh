#!/usr/bin/env bash
# Local services for saga, as plain processes on loopback (no Docker engine):
# Apache Kafka (KRaft, one node), PostgreSQL, Redis (AOF on) and FerretDB
# (MongoDB wire protocol, SQLite backend), plus the Spark connector jars.
#
#   infra/services.sh provision   install / download what is missing (cheap when repeated)
#   infra/services.sh up          provision, then start what is not running and wait for it
#   infra/services.sh down        stop every service this script started (by pid)
#   infra/services.sh status      which services are up, then their addresses as shell exports
#   infra/services.sh env         only the shell exports
#
# Versions, ports and folders: infra/config.env.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=infra/config.env
source infra/config.env

D=$(realpath -m "$SAGA_INFRA_DIR")
LOGS=$D/logs
PIDS=$D/pids
SERVICES=(kafka postgres redis mongo)
READY_TIMEOUT=${SAGA_READY_TIMEOUT:-90}

say() { printf 'saga infra: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# ---------------------------------------------------------------- provision

need_root_for() {
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
    die "$1 is missing and installing it needs root: run 'apt-get install $2' as root, then retry."
  fi
}

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

pg_bindir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/postgres" ] && { echo "$d"; return 0; }
  done
  return 1
}

provision_debian() {
  local missing=()
  pg_bindir >/dev/null || missing+=(postgresql)
  command -v redis-server >/dev/null || missing+=(redis-server)
  [ ${#missing[@]} -eq 0 ] && return 0
  need_root_for "${missing[*]}" "${missing[*]}"
  say "installing ${missing[*]} from Debian packages"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$LOGS/apt.log" 2>&1 ||
    die "apt-get update failed; see $LOGS/apt.log"
  # policy-rc.d keeps the packages' own system services from starting; ours run on other ports.
  as_root sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d'
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >>"$LOGS/apt.log" 2>&1 ||
    { as_root rm -f /usr/sbin/policy-rc.d; die "apt-get install ${missing[*]} failed; see $LOGS/apt.log"; }
  as_root rm -f /usr/sbin/policy-rc.d
}

maven_fetch() { # pom-dir out-dir stamp-text extra-args...
  local pom=$1 out=$2 stamp=$3; shift 3
  if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp" ]; then return 0; fi
  command -v mvn >/dev/null || die "Maven (mvn) is missing: install it with 'apt-get install maven', then retry."
  say "fetching $(basename "$out") jars from Maven Central ($stamp)"
  rm -rf "$out.tmp" && mkdir -p "$out.tmp"
  if ! mvn -s infra/maven-settings.xml -B -q -f "$pom/pom.xml" dependency:copy-dependencies \
      -DoutputDirectory="$out.tmp" "$@" >"$LOGS/maven-$(basename "$out").log" 2>&1; then
    die "could not fetch $(basename "$out") jars; see $LOGS/maven-$(basename "$out").log"
  fi
  rm -rf "$out" && mv "$out.tmp" "$out" && echo "$stamp" >"$out/.stamp"
}

# FerretDB v1.24's SQLite backend looks documents up by an _id expression that
# differs from the one its unique index is built on, so every lookup by _id scans
# the table. The build patches that one expression in a private copy of the
# module (under $D, never in this repository) so lookups use the index.
FERRETDB_ID_FROM="IDColumn = DefaultColumn + \"->'\$._id'\""
FERRETDB_ID_TO="IDColumn = DefaultColumn + \"->'_id'\""

provision_ferretdb() {
  local bin=$D/bin/saga-ferretdb stamp
  stamp=$( (cat infra/ferretdb/go.mod infra/ferretdb/go.sum infra/ferretdb/main.go; echo "$FERRETDB_ID_TO") | sha256sum | cut -c1-16)
  if [ -x "$bin" ] && [ -f "$D/bin/.ferretdb-stamp" ] && [ "$(cat "$D/bin/.ferretdb-stamp")" = "$stamp" ]; then
    return 0
  fi
  command -v go >/dev/null || die "Go is missing: install Go 1.22 or newer, then retry."
  say "building FerretDB (go install, a minute or two the first time)"
  mkdir -p "$D/bin"
  local build=$D/ferretdb-build src=$D/ferretdb-build/ferretdb-module
  if ! (
    set -e
    rm -rf "$build" && mkdir -p "$build"
    cp infra/ferretdb/go.mod infra/ferretdb/go.sum infra/ferretdb/main.go "$build/"
    cd "$build"
    GOFLAGS=-mod=mod go mod download github.com/FerretDB/FerretDB
    cp -r "$(GOFLAGS=-mod=mod go list -m -f '{{.Dir}}' github.com/FerretDB/FerretDB)" "$src"
    chmod -R u+w "$src"
    meta=$src/internal/backends/sqlite/metadata/metadata.go
    grep -qF "$FERRETDB_ID_FROM" "$meta"
    sed -i "s|$(printf '%s' "$FERRETDB_ID_FROM" | sed 's/[$.*[\]/\\&/g')|$FERRETDB_ID_TO|" "$meta"
    grep -qF "$FERRETDB_ID_TO" "$meta"
    go mod edit -replace "github.com/FerretDB/FerretDB=$src"
    GOBIN="$D/bin.tmp" GOFLAGS=-mod=mod go install .
  ) >"$LOGS/go-ferretdb.log" 2>&1; then
    die "could not build FerretDB; see $LOGS/go-ferretdb.log"
  fi
  mv "$D/bin.tmp/ferretdb" "$bin" && rmdir "$D/bin.tmp" && echo "$stamp" >"$D/bin/.ferretdb-stamp"
}

provision() {
  mkdir -p "$LOGS" "$PIDS"
  provision_debian
  command -v java >/dev/null || die "Java is missing: install a Java 17 runtime, then retry."
  maven_fetch infra/kafka "$D/kafka-libs" "kafka $KAFKA_VERSION slf4j2" -DincludeScope=runtime \
    -Dkafka.version="$KAFKA_VERSION"
  maven_fetch infra/spark "$D/spark-jars" \
    "spark $SPARK_VERSION kafka-clients $KAFKA_CLIENTS_FOR_SPARK pool2 $COMMONS_POOL2_VERSION jdbc $POSTGRES_JDBC_VERSION" \
    -DexcludeTransitive=true -Dspark.version="$SPARK_VERSION" \
    -Dkafka.clients.version="$KAFKA_CLIENTS_FOR_SPARK" -Dcommons.pool2.version="$COMMONS_POOL2_VERSION" \
    -Dpostgres.jdbc.version="$POSTGRES_JDBC_VERSION"
  provision_ferretdb
}

# ---------------------------------------------------------------- processes

pid_of() { [ -f "$PIDS/$1.pid" ] && cat "$PIDS/$1.pid" || true; }

running() {
  local pid; pid=$(pid_of "$1")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  # A killed server whose parent has not reaped it yet is a zombie: not running.
  [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

port_open() { (exec 3<>"/dev/tcp/$SAGA_HOST/$1") 2>/dev/null; }

wait_ready() { # name check-command...
  local name=$1; shift
  local deadline=$((SECONDS + READY_TIMEOUT))
  until "$@"; do
    if ! running "$name"; then
      die "$name exited while starting; see its log: $LOGS/$name.log"
    fi
    if [ $SECONDS -ge $deadline ]; then
      die "$name did not become ready within ${READY_TIMEOUT}s; see its log: $LOGS/$name.log"
    fi
    sleep 0.5
  done
}

# The server refuses to run as root, so as root it runs as the postgres
# user, which must be able to reach its data folder.
pg_user() { if [ "$(id -u)" -eq 0 ]; then echo postgres; else id -un; fi; }
pg_run() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

pg_data() {
  local want=$D/postgres
  if [ "$(id -u)" -eq 0 ]; then
    mkdir -p "$want"; chown postgres "$want"
    if ! runuser -u postgres -- test -w "$want"; then
      # The checkout's folders are closed to other users: keep the cluster where postgres can reach it.
      want=/var/tmp/saga-infra-postgres-$POSTGRES_PORT
      mkdir -p "$want"; chown postgres "$want"
    fi
  fi
  echo "$want"
}

start_postgres() {
  local bin data; bin=$(pg_bindir) || die "PostgreSQL is not installed; run 'make infra-up' as root to install it."
  data=$(pg_data)
  if [ ! -f "$data/PG_VERSION" ]; then
    pg_run "$bin/initdb" -D "$data" -U postgres --auth=trust -E UTF8 >"$LOGS/postgres-initdb.log" 2>&1 ||
      die "PostgreSQL initdb failed; see $LOGS/postgres-initdb.log"
  fi
  : >"$LOGS/postgres.log"; chmod 666 "$LOGS/postgres.log"
  pg_run "$bin/pg_ctl" -D "$data" -l "$LOGS/postgres.log" -w -t "$READY_TIMEOUT" \
    -o "-p $POSTGRES_PORT -c listen_addresses=$SAGA_HOST -c unix_socket_directories='$data' -c max_connections=200" \
    start >/dev/null 2>&1 || die "postgres did not start; see its log: $LOGS/postgres.log"
  head -1 "$data/postmaster.pid" >"$PIDS/postgres.pid"
  echo "$data" >"$PIDS/postgres.data"
  wait_ready postgres pg_run "$bin/pg_isready" -q -h "$SAGA_HOST" -p "$POSTGRES_PORT"
  psql_admin() { pg_run psql -q -v ON_ERROR_STOP=1 -h "$SAGA_HOST" -p "$POSTGRES_PORT" -U postgres -d postgres "$@"; }
  if [ -z "$(psql_admin -tAc "SELECT 1 FROM pg_roles WHERE rolname='$POSTGRES_USER'")" ]; then
    psql_admin -c "CREATE ROLE \"$POSTGRES_USER\" LOGIN CREATEDB PASSWORD '$POSTGRES_PASSWORD'" >/dev/null
  fi
  if [ -z "$(psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname='$POSTGRES_DB'")" ]; then
    psql_admin -c "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\"" >/dev/null
  fi
}

start_redis() {
  mkdir -p "$D/redis"
  nohup redis-server --bind "$SAGA_HOST" --port "$REDIS_PORT" --dir "$D/redis" \
    --appendonly yes --appendfsync everysec --save '' --protected-mode no \
    --daemonize no >"$LOGS/redis.log" 2>&1 &
  echo $! >"$PIDS/redis.pid"
  wait_ready redis sh -c "redis-cli -h $SAGA_HOST -p $REDIS_PORT ping 2>/dev/null | grep -q PONG"
}

start_mongo() {
  mkdir -p "$D/ferretdb-data"
  # synchronous(normal) in WAL mode: a commit survives kill -9 of the server (the WAL is
  # in the OS's cache) and may be lost only if the machine itself crashes -- the same
  # durability as Redis's appendfsync everysec here -- and FerretDB's writes cost
  # about a quarter less (measured: 394 -> 508 steps/s applied by the Mongo adapter).
  nohup "$D/bin/saga-ferretdb" --listen-addr "$SAGA_HOST:$MONGO_PORT" \
    --sqlite-url "file:$D/ferretdb-data/?_pragma=synchronous(normal)" >"$LOGS/mongo.log" 2>&1 &
  echo $! >"$PIDS/mongo.pid"
  wait_ready mongo port_open "$MONGO_PORT"
}

# Always called in a subshell or in the background: it replaces that process with the JVM.
kafka_java() {
  exec java -Xms256m -Xmx1g -XX:+UseG1GC -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$ROOT/infra/kafka/log4j2.properties" \
    -cp "$D/kafka-libs/*" "$@"
}

kafka_started() { port_open "$KAFKA_PORT" && grep -q "Kafka Server started" "$LOGS/kafka.log"; }

start_kafka() {
  local conf=$D/kafka/server.properties
  mkdir -p "$D/kafka/data"
  cat >"$conf" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=$SAGA_HOST:$KAFKA_CONTROLLER_PORT
listeners=PLAINTEXT://$SAGA_HOST:$KAFKA_PORT,CONTROLLER://$SAGA_HOST:$KAFKA_CONTROLLER_PORT
advertised.listeners=PLAINTEXT://$SAGA_HOST:$KAFKA_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$D/kafka/data
auto.create.topics.enable=false
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.segment.bytes=67108864
log.retention.hours=168
# how often segments past a topic's retention.ms are deleted (the status topic's
# retention is twice the coordinator's; 5 minutes by default)
log.retention.check.interval.ms=30000
EOF
  if [ ! -f "$D/kafka/data/meta.properties" ]; then
    local cluster_id
    cluster_id=$( (kafka_java kafka.tools.StorageTool random-uuid) 2>>"$LOGS/kafka-format.log")
    (kafka_java kafka.tools.StorageTool format -t "$cluster_id" -c "$conf" --standalone) \
      >>"$LOGS/kafka-format.log" 2>&1 || die "formatting Kafka's log folder failed; see $LOGS/kafka-format.log"
  fi
  kafka_java kafka.Kafka "$conf" </dev/null >"$LOGS/kafka.log" 2>&1 &
  echo $! >"$PIDS/kafka.pid"
  wait_ready kafka kafka_started
}

up() {
  provision
  local s
  for s in "${SERVICES[@]}"; do
    if running "$s"; then continue; fi
    say "starting $s"
    "start_$s"
  done
  say "all services are up (addresses: 'make infra-status')"
}

stop_one() {
  local s=$1 pid; pid=$(pid_of "$s")
  [ -n "$pid" ] || return 0
  if running "$s"; then
    say "stopping $s (pid $pid)"
    # PostgreSQL's SIGTERM waits for clients to leave; SIGINT is its fast shutdown.
    local sig=TERM; [ "$s" = postgres ] && sig=INT
    kill -"$sig" "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while running "$s"; do
      if [ $SECONDS -ge $deadline ]; then kill -KILL "$pid" 2>/dev/null || true; break; fi
      sleep 0.2
    done
  fi
  rm -f "$PIDS/$s.pid"
}

down() {
  local s
  for s in "${SERVICES[@]}"; do stop_one "$s"; done
}

exports() {
  cat <<EOF
export SAGA_KAFKA_BOOTSTRAP=$SAGA_HOST:$KAFKA_PORT
export SAGA_POSTGRES_URL=postgresql://$POSTGRES_USER:$POSTGRES_PASSWORD@$SAGA_HOST:$POSTGRES_PORT/$POSTGRES_DB
export SAGA_MONGO_URL=mongodb://$SAGA_HOST:$MONGO_PORT/
export SAGA_REDIS_URL=redis://$SAGA_HOST:$REDIS_PORT/0
export SAGA_SPARK_JARS=$D/spark-jars
EOF
}

status() {
  local s all_up=0
  for s in "${SERVICES[@]}"; do
    if running "$s"; then
      echo "# $s: up (pid $(pid_of "$s")), log $LOGS/$s.log"
    else
      echo "# $s: down"; all_up=1
    fi
  done
  exports
  return $all_up
}

case "${1:-}" in
  provision) provision ;;
  up) up ;;
  down) down ;;
  status) status ;;
  env) exports ;;
  *) echo "usage: infra/services.sh provision|up|down|status|env" >&2; exit 2 ;;
esac
