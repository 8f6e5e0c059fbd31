#!/usr/bin/env bash
# A local three-broker Kafka cluster on loopback, next to the single node of
# infra/services.sh (other ports, other folders: both can run at once).
#
# Three combined broker+controller nodes (KRaft, a static quorum of three voters),
# node N listening on KAFKA_CLUSTER_PORT + 100*(N-1) (clients) and one more
# (controller). Internal topics at replication factor 3, min.insync.replicas 2 by
# default, no unclean leader election: a partition takes writes while two of its
# three replicas are in sync, and never elects a replica that may have lost data.
# PLAINTEXT only (no SASL listener): it is the crash-test bed of `make chaos-cluster`.
#
#   infra/kafka-cluster.sh up       provision the Kafka jars if missing, start the nodes that
#                                   are not running, wait until all three serve
#   infra/kafka-cluster.sh start N  start node N only (if not running) and wait for it
#   infra/kafka-cluster.sh down     stop every node this script started (by pid)
#   infra/kafka-cluster.sh status   which nodes are up, then the shell exports
#   infra/kafka-cluster.sh env      only the shell exports (SAGA_KAFKA_BOOTSTRAP=a,b,c)
#
# Data, logs and pid files: <infra dir>/kafka-cluster/node-N, <infra dir>/logs/kafka-cluster-N.log,
# <infra dir>/pids/kafka-cluster-N.pid. Versions and the infra dir: infra/config.env.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# shellcheck source=infra/config.env
source infra/config.env

KAFKA_CLUSTER_PORT=${KAFKA_CLUSTER_PORT:-29092}
NODES=(1 2 3)
D=$(realpath -m "$SAGA_INFRA_DIR")
LOGS=$D/logs
PIDS=$D/pids
HOME_DIR=$D/kafka-cluster
READY_TIMEOUT=${SAGA_READY_TIMEOUT:-120}

say() { printf 'saga kafka-cluster: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

client_port() { echo $((KAFKA_CLUSTER_PORT + 100 * ($1 - 1))); }
controller_port() { echo $((KAFKA_CLUSTER_PORT + 100 * ($1 - 1) + 1)); }

bootstrap() {
  local n out=()
  for n in "${NODES[@]}"; do out+=("$SAGA_HOST:$(client_port "$n")"); done
  (IFS=,; echo "${out[*]}")
}

voters() {
  local n out=()
  for n in "${NODES[@]}"; do out+=("$n@$SAGA_HOST:$(controller_port "$n")"); done
  (IFS=,; echo "${out[*]}")
}

# The same jars as the single node (infra/services.sh provision fetches them with the
# same stamp, so either script's copy serves both).
provision() {
  mkdir -p "$LOGS" "$PIDS"
  command -v java >/dev/null || die "Java is missing: install a Java 17 runtime, then retry."
  local out=$D/kafka-libs stamp="kafka $KAFKA_VERSION slf4j2"
  if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$stamp" ]; then return 0; fi
  command -v mvn >/dev/null || die "Maven (mvn) is missing: install it with 'apt-get install maven', then retry."
  say "fetching the Kafka $KAFKA_VERSION jars from Maven Central"
  rm -rf "$out.tmp" && mkdir -p "$out.tmp"
  mvn -s infra/maven-settings.xml -B -q -f infra/kafka/pom.xml dependency:copy-dependencies \
    -DoutputDirectory="$out.tmp" -DincludeScope=runtime -Dkafka.version="$KAFKA_VERSION" \
    >"$LOGS/maven-kafka-libs.log" 2>&1 || die "could not fetch the Kafka jars; see $LOGS/maven-kafka-libs.log"
  rm -rf "$out" && mv "$out.tmp" "$out" && echo "$stamp" >"$out/.stamp"
}

pid_of() { [ -f "$PIDS/kafka-cluster-$1.pid" ] && cat "$PIDS/kafka-cluster-$1.pid" || true; }

running() {
  local pid; pid=$(pid_of "$1")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]
}

port_open() { (exec 3<>"/dev/tcp/$SAGA_HOST/$1") 2>/dev/null; }

