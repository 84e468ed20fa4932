#!/usr/bin/env bash
# Snapshot of the committed tree (HEAD) for a device run, so that uncommitted work in progress in the shared
# checkout never reaches the device's build. Writes .device-out/src.tar (git-ignored). Run on the device with
#   carry: [".whl", ".device-out/src.tar"]
#   command: mkdir -p /tmp/src && tar xf .device-out/src.tar -C /tmp/src && cp -r .whl /tmp/src/ \
#            && cd /tmp/src && bash scripts/device_check.sh <steps>
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device-out
# without the built-in model's 16 MB of weights (tracked, never changed; the device's working tree copy has
# them and scripts/device_session.sh copies them in): the call's carry is capped at 64 MiB in all
git archive HEAD -o .device-out/src.tar -- . ':(exclude)ktorch/builtin/model.safetensors'
echo "$(git rev-parse --short HEAD): .device-out/src.tar ($(du -h .device-out/src.tar | cut -f1))"
