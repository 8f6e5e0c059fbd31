#!/usr/bin/env bash
# Local services for saga, as plain processes on loopback (no Docker engine):
# Apache Kafka (KRaft, one node), PostgreSQL, Redis (AOF on), FerretDB
# (MongoDB wire protocol, SQLite backend) and MariaDB, plus the Spark connector jars.
#
# Credentials, as in production: PostgreSQL and MariaDB ask TCP clients for a
# password (SCRAM-SHA-256; a password user), Redis for its password (requirepass),
# and Kafka has a second
# listener, SASL_SSL with SCRAM-SHA-512 users and ACLs (KAFKA_SASL in config.env),
# next to the PLAINTEXT one everything else uses. Generated secrets live under
# <infra dir>/secrets, readable by the owner only. FerretDB runs without
# authentication. An install made before credentials existed is upgraded in place
# by the next `up` (Redis gets its password live, PostgreSQL reloads pg_hba.conf,
# Kafka restarts once with the new listener).
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
# shellcheck source=infra/policy_rc.sh
source infra/policy_rc.sh

D=$(realpath -m "$SAGA_INFRA_DIR")
LOGS=$D/logs
PIDS=$D/pids
SECRETS=$D/secrets
KAFKA_SECRETS=$SECRETS/kafka
TLS=$SECRETS/tls
SERVICES=(kafka postgres redis mongo mariadb)
READY_TIMEOUT=${SAGA_READY_TIMEOUT:-90}

say() { printf 'saga infra: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# ---------------------------------------------------------------- secrets

sasl_on() { [ "$KAFKA_SASL" = on ]; }

private_dir() { mkdir -p "$1" && chmod 700 "$1"; }

# A random secret in a file only its owner can read, created once.
secret_file() { # path
  if [ ! -s "$1" ]; then
    private_dir "$(dirname "$1")"
    (umask 077 && openssl rand -hex 24 >"$1.tmp") && mv "$1.tmp" "$1"
  fi
  chmod 600 "$1"
}

# Kafka's SCRAM users, one per line: admin (a super user), the other roles, then
# participant-<name> per participant.
kafka_users() {
  local item
  local -a items
  echo admin
  IFS=, read -r -a items <<<"$KAFKA_SASL_ROLES"
  for item in "${items[@]}"; do [ -n "$item" ] && [ "$item" != admin ] && echo "$item"; done
  IFS=, read -r -a items <<<"$KAFKA_SASL_PARTICIPANTS"
  for item in "${items[@]}"; do [ -n "$item" ] && echo "participant-$item"; done
  return 0
}

check_settings() {
  case "$KAFKA_SASL" in on | off) ;; *) die "KAFKA_SASL is '$KAFKA_SASL': use on or off" ;; esac
  case "$REDIS_PASSWORD" in
    *[[:space:]\'\"\\]*) die "REDIS_PASSWORD may not hold spaces, quotes or backslashes" ;;
  esac
  local user
  while read -r user; do
    [[ $user =~ ^[A-Za-z0-9._-]+$ ]] ||
      die "Kafka user '$user' (KAFKA_SASL_ROLES, KAFKA_SASL_PARTICIPANTS): use A-Z, a-z, 0-9, '.', '_' and '-'"
  done < <(kafka_users)
}

redis_password() {
  if [ -n "$REDIS_PASSWORD" ]; then
    printf '%s' "$REDIS_PASSWORD"
  else
    secret_file "$SECRETS/redis.password"
    tr -d '\n' <"$SECRETS/redis.password"
  fi
}

