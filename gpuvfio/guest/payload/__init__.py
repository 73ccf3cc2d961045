"""Files that run inside the guest, sent over SSH (sh -c, python3 -) and never imported
by gpuvfio itself: probe.sh (POSIX sh, busybox is enough) and verifier.py (stdlib only)."""

import os

GUEST_DIR = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(GUEST_DIR, "probe.sh")
VERIFIER = os.path.join(GUEST_DIR, "verifier.py")
