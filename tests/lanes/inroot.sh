#!/bin/sh
# Run a command inside a root file system (tests/lanes/current.py: Debian 13's), in the mount
# namespace of the caller (run it under `unshare --mount --propagation private`, so that every
# mount here goes away with the command). The root is bound onto itself first: libvirt's QEMU
# driver makes each QEMU's mount namespace private and needs "/" to be a mount point.
# usage: inroot.sh ROOT REPO COMMAND [ARG...]   (REPO is bound at the same path inside)
set -eu
R=$1
REPO=$2
shift 2
mount --bind "$R" "$R"
mount -t proc proc "$R/proc"
mount --rbind /sys "$R/sys"
mount --rbind /dev "$R/dev"
# A devpts of its own: QEMU's serial ptys inside libvirt's namespace come from it (the machine's
# may say ptmxmode=000, and its /dev/ptmx is then no way in).
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$R/dev/pts"
mount --bind "$R/dev/pts/ptmx" "$R/dev/ptmx"
mount -t tmpfs tmpfs "$R/run"
mount -t tmpfs tmpfs "$R/tmp"
mkdir -p "$R$REPO"
mount --bind "$REPO" "$R$REPO"
cd /
# gpuvfio itself from this checkout (as an editable install would, without writing into it).
for site in "$R"/opt/venv/lib/python3*/site-packages; do
    if [ -d "$site" ]; then echo "$REPO" >"$site/gpuvfio-checkout.pth"; fi
done
exec chroot "$R" env -i PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    PYTHONDONTWRITEBYTECODE=1 SSL_CERT_FILE=/etc/ssl/certs/host-ca-certificates.crt \
    GPUVFIO_REQUIRE_LANES=1 sh -c 'cd "$0" && exec "$@"' "$REPO" "$@"
