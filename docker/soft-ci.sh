#!/bin/bash
# docker/soft-ci.sh — the compose `soft` profile for real, without a registry:
# a minimal image from the host-built qpmux binary and the libraries `ldd`
# lists (`docker import`, seconds), then two containers on a private network
# running `qpmux pingpong` server and client over the soft provider.
#
# Exit status: 0 passed, 1 failed, 77 skipped (reason printed: no Docker
# engine, no docker-compose). QPMUX_DOCKER=1 turns a skip into a failure (CI).
# Env: QPMUX_BIN (default: cargo build --bin qpmux, debug), QPMUX_PINGPONG_ITERS (300).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
T0=$(date +%s)
say() { echo "[soft-ci $(($(date +%s) - T0))s] $*" >&2; }
skip() {
    if [ "${QPMUX_DOCKER:-0}" = 1 ]; then echo "FAIL: QPMUX_DOCKER=1 but: $*" >&2; exit 1; fi
    echo "SKIP: $*" >&2; exit 77
}

command -v docker >/dev/null || skip "no docker client"
docker info >/dev/null 2>&1 || skip "no Docker engine running (docker info: $(docker info 2>&1 | grep -v "^ *$" | tail -n 1))"
if docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then
    COMPOSE=(docker-compose)
else
    skip "neither 'docker compose' nor docker-compose is installed"
fi

BIN=${QPMUX_BIN:-}
if [ -z "$BIN" ]; then
    say "cargo build --bin qpmux"
    (cd "$ROOT" && cargo build -q --bin qpmux)
    BIN=$ROOT/target/debug/qpmux
fi
[ -x "$BIN" ] || { echo "no qpmux binary at $BIN" >&2; exit 1; }

# ------------------------------------------------------------ minimal image
TAG=qpmux-soft-ci:$$
WORK=$(mktemp -d)
PROJECT=qpmux-soft-ci-$$
cleanup() {
    QPMUX_IMAGE=$TAG "${COMPOSE[@]}" -f "$ROOT/docker/compose.yaml" -p "$PROJECT" --profile soft \
        down --remove-orphans >/dev/null 2>&1 || true
    docker image rm -f "$TAG" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT
R=$WORK/rootfs
mkdir -p "$R/usr/local/bin" "$R/etc" "$R/tmp"
# Debug info is most of a debug build's size; the image needs none of it.
if command -v strip >/dev/null; then
    strip -o "$R/usr/local/bin/qpmux" "$BIN"
else
    cp "$BIN" "$R/usr/local/bin/qpmux"
fi
for lib in $(ldd "$BIN" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do
    mkdir -p "$R$(dirname "$lib")"
    cp -L "$lib" "$R$lib"
done
# /lib64 and /lib are symlinks on Debian: keep the loader where ELF asks for it.
printf 'root:x:0:0:root:/:/nonexistent\n' >"$R/etc/passwd"
printf 'hosts: files dns\n' >"$R/etc/nsswitch.conf"
tar -C "$R" -c . | docker import -c 'ENV PATH=/usr/local/bin' -c 'CMD ["qpmux"]' - "$TAG" >/dev/null
say "image $TAG: $(docker image inspect -f '{{.Size}}' "$TAG") bytes from $(basename "$BIN") + $(ldd "$BIN" | grep -c /) libraries"

# ------------------------------------------------------------ two containers
# A free private /24: the compose network's subnet must not overlap another.
NET=
for _ in 1 2 3 4 5 6 7 8; do
    cand=172.30.$((RANDOM % 250 + 1))
    if ! docker network inspect -f '{{range .IPAM.Config}}{{.Subnet}} {{end}}' $(docker network ls -q) 2>/dev/null \
        | grep -q "$cand.0/"; then
        NET=$cand; break
    fi
done
[ -n "$NET" ] || { echo "no free 172.30.x.0/24 subnet" >&2; exit 1; }
say "compose --profile soft on $NET.0/24 (${COMPOSE[*]})"
set +e
QPMUX_IMAGE=$TAG QPMUX_SOFT_NET=$NET QPMUX_PINGPONG_ITERS=${QPMUX_PINGPONG_ITERS:-300} \
    timeout 300 "${COMPOSE[@]}" -f "$ROOT/docker/compose.yaml" -p "$PROJECT" --profile soft \
    up --no-build --no-color --abort-on-container-exit --exit-code-from soft-client >"$WORK/compose.log" 2>&1
RC=$?
set -e
grep -E 'soft-(client|server)' "$WORK/compose.log" | grep -vE 'Creating|Starting|Stopping|Removing' >&2 || true
if [ $RC = 0 ] && grep -q 'pingpong over rdma, provider soft' "$WORK/compose.log" \
    && grep -qE '^\S*soft-client\S* +\| +65536 ' "$WORK/compose.log"; then
    say "PASS: the client measured every size against the server across containers"
    exit 0
fi
echo "FAIL: compose exit $RC; log:" >&2
tail -n 60 "$WORK/compose.log" >&2
exit 1
