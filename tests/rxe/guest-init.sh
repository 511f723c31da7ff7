#!/bin/sh
# PID 1 of the rxe test guest (copied into the initramfs by tests/rxe/run.sh).
# Loads rdma_rxe, creates rxe0, runs /mnt/share/in/verbs_ibv (verbs suite),
# link_ibv (link suite) and `qpmux pingpong --provider ibverbs` against it,
# then the soft↔rxe interop on rxe1, and writes the verdict (PASS / FAIL /
# SETUP-FAIL) to /mnt/share/out/verdict.
export PATH=/usr/sbin:/usr/bin
# Debian's busybox-static prefers its own applets to $PATH: use iproute2's ip.
ip() { /usr/sbin/ip "$@"; }
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
log() { echo "RXE[$(cut -d' ' -f1 /proc/uptime)s]: $*"; }
VERDICT=SETUP-FAIL
finish() {
    log "verdict: $VERDICT"
    if [ -d /mnt/share/out ]; then
        echo "$VERDICT" >/mnt/share/out/verdict
        dmesg >/mnt/share/out/dmesg.log 2>/dev/null
        sync; umount /mnt/share
    fi
    poweroff -f; echo o >/proc/sysrq-trigger; sleep 5
}
NET=dummy
for a in $(cat /proc/cmdline); do case $a in rxe.net=*) NET=${a#*=};; esac; done

for m in $(cat /etc/modules.list); do
    case $m in */dummy.ko*) insmod "$m" numdummies=0 ;; *) insmod "$m" ;; esac || log "insmod $m failed"
done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 share /mnt/share || { log "9p mount failed"; finish; }
mkdir -p /mnt/share/out

ip link set lo up
IP=10.0.2.15
if [ "$NET" = dummy ]; then
    ip link add dummy0 type dummy; DEV=dummy0
