#!/usr/bin/env bash
# Headless Chromium and its WebDriver for the console's browser test, from Debian's
# packages (chromium, chromium-driver): no browser download, no selenium-manager.
#
#   infra/chromium.sh          install them if missing (needs root or sudo), print the paths
#   infra/chromium.sh --check  exit 0 if both are installed, 1 otherwise (installs nothing)
#
# The test (tests/e2e/test_console_browser.py) runs this script before it starts a browser.
set -euo pipefail

BROWSER=/usr/bin/chromium
DRIVER=/usr/bin/chromedriver

installed() { [[ -x "$BROWSER" && -x "$DRIVER" ]]; }

if [[ "${1:-}" == "--check" ]]; then
  installed
  exit $?
fi

if ! installed; then
  if [[ $(id -u) -eq 0 ]]; then
    as_root=()
  elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo -n)
  else
    echo "chromium.sh: chromium and chromium-driver are missing and this user cannot install" \
      "packages; run as root: apt-get install chromium chromium-driver" >&2
    exit 2
  fi
  echo "chromium.sh: installing chromium and chromium-driver (Debian packages)..." >&2
  # The package lists may be old on a fresh machine: refresh them once, then install.
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      chromium chromium-driver >&2 \
    || { "${as_root[@]}" apt-get update -q >&2 \
         && "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
              --no-install-recommends chromium chromium-driver >&2; }
fi

installed || { echo "chromium.sh: $BROWSER or $DRIVER still missing after the install" >&2; exit 1; }
echo "browser=$BROWSER"
echo "driver=$DRIVER"
