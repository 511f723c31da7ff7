#!/bin/bash
# tests/rxe/run.sh — run qpmux's provider-generic verbs suite (tests/verbs_ibv.rs),
# link suite (tests/link_ibv.rs) and `qpmux pingpong --provider ibverbs`, all
# built with --features ibverbs, against real kernel soft-RoCE (rdma_rxe) inside
# a QEMU guest booted from Debian's own kernel package. See docs/rxe.md.
#
# Exit status: 0 the guest suite passed, 1 it failed, 77 skipped (reason on stderr).
#
# Environment:
#   QPMUX_RXE=0          skip
#   RXE_TEST_BIN=path    verbs suite binary to run in the guest (default: cargo builds it)
#   RXE_LINK_BIN=path    link suite binary (default: cargo builds it with RXE_TEST_BIN)
#   RXE_QPMUX_BIN=path   qpmux binary for the guest's pingpong (likewise)
#   RXE_TEST_ARGS="..."  extra libtest arguments (filters, --test-threads=N)
#   RXE_PINGPONG_ITERS=100  iterations per size of the guest's pingpong runs
#   RXE_WORK=dir         cache and work dir (default: target/rxe)
#   RXE_ACCEL=auto|kvm|tcg   (auto: kvm when /dev/kvm works with vmx/svm)
#   RXE_NET=dummy|virtio netdev under rxe0 (dummy: no NIC, rxe loops back)
#   RXE_TIMEOUT=900      wall-clock bound of the guest run, seconds
#   RXE_INSTALL=1        apt-get install missing host packages first
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=${RXE_WORK:-$ROOT/target/rxe}
ACCEL=${RXE_ACCEL:-auto}
NET=${RXE_NET:-dummy}
TIMEOUT=${RXE_TIMEOUT:-900}
T0=$(date +%s)
say() { echo "[rxe $(( $(date +%s) - T0 ))s] $*" >&2; }
skip() { echo "SKIP: $*" >&2; exit 77; }

[ "${QPMUX_RXE:-1}" = 0 ] && skip "QPMUX_RXE=0"
[ "$(uname -m)" = x86_64 ] || skip "host is $(uname -m); the harness boots x86_64 Debian kernels"

# ------------------------------------------------------------- 1. host tools
need_pkgs=()
command -v qemu-system-x86_64 >/dev/null || need_pkgs+=(qemu-system-x86)
[ -x /bin/busybox ] || need_pkgs+=(busybox-static)
command -v rdma >/dev/null || need_pkgs+=(iproute2)
command -v cpio >/dev/null || need_pkgs+=(cpio)
command -v modprobe >/dev/null || need_pkgs+=(kmod)
ls /usr/lib/x86_64-linux-gnu/libibverbs.so.1 >/dev/null 2>&1 || need_pkgs+=(libibverbs1)
ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so >/dev/null 2>&1 || need_pkgs+=(ibverbs-providers)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    if [ "${RXE_INSTALL:-0}" = 1 ]; then
        say "apt-get install ${need_pkgs[*]}"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${need_pkgs[@]}" >&2 \
            || skip "cannot install ${need_pkgs[*]}"
    else
        skip "missing host packages: ${need_pkgs[*]} (apt-get install them, or set RXE_INSTALL=1)"
    fi
fi
command -v apt-get >/dev/null || skip "no apt-get: the guest kernel comes from Debian's linux-image-amd64"

# ------------------------------------------------------------- 2. guest kernel (unpacked, not installed)
mkdir -p "$W/dl"
KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
[ -n "$KPKG" ] || skip "apt cannot resolve linux-image-amd64"
if ! ls "$W/dl/${KPKG}"_*.deb >/dev/null 2>&1; then
    say "apt-get download $KPKG"
    (cd "$W/dl" && apt-get -q -o APT::Sandbox::User=root download "$KPKG" >&2) \
        || skip "cannot download $KPKG"
fi
KDEB=$(ls "$W/dl/${KPKG}"_*.deb | head -1)
KROOT=$W/kroot
if [ ! -f "$KROOT/.stamp-$(basename "$KDEB")" ]; then
    say "unpacking $(basename "$KDEB")"
    rm -rf "$KROOT"; mkdir -p "$KROOT"
    dpkg-deb -x "$KDEB" "$KROOT"
    touch "$KROOT/.stamp-$(basename "$KDEB")"
