#!/usr/bin/env bash
# A local observability stack on loopback, without containers: Debian's Prometheus scraping the SteerSpec
# services' /metrics and Arize Phoenix (from PyPI, in its own virtual environment) receiving their traces.
#
#   bash scripts/observability-stack.sh       # Prometheus http://127.0.0.1:9090, Phoenix http://127.0.0.1:6006
#
# then serve SteerSpec with metrics on 9464 (coordinator), 9465 (verifier), 9466 (drafter) and OTLP traces:
#   export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 OTEL_EXPORTER_OTLP_INSECURE=true
#   steerspec serve verifier --metrics-port 9465 ...   (drafter 9466, coordinator 9464)
# Ctrl-C stops both. Ports: PROMETHEUS_PORT, PHOENIX_PORT, OTLP_PORT; state in STEERSPEC_OBS_DIR (.observability/).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STATE="${STEERSPEC_OBS_DIR:-$ROOT/.observability}"
PHOENIX_VENV="${PHOENIX_VENV:-$STATE/phoenix-venv}"
PROMETHEUS_PORT="${PROMETHEUS_PORT:-9090}" PHOENIX_PORT="${PHOENIX_PORT:-6006}" OTLP_PORT="${OTLP_PORT:-4317}"
mkdir -p "$STATE"
bash "$ROOT/scripts/ensure-prometheus.sh"
command -v prometheus >/dev/null || { echo "observability-stack: prometheus is not installed" >&2; exit 2; }
if [ ! -x "$PHOENIX_VENV/bin/phoenix" ]; then  # its own venv: Phoenix's dependencies stay out of SteerSpec's
  python3 -m venv "$PHOENIX_VENV" && "$PHOENIX_VENV/bin/pip" install -q arize-phoenix
fi
cat > "$STATE/prometheus.yml" <<YAML
global: {scrape_interval: 5s}
scrape_configs:
  - {job_name: steerspec-coordinator, static_configs: [{targets: ["127.0.0.1:9464"]}]}
  - {job_name: steerspec-verifier, static_configs: [{targets: ["127.0.0.1:9465"]}]}
  - {job_name: steerspec-drafter, static_configs: [{targets: ["127.0.0.1:9466"]}]}
YAML
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT INT TERM
prometheus --config.file="$STATE/prometheus.yml" --storage.tsdb.path="$STATE/prometheus" \
  --web.listen-address="127.0.0.1:$PROMETHEUS_PORT" --log.level=warn &
PHOENIX_HOST=127.0.0.1 PHOENIX_PORT="$PHOENIX_PORT" PHOENIX_GRPC_PORT="$OTLP_PORT" PHOENIX_WORKING_DIR="$STATE/phoenix" \
  "$PHOENIX_VENV/bin/phoenix" serve &
echo "Prometheus http://127.0.0.1:$PROMETHEUS_PORT   Phoenix http://127.0.0.1:$PHOENIX_PORT   OTLP gRPC 127.0.0.1:$OTLP_PORT"
wait
