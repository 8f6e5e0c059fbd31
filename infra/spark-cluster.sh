#!/usr/bin/env bash
# A Spark standalone cluster on loopback, for `saga reconcile --master spark://...`:
# one master and SPARK_WORKERS workers (two by default, one core and 1 GiB each), run
# as plain background processes from the pyspark package of the virtual environment.
# The pip package has bin/spark-class but no sbin/start-master.sh, so this script
# starts the master and worker classes itself. It is an option of the local services
# (infra/services.sh), started on its own: nothing else needs it.
#
#   infra/spark-cluster.sh up      start what is not running, wait until every worker registered
#   infra/spark-cluster.sh down    stop the master and the workers this script started (by pid)
#   infra/spark-cluster.sh status  master and workers up or down, then the exports
#   infra/spark-cluster.sh env     only the exports: SAGA_SPARK_MASTER (for saga reconcile
#                                  --master) and SAGA_SPARK_MASTER_UI (the master's web UI;
#                                  <ui>/json/ lists workers and applications)
#
# The workers need no jar of their own: `saga reconcile` names the connector jars in
# spark.jars, and the executors fetch them from the driver. The executors start the
# driver's Python (the venv's) for the ledger readers. Nothing here asks for a password:
# the cluster listens on SAGA_HOST only (loopback by default) and has no authentication,
# like a development cluster; see README "Running on a cluster".
#
# Settings (environment): SAGA_PYTHON (a python with pyspark; default .venv/bin/python),
# SPARK_MASTER_PORT (17077), SPARK_MASTER_WEBUI_PORT (18080), SPARK_WORKERS (2),
# SPARK_WORKER_CORES (1), SPARK_WORKER_MEMORY (1g), SPARK_WORKER_WEBUI_PORT (18081, one
# more per worker), SAGA_SPARK_CLUSTER_DIR (logs, pid files, work folders; default
# <infra dir>/spark-cluster). SAGA_HOST and SAGA_INFRA_DIR come from infra/config.env.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=infra/config.env
source infra/config.env

D=$(realpath -m "$SAGA_INFRA_DIR")
C=$(realpath -m "${SAGA_SPARK_CLUSTER_DIR:-$D/spark-cluster}")
LOGS=$C/logs
PIDS=$C/pids
PYTHON=${SAGA_PYTHON:-$ROOT/.venv/bin/python}
MASTER_PORT=${SPARK_MASTER_PORT:-17077}
MASTER_UI_PORT=${SPARK_MASTER_WEBUI_PORT:-18080}
WORKERS=${SPARK_WORKERS:-2}
WORKER_CORES=${SPARK_WORKER_CORES:-1}
WORKER_MEMORY=${SPARK_WORKER_MEMORY:-1g}
WORKER_UI_PORT=${SPARK_WORKER_WEBUI_PORT:-18081}
READY_TIMEOUT=${SAGA_READY_TIMEOUT:-90}
MASTER_URL=spark://$SAGA_HOST:$MASTER_PORT
MASTER_UI=http://$SAGA_HOST:$MASTER_UI_PORT

say() { printf 'saga spark-cluster: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

check_settings() {
  local name value
  for name in MASTER_PORT MASTER_UI_PORT WORKERS WORKER_CORES WORKER_UI_PORT; do
    value=${!name}
    [[ $value =~ ^[0-9]+$ ]] && [ "$value" -ge 1 ] || die "$name is '$value': use a positive number"
  done
  [[ $WORKER_MEMORY =~ ^[0-9]+[mMgG]$ ]] || die "SPARK_WORKER_MEMORY is '$WORKER_MEMORY': use e.g. 512m or 2g"
}

names() { # master, then worker-1 ... worker-N
  local i
  echo master
  for ((i = 1; i <= WORKERS; i++)); do echo "worker-$i"; done
}

# ---------------------------------------------------------------- processes

pid_of() { [ -f "$PIDS/$1.pid" ] && cat "$PIDS/$1.pid" || true; }

running() {
  local pid; pid=$(pid_of "$1")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

spark_home() {
  [ -x "$PYTHON" ] || die "no python at $PYTHON: run 'make venv' first (or set SAGA_PYTHON to a python with pyspark)"
  "$PYTHON" -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))' 2>/dev/null ||
    die "$PYTHON has no pyspark: run 'make venv' (or install saga-olep[spark]) first"
}

# The master's JSON status (workers, applications), or nothing when it does not answer.
master_json() {
  "$PYTHON" - "$MASTER_UI/json/" <<'EOF' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=3) as answer:
    sys.stdout.write(answer.read().decode())
EOF
}

alive_workers() {
  master_json | "$PYTHON" -c '
import json, sys
print(sum(1 for w in json.load(sys.stdin).get("workers", []) if w.get("state") == "ALIVE"))' \
    2>/dev/null || echo 0
}

wait_for() { # name what check-command...
  local name=$1 what=$2; shift 2
  local deadline=$((SECONDS + READY_TIMEOUT))
  while true; do
    running "$name" || die "$name exited while starting; see its log: $LOGS/$name.log"
    "$@" && return 0
    [ $SECONDS -lt $deadline ] || die "$what within ${READY_TIMEOUT}s; see $LOGS/$name.log"
    sleep 0.5
  done
}

