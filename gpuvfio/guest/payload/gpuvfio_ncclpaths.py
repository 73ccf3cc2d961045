"""NCCL's paths between GPUs, rule for rule: the path type NCCL computes between two GPUs of a
topology it has read (with gpuvfio_ncclxml), before it decides on P2P.

The rules follow NCCL v2.30.7-1 (commit 73cf1122):

- src/graph/topo.cc ``ncclTopoGetSystemFromXml`` on the first <system>: ``ncclTopoAddCpu``
  makes a CPU node of each <cpu>; ``ncclTopoAddPci`` gives each <pci> below it a type by its
  class, the first entry of ``kvDictPciClass`` the class starts with (``kvConvertToInt``
  compares strlen(key) bytes, and anything unknown falls back to PCI). A PCI node (a bridge,
  or an unknown class) is linked to its parent both ways with LINK_PCI and holds the <pci>
  below it; a GPU is a DEV node named by its bus id, linked to its parent the same way, with
  a GPU node beside it (LINK_LOC); a <pci> holding a <gpu> without a ``rank`` ends there; a
  <nic> makes a NIC node (a leaf); any other <pci> makes no node and what it holds is not read.
  The bandwidth of a link is ``link_width`` x the per-lane rate of ``link_speed``
  (``kvDictPciGen``, by prefix; 60 when unknown) / 80, a width of 0 taken as 16;
  ``ncclTopoConnectNodes`` keeps a node's links in descending bandwidth.
- ``ncclTopoAddPciLinks``: a <pcilink> links two PCI switches with LINK_LOC (Broadcom Gen5 P2P).
- ``ncclTopoFlattenBcmSwitches``: a Broadcom PEX Gen4 or Gen5 switch shows two levels of bridges
  (``getBcmGen`` on vendor << 48 | device << 32 | subsystem_vendor << 16 | subsystem_device);
  NCCL folds the lower level into the upper one.
- ``ncclTopoConnectCpus``: every CPU linked to every other with LINK_SYS.
- src/graph/paths.cc ``ncclTopoSetPaths``: breadth-first from a GPU. A hop's type is its link's
  (LOC 0, PCI = PATH_PIX 4, SYS 9), PATH_PXB (5) between two PCI nodes, PATH_PHB (8) for a PCI
  link at a CPU; a path's type is the largest of its hops; a node's path is replaced by one of a
  smaller type, or the same type and more bandwidth, or both the same and fewer hops; no path
  goes on through a DEV node but the first, except into its own GPU.

Left out because none of it changes the PCIe path between two GPUs: NVLink and C2C (the PCIe
path is what gpuvfio mirrors; an NVLink pair is NVL in a guest as on the host), networks, the
bandwidth between CPUs (``ncclTopoGetInterCpuBw``: only ties between SYS paths depend on it),
MLO partitions. Where a <pci> of a GPU's class holds no <gpu> (gpuvfio's own file: NCCL adds the
<gpu> in ``ncclTopoFillGpu`` when it finds the device) it is taken as the GPU it will be; a
missing link attribute, which NCCL fills from sysfs first, counts as NCCL's fallback.

NCCL's type names (``topoPathTypeStr``); nvidia-smi's PHB and NODE are both PHB here, as NCCL
makes one CPU node of a NUMA node. Standard library only (python3 >= 3.6): the in-guest
verifier computes the paths of NCCL's dump with it, and the host computes its own with it.
"""

LOC_BW = 5000.0  # src/graph/topo.h
LINK_LOC, LINK_PCI, LINK_SYS = 0, 4, 9  # src/graph/topo.h LINK_*
PATH_PIX, PATH_PXB, PATH_PHB, PATH_SYS, PATH_DIS = 4, 5, 8, 9, 11  # src/graph/topo.h PATH_*
PATH_NAMES = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS", "NET", "DIS")
CPU, PCI, NVS, NIC, GPU, DEV = "CPU", "PCI", "NVS", "NIC", "GPU", "DEV"
# kvDictPciClass, in NCCL's order: the first key a class starts with wins; PCI otherwise.
PCI_CLASSES = (("0x060400", PCI), ("0x080100", PCI), ("0x068000", NVS), ("0x068001", CPU), ("0x03", GPU),
               ("0x02", NIC))
# kvDictPciGen: x100 Mbps per lane; the first key the speed starts with wins; 60 otherwise.
PCI_GENS = (("2.5 GT/s", 15), ("5 GT/s", 30), ("8 GT/s", 60), ("16 GT/s", 120), ("32 GT/s", 240),
            ("2.5 GT/s PCIe", 15), ("5.0 GT/s PCIe", 30), ("8.0 GT/s PCIe", 60), ("16.0 GT/s PCIe", 120),
            ("32.0 GT/s PCIe", 240), ("64.0 GT/s PCIe", 480))
MAX_NODES = 1024  # far above NCCL_TOPO_MAX_NODES (576 in all): a bound on hostile dumps


