"""Files that run inside the guest, sent over SSH (sh -c, python3 -): probe.sh (POSIX sh,
busybox is enough), verifier.py with its driver layer gpuvfio_nvapi.py and its references of
NCCL's own readers: of topology XML (gpuvfio_ncclxml.py), of nccl.conf (gpuvfio_ncclconf.py) and
of paths (gpuvfio_ncclpaths.py), stdlib only, and their kernels (kernels.cu, compiled to
kernels.ptx). gpuvfio itself imports only the three NCCL references, so that the host and the
guest apply the same rules."""

import os

from gpuvfio.errors import GpuvfioError
from gpuvfio.user_files import read_regular

PAYLOAD_LIMIT = 4 << 20  # the largest of the files (kernels.ptx) is far below it
GUEST_DIR = os.path.dirname(os.path.abspath(__file__))
PROBE = os.path.join(GUEST_DIR, "probe.sh")
VERIFIER = os.path.join(GUEST_DIR, "verifier.py")
NVAPI = os.path.join(GUEST_DIR, "gpuvfio_nvapi.py")  # the verifier's driver layer, beside it
NCCLXML = os.path.join(GUEST_DIR, "gpuvfio_ncclxml.py")  # NCCL's XML reader, beside it
NCCLPATHS = os.path.join(GUEST_DIR, "gpuvfio_ncclpaths.py")  # NCCL's paths, beside it
NCCLCONF = os.path.join(GUEST_DIR, "gpuvfio_ncclconf.py")  # NCCL's reader of nccl.conf, beside it
KERNELS_PTX = os.path.join(GUEST_DIR, "kernels.ptx")  # kernels.cu, compiled (see there)
# What python3 - runs: gpuvfio_ncclxml, gpuvfio_ncclconf, gpuvfio_ncclpaths and gpuvfio_nvapi
# become modules (the last with its kernels), then the verifier runs as __main__, as if the
# files and kernels.ptx lay side by side in the guest.
_BOOTSTRAP = """import sys, types
_module = types.ModuleType("gpuvfio_ncclxml")
sys.modules["gpuvfio_ncclxml"] = _module
exec(compile({ncclxml!r}, "gpuvfio_ncclxml.py", "exec"), _module.__dict__)
_module = types.ModuleType("gpuvfio_ncclconf")
sys.modules["gpuvfio_ncclconf"] = _module
exec(compile({ncclconf!r}, "gpuvfio_ncclconf.py", "exec"), _module.__dict__)
_module = types.ModuleType("gpuvfio_ncclpaths")
sys.modules["gpuvfio_ncclpaths"] = _module
exec(compile({ncclpaths!r}, "gpuvfio_ncclpaths.py", "exec"), _module.__dict__)
_module = types.ModuleType("gpuvfio_nvapi")
_module.__dict__["KERNELS_PTX"] = {ptx!r}
sys.modules["gpuvfio_nvapi"] = _module
exec(compile({nvapi!r}, "gpuvfio_nvapi.py", "exec"), _module.__dict__)
exec(compile({verifier!r}, "verifier.py", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
"""


def verifier_program() -> bytes:
    """The verifier as ``python3 -`` reads it on stdin (nothing is written in the guest)."""
    texts = {}
    for name, path in (("ptx", KERNELS_PTX), ("nvapi", NVAPI), ("ncclxml", NCCLXML), ("ncclpaths", NCCLPATHS),
                       ("ncclconf", NCCLCONF), ("verifier", VERIFIER)):
        data = read_regular(path, PAYLOAD_LIMIT)
        if data is None:
            raise GpuvfioError(f"the in-guest payload is missing ({path}): the installation is incomplete")
        texts[name] = data.decode("utf-8")
    return _BOOTSTRAP.format(**texts).encode()