# A value percent-encoded for the user information of a URL.
url_encode() {
  local s=$1 out='' c i
  for ((i = 0; i < ${#s}; i++)); do
    c=${s:i:1}
    case "$c" in [A-Za-z0-9._~-]) out+=$c ;; *) printf -v c '%%%02X' "'$c"; out+=$c ;; esac
  done
  printf '%s' "$out"
}

# A self-signed CA and the broker's certificate (for SAGA_HOST, 127.0.0.1 and
# localhost) in a PKCS#12 keystore; made once per infra folder and host.
provision_tls() {
  if [ -s "$TLS/broker.p12" ] && [ "$(cat "$TLS/.host" 2>/dev/null)" = "$SAGA_HOST" ]; then return 0; fi
  command -v openssl >/dev/null || die "openssl is missing: install it with 'apt-get install openssl', then retry."
  say "making a local CA and the Kafka broker's TLS certificate"
  local san="IP:127.0.0.1,DNS:localhost"
  if [[ $SAGA_HOST =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    [ "$SAGA_HOST" = 127.0.0.1 ] || san="IP:$SAGA_HOST,$san"
  elif [ "$SAGA_HOST" != localhost ]; then
    san="DNS:$SAGA_HOST,$san"
  fi
  private_dir "$SECRETS"
  rm -rf "$TLS.tmp" && private_dir "$TLS.tmp"
  if ! (
    set -e
    cd "$TLS.tmp"
    umask 077
    openssl rand -hex 24 >keystore.password
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -subj "/CN=saga local CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -keyout ca.key -out ca.pem
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$SAGA_HOST" -keyout broker.key -out broker.csr
    printf 'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' \
      "$san" >broker.ext
    openssl x509 -req -sha256 -days 3650 -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
      -extfile broker.ext -out broker.pem
    openssl pkcs12 -export -name broker -in broker.pem -inkey broker.key -certfile ca.pem \
      -passout file:keystore.password -out broker.p12
    rm -f broker.csr broker.ext ca.srl
    chmod 644 ca.pem broker.pem # certificates are public; the keys stay 0600
  ) >"$LOGS/tls.log" 2>&1; then
    die "could not make the TLS certificates; see $LOGS/tls.log"
  fi
  rm -rf "$TLS" && mv "$TLS.tmp" "$TLS" && echo "$SAGA_HOST" >"$TLS/.host"
}

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

mariadbd_bin() {
  local b
  for b in "$(command -v mariadbd 2>/dev/null)" /usr/sbin/mariadbd; do
    [ -n "$b" ] && [ -x "$b" ] && { echo "$b"; return 0; }
  done
  return 1
}

provision_debian() {
  local missing=()
  pg_bindir >/dev/null || missing+=(postgresql)
  command -v redis-server >/dev/null || missing+=(redis-server)
  mariadbd_bin >/dev/null || missing+=(mariadb-server)
  [ ${#missing[@]} -eq 0 ] && return 0
  need_root_for "${missing[*]}" "${missing[*]}"
  say "installing ${missing[*]} from Debian packages"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$LOGS/apt.log" 2>&1 ||
    die "apt-get update failed; see $LOGS/apt.log"
  # The packages' own system services must not start (ours run on other ports), and a
  # policy-rc.d the host already had is kept (infra/policy_rc.sh).
  with_services_held as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >>"$LOGS/apt.log" 2>&1 ||
    die "apt-get install ${missing[*]} failed; see $LOGS/apt.log"
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
# It also records, for every cursor and iterator it opens, a pprof sample with the
# stack (runtime.Callers) and a finalizer that panics if the object is never closed:
# a developer's leak check costing about 7 % of the server's CPU here. The same
# private copy makes resource.Track and resource.Untrack return at once.
FERRETDB_TRACK_PATCH="noResourceTracking-1"
# And it hands SQLite the _id of a filter only when the filter is exactly {_id: v}:
# {_id: v, x: 1} decodes every document of the collection. The same private copy
# looks such a filter up by _id whenever it names _id once (every handler still checks
# the whole filter on the documents found), so that a conditional write by _id costs
# one indexed lookup, as on MongoDB (the Mongo adapter detects it from explain).
FERRETDB_ID_PUSHDOWN_PATCH="idPushdown-1"

provision_ferretdb() {
  local bin=$D/bin/saga-ferretdb stamp
  stamp=$( (cat infra/ferretdb/go.mod infra/ferretdb/go.sum infra/ferretdb/main.go; echo "$FERRETDB_ID_TO $FERRETDB_TRACK_PATCH $FERRETDB_ID_PUSHDOWN_PATCH") | sha256sum | cut -c1-16)
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
    res=$src/internal/util/resource/resource.go
    sed -i -e 's|^func Track(obj any, token \*Token) {$|&\n\tif noResourceTracking {\n\t\treturn\n\t}|' \
      -e 's|^func Untrack(obj any, token \*Token) {$|&\n\tif noResourceTracking {\n\t\treturn\n\t}|' "$res"
    [ "$(grep -c 'if noResourceTracking' "$res")" = 2 ]
    printf '\nconst noResourceTracking = true\n' >>"$res"
    coll=$src/internal/backends/sqlite/collection.go
    [ "$(grep -c 'if params.Filter.Len() == 1 {' "$coll")" = 2 ]
    sed -i 's|if params.Filter.Len() == 1 {|if sagaNamesIDOnce(params.Filter) {|' "$coll"
    { echo; printf '%s\n' \
      '// sagaNamesIDOnce: whether the filter names _id exactly once (patched in by saga).' \
      'func sagaNamesIDOnce(filter *types.Document) bool {' \
      '	n := 0' \
      '	for _, k := range filter.Keys() {' \
      '		if k == "_id" {' \
      '			n++' \
      '		}' \
      '	}' \
      '	return n == 1' \
      '}'; } >>"$coll"
    go mod edit -replace "github.com/FerretDB/FerretDB=$src"
    GOBIN="$D/bin.tmp" GOFLAGS=-mod=mod go install .
  ) >"$LOGS/go-ferretdb.log" 2>&1; then
    die "could not build FerretDB; see $LOGS/go-ferretdb.log"
  fi
  mv "$D/bin.tmp/ferretdb" "$bin" && rmdir "$D/bin.tmp" && echo "$stamp" >"$D/bin/.ferretdb-stamp"
}

provision() {
  mkdir -p "$LOGS" "$PIDS"
  check_settings
  provision_debian
  command -v java >/dev/null || die "Java is missing: install a Java 17 runtime, then retry."
  maven_fetch infra/kafka "$D/kafka-libs" "kafka $KAFKA_VERSION slf4j2" -DincludeScope=runtime \
    -Dkafka.version="$KAFKA_VERSION"
  maven_fetch infra/spark "$D/spark-jars" \
    "spark $SPARK_VERSION kafka-clients $KAFKA_CLIENTS_FOR_SPARK pool2 $COMMONS_POOL2_VERSION jdbc $POSTGRES_JDBC_VERSION mariadb-jdbc $MARIADB_JDBC_VERSION" \
    -DexcludeTransitive=true -Dspark.version="$SPARK_VERSION" \
    -Dkafka.clients.version="$KAFKA_CLIENTS_FOR_SPARK" -Dcommons.pool2.version="$COMMONS_POOL2_VERSION" \
    -Dpostgres.jdbc.version="$POSTGRES_JDBC_VERSION" -Dmariadb.jdbc.version="$MARIADB_JDBC_VERSION"
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
pg_run() { if [ "$(id -u)" -eq 0 ]; then (cd / && runuser -u postgres -- "$@"); else "$@"; fi; }

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

# Who may connect how: the script itself as the superuser over the server's socket,
# which lives in the data folder only the server's user can enter; everyone else
# over TCP, with a password (SCRAM-SHA-256).
pg_hba() {
  cat <<'EOF'
# Written by infra/services.sh on every `up`: edits here are lost.
# TYPE  DATABASE  USER  ADDRESS  METHOD
local   all       all            trust
host    all       all   all      scram-sha-256
EOF
}

start_postgres() {
  local bin data; bin=$(pg_bindir) || die "PostgreSQL is not installed; run 'make infra-up' as root to install it."
  data=$(pg_data)
  if [ ! -f "$data/PG_VERSION" ]; then
    pg_run "$bin/initdb" -D "$data" -U postgres --auth-local=trust --auth-host=scram-sha-256 -E UTF8 \
      >"$LOGS/postgres-initdb.log" 2>&1 || die "PostgreSQL initdb failed; see $LOGS/postgres-initdb.log"
  fi
  pg_hba >"$data/pg_hba.conf"
  local pglog=$LOGS/postgres.log
  rm -f "$pglog"; : >"$pglog"; chmod 666 "$pglog"
  if [ "$(id -u)" -eq 0 ] && ! runuser -u postgres -- test -w "$pglog"; then
    # The checkout's folders are closed to other users: the server logs next to its data,
    # and the usual log path points there.
    pglog=/var/tmp/saga-infra-postgres-$POSTGRES_PORT.log
    : >"$pglog"; chmod 666 "$pglog"
    rm -f "$LOGS/postgres.log"; ln -s "$pglog" "$LOGS/postgres.log"
  fi
  pg_run "$bin/pg_ctl" -D "$data" -l "$pglog" -w -t "$READY_TIMEOUT" \
    -o "-p $POSTGRES_PORT -c listen_addresses=$SAGA_HOST -c unix_socket_directories='$data' -c max_connections=200" \
    start >/dev/null 2>&1 || die "postgres did not start; see its log: $LOGS/postgres.log"
  head -1 "$data/postmaster.pid" >"$PIDS/postgres.pid"
  echo "$data" >"$PIDS/postgres.data"
  wait_ready postgres pg_run "$bin/pg_isready" -q -h "$SAGA_HOST" -p "$POSTGRES_PORT"
}

# The user and database of config.env, the user's password (set on every `up`, so a
# changed POSTGRES_PASSWORD applies), and pg_hba.conf: an install that trusted every
# TCP connection (before passwords) is switched over with a reload, no restart.
secure_postgres() {
  local data; data=$(cat "$PIDS/postgres.data" 2>/dev/null || pg_data)
  psql_admin() { pg_run psql -q -X -v ON_ERROR_STOP=1 -h "$data" -p "$POSTGRES_PORT" -U postgres -d postgres "$@"; }
  local user=${POSTGRES_USER//\"/\"\"} password=${POSTGRES_PASSWORD//\'/\'\'}
  if [ -z "$(psql_admin -tAc "SELECT 1 FROM pg_roles WHERE rolname='${POSTGRES_USER//\'/\'\'}'")" ]; then
    psql_admin -c "CREATE ROLE \"$user\" LOGIN CREATEDB" >/dev/null
  fi
  # On standard input, not the command line: no password in the process list.
  printf "SET log_min_error_statement = panic;\nSET password_encryption = 'scram-sha-256';\nALTER ROLE \"%s\" PASSWORD '%s';\n" \
    "$user" "$password" | psql_admin >/dev/null || die "could not set the PostgreSQL password of $POSTGRES_USER"
  if [ -z "$(psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname='${POSTGRES_DB//\'/\'\'}'")" ]; then
    psql_admin -c "CREATE DATABASE \"${POSTGRES_DB//\"/\"\"}\" OWNER \"$user\"" >/dev/null
  fi
  if ! cmp -s <(pg_hba) "$data/pg_hba.conf"; then
    pg_hba >"$data/pg_hba.conf"
    psql_admin -tAc "SELECT pg_reload_conf()" >/dev/null
    say "postgres: TCP connections need a password now (pg_hba.conf rewritten and reloaded)"
  fi
}

# MariaDB, like PostgreSQL, runs as its own user (mysql) when this script runs as
# root, in a data folder that user can reach: under the infra folder when it can,
# else in /var/tmp (a checkout whose folders are closed to other users).
maria_root() { [ "$(id -u)" -eq 0 ]; }

mariadb_data() {
  local want=$D/mariadb
  mkdir -p "$want"
  if maria_root; then
    chown mysql:mysql "$want"
    if ! runuser -u mysql -- test -w "$want"; then
      want=/var/tmp/saga-infra-mariadb-$MARIADB_PORT
      mkdir -p "$want"; chown mysql:mysql "$want"
    fi
  fi
  chmod 700 "$want"
  echo "$want"
}

# The script's own account: the OS user that runs it, over the server's socket (in the
# data folder), authenticated by the socket itself (unix_socket), never over TCP.
mariadb_admin() { # data-folder mariadb-args...
  local data=$1; shift
  mariadb --no-defaults --socket="$data/mariadb.sock" --user="$(id -un)" --batch --skip-column-names "$@"
}
mariadb_answers() { mariadb_admin "$1" -e "SELECT 1" >/dev/null 2>&1; }

start_mariadb() {
  local bin data; bin=$(mariadbd_bin) || die "MariaDB is not installed; run 'make infra-up' as root to install it."
  data=$(mariadb_data)
  # As root the server runs as mysql; otherwise as this user, who also gets an account
  # of its own name for mariadb_admin.
  local as_user=(--user=mysql); maria_root || as_user=(--auth-root-socket-user="$(id -un)")
  if [ ! -d "$data/mysql" ]; then
    (cd / && mariadb-install-db --no-defaults --datadir="$data" "${as_user[@]}" \
      --auth-root-authentication-method=socket --skip-test-db) \
      >"$LOGS/mariadb-install.log" 2>&1 || die "MariaDB's mariadb-install-db failed; see $LOGS/mariadb-install.log"
  fi
  # --no-defaults: the host's /etc/mysql settings (socket, port, data folder) are not ours.
  # Its compiled-in character set is latin1; utf8mb4 as Debian's own configuration has.
  local run_as=(); maria_root && run_as=(--user=mysql)
  (cd / && exec "$bin" --no-defaults --datadir="$data" "${run_as[@]}" --port="$MARIADB_PORT" \
    --bind-address="$SAGA_HOST" --socket="$data/mariadb.sock" --pid-file="$data/mariadb.pid" \
    --skip-name-resolve --max-connections=300 --innodb-buffer-pool-size=256M \
    --character-set-server=utf8mb4 --collation-server=utf8mb4_general_ci) \
    </dev/null >"$LOGS/mariadb.log" 2>&1 &
  echo $! >"$PIDS/mariadb.pid"
  echo "$data" >"$PIDS/mariadb.data"
  wait_ready mariadb mariadb_answers "$data"
  wait_ready mariadb port_open "$MARIADB_PORT"
}

# The user and database of config.env, and the user's password (set on every `up`, so
# a changed MARIADB_PASSWORD applies). The user may use MARIADB_DB and every database
# whose name starts with it (the tests make one per test).
secure_mariadb() {
  local data; data=$(cat "$PIDS/mariadb.data" 2>/dev/null || mariadb_data)
  local user=${MARIADB_USER//\\/\\\\} password=${MARIADB_PASSWORD//\\/\\\\}
  user=${user//\'/\'\'}; password=${password//\'/\'\'}
  local db=${MARIADB_DB//\`/\`\`}
  # On standard input, not the command line: no password in the process list.
  printf "%s\n" \
    "CREATE USER IF NOT EXISTS '$user'@'%' IDENTIFIED BY '$password';" \
    "ALTER USER '$user'@'%' IDENTIFIED BY '$password';" \
    "CREATE DATABASE IF NOT EXISTS \`$db\`;" \
    "GRANT ALL PRIVILEGES ON \`$db%\`.* TO '$user'@'%';" |
    mariadb_admin "$data" >/dev/null 2>"$LOGS/mariadb-admin.log" ||
    die "could not set up the MariaDB user $MARIADB_USER; see $LOGS/mariadb-admin.log"
}

# The settings live in a file (0600) rather than on the command line, which every
# user can read in the process list: it holds the password.
redis_conf() {
  cat <<EOF
# Written by infra/services.sh on every start of Redis: edits here are lost.
bind $SAGA_HOST
port $REDIS_PORT
dir $D/redis
appendonly yes
appendfsync everysec
save ""
protected-mode no
daemonize no
requirepass $(redis_password)
EOF
}

write_redis_conf() { mkdir -p "$D/redis" && (umask 077 && redis_conf >"$D/redis/redis.conf") && chmod 600 "$D/redis/redis.conf"; }

# redis-cli takes the password from REDISCLI_AUTH (not in the process list).
redis_cli() { REDISCLI_AUTH=$(redis_password) redis-cli --no-auth-warning -h "$SAGA_HOST" -p "$REDIS_PORT" "$@"; }
redis_answers() { redis_cli ping 2>/dev/null | grep -q PONG; }

start_redis() {
  write_redis_conf
  nohup redis-server "$D/redis/redis.conf" >"$LOGS/redis.log" 2>&1 &
  echo $! >"$PIDS/redis.pid"
  wait_ready redis redis_answers
}

# A Redis started before passwords (no requirepass) gets its password live; the
# config file has it for the next start.
secure_redis() {
  local reply
  reply=$(redis-cli -h "$SAGA_HOST" -p "$REDIS_PORT" ping 2>&1 || true)
  if [ "$reply" = PONG ]; then
    # On standard input, not the command line: no password in the process list.
    reply=$(printf 'CONFIG SET requirepass "%s"\n' "$(redis_password)" | redis-cli -h "$SAGA_HOST" -p "$REDIS_PORT" 2>&1 || true)
    [ "$reply" = OK ] || die "could not set the Redis password: $reply"
    say "redis: clients need the password now (set live)"
  fi
  redis_answers || die "Redis at $SAGA_HOST:$REDIS_PORT refuses the password of REDIS_PASSWORD / $SECRETS/redis.password"
  write_redis_conf
}

start_mongo() {
  mkdir -p "$D/ferretdb-data"
  # synchronous(normal) in WAL mode: a commit survives kill -9 of the server (the WAL is
  # in the OS's cache) and may be lost only if the machine itself crashes -- the same
  # durability as Redis's appendfsync everysec here -- and FerretDB's writes cost
  # about a quarter less (measured: 394 -> 508 steps/s applied by the Mongo adapter).
  # GOGC=800: FerretDB allocates a lot per command, and Go's default collector
  # (GOGC=100) spent about a fifth of its CPU; at 800 the server takes tens of MB
  # more and about 20 % less CPU per step (python -m tests.mongo_batch_bench:
  # 1.38-1.46 -> 1.09-1.14 ms of server CPU per new step).
  GOGC=${SAGA_FERRETDB_GOGC:-800} nohup "$D/bin/saga-ferretdb" --listen-addr "$SAGA_HOST:$MONGO_PORT" \
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

# The broker's settings. With KAFKA_SASL=on: a SASL_SSL listener (SCRAM-SHA-512, the
# certificate of provision_tls) and KRaft's StandardAuthorizer, which denies what no
# ACL allows; User:ANONYMOUS -- every PLAINTEXT and CONTROLLER client, the broker
# itself included -- and the admin user are super users, so the PLAINTEXT listener
# works as it did before.
kafka_conf() {
  local listeners="PLAINTEXT://$SAGA_HOST:$KAFKA_PORT,CONTROLLER://$SAGA_HOST:$KAFKA_CONTROLLER_PORT"
  local advertised="PLAINTEXT://$SAGA_HOST:$KAFKA_PORT"
  local protocols="PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
  if sasl_on; then
    listeners+=",SASL_SSL://$SAGA_HOST:$KAFKA_SASL_PORT"
    advertised+=",SASL_SSL://$SAGA_HOST:$KAFKA_SASL_PORT"
    protocols+=",SASL_SSL:SASL_SSL"
  fi
  cat <<EOF
# Written by infra/services.sh on every start of Kafka: edits here are lost.
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=$SAGA_HOST:$KAFKA_CONTROLLER_PORT
listeners=$listeners
advertised.listeners=$advertised
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=$protocols
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
# The broker aborts a transaction past its transaction.timeout.ms only when this check
# runs (every 10 s by default): a coordinator gone for good left its open transaction
# blocking its successor's read_committed reads up to 10 s past that timeout.
transaction.abort.timed.out.transaction.cleanup.interval.ms=1000
group.initial.rebalance.delay.ms=0
log.segment.bytes=67108864
log.retention.hours=168
# how often segments past a topic's retention.ms are deleted (the status topic's
# retention is twice the coordinator's; 5 minutes by default)
log.retention.check.interval.ms=30000
EOF
  if sasl_on; then
    cat "$ROOT/infra/kafka/security.properties"
    cat <<EOF
super.users=User:ANONYMOUS;User:admin
listener.name.sasl_ssl.ssl.keystore.location=$TLS/broker.p12
listener.name.sasl_ssl.ssl.keystore.password=$(cat "$TLS/keystore.password")
EOF
  fi
}

# The file holds the keystore's password: only its owner reads it.
write_kafka_conf() { # path
  sasl_on && provision_tls
  mkdir -p "$(dirname "$1")"
  (umask 077 && kafka_conf >"$1") && chmod 600 "$1"
}

start_kafka() {
  local conf=$D/kafka/server.properties
  mkdir -p "$D/kafka/data"
  write_kafka_conf "$conf"
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

# A running broker whose settings differ from what this script writes now (e.g. one
# started before the SASL listener existed) is restarted once; its data stays.
refresh_kafka() {
  local conf=$D/kafka/server.properties
  write_kafka_conf "$conf.new"
  if cmp -s "$conf.new" "$conf"; then rm -f "$conf.new"; return 0; fi
  rm -f "$conf.new"
  say "restarting kafka: its settings changed (listeners, authorizer)"
  stop_one kafka
  start_kafka
}

# Small JVM for Kafka's command-line tools; always in a subshell (it execs).
kafka_tool() {
  exec java -Xms64m -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$ROOT/infra/kafka/log4j2.properties" \
    -cp "$D/kafka-libs/*" "$@"
}

# One SCRAM-SHA-512 user per role, created (or given its password again) through
# the PLAINTEXT listener with Kafka's own tool, once per user, password and cluster.
# The password goes in a 0600 file (--add-config-file), never on a command line.
# Also writes each user's librdkafka settings for `saga --kafka-config FILE`.
secure_kafka() {
  sasl_on || return 0
  private_dir "$SECRETS" && private_dir "$KAFKA_SECRETS"
  local cluster user pwfile password output rc want stamp tmp=$KAFKA_SECRETS/.add-config
  cluster=$(sed -n 's/^cluster.id=//p' "$D/kafka/data/meta.properties")
  while read -r user; do
    pwfile=$KAFKA_SECRETS/$user.password
    secret_file "$pwfile"
    (
      umask 077
      cat >"$KAFKA_SECRETS/$user.properties" <<EOF
# librdkafka settings of the Kafka user $user (saga ... --kafka-config THIS_FILE);
# written by infra/services.sh. bootstrap.servers applies only when neither
# --bootstrap nor SAGA_KAFKA_BOOTSTRAP is given.
bootstrap.servers=$SAGA_HOST:$KAFKA_SASL_PORT
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.username=$user
sasl.password=$(tr -d '\n' <"$pwfile")
ssl.ca.location=$TLS/ca.pem
EOF
    )
    want=$(printf '%s %s' "$cluster" "$(sha256sum <"$pwfile")" | sha256sum | cut -c1-32)
    stamp=$KAFKA_SECRETS/$user.created
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then continue; fi
    # A properties file: the value without the brackets of --add-config's syntax.
    password=$(tr -d '\n' <"$pwfile")
    (umask 077 && printf 'SCRAM-SHA-512=password=%s\n' "$password" >"$tmp")
    rc=0
    output=$( (kafka_tool kafka.admin.ConfigCommand --bootstrap-server "$SAGA_HOST:$KAFKA_PORT" --alter \
      --entity-type users --entity-name "$user" --add-config-file "$tmp") </dev/null 2>&1) || rc=$?
    rm -f "$tmp"
    # What the tool said, with the password masked should it echo it.
    printf '%s\n' "${output//"$password"/***}" >>"$LOGS/kafka-users.log"
    [ "$rc" -eq 0 ] || die "could not create the Kafka user $user; see $LOGS/kafka-users.log"
    echo "$want" >"$stamp"
  done < <(kafka_users)
}

up() {
  provision
  local s
  for s in "${SERVICES[@]}"; do
    if running "$s"; then
      [ "$s" = kafka ] && refresh_kafka
    else
      say "starting $s"
      "start_$s"
    fi
    case "$s" in
      kafka) secure_kafka ;; postgres) secure_postgres ;; redis) secure_redis ;; mariadb) secure_mariadb ;;
    esac
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

# The SASL listener's variables are not SAGA_KAFKA_*: every SAGA_KAFKA_<NAME> variable
# is a librdkafka setting for saga's own clients (streams/kafka/_settings.py).
exports() {
  local pg_user pg_password redis maria_user maria_password
  pg_user=$(url_encode "$POSTGRES_USER")
  pg_password=$(url_encode "$POSTGRES_PASSWORD")
  maria_user=$(url_encode "$MARIADB_USER")
  maria_password=$(url_encode "$MARIADB_PASSWORD")
  redis=$(url_encode "$(redis_password)")
  cat <<EOF
export SAGA_KAFKA_BOOTSTRAP=$SAGA_HOST:$KAFKA_PORT
export SAGA_POSTGRES_URL=postgresql://$pg_user:$pg_password@$SAGA_HOST:$POSTGRES_PORT/$POSTGRES_DB
export SAGA_MONGO_URL=mongodb://$SAGA_HOST:$MONGO_PORT/
export SAGA_REDIS_URL=redis://:$redis@$SAGA_HOST:$REDIS_PORT/0
export SAGA_MARIADB_URL=mariadb://$maria_user:$maria_password@$SAGA_HOST:$MARIADB_PORT/$MARIADB_DB
export SAGA_SPARK_JARS=$D/spark-jars
EOF
  if sasl_on; then
    cat <<EOF
export SAGA_SASL_BOOTSTRAP=$SAGA_HOST:$KAFKA_SASL_PORT
export SAGA_SASL_CA=$TLS/ca.pem
export SAGA_SASL_USERS=$KAFKA_SECRETS
EOF
  fi
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
  env) check_settings && exports ;;
  *) echo "usage: infra/services.sh provision|up|down|status|env" >&2; exit 2 ;;
esac