# Always in a subshell or in the background: it replaces that process with the JVM.
# Half the single node's heap: three of them share the machine. The client JIT only
# (TieredStopAtLevel=1) and the serial collector: a node restarts in about half the time
# (measured 17 s -> 10 s on two busy cores), which the crash profile does dozens of times,
# and the light test load never needs the optimising compiler.
kafka_java() {
  exec java -Xms128m -Xmx512m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$ROOT/infra/kafka/log4j2.properties" \
    -cp "$D/kafka-libs/*" "$@"
}

node_conf() { # node
  local n=$1
  cat <<EOF
# Written by infra/kafka-cluster.sh on every start of node $n: edits here are lost.
process.roles=broker,controller
node.id=$n
controller.quorum.voters=$(voters)
listeners=PLAINTEXT://$SAGA_HOST:$(client_port "$n"),CONTROLLER://$SAGA_HOST:$(controller_port "$n")
advertised.listeners=PLAINTEXT://$SAGA_HOST:$(client_port "$n")
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$HOME_DIR/node-$n/data
auto.create.topics.enable=false
num.partitions=1
# Durability: three copies, a write is acknowledged (acks=all) once two hold it, and a
# replica that fell out of sync is never elected leader (it may lack acknowledged writes).
default.replication.factor=3
min.insync.replicas=2
unclean.leader.election.enable=false
offsets.topic.replication.factor=3
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
transaction.state.log.num.partitions=8
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
# The broker aborts a transaction past its transaction.timeout.ms only when this check
# runs (every 10 s by default): a coordinator gone for good left its open transaction
# blocking its successor's read_committed reads up to 10 s past that timeout.
transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
# A node that stops heartbeating to the controller quorum for this long is fenced and
# its partitions get new leaders. Kafka's default is 9 s (heartbeat 2 s): every partition
# a crashed node led takes no writes that long. 6 s (heartbeat 1.5 s) shortens that by a
# third; the price is that a live node stalled that long (a long GC pause, a starved
# CPU) is fenced too and its leaderships move (no data is lost: min.insync.replicas 2).
# The chaos profile's pauses are sized past it (tests/chaos/broker_faults.py).
broker.session.timeout.ms=6000
broker.heartbeat.interval.ms=1500
group.initial.rebalance.delay.ms=0
log.segment.bytes=67108864
log.retention.hours=168
log.retention.check.interval.ms=30000
EOF
}

# The log keeps every start of the node (appended, each after a "--- start" line); a
# start is done once its own part of the log says so.
node_started() {
  port_open "$(client_port "$1")" &&
    awk '/^--- start /{n=0} /Kafka Server started/{n=1} END{exit !n}' "$LOGS/kafka-cluster-$1.log"
}

wait_node() { # node
  local n=$1 deadline=$((SECONDS + READY_TIMEOUT))
  until node_started "$n"; do
    running "$n" || die "node $n exited while starting; see its log: $LOGS/kafka-cluster-$n.log"
    [ $SECONDS -lt $deadline ] || die "node $n did not start within ${READY_TIMEOUT}s; see $LOGS/kafka-cluster-$n.log"
    sleep 0.5
  done
}

cluster_id() {
  if [ ! -s "$HOME_DIR/cluster.id" ]; then
    mkdir -p "$HOME_DIR"
    (kafka_java kafka.tools.StorageTool random-uuid) 2>>"$LOGS/kafka-cluster-format.log" >"$HOME_DIR/cluster.id.tmp"
    mv "$HOME_DIR/cluster.id.tmp" "$HOME_DIR/cluster.id"
  fi
  cat "$HOME_DIR/cluster.id"
}

launch_node() { # node: start it in the background (no wait)
  local n=$1 dir=$HOME_DIR/node-$n
  mkdir -p "$dir/data"
  node_conf "$n" >"$dir/server.properties"
  if [ ! -f "$dir/data/meta.properties" ]; then
    (kafka_java kafka.tools.StorageTool format -t "$(cluster_id)" -c "$dir/server.properties") \
      >>"$LOGS/kafka-cluster-format.log" 2>&1 ||
      die "formatting node $n's log folder failed; see $LOGS/kafka-cluster-format.log"
  fi
  say "starting node $n ($SAGA_HOST:$(client_port "$n"))"
  echo "--- start $(date -u '+%F %T') ---" >>"$LOGS/kafka-cluster-$n.log"
  # setsid: a test that SIGKILLs a node kills that JVM only, never this script's group.
  setsid bash -c "$(declare -f kafka_java); D='$D'; ROOT='$ROOT'; kafka_java kafka.Kafka '$dir/server.properties'" \
    </dev/null >>"$LOGS/kafka-cluster-$n.log" 2>&1 &
  echo $! >"$PIDS/kafka-cluster-$n.pid"
}

up() {
  provision
  local n started=()
  for n in "${NODES[@]}"; do
    running "$n" || { launch_node "$n"; started+=("$n"); }
  done
  # All at once, then wait: a node finishes starting only once the quorum has a leader.
  for n in "${started[@]}"; do wait_node "$n"; done
  say "three nodes up: $(bootstrap)"
}

start_one() { # node
  local n=$1
  [[ " ${NODES[*]} " == *" $n "* ]] || die "no node '$n': use 1, 2 or 3"
  provision
  running "$n" || launch_node "$n"
  wait_node "$n"
}

stop_one() {
  local n=$1 pid; pid=$(pid_of "$n")
  [ -n "$pid" ] || return 0
  if running "$n"; then
    say "stopping node $n (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 60))
    while running "$n"; do
      if [ $SECONDS -ge $deadline ]; then kill -KILL "$pid" 2>/dev/null || true; break; fi
      sleep 0.2
    done
  fi
  rm -f "$PIDS/kafka-cluster-$n.pid"
}

down() {
  local n
  # TERM to all first: each waits for the others' controlled shutdown otherwise.
  for n in "${NODES[@]}"; do running "$n" && kill -TERM "$(pid_of "$n")" 2>/dev/null || true; done
  for n in "${NODES[@]}"; do stop_one "$n"; done
}

# SAGA_BROKERS_DIR: where the chaos suite finds the nodes' pid files (not SAGA_KAFKA_*,
# which saga reads as librdkafka settings).
exports() {
  cat <<EOF
export SAGA_KAFKA_BOOTSTRAP=$(bootstrap)
export SAGA_BROKERS_DIR=$D
EOF
}

status() {
  local n all_up=0
  for n in "${NODES[@]}"; do
    if running "$n"; then
      echo "# node $n: up (pid $(pid_of "$n")), $SAGA_HOST:$(client_port "$n"), log $LOGS/kafka-cluster-$n.log"
    else
      echo "# node $n: down"; all_up=1
    fi
  done
  exports
  return $all_up
}

case "${1:-}" in
  up) up ;;
  start) start_one "${2:-}" ;;
  down) down ;;
  status) status ;;
  env) exports ;;
  *) echo "usage: infra/kafka-cluster.sh up|start N|down|status|env" >&2; exit 2 ;;
esac
