"""The host's NVIDIA GPUs as the NVLink reading checks a recording against them (nvlink.nvidia_gpus:
one pass over held directories, ids read as the inventory reads them) are the inventory's NVIDIA
display-class functions, on every sample and the generated host."""

import os

import pytest

from gpuvfio.errors import HostReadError
from gpuvfio.host.inventory import read_inventory
from gpuvfio.host.nvlink import nvidia_gpus
from gpuvfio.host.root import HostRoot
from tests.make_samples import EVERY_HOST, host_tree


def _root(name: str, tmp_path) -> str:
    return host_tree(name, str(tmp_path / name))


@pytest.mark.parametrize("name", EVERY_HOST)
def test_the_gpus_are_the_inventorys(name, tmp_path):
    host = HostRoot(_root(name, tmp_path))
    expected = {a for a, f in read_inventory(host).functions.items()
                if f.vendor_id == "10de" and f.class_id.startswith("03")}
    assert nvidia_gpus(HostRoot(host.root)) == expected
    if name == "dgx-h100":
        assert len(expected) == 8


def test_a_gpu_whose_ids_are_a_fifo_is_an_error(tmp_path):
    root = _root("dgx-h100", tmp_path)
    address = sorted(nvidia_gpus(HostRoot(root)))[0]
    directory = os.path.realpath(os.path.join(root, "sys", "bus", "pci", "devices", str(address)))
    for name in ("uevent", "vendor"):
        os.unlink(os.path.join(directory, name))
    os.mkfifo(os.path.join(directory, "vendor"))
    with pytest.raises(HostReadError):
        nvidia_gpus(HostRoot(root))
