#!/bin/sh
# Three network namespaces for the fault harness (docs/faults.md):
#
#   A 10.77.1.2 ── veth ── 10.77.1.1  R  10.77.2.1 ── veth ── 10.77.2.2 B
#                               (ip_forward; nft: tproxy, partition)
#
# usage: netns.sh up TAG | down TAG | tproxy TAG PORT_A PORT_B
#        | partition TAG on|off|b-to-a   (b-to-a: only B's packets to A are cut)
# TAG keeps concurrent runs apart (the test uses its pid).
set -eu

cmd=$1
tag=$2
a=qf-a-$tag
r=qf-r-$tag
b=qf-b-$tag
A=10.77.1.2
B=10.77.2.2

case $cmd in
up)
    ip netns add "$a"
    ip netns add "$r"
    ip netns add "$b"
    ip link add "qfa$tag" netns "$a" type veth peer name "qfra$tag" netns "$r"
    ip link add "qfb$tag" netns "$b" type veth peer name "qfrb$tag" netns "$r"
    ip -n "$a" addr add $A/24 dev "qfa$tag"
    ip -n "$b" addr add $B/24 dev "qfb$tag"
    ip -n "$r" addr add 10.77.1.1/24 dev "qfra$tag"
    ip -n "$r" addr add 10.77.2.1/24 dev "qfrb$tag"
    for ns in "$a" "$r" "$b"; do ip -n "$ns" link set lo up; done
    ip -n "$a" link set "qfa$tag" up
    ip -n "$b" link set "qfb$tag" up
    ip -n "$r" link set "qfra$tag" up
    ip -n "$r" link set "qfrb$tag" up
    ip -n "$a" route add default via 10.77.1.1
    ip -n "$b" route add default via 10.77.2.1
    ip netns exec "$r" sysctl -qw net.ipv4.ip_forward=1
    # The relay sends with the peers' source addresses; R must not filter them.
    ip netns exec "$r" sysctl -qw net.ipv4.conf.all.rp_filter=0
    ip netns exec "$r" sysctl -qw net.ipv4.conf.default.rp_filter=0
    ;;
tproxy)
    # Divert RoCE datagrams for A:PORT_A and B:PORT_B to local sockets bound
    # (IP_TRANSPARENT) to exactly those addresses: the relay.
    pa=$3
    pb=$4
    ip -n "$r" rule add fwmark 0x77 lookup 177
    ip -n "$r" route add local 0.0.0.0/0 dev lo table 177
    ip netns exec "$r" nft -f - <<NFT
table ip qf_relay {
    chain pre {
        type filter hook prerouting priority mangle; policy accept;
        ip daddr $B udp dport $pb meta mark set 0x77 tproxy to $B:$pb accept
        ip daddr $A udp dport $pa meta mark set 0x77 tproxy to $A:$pa accept
    }
}
NFT
    ;;
partition)
    if [ "$3" = on ] || [ "$3" = b-to-a ]; then
        if [ "$3" = on ]; then
            cut="ip saddr { $A, $B } ip daddr { $A, $B } drop"
        else
            cut="ip saddr $B ip daddr $A drop"
        fi
        ip netns exec "$r" nft -f - <<NFT
table ip qf_partition {
    chain pre {
        type filter hook prerouting priority raw; policy accept;
        $cut
    }
}
NFT
    else
        ip netns exec "$r" nft delete table ip qf_partition
    fi
    ;;
down)
    for ns in "$a" "$r" "$b"; do ip netns del "$ns" 2>/dev/null || true; done
    ;;
*)
    echo "unknown command $cmd" >&2
    exit 2
    ;;
esac
