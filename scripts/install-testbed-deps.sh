#!/usr/bin/env bash
# Installs what `gossipnet.testbed` drives: ip/tc/bridge (iproute2) and nft (nftables).
# Why a separate script: the testbed needs root anyway, and setup.sh must keep working
# for users without it. Not root, or everything present: says so and exits 0
# (the testbed's tests then skip with the reason). Safe to run repeatedly.
set -euo pipefail
need=()
command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1 \
  && command -v bridge >/dev/null 2>&1 || need+=(iproute2)
command -v nft >/dev/null 2>&1 || need+=(nftables)
if [ ${#need[@]} -eq 0 ]; then
  echo "testbed tools present (ip, tc, bridge, nft)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "testbed needs ${need[*]}; not root, skipping (run: sudo $0)" >&2
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "testbed needs ${need[*]}; no apt-get here, install them with your package manager" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}"
echo "installed: ${need[*]}"