port_open() { (exec 3<>"/dev/tcp/$SAGA_HOST/$1") 2>/dev/null; }

# A port another process holds would make the new daemon fail, or worse, make this
# script talk to someone else's master.
check_free() { # port what
  ! port_open "$1" || die "port $1 ($2) is in use on $SAGA_HOST, by another Spark cluster or \
program: stop it, or choose another port (the variables in infra/spark-cluster.sh's header)"
}

master_answers() { master_json >/dev/null; }
workers_registered() { [ "$(alive_workers)" -ge "$WORKERS" ]; }

# Starts a Spark daemon class in the background; spark-class execs the JVM, so the pid
# recorded is the JVM's. The executors a worker starts inherit its environment: they
# bind to SAGA_HOST too (SPARK_LOCAL_IP; else Spark picks the first non-loopback
# interface), and keep shuffle and temporary files under the cluster folder.
start_daemon() { # name class args...
  local name=$1; shift
  # spark.port.maxRetries=0: a port in use fails the start instead of Spark moving to
  # the next port, which the exports would not name.
  SPARK_HOME=$HOME_DIR SPARK_LOCAL_IP=$SAGA_HOST SPARK_LOCAL_DIRS="$C/tmp" SPARK_DAEMON_MEMORY=512m \
    SPARK_DAEMON_JAVA_OPTS="-Dspark.port.maxRetries=0" \
    SPARK_WORKER_OPTS="-Dspark.worker.cleanup.enabled=true -Dspark.worker.cleanup.appDataTtl=86400" \
    nohup "$HOME_DIR/bin/spark-class" "$@" </dev/null >"$LOGS/$name.log" 2>&1 &
  echo $! >"$PIDS/$name.pid"
}

up() {
  check_settings
  command -v java >/dev/null || [ -n "${JAVA_HOME:-}" ] ||
    die "java is missing: install a JDK 17 ('apt-get install openjdk-17-jre-headless'), then retry."
  HOME_DIR=$(spark_home)
  mkdir -p "$LOGS" "$PIDS" "$C/tmp" "$C/work"
  if ! running master; then
    check_free "$MASTER_PORT" SPARK_MASTER_PORT
    check_free "$MASTER_UI_PORT" SPARK_MASTER_WEBUI_PORT
    say "starting the Spark master at $MASTER_URL (web UI $MASTER_UI)"
    start_daemon master org.apache.spark.deploy.master.Master \
      --host "$SAGA_HOST" --port "$MASTER_PORT" --webui-port "$MASTER_UI_PORT"
  fi
  wait_for master "the Spark master did not answer at $MASTER_UI" master_answers
  local i name
  for ((i = 1; i <= WORKERS; i++)); do
    name=worker-$i
    running "$name" && continue
    check_free $((WORKER_UI_PORT + i - 1)) "SPARK_WORKER_WEBUI_PORT + $((i - 1))"
    say "starting Spark $name ($WORKER_CORES core(s), $WORKER_MEMORY)"
    mkdir -p "$C/work/$name"
    start_daemon "$name" org.apache.spark.deploy.worker.Worker "$MASTER_URL" \
      --host "$SAGA_HOST" --cores "$WORKER_CORES" --memory "$WORKER_MEMORY" \
      --webui-port $((WORKER_UI_PORT + i - 1)) --work-dir "$C/work/$name"
  done
  wait_for master "not all $WORKERS Spark workers registered with the master" workers_registered
  say "the Spark cluster is up: $MASTER_URL with $WORKERS worker(s) (addresses: 'infra/spark-cluster.sh env')"
}

stop_one() {
  local name=$1 pid; pid=$(pid_of "$name")
  [ -n "$pid" ] || return 0
  if running "$name"; then
    say "stopping Spark $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while running "$name"; do
      if [ $SECONDS -ge $deadline ]; then kill -KILL "$pid" 2>/dev/null || true; break; fi
      sleep 0.2
    done
  fi
  rm -f "$PIDS/$name.pid"
}

down() {
  # Workers first: a worker whose master went away keeps trying to reconnect.
  local name
  for name in $(names | tac); do stop_one "$name"; done
  # Workers started with a larger SPARK_WORKERS than now.
  local file
  for file in "$PIDS"/worker-*.pid; do
    [ -e "$file" ] && stop_one "$(basename "$file" .pid)"
  done
  return 0
}

exports() {
  cat <<EOF
export SAGA_SPARK_MASTER=$MASTER_URL
export SAGA_SPARK_MASTER_UI=$MASTER_UI
EOF
}

status() {
  local name all_up=0
  for name in $(names); do
    if running "$name"; then
      echo "# spark $name: up (pid $(pid_of "$name")), log $LOGS/$name.log"
    else
      echo "# spark $name: down"; all_up=1
    fi
  done
  exports
  return $all_up
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  env) check_settings && exports ;;
  *) echo "usage: infra/spark-cluster.sh up|down|status|env" >&2; exit 2 ;;
esac