class TopoNode(object):
    __slots__ = ("type", "id", "device", "links")

    def __init__(self, kind, ident, device=0):
        self.type, self.id, self.device, self.links = kind, ident, device, []

    def connect(self, other, link_type, bw):
        """ncclTopoConnectNodes: one link per (node, type), bandwidth added; links kept in
        descending bandwidth, a new one after those of equal bandwidth."""
        for n, (rem, kind, old) in enumerate(self.links):
            if rem is other and kind == link_type:
                del self.links[n]
                bw += old
                break
        at = len(self.links)
        while at and self.links[at - 1][2] < bw:
            at -= 1
        self.links.insert(at, (other, link_type, bw))


def _required(xml, key):
    """xmlGetAttrStr: the attribute, or NCCL's refusal."""
    value = xml.get(key)
    if value is None:
        raise ValueError("Attribute %s of node %s not found" % (key, xml.name))
    return value


def class_type(text):
    for key, kind in PCI_CLASSES:
        if text.startswith(key):
            return kind
    return PCI


def link_bw(xml):
    """ncclTopoAddPci's bandwidth, GB/s: width x per-lane rate / 80."""
    width = _strtol(xml.get("link_width") or "0")
    speed = xml.get("link_speed") or ""
    rate = next((value for key, value in PCI_GENS if speed.startswith(key)), 60)
    return (width or 16) * rate / 80.0


def _strtol(text):
    digits = ""
    for c in text.strip():
        if not c.isdigit():
            break
        digits += c
    return int(digits) if digits else 0


def bus_key(busid):
    """A bus id as NCCL keys it: src/misc/utils.cc busIdToInt64 reads hex digits, skipping ':'
    and '.', up to the first other character or 16 digits, as one number (so 00000000:20:00.0 is
    0000:20:00.0); strtol clamps what overflows an int64."""
    digits = ""
    for c in busid:
        if len(digits) == 16:
            break
        if c in ".:":
            continue
        if c not in "0123456789abcdefABCDEF":
            break
        digits += c
    return min(int(digits, 16), 2 ** 63 - 1) if digits else 0


def bus_name(busid):
    """The bus id as the pairs name it: lower case, without blanks around it."""
    return busid.strip().lower()


def int_device(xml):
    """ncclTopoGetIntDevice: vendor << 48 | device << 32 | subsystem_vendor << 16 | subsystem_device."""
    value = 0
    for key, shift in (("vendor", 48), ("device", 32), ("subsystem_vendor", 16), ("subsystem_device", 0)):
        text = xml.get(key)
        if text:
            try:
                value += (int(text, 0) & 0xFFFF) << shift
            except ValueError:
                pass
    return value


class System(object):
    """The nodes NCCL builds; ``gpus`` by NCCL's number of their bus id, ``names`` the bus id as
    the first node of that number spelled it."""

    def __init__(self):
        self.nodes, self.gpus, self.cpus, self.names = [], {}, [], {}

    def node(self, kind, ident, device=0):
        if len(self.nodes) == MAX_NODES:
            raise ValueError("more than %d topology nodes" % MAX_NODES)
        node = TopoNode(kind, ident, device)
        self.nodes.append(node)
        return node

    def find(self, kind, ident):
        return next((n for n in self.nodes if n.type == kind and n.id == ident), None)


def _link_both(a, b, link_type, bw):
    a.connect(b, link_type, bw)
    b.connect(a, link_type, bw)


def _add_gpu(system, xml, parent, bw):
    text = _required(xml, "busid")
    busid = bus_key(text)
    dev = system.find(DEV, busid)
    if dev is None:
        dev = system.node(DEV, busid)
        _link_both(dev, parent, LINK_PCI, bw)
    gpu = system.node(GPU, busid)
    _link_both(dev, gpu, LINK_LOC, LOC_BW)
    if busid not in system.names:
        system.names[busid] = bus_name(text)
        system.gpus[busid] = gpu


def add_pci(system, xml, parent, depth=0):
    """ncclTopoAddPci for ``xml`` below the node ``parent``."""
    if depth > 64:
        raise ValueError("PCI nodes nested more than 64 deep")
    kind = class_type(_required(xml, "class"))
    busid = bus_key(_required(xml, "busid"))
    bw = link_bw(xml)
    gpus = [sub for sub in xml.subs if sub.name == "gpu"]
    for sub in gpus:
        if sub.get("rank") is None:
            return
        _add_gpu(system, xml, parent, bw)
    if not gpus and kind == GPU:
        _add_gpu(system, xml, parent, bw)  # gpuvfio's file: the <gpu> NCCL adds when it finds it
    node = None
    if any(sub.name == "nic" for sub in xml.subs):
        node = system.node(NIC, busid) if system.find(NIC, busid) is None else None
    elif kind == PCI:
        node = system.node(PCI, busid, int_device(xml))
        for sub in xml.subs:
            if sub.name != "pcilink":
                add_pci(system, sub, node, depth + 1)
    if node is not None:
        _link_both(node, parent, LINK_PCI, bw)


