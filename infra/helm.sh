#!/usr/bin/env bash
# Helm (the Kubernetes package manager) for the chart's tests, built with `go install`
# from the Go module proxy: no binary download from get.helm.sh.
#
#   infra/helm.sh          install it if missing (or another version), print its path
#   infra/helm.sh --check  exit 0 if the pinned version is installed, 1 otherwise (installs nothing)
#
# It goes to $SAGA_INFRA_DIR/helm-<version>/bin/helm (default .infra/, git-ignored), so
# it never touches a helm on the PATH. The chart's test (tests/unit/test_helm.py) runs
# this script and uses the path it prints (the last line of its output).
# HELM_VERSION overrides the pinned version (a v3 release the Go module proxy serves).
set -euo pipefail

cd "$(dirname "$0")/.."
HELM_VERSION=${HELM_VERSION:-v3.22.0}
SAGA_INFRA_DIR=${SAGA_INFRA_DIR:-.infra}
DIR="$(mkdir -p "$SAGA_INFRA_DIR" && cd "$SAGA_INFRA_DIR" && pwd)/helm-$HELM_VERSION"
BIN=$DIR/bin/helm

# The stamp names what the binary was built with: a change here rebuilds it.
STAMP="$HELM_VERSION build-flags-2"
installed() {
  [[ -x "$BIN" && -f "$DIR/bin/.stamp" && "$(cat "$DIR/bin/.stamp")" == "$STAMP" ]] \
    && "$BIN" version --short 2>/dev/null | grep -qF "$HELM_VERSION"
}

# Helm's Makefile sets, through the linker, its version and the Kubernetes version it
# assumes without a cluster (the client-go minor of its go.mod; otherwise 1.20, which a
# chart's kubeVersion refuses): do the same.
build() {
  local gomod k8s_minor flags pkg
  gomod=$(GOFLAGS=-mod=mod go mod download -json "helm.sh/helm/v3@$HELM_VERSION" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p') || return 1
  k8s_minor=$(awk '$1 == "k8s.io/client-go" { split($2, v, "."); print v[2]; exit }' "$gomod") \
    || return 1
  [[ -n "$k8s_minor" ]] || { echo "no k8s.io/client-go version in $gomod"; return 1; }
  flags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  for pkg in pkg/chartutil pkg/lint/rules; do
    flags+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=$k8s_minor"
  done
  GOBIN="$DIR/bin.tmp" GOFLAGS=-mod=mod CGO_ENABLED=0 go install -trimpath -ldflags "$flags" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
}

if [[ "${1:-}" == "--check" ]]; then
  installed
  exit $?
fi

if ! installed; then
  command -v go >/dev/null 2>&1 || {
    echo "helm.sh: Go is missing: install Go 1.24 or newer (helm $HELM_VERSION is built with go install), then retry" >&2
    exit 2
  }
  mkdir -p "$DIR"
  log=$DIR/go-install.log
  echo "helm.sh: building helm $HELM_VERSION with go install (a few minutes the first time; log: $log)" >&2
  if ! build >"$log" 2>&1; then
    echo "helm.sh: could not build helm $HELM_VERSION; see $log" >&2
    tail -n 5 "$log" >&2 || true
    exit 1
  fi
  mkdir -p "$DIR/bin"
  mv "$DIR/bin.tmp/helm" "$BIN" && rmdir "$DIR/bin.tmp" && echo "$STAMP" >"$DIR/bin/.stamp"
fi

installed || { echo "helm.sh: $BIN does not report version $HELM_VERSION" >&2; exit 1; }
echo "$BIN"
