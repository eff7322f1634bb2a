#!/usr/bin/env bash
# Install Debian's prometheus for the dashboard test when it is missing and we are allowed to (as ensure-redis.sh).
set -u
if command -v prometheus >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
    >/dev/null 2>&1 || echo "ensure-prometheus: could not install prometheus; the dashboard test will be skipped" >&2
else
  echo "ensure-prometheus: prometheus missing and not installable here; the dashboard test will be skipped" >&2
fi
exit 0