def _add_pci_links(system, xml, parent_busid):
    if xml.name == "pcilink":
        switch = system.find(PCI, bus_key(parent_busid or ""))
        if switch is None:
            raise ValueError("Add PCI Link error : could not find PCI SW %s" % parent_busid)
        remote = system.find(PCI, bus_key(_required(xml, "target")))
        if remote is not None:
            switch.connect(remote, LINK_LOC, LOC_BW)
        return
    busid = xml.get("busid")
    for sub in xml.subs:
        _add_pci_links(system, sub, busid if busid is not None else parent_busid)


def bcm_gen(device, level):
    """getBcmGen."""
    if device & 0xFFFFFFFFFFFFF000 == 0x1000C0101000A000:
        return 4
    if device & 0xFFFFFFFFFFFFF000 == 0x1000C03010000000 | level * 0x1000:
        return 5
    return 0


def _remove(system, gone):
    """ncclTopoRemoveNode: the node and every link to it."""
    system.nodes.remove(gone)
    for node in system.nodes:
        node.links = [link for link in node.links if link[0] is not gone]


def flatten_bcm(system):
    """ncclTopoFlattenBcmSwitches: each sub-switch of a Broadcom switch folded into it."""
    again = True
    while again:
        again = False
        for switch in [n for n in system.nodes if n.type == PCI]:
            gen = bcm_gen(switch.device, 0)
            if not gen:
                continue
            subs = [rem for rem, _kind, _bw in switch.links if rem.type == PCI and bcm_gen(rem.device, 1) == gen]
            switch.links = [link for link in switch.links if link[0] not in subs]
            for sub in subs:
                for rem, kind, bw in sub.links:
                    if rem is switch:
                        continue
                    switch.links.append((rem, kind, bw))
                    for n, (back, back_kind, back_bw) in enumerate(rem.links):
                        if back is sub:
                            rem.links[n] = (switch, back_kind, back_bw)
                            break
                _remove(system, sub)
            switch.device |= 0xFFFF
            again = True
            break


def build_system(systems):
    """The system NCCL builds from the first <system> of a read topology (gpuvfio_ncclxml's
    load_topology); ValueError where NCCL refuses it."""
    system = System()
    if not systems:
        raise ValueError("ncclTopoGetSystemFromXml: system node not found in XML")
    top = systems[0]
    for xml in top.subs:
        if xml.name != "cpu":
            continue
        cpu = system.node(CPU, xml.get("numaid"))
        system.cpus.append(cpu)
        for sub in xml.subs:
            if sub.name == "pci":
                add_pci(system, sub, cpu)
            elif sub.name == "nic" and system.find(NIC, ("cpu", xml.get("numaid"))) is None:
                _link_both(cpu, system.node(NIC, ("cpu", xml.get("numaid"))), LINK_PCI, LOC_BW)
    _add_pci_links(system, top, None)
    flatten_bcm(system)
    for a in system.cpus:
        for b in system.cpus:
            if a is not b:
                a.connect(b, LINK_SYS, LOC_BW)
    return system


def paths_from(system, base):
    """ncclTopoSetPaths from GPU ``base``: node -> (type, bw, hops)."""
    paths = {base: (0, LOC_BW, 0)}
    base_dev = next(rem for rem, kind, _bw in base.links if rem.type == DEV)
    level = [base]
    while level:
        following = []
        for node in level:
            path_type, path_bw, hops = paths[node]
            for rem, link_type, link_bw_ in node.links:
                if node is not base_dev and node.type == DEV and (link_type != LINK_LOC or rem.type != GPU):
                    continue
                bw = min(path_bw, link_bw_)
                new_type = link_type
                if node.type == PCI and rem.type == PCI:
                    new_type = PATH_PXB
                if link_type == LINK_PCI and CPU in (node.type, rem.type):
                    new_type = PATH_PHB
                new_type = max(path_type, new_type)
                old = paths.get(rem, (PATH_DIS, 0.0, 0))
                if (new_type < old[0] or (new_type == old[0] and old[1] < bw)
                        or (new_type == old[0] and old[1] == bw and old[2] > hops + 1)):
                    paths[rem] = (new_type, bw, hops + 1)
                    if rem not in following:
                        following.append(rem)
        level = following
    return paths


def gpu_paths(systems):
    """{(bus id, bus id): NCCL's path type name} for each pair of GPUs of a read topology, the
    smaller bus id first (``bus_name``: lower case, without blanks)."""
    system = build_system(systems)
    out = {}
    busids = sorted(system.gpus, key=lambda number: system.names[number])
    for n, a in enumerate(busids):
        paths = paths_from(system, system.gpus[a])
        for b in busids[n + 1:]:
            out[(system.names[a], system.names[b])] = PATH_NAMES[paths.get(system.gpus[b], (PATH_DIS,))[0]]
    return out
