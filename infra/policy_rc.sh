# shellcheck shell=bash
# Sourced by infra/services.sh: run a package installation with the packages' own
# system services held back (Debian's policy-rc.d answering 101 "action forbidden"),
# leaving the host's own /usr/sbin/policy-rc.d, if it had one, as it was.
#
# Needs as_root and die from the caller; SAGA_POLICY_RC names another path (tests).

POLICY_RC=${SAGA_POLICY_RC:-/usr/sbin/policy-rc.d}

# with_services_held COMMAND...: run COMMAND with a policy-rc.d that forbids starting
# services; a policy-rc.d already there is moved aside meanwhile and put back after,
# whether COMMAND succeeds or not. Returns COMMAND's status.
with_services_held() {
  local kept="" rc=0
  if as_root test -e "$POLICY_RC" || as_root test -L "$POLICY_RC"; then
    kept=$(as_root mktemp "$POLICY_RC.saga-kept.XXXXXX") &&
      as_root mv -f "$POLICY_RC" "$kept" ||
      die "could not move the host's $POLICY_RC aside; install the packages by hand, then retry."
  fi
  as_root sh -c 'printf "#!/bin/sh\nexit 101\n" > "$1" && chmod +x "$1"' sh "$POLICY_RC"
  "$@" || rc=$?
  if [ -n "$kept" ]; then
    as_root mv -f "$kept" "$POLICY_RC"
  else
    as_root rm -f "$POLICY_RC"
  fi
  return "$rc"
}
