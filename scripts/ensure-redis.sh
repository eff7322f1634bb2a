#!/usr/bin/env bash
# Install Debian's redis-server for the tests when it is missing and we are allowed to.
set -u
if command -v redis-server >/dev/null 2>&1; then exit 0; fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1 \
    || echo "ensure-redis: could not install redis-server; Redis tests will be skipped" >&2
else
  echo "ensure-redis: redis-server missing and not installable here; Redis tests will be skipped" >&2
fi
exit 0