else
    DEV=
    for i in $(seq 50); do
        for n in /sys/class/net/*; do case ${n##*/} in lo|dummy*) ;; *) DEV=${n##*/};; esac; done
        [ -n "$DEV" ] && break; sleep 0.1
    done
fi
[ -n "$DEV" ] || { log "no netdev"; finish; }
ip addr add $IP/24 dev $DEV
ip -6 addr add fd00::15/64 dev $DEV nodad 2>/dev/null
ip link set $DEV up
rdma link add rxe0 type rxe netdev $DEV || { log "rdma link add failed"; finish; }
# The GID table fills from netdev events: wait for the IPv4-mapped RoCEv2 GID.
for i in $(seq 100); do
    grep -qs "0000:0000:0000:0000:0000:ffff:0a00:020f" /sys/class/infiniband/rxe0/ports/1/gids/* && break
    sleep 0.1
done
log "rxe0 on $DEV, kernel $(uname -r), ulimit -l $(ulimit -l)"
ibv_devinfo -d rxe0 2>&1 | grep -E 'state|active_mtu|link_layer' | sed 's/^/    /'

cd /tmp
export QPMUX_IBV_DEVICE=rxe0 QPMUX_IBV_REQUIRE=1 QPMUX_IBV_TRACE=1 RUST_BACKTRACE=0
ARGS=$(cat /mnt/share/in/args 2>/dev/null)
PINGPONG_ITERS=$(cat /mnt/share/in/pingpong_iters 2>/dev/null)
log "running verbs_ibv $ARGS"
/mnt/share/in/verbs_ibv --test-threads=2 $ARGS >/mnt/share/out/suite.log 2>&1
RC=$?
# The mux over RDMA links on rxe0. One test at a time: rxe's RNR counter is
# device-wide.
LRC=0
if [ -x /mnt/share/in/link_ibv ]; then
    log "running link_ibv"
    /mnt/share/in/link_ibv --test-threads=1 >/mnt/share/out/link.log 2>&1 || LRC=1
    grep -qE '^test result: ok\. [1-9]' /mnt/share/out/link.log || LRC=1
    echo "link rc=$LRC" >>/mnt/share/out/link.log
    log "link rc=$LRC"
fi
# qpmux pingpong over rxe0: both ends in one process, then server and client
# as two processes (bootstrap over TCP on lo, RDMA through rxe0's loopback).
PRC=0
if [ -x /mnt/share/in/qpmux ]; then
    Q=/mnt/share/in/qpmux
    PP="pingpong --provider ibverbs --ibv-device rxe0 --handshake-timeout 60 --iters ${PINGPONG_ITERS:-100} --size 64,4096,65536"
    {
        unset QPMUX_IBV_TRACE; export NO_COLOR=1
        echo "\$ qpmux devices"
        $Q devices || PRC=1
        echo "\$ qpmux $PP"
        timeout 300 $Q $PP || PRC=1
        echo "\$ qpmux $PP --test bw"
        timeout 300 $Q $PP --test bw || PRC=1
        echo "\$ qpmux pingpong --provider ibverbs --ibv-device rxe0 --handshake-timeout 60 --server 127.0.0.1:7000 &"
        $Q pingpong --provider ibverbs --ibv-device rxe0 --handshake-timeout 60 --server 127.0.0.1:7000 >/tmp/server.log 2>&1 &
        SERVER=$!
        echo "\$ qpmux $PP --connect 127.0.0.1:7000"
        timeout 300 $Q $PP --connect 127.0.0.1:7000 || PRC=1
        echo "\$ qpmux pingpong --provider ibverbs --ibv-device rxe0 --handshake-timeout 60 --iters ${PINGPONG_ITERS:-100} --size 64 --connect 127.0.0.1:7000"
        timeout 300 $Q pingpong --provider ibverbs --ibv-device rxe0 --handshake-timeout 60 --iters ${PINGPONG_ITERS:-100} --size 64 --connect 127.0.0.1:7000 || PRC=1
        kill $SERVER 2>/dev/null
        sed 's/^/server: /' /tmp/server.log
        echo "pingpong rc=$PRC"
    } >/mnt/share/out/pingpong.log 2>&1
    log "pingpong rc=$PRC"
fi
# Tests that disturb the device (a link flap) run alone, afterwards.
QPMUX_IBV_FLAP_NETDEV=$DEV /mnt/share/in/verbs_ibv --ignored --exact async_events_report_port_flap --nocapture \
    >>/mnt/share/out/suite.log 2>&1 || RC=1
# Wire interop: the soft provider in netns qpmux-soft (veth1, UDP 4791) and
# kernel rxe on the root end (veth0, rxe1), over IPv6 GIDs.
IRC=1
if ip link add veth0 type veth peer name veth1 && ip netns add qpmux-soft \
    && ip link set veth1 netns qpmux-soft; then
    # IPv6: the ICRC covers no IPv6 field a UDP socket cannot see (over IPv4
    # it covers the Identification field; see docs/soft-provider.md).
    ip -6 addr add fd01::1/64 dev veth0 nodad; ip link set veth0 up
    ip netns exec qpmux-soft /usr/sbin/ip -6 addr add fd01::2/64 dev veth1 nodad
    ip netns exec qpmux-soft /usr/sbin/ip link set veth1 up
    ip netns exec qpmux-soft /usr/sbin/ip link set lo up
    # rxe (like RoCE NICs) sends UDP checksum 0; over IPv6 a normal UDP socket
    # drops that unless it sets UDP_NO_CHECK6_RX, which the soft provider does
    # not (yet). Recompute the checksum on the soft side's ingress instead.
    ip netns exec qpmux-soft /usr/sbin/tc qdisc add dev veth1 clsact
    ip netns exec qpmux-soft /usr/sbin/tc filter add dev veth1 ingress matchall action csum udp
    # Static neighbours both ways: rxe resolves the peer's MAC inside
    # modify_qp(RTR) with a short timeout, which neighbour discovery under
    # TCG emulation sometimes misses (RTR failed with ETIMEDOUT in 1 CI run).
    MAC0=$(cat /sys/class/net/veth0/address)
    MAC1=$(ip netns exec qpmux-soft /usr/bin/cat /sys/class/net/veth1/address)
    ip -6 neigh replace fd01::2 lladdr "$MAC1" dev veth0 nud permanent
    ip netns exec qpmux-soft /usr/sbin/ip -6 neigh replace fd01::1 lladdr "$MAC0" dev veth1 nud permanent
    rdma link add rxe1 type rxe netdev veth0
    for i in $(seq 100); do
        grep -qs "fd01:0000:0000:0000:0000:0000:0000:0001" /sys/class/infiniband/rxe1/ports/1/gids/* && break
        sleep 0.1
    done
    rm -rf /tmp/interop
    QPMUX_IBV_DEVICE=rxe1 QPMUX_INTEROP_DIR=/tmp/interop QPMUX_INTEROP_NETNS=qpmux-soft \
    QPMUX_INTEROP_RXE_IP=fd01::1 QPMUX_INTEROP_SOFT_IP=fd01::2 \
        /mnt/share/in/verbs_ibv --ignored --exact interop_soft_provider_with_kernel_rxe --nocapture \
        >/mnt/share/out/interop.log 2>&1
    IRC=$?
else
    echo "veth/netns setup failed" >/mnt/share/out/interop.log
fi
echo "interop rc=$IRC" >>/mnt/share/out/interop.log
for c in /sys/class/infiniband/rxe1/ports/1/hw_counters/*; do
    echo "rxe1 ${c##*/} $(cat "$c")"
done >>/mnt/share/out/interop.log 2>/dev/null
log "interop rc=$IRC"
echo "rc=$RC" >>/mnt/share/out/suite.log
grep -E '^test result' /mnt/share/out/suite.log
log "suite rc=$RC"
for c in /sys/class/infiniband/rxe0/ports/1/hw_counters/*; do
    echo "${c##*/} $(cat "$c")"
done >/mnt/share/out/hw_counters.txt 2>/dev/null
# A binary built without --features ibverbs has no tests: that is no pass.
if [ $RC = 0 ] && [ $IRC = 0 ] && [ $LRC = 0 ] && [ $PRC = 0 ] && grep -qE '^test result: ok\. [1-9]' /mnt/share/out/suite.log; then
    VERDICT=PASS
else
    VERDICT=FAIL
fi
finish
