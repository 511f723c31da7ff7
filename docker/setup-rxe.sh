#!/bin/sh
# Create a kernel soft-RoCE device on this host for the `rxe` compose profile.
#   sudo docker/setup-rxe.sh [NETDEV]     (default: the netdev of the default route)
# Env: RXE_NAME (default rxe0). Idempotent. See docs/rxe.md.
set -eu
NAME=${RXE_NAME:-rxe0}
NETDEV=${1:-$(ip -o route get 1.1.1.1 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") { print $(i + 1); exit }}')}
[ -n "$NETDEV" ] || { echo "no default route: name the netdev, e.g. $0 eth0" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "run as root (modprobe, rdma link add)" >&2; exit 1; }

# rdma_rxe asks the crypto API for "crc32" at run time; minimal kernels need
# the generic implementation loaded first.
modprobe crc32_generic 2>/dev/null || true
modprobe rdma_rxe || { echo "this kernel has no rdma_rxe module (CONFIG_RDMA_RXE)" >&2; exit 1; }
if ! rdma link show "$NAME/1" >/dev/null 2>&1; then
    rdma link add "$NAME" type rxe netdev "$NETDEV"
fi
# The GID table fills asynchronously from netdev events.
i=0
until grep -qsv '^0000:0000:0000:0000:0000:0000:0000:0000$' /sys/class/infiniband/"$NAME"/ports/1/gids/*; do
    i=$((i + 1)); [ $i -lt 50 ] || { echo "$NAME has no GID: does $NETDEV have an address?" >&2; exit 1; }
    sleep 0.1
done
rdma link show "$NAME/1"
echo "uverbs devices: $(ls /dev/infiniband 2>/dev/null | tr '\n' ' ')"
echo "locked-memory limit here: $(ulimit -l) KiB (containers: --ulimit memlock=-1 or --cap-add IPC_LOCK)"
echo "RDMA netns mode: $(rdma system show 2>/dev/null | sed -n 's/.*netns \([a-z]*\).*/\1/p')"
