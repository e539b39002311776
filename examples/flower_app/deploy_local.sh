#!/usr/bin/env bash
# A real Flower deployment of this App on one machine: a SuperLink, one SuperNode per fedloom
# client (node config partition-id=K), then `flwr run`. Everything is stopped at the end.
#   examples/flower_app/deploy_local.sh [NUM_CLIENTS=4] [extra `flwr run` args ...]
# Needs `pip install 'fedloom[flower]'` in this environment: the SuperLink runs the ServerApp
# here (--disable-runtime-dependency-installation) instead of installing the App's
# dependencies into a fresh environment. Logs: $FLWR_HOME/logs.
set -euo pipefail
APP="$(cd "$(dirname "$0")" && pwd)"
CLIENTS="${1:-4}"; shift || true
export FLWR_HOME="${FLWR_HOME:-$(mktemp -d)}"
LINK_PORT="${LINK_PORT:-9190}"
LOGS="$FLWR_HOME/logs"; mkdir -p "$LOGS"
cat > "$FLWR_HOME/config.toml" <<TOML
[superlink]
default = "local-deployment"

[superlink.local-deployment]
address = "127.0.0.1:$LINK_PORT"
insecure = true
TOML
groups=()
cleanup() {  # SIGTERM each process group; SIGKILL what is left after a grace period
  for g in "${groups[@]}"; do kill -- "-$g" 2>/dev/null || true; done
  sleep 5
  for g in "${groups[@]}"; do kill -9 -- "-$g" 2>/dev/null || true; done
}
trap cleanup EXIT
setsid flower-superlink --insecure --port "$LINK_PORT" --disable-runtime-dependency-installation \
  > "$LOGS/superlink.log" 2>&1 &
groups+=($!)
sleep 5
for ((k = 0; k < CLIENTS; k++)); do
  setsid flower-supernode --insecure --superlink "127.0.0.1:$LINK_PORT" --port $((LINK_PORT + 10 + k)) \
    --node-config "partition-id=$k num-partitions=$CLIENTS" > "$LOGS/supernode-$k.log" 2>&1 &
  groups+=($!)
done
flwr run "$APP" local-deployment --stream "$@"
