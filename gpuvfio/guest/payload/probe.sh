#!/bin/sh
# gpuvfio guest probe: facts a minimal guest (busybox) can give, one record per line.
# Runs without python3. Output (consumed by gpuvfio/verify.py):
#   GPUVFIO-PROBE 1
#   KERNEL <release>
#   PYTHON3 <path>|none
#   PCI|<addr>|<vendor>|<device>|<class>|<driver|->|<cur speed>|<cur width>|<max speed>|<max width>|<upstream|->
#     (upstream: the bridge above it, for NVIDIA functions, bridges, NICs and displays; '-' on a root bus)
#   MODULE <name>
#   NVIDIA-VERSION <first line of /proc/driver/nvidia/version>
#   NVSMI-BEGIN / ... nvidia-smi -q -x ... / NVSMI-END
#   DMESG <a kernel line about NVRM/nvidia>   (the driver's own words when a GPU fails to come up)
#   END
# GPUVFIO_PROBE_ROOT prefixes /sys and /proc (tests run it against recorded trees).
R="${GPUVFIO_PROBE_ROOT:-}"
nv=
echo "GPUVFIO-PROBE 1"
echo "KERNEL $(uname -r)"
py=$(command -v python3 2>/dev/null || true)
echo "PYTHON3 ${py:-none}"
one() { # first line of a sysfs attribute in V ("-" when absent), without a fork: under
        # nested emulation 300 $(cat ...) subshells took minutes, `read` takes milliseconds.
    V=
    { IFS= read -r V < "$1"; } 2>/dev/null || :
    [ -n "$V" ] || V=-
}
for d in "$R/sys/bus/pci/devices/"*; do
    [ -e "$d/vendor" ] || continue
    a=${d##*/}
    drv=-
    if [ -L "$d/driver" ]; then
        drv=$(readlink "$d/driver")
        drv=${drv##*/}
    fi
    one "$d/vendor"; ven=$V; one "$d/device"; dev=$V; one "$d/class"; cls=$V
    one "$d/current_link_speed"; cs=$V; one "$d/current_link_width"; cw=$V
    one "$d/max_link_speed"; ms=$V; one "$d/max_link_width"; mw=$V
    up=-
    want=
    [ "$ven" = 0x10de ] && { nv=1; want=1; }
    case $cls in 0x0604*|0x02*|0x03*) want=1 ;; esac
    if [ -n "$want" ]; then  # the port it sits on (one fork: NVIDIA functions, bridges, NICs, displays)
        up=$(readlink -f "$d" 2>/dev/null) || up=-
        up=${up%/*}; up=${up##*/}
        case $up in *:*:*.*) ;; *) up=- ;; esac
    fi
    printf 'PCI|%s|%s|%s|%s|%s|%s|%s|%s|%s|%s\n' "$a" "$ven" "$dev" "$cls" "$drv" "$cs" "$cw" "$ms" "$mw" "$up"
done
if [ -r "$R/proc/modules" ]; then
    while read -r name _rest; do echo "MODULE $name"; done < "$R/proc/modules"
fi
if [ -r "$R/proc/driver/nvidia/version" ]; then
    echo "NVIDIA-VERSION $(head -n 1 "$R/proc/driver/nvidia/version")"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    echo "NVSMI-BEGIN"
    nvidia-smi -q -x 2>/dev/null
    echo "NVSMI-END"
fi
if [ -n "$nv" ] && [ -z "$R" ]; then
    dmesg 2>/dev/null | grep -e NVRM -e 'nvidia' | tail -n 20 | while IFS= read -r line; do echo "DMESG $line"; done
fi
echo "END"
