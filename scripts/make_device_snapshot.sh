#!/usr/bin/env bash
# Snapshot of the committed tree (HEAD) for a device run, so that uncommitted work in progress in the shared
# checkout never reaches the device's build. Writes .device-out/src.tar (git-ignored). Run on the device with
#   carry: [".whl", ".device-out/src.tar"]
#   command: mkdir -p /tmp/src && tar xf .device-out/src.tar -C /tmp/src && cp -r .whl /tmp/src/ \
#            && cd /tmp/src && bash scripts/device_check.sh <steps>
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device-out
git archive HEAD -o .device-out/src.tar
echo "$(git rev-parse --short HEAD): .device-out/src.tar ($(du -h .device-out/src.tar | cut -f1))"
