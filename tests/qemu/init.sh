#!/bin/busybox sh
# PID 1 of the arm64 test guest (an initramfs; see tests/qemu/README.md).
# Mounts proc/sys/dev/cgroup2, loads the modules listed in /etc/ea-modules, mounts /dev/vda at
# /mnt/disk (kernel arg ea.mount=rw|ro|none, default rw), runs the command from ea.cmd=<base64>
# (or the file /ea/cmd) with output on the virtio port named ea.out (else the console), prints
# "EA-EXIT <rc>" on the console and powers off. Markers are what guest.py waits for.
/bin/busybox mkdir -p /proc /sys /dev /tmp /run /root /mnt/disk /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run
mount -t cgroup2 cgroup2 /sys/fs/cgroup
ip link set lo up 2>/dev/null
CMDLINE=" $(cat /proc/cmdline) "
arg() { for w in $CMDLINE; do case "$w" in "$1="*) echo "${w#*=}"; return;; esac; done; }
while read -r m; do insmod "$m" 2>/dev/null || echo "ea-init: insmod $m failed"; done \
    < /etc/ea-modules
wait_for() { i=0; while [ ! -e "$1" ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done; }
case "$CMDLINE" in
    *" console=hvc0 "*) wait_for /dev/hvc0; exec </dev/hvc0 >/dev/hvc0 2>&1 ;;
esac
OUT=/dev/console
if [ "$(arg ea.out)" = 1 ]; then
    i=0
    while [ $i -lt 100 ]; do
        for p in /sys/class/virtio-ports/*; do
            [ "$(cat "$p/name" 2>/dev/null)" = ea.out ] && OUT=/dev/${p##*/}
        done
        [ "$OUT" != /dev/console ] && [ -e "$OUT" ] && break
        sleep 0.05; i=$((i+1))
    done
fi
MOUNT=$(arg ea.mount)
if [ -b /dev/vda ] && [ "$MOUNT" != none ]; then
    mount -t ext4 -o "${MOUNT:-rw}" /dev/vda /mnt/disk || echo "ea-init: mount /dev/vda failed"
fi
CMD=$(arg ea.cmd)
if [ -n "$CMD" ]; then
    echo "$CMD" | base64 -d > /tmp/ea-cmd
elif [ -f /ea/cmd ]; then
    cp /ea/cmd /tmp/ea-cmd
else
    echo "true" > /tmp/ea-cmd
fi
echo "EA-BEGIN uptime=$(cut -d' ' -f1 /proc/uptime)"
cd /root
sh /tmp/ea-cmd < /dev/null > "$OUT" 2>&1
RC=$?
sync
echo "EA-EXIT $RC uptime=$(cut -d' ' -f1 /proc/uptime)"
if [ "$OUT" != /dev/console ]; then echo "EA-EXIT $RC" > "$OUT"; fi
grep -q ' /mnt/disk ' /proc/mounts && umount /mnt/disk
[ "$(arg ea.halt)" = 0 ] && exec sh
poweroff -f
