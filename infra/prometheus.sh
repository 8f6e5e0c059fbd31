#!/usr/bin/env bash
# Debian's Prometheus server, for the scrape test (tests/integration/test_prometheus_scrape.py)
# and for trying the metrics endpoints by hand.
#
#   infra/prometheus.sh install   install the `prometheus` package if missing, print the binary
#   infra/prometheus.sh path      print the binary's path (exit 1 if it is not installed)
#
# The package's own system service is never started (policy-rc.d denies it while the
# package installs, and nothing here calls systemctl): whoever needs a server runs
# the binary with its own configuration, data folder and port, e.g.
#
#   /usr/bin/prometheus --config.file=prom.yml --storage.tsdb.path=/tmp/prom \
#       --web.listen-address=127.0.0.1:9091
set -euo pipefail

BIN=/usr/bin/prometheus
LOG=${TMPDIR:-/tmp}/saga-prometheus-apt.log

die() { echo "saga infra: $*" >&2; exit 1; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

install_prometheus() {
  [ -x "$BIN" ] && { echo "$BIN"; return 0; }
  if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
    die "prometheus is missing and installing it needs root: run 'apt-get install prometheus' as root, then retry."
  fi
  echo "saga infra: installing prometheus from Debian packages (log: $LOG)" >&2
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600)
  # Keep the package's service from starting; leave a policy-rc.d that another
  # install put there (and its removal) to that install.
  local ours=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    as_root sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d'
    ours=1
  fi
  local ok=1
  if ! as_root "${apt[@]}" install -y -qq --no-install-recommends prometheus >"$LOG" 2>&1; then
    # A fresh machine may not have package lists yet.
    as_root "${apt[@]}" update -qq >>"$LOG" 2>&1 &&
      as_root "${apt[@]}" install -y -qq --no-install-recommends prometheus >>"$LOG" 2>&1 || ok=0
  fi
  [ "$ours" -eq 1 ] && as_root rm -f /usr/sbin/policy-rc.d
  [ "$ok" -eq 1 ] || die "apt-get install prometheus failed; see $LOG"
  [ -x "$BIN" ] || die "the prometheus package installed no $BIN; see $LOG"
  echo "$BIN"
}

case "${1:-install}" in
  install) install_prometheus ;;
  path) [ -x "$BIN" ] && echo "$BIN" || die "prometheus is not installed: run infra/prometheus.sh install" ;;
  *) die "usage: infra/prometheus.sh install|path" ;;
esac
