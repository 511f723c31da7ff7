#!/bin/sh
# PID 1 of the rxe test guest (copied into the initramfs by tests/rxe/run.sh).
# Loads rdma_rxe, creates rxe0, runs /mnt/share/in/verbs_ibv against it and
# writes the verdict (PASS / FAIL / SETUP-FAIL) to /mnt/share/out/verdict.
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
log "running verbs_ibv $ARGS"
/mnt/share/in/verbs_ibv --test-threads=2 $ARGS >/mnt/share/out/suite.log 2>&1
RC=$?
# Tests that disturb the device (a link flap) run alone, afterwards.
QPMUX_IBV_FLAP_NETDEV=$DEV /mnt/share/in/verbs_ibv --ignored --exact async_events_report_port_flap --nocapture \
    >>/mnt/share/out/suite.log 2>&1 || RC=1
echo "rc=$RC" >>/mnt/share/out/suite.log
grep -E '^test result' /mnt/share/out/suite.log
log "suite rc=$RC"
for c in /sys/class/infiniband/rxe0/ports/1/hw_counters/*; do
    echo "${c##*/} $(cat "$c")"
done >/mnt/share/out/hw_counters.txt 2>/dev/null
# A binary built without --features ibverbs has no tests: that is no pass.
if [ $RC = 0 ] && grep -qE '^test result: ok\. [1-9]' /mnt/share/out/suite.log; then
    VERDICT=PASS
else
    VERDICT=FAIL
fi
finish