fi
KVER=$(ls "$KROOT/lib/modules" | head -1)
[ -f "$KROOT/lib/modules/$KVER/modules.dep" ] || depmod -b "$KROOT" "$KVER"
KIMG=$KROOT/boot/vmlinuz-$KVER
# Under TCG, booting the uncompressed ELF through QEMU's PVH entry skips the
# firmware and the XZ decompression (seconds under emulation).
if [ ! -s "$W/vmlinux-$KVER" ]; then
    off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$KIMG" | head -1 | cut -d: -f1 || true)
    if [ -n "$off" ]; then
        tail -c +$((off + 1)) "$KIMG" | xz -dcq >"$W/vmlinux.tmp" 2>/dev/null || true
        if [ "$(head -c4 "$W/vmlinux.tmp" | od -An -c | tr -d ' ')" = '177ELF' ]; then
            mv "$W/vmlinux.tmp" "$W/vmlinux-$KVER"
        fi
        rm -f "$W/vmlinux.tmp"
    fi
fi
[ -s "$W/vmlinux-$KVER" ] && KIMG=$W/vmlinux-$KVER

# ------------------------------------------------------------- 3. the test binary
BIN=${RXE_TEST_BIN:-}
LINK_BIN=${RXE_LINK_BIN:-}
QPMUX_BIN=${RXE_QPMUX_BIN:-}
if [ -z "$BIN" ]; then
    say "cargo test --features ibverbs --test verbs_ibv --test link_ibv --no-run"
    built=$(cd "$ROOT" && cargo test -q --features ibverbs --test verbs_ibv --test link_ibv --no-run \
        --message-format=json | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p')
    BIN=$(echo "$built" | grep '/verbs_ibv-' | tail -1)
    LINK_BIN=$(echo "$built" | grep '/link_ibv-' | tail -1)
    QPMUX_BIN=$ROOT/target/debug/qpmux
fi
[ -x "$BIN" ] || { echo "no test binary ($BIN)" >&2; exit 1; }
for b in "$LINK_BIN" "$QPMUX_BIN"; do
    [ -z "$b" ] || [ -x "$b" ] || { echo "no binary $b" >&2; exit 1; }
done

# ------------------------------------------------------------- 4. initramfs
S=$W/initramfs
rm -rf "$S"
mkdir -p "$S"/{usr/bin,usr/sbin,usr/lib/x86_64-linux-gnu,usr/lib64,etc/libibverbs.d,proc,sys,dev,tmp,run,mnt/share}
ln -s usr/bin "$S/bin"; ln -s usr/sbin "$S/sbin"; ln -s usr/lib "$S/lib"; ln -s usr/lib64 "$S/lib64"
add_file() { [ -e "$S$1" ] || { mkdir -p "$S$(dirname "$1")"; cp -L "$1" "$S$1"; }; }
add_elf() {
    add_file "$1"
    local l
    for l in $(ldd "$1" | awk '$2=="=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do add_file "$l"; done
}
for b in /usr/bin/rdma /usr/sbin/ip /usr/sbin/tc; do add_elf "$b"; done
for b in /usr/bin/ibv_devinfo; do [ -x "$b" ] && add_elf "$b"; done
add_elf /usr/lib/x86_64-linux-gnu/libibverbs.so.1
add_file /etc/libibverbs.d/rxe.driver
add_elf "$(ls /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav*.so | head -1)"
# The test binary runs from the 9p share; its libraries go in the image.
for b in "$BIN" $LINK_BIN $QPMUX_BIN; do
    for l in $(ldd "$b" | awk '$2=="=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do add_file "$l"; done
done
cp /bin/busybox "$S/usr/bin/busybox"
for a in $(/bin/busybox --list); do
    [ -e "$S/usr/bin/$a" ] || [ -e "$S/usr/sbin/$a" ] || ln -s busybox "$S/usr/bin/$a"
done
printf '/usr/lib/x86_64-linux-gnu\n/usr/lib64\n' >"$S/etc/ld.so.conf"
ldconfig -r "$S" 2>/dev/null || true
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$S/etc/passwd"
printf 'root:x:0:\n' >"$S/etc/group"
printf '127.0.0.1 localhost\n' >"$S/etc/hosts"
# Modules in dependency order. rdma_rxe asks for "crc32" through the crypto
# API at run time (not a modules.dep edge), so crc32_generic is named.
MODS="virtio_pci 9pnet_virtio 9p dummy veth sch_ingress cls_matchall act_csum crc32_generic rdma_rxe"
[ "$NET" = virtio ] && MODS="virtio_net $MODS"
: >"$S/etc/modules.list"
for m in $MODS; do
    modprobe -C /dev/null -d "$KROOT" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
    rel=${ko#"$KROOT"}
    mkdir -p "$S$(dirname "$rel")"; cp "$ko" "$S$rel"; echo "$rel" >>"$S/etc/modules.list"
done
cp "$ROOT/tests/rxe/guest-init.sh" "$S/init"
chmod +x "$S/init"
(cd "$S" && find . -print0 | cpio --null -o -H newc --owner=0:0 --quiet | gzip -1) >"$W/initrd.gz"

# ------------------------------------------------------------- 5. share and boot
SH=$W/share
rm -rf "$SH"; mkdir -p "$SH/in" "$SH/out"
cp "$BIN" "$SH/in/verbs_ibv"
[ -z "$LINK_BIN" ] || cp "$LINK_BIN" "$SH/in/link_ibv"
[ -z "$QPMUX_BIN" ] || cp "$QPMUX_BIN" "$SH/in/qpmux"
printf '%s\n' "${RXE_TEST_ARGS:-}" >"$SH/in/args"
printf '%s\n' "${RXE_PINGPONG_ITERS:-100}" >"$SH/in/pingpong_iters"
if [ "$ACCEL" = auto ]; then
    ACCEL=tcg
    if [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then ACCEL=kvm; fi
fi
# no_timer_check: under TCG on a busy host the kernel's IO-APIC timer check
# can fail and panic the boot ("IO-APIC + timer doesn't work!").
QEMU=(qemu-system-x86_64 -m 1024 -smp 2 -nographic -no-reboot
      -kernel "$KIMG" -initrd "$W/initrd.gz"
      -append "console=ttyS0 quiet panic=-1 no_timer_check rxe.net=$NET"
      -virtfs "local,path=$SH,mount_tag=share,security_model=none,id=share")
if [ "$ACCEL" = kvm ]; then QEMU+=(-enable-kvm -cpu host); else QEMU+=(-accel tcg -cpu max); fi
if [ "$NET" = virtio ]; then QEMU+=(-nic user,model=virtio-net-pci); else QEMU+=(-nic none); fi
say "booting $KVER ($ACCEL, net=$NET), test binary $(basename "$BIN")"
set +e
timeout "$TIMEOUT" "${QEMU[@]}" </dev/null >"$W/console.log" 2>&1
QRC=$?
set -e
say "qemu exited rc=$QRC (console: $W/console.log, guest output: $SH/out)"
if [ -f "$SH/out/suite.log" ]; then
    grep -E '^(test |test result|failures:|---- |thread .* panicked)' "$SH/out/suite.log" >&2 || true
fi
grep -E '^(test interop|interop rc|soft device stats)' "$SH/out/interop.log" >&2 2>/dev/null || true
grep -E '^(test |test result|---- |thread .* panicked|link rc)' "$SH/out/link.log" >&2 2>/dev/null || true
[ -f "$SH/out/pingpong.log" ] && cat "$SH/out/pingpong.log" >&2
VERDICT=$(cat "$SH/out/verdict" 2>/dev/null || echo "none")
case $VERDICT in
    PASS) say "PASS"; exit 0 ;;
    *)
        echo "guest verdict: $VERDICT; console tail:" >&2
        tail -n 40 "$W/console.log" >&2
        [ -f "$SH/out/suite.log" ] && { echo "--- suite.log tail" >&2; tail -n 60 "$SH/out/suite.log" >&2; }
        exit 1 ;;
esac
