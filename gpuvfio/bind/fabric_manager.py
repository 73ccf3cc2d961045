"""Fabric Manager partitions: listing, activating and deactivating them through an ``fmpm``-like
command, and the journaled steps attach and detach take with them.

The command is NVIDIA's Fabric-Manager-Client sample (``fmpm``), which calls the FM API
(nv_fm_agent.h) and prints what it got (fmpm.cpp):

* ``fmpm -l``: fmGetSupportedFabricPartitions as JSON -- ``numPartitions``, ``maxNumPartitions``,
  ``partitionInfo[]`` of ``partitionId``, ``isActive``, ``numGpus``, ``gpuInfo[]`` of
  ``physicalId`` (the GPU module id), ``uuid``, ``pciBusId``, ``numNvLinksAvailable``,
  ``maxNumNvLinks``, ``nvlinkLineRateMBps``.
* ``fmpm -a ID`` / ``fmpm -d ID``: fmActivateFabricPartition / fmDeactivateFabricPartition;
  nothing on success; on failure "Failed to activate partition. fmReturn: N" on stdout and the
  fmReturn_t as exit status (nv_fm_types.h: FM_ST_SUCCESS 0, FM_ST_BADPARAM -1 ... so -7 exits 249).
* ``--hostname ADDR`` / ``--unix-domain-socket PATH`` choose the FM instance (default 127.0.0.1).

Partition ids are below FM_MAX_FABRIC_PARTITIONS (64), a partition has at most FM_MAX_NUM_GPUS
(16) GPUs, uuid and pciBusId fit 80 and 32 bytes (nv_fm_types.h). The command runs from an
argument list (never a shell), under a timeout, with its output bounded, through the runner
it is given (gpuvfio.commands; a Context's own); output that is not what fmpm prints is a
FabricManagerOutputError, never a traceback.

Order (FM user guide, shared NVSwitch and vGPU life cycles: activate before the guest starts; "Do
not deactivate partitions when VMs are executing on the GPUs in the partition"): attach binds,
activates, starts; detach stops, deactivates, restores. A partition is written to the journal
as ``activating`` before the activation is asked for, so a crash at any point leaves it where
``gpuvfio restore`` finds and deactivates it. The caller holds the run lock (journal.RunLock).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuvfio.address import PciAddress
from gpuvfio.bind.journal import Journal
from gpuvfio.commands import CommandError, CommandNotStarted, CommandOutputLimit, CommandTimeout, Runner, last_line
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.host.fabric import Decision, Partition, PartitionGpu
from gpuvfio.planning import Check
from gpuvfio.strictjson import JsonRejected, strict_loads

FMPM = "fmpm"
DEFAULT_TIMEOUT = 60.0
MAX_PARTITIONS = 64  # FM_MAX_FABRIC_PARTITIONS
MAX_GPUS = 16  # FM_MAX_NUM_GPUS
MAX_NVLINKS = 64  # FM_MAX_NUM_NVLINK_PORTS
UUID_SIZE, BUS_ID_SIZE, ADDRESS_SIZE = 80, 32, 256  # FM_UUID_BUFFER_SIZE, ..._PCI_BUS_ID_..., fmpm MAX_PATH_LEN
OUTPUT_LIMIT = 1 << 20  # a full list (64 partitions of 16 GPUs) is about 300 KiB of styled JSON
# fmReturn_t (nv_fm_types.h) and what each means for a partition call (FM user guide, "Partition
# Life Cycle Errors").
FM_STATUS = {
    -1: ("FM_ST_BADPARAM", "invalid or unsupported partition id"),
    -2: ("FM_ST_GENERIC_ERROR", "generic error; see the host's syslog"),
    -3: ("FM_ST_NOT_SUPPORTED", "Fabric Manager is not in shared-NVSwitch or vGPU mode"),
    -4: ("FM_ST_UNINITIALIZED", "partition not active (or the FM library is not initialised)"),
    -5: ("FM_ST_TIMEOUT", "a GPU or NVSwitch setting timed out; see the host's syslog"),
    -6: ("FM_ST_VERSION_MISMATCH", "the client is built against another Fabric Manager version"),
    -7: ("FM_ST_IN_USE", "partition already active, or its GPUs are in another active partition"),
    -8: ("FM_ST_NOT_CONFIGURED", "Fabric Manager is still initialising"),
    -9: ("FM_ST_CONNECTION_NOT_VALID", "cannot reach the Fabric Manager"),
    -10: ("FM_ST_NVLINK_ERROR", "NVLink error"),
}
NOT_ACTIVE = -4  # what fmDeactivateFabricPartition answers for a partition that is not active


class FabricManagerError(GpuvfioError):
    """The command failed. ``status``: the fmReturn_t it exited with, when it exited with one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class FabricManagerOutputError(FabricManagerError):
    """The command printed something that is not what fmpm prints."""


class FabricManagerTimeout(FabricManagerError):
    """No answer in time: the call may or may not have taken effect."""


class FabricStepError(GpuvfioError):
    """A partition step failed; the message says which, what FM said, and the rollback."""


def _uint(value, where: str, top: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise FabricManagerOutputError(f"fmpm -l: {where} is {str(value)[:40]!r}, not a number from 0 to {top}")
    return value


def _text(value, where: str, size: int) -> str | None:
    if not isinstance(value, str) or len(value) >= size or not value.isprintable():
        raise FabricManagerOutputError(f"fmpm -l: {where} is {str(value)[:40]!r}, not text shorter than {size}")
    return value or None


def _gpu(item, where: str) -> PartitionGpu:
    if not isinstance(item, dict) or "physicalId" not in item:
        raise FabricManagerOutputError(f"fmpm -l: {where} is not a GPU (no physicalId)")
    module = _uint(item["physicalId"], f"{where}.physicalId", 255)
    uuid = _text(item.get("uuid", ""), f"{where}.uuid", UUID_SIZE)
    bus = _text(item.get("pciBusId", ""), f"{where}.pciBusId", BUS_ID_SIZE)
    address = None
    if bus is not None:
        address = PciAddress.try_parse(bus)  # NVML's form, 00000000:1B:00.0
        if address is None:
            raise FabricManagerOutputError(f"fmpm -l: {where}.pciBusId is {bus!r}, not a PCI address")
    nvlinks = item.get("numNvLinksAvailable")
    top = item.get("maxNumNvLinks")
    if "nvlinkLineRateMBps" in item:
        _uint(item["nvlinkLineRateMBps"], f"{where}.nvlinkLineRateMBps", 0xFFFFFFFF)
    return PartitionGpu(module, address, uuid,
                        None if nvlinks is None else _uint(nvlinks, f"{where}.numNvLinksAvailable", MAX_NVLINKS),
                        None if top is None else _uint(top, f"{where}.maxNumNvLinks", MAX_NVLINKS))


def parse_partitions(output: bytes | str) -> list[Partition]:
    """The partitions ``fmpm -l`` printed; anything else is a FabricManagerOutputError."""
    try:
        doc = strict_loads(output)
    except JsonRejected as exc:
        shown = last_line(output if isinstance(output, bytes) else output.encode(), 160) or "nothing"
        raise FabricManagerOutputError(f"fmpm -l printed no partition list ({exc}: {shown!r})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("partitionInfo"), list):
        raise FabricManagerOutputError("fmpm -l printed JSON without a partitionInfo list")
    infos = doc["partitionInfo"]
    if len(infos) > MAX_PARTITIONS:
        raise FabricManagerOutputError(f"fmpm -l listed {len(infos)} partitions; FM has at most {MAX_PARTITIONS}")
    if "numPartitions" in doc and _uint(doc["numPartitions"], "numPartitions", MAX_PARTITIONS) != len(infos):
        raise FabricManagerOutputError(f"fmpm -l says numPartitions {doc['numPartitions']} but lists {len(infos)}")
    partitions: list[Partition] = []
    bus_of: dict[int, PciAddress] = {}
    for index, info in enumerate(infos):
        where = f"partitionInfo[{index}]"
        if not isinstance(info, dict) or not isinstance(info.get("gpuInfo"), list):
            raise FabricManagerOutputError(f"fmpm -l: {where} is not a partition (no gpuInfo list)")
        pid = _uint(info.get("partitionId"), f"{where}.partitionId", MAX_PARTITIONS - 1)
        active = _uint(info.get("isActive"), f"{where}.isActive", 1)
        items = info["gpuInfo"]
        if len(items) > MAX_GPUS or _uint(info.get("numGpus", len(items)), f"{where}.numGpus", MAX_GPUS) != len(items):
            raise FabricManagerOutputError(f"fmpm -l: {where} says numGpus {info.get('numGpus')} but lists "
                                           f"{len(items)} GPUs")
        gpus = tuple(_gpu(item, f"{where}.gpuInfo[{n}]") for n, item in enumerate(items))
        modules = [g.module_id for g in gpus]
        buses = [g.pci for g in gpus if g.pci is not None]
        if len(set(modules)) != len(modules) or len(set(buses)) != len(buses):
            raise FabricManagerOutputError(f"fmpm -l: partition {pid} names a GPU twice")
        for gpu in gpus:
            if gpu.pci is not None and bus_of.setdefault(gpu.module_id, gpu.pci) != gpu.pci:
                raise FabricManagerOutputError(f"fmpm -l: GPU module {gpu.module_id} has two PCI addresses")
        if any(p.partition_id == pid for p in partitions):
            raise FabricManagerOutputError(f"fmpm -l: partition {pid} is listed twice")
        partitions.append(Partition(pid, bool(active), gpus))
    return partitions


def _partition_id(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_PARTITIONS:
        raise InputError(f"not a Fabric Manager partition id: {value!r} (0 to {MAX_PARTITIONS - 1})")
    return value


def _argument(value: str, what: str) -> str:
    if not isinstance(value, str) or not value or "\0" in value or len(value) >= ADDRESS_SIZE:
        raise InputError(f"{what} must be text of 1 to {ADDRESS_SIZE - 1} characters without NUL")
    return value


class FabricManagerClient:
    """Partitions through an fmpm-like command: ``command`` is its path (or an argument-list
    prefix, ``[python, script]``), ``hostname`` / ``unix_socket`` the FM instance to talk to,
    ``env`` its environment (None: this process's), ``run`` what starts it (a Context hands out
    its clients with its own runner: ``with_runner``)."""

    def __init__(self, command: str | Sequence[str] = FMPM, *, timeout: float = DEFAULT_TIMEOUT,
                 hostname: str | None = None, unix_socket: str | None = None, env: dict | None = None,
                 run: Runner | None = None) -> None:
        prefix = [command] if isinstance(command, str) else list(command)
        self.prefix = [_argument(part, "the fmpm command") for part in prefix] or [FMPM]
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise InputError(f"the Fabric Manager timeout must be a number of seconds from 0 to 3600, not {timeout!r}")
        self.timeout = float(timeout)
        self.connection: list[str] = []
        if unix_socket is not None:
            self.connection = ["--unix-domain-socket", _argument(unix_socket, "the FM socket path")]
        elif hostname is not None:
            self.connection = ["--hostname", _argument(hostname, "the FM address")]
        self.env = env
        self.run = run or Runner()

    def with_runner(self, run: Runner) -> "FabricManagerClient":
        """This client, its commands started by ``run``."""
        other = copy.copy(self)
        other.run = run
        return other

    def _call(self, args: list[str], what: str) -> bytes:
        label = f"fmpm {' '.join(args)} ({what})"
        try:
            done = self.run.finish(self.prefix + self.connection + args, self.timeout, env=self.env,
                                   limit=OUTPUT_LIMIT, label=label)
        except CommandTimeout as exc:  # the call may or may not have taken effect
            raise FabricManagerTimeout(str(exc)) from None
        except CommandOutputLimit as exc:
            raise FabricManagerOutputError(f"{exc}; not fmpm's") from None
        except CommandNotStarted as exc:
            raise FabricManagerError(str(exc)) from None
        except CommandError as exc:  # a recording runner's refusal, say: no FM status
            raise FabricManagerError(f"{label}: {exc.reason}") from None
        status, out, err = done.status, done.stdout, done.stderr
        if status == 0:
            return out
        said = last_line(out, 160) or last_line(err, 160) or "nothing"
        if status < 0:
            raise FabricManagerError(f"fmpm {' '.join(args)} ({what}) was killed by signal {-status}; it said {said!r}")
        code = status - 256 if status >= 128 else status
        name, meaning = FM_STATUS.get(code, (f"exit status {status}", "not an FM status"))
        raise FabricManagerError(f"fmpm {' '.join(args)} ({what}) failed: {name}, {meaning}; it said {said!r}",
                                 status=code if code in FM_STATUS else None)

    def list_partitions(self) -> list[Partition]:
        return parse_partitions(self._call(["-l"], "list the partitions"))

    def activate(self, partition_id: int) -> None:
        self._call(["-a", str(_partition_id(partition_id))], f"activate partition {partition_id}")

    def deactivate(self, partition_id: int) -> None:
        self._call(["-d", str(_partition_id(partition_id))], f"deactivate partition {partition_id}")


@dataclass(frozen=True, slots=True)
class PartitionStep:
    kind: str  # activate_partition | deactivate_partition
    partition_id: int
    modules: tuple[int, ...] = ()
    devices: tuple[str, ...] = ()

    def describe(self) -> str:
        verb = "activate" if self.kind == "activate_partition" else "deactivate"
        gpus = f" (GPU modules {', '.join(map(str, self.modules))}" if self.modules else ""
        gpus += (f": {', '.join(self.devices)})" if self.devices else ")") if gpus else ""
        return f"{verb} Fabric Manager partition {self.partition_id}{gpus}"

    def undo(self) -> "PartitionStep":
        other = "deactivate_partition" if self.kind == "activate_partition" else "activate_partition"
        return PartitionStep(other, self.partition_id, self.modules, self.devices)

    def to_json(self) -> dict:
        return {"kind": self.kind, "partition": self.partition_id, "modules": list(self.modules),
                "devices": list(self.devices), "description": self.describe()}


def plan_attach(decision: Decision) -> list[PartitionStep]:
    """The partition steps of an attach (after the bind, before the start): none unless the
    decision names a partition."""
    if decision.refused or decision.partition is None:
        return []
    return [PartitionStep("activate_partition", decision.partition.partition_id,
                          tuple(decision.partition.module_ids), tuple(str(a) for a in decision.gpus))]


def plan_detach(journal: Journal, devices: list[PciAddress] | None = None) -> list[PartitionStep]:
    """Deactivation of the partitions gpuvfio activated for ``devices`` (all, with None), from the
    journal (after the stop, before the restore)."""
    wanted = None if devices is None else {str(d) for d in devices}
    steps = []
    for key, record in sorted(journal.data["partitions"].items(), key=lambda kv: int(kv[0])):
        if wanted is None or wanted & set(record.get("devices", [])):
            steps.append(PartitionStep("deactivate_partition", int(key), tuple(record.get("modules", [])),
                                       tuple(record.get("devices", []))))
    return steps


def plan_checks(decision: Decision) -> list[Check]:
    """The decision's lines as bind-plan checks (a refusal refuses the bind)."""
    return [Check("fabric", line.status, line.message) for line in decision.lines]


def _state_of(client: FabricManagerClient, partition_id: int) -> bool:
    for partition in client.list_partitions():
        if partition.partition_id == partition_id:
            return partition.active
    raise FabricManagerError(f"partition {partition_id} is not in the Fabric Manager's list")


def _activate(journal: Journal, client: FabricManagerClient, step: PartitionStep) -> None:
    key = str(step.partition_id)
    if key in journal.data["partitions"]:  # left by an earlier run: its state is restore's business
        raise FabricManagerError(f"partition {key} is in the journal already "
                                 f"({journal.data['partitions'][key].get('state')}); run gpuvfio restore first",
                                 status=-7)
    journal.data["partitions"][key] = {"state": "activating", "since": journal.clock.time(),
                                       "modules": list(step.modules), "devices": list(step.devices)}
    journal.save()  # before the call: a crash from here on leaves it for restore
    try:
        client.activate(step.partition_id)
    except FabricManagerError as exc:
        if exc.status is not None:  # FM answered no: nothing was activated (IN_USE: not by us)
            del journal.data["partitions"][key]
            journal.save()
        raise
    if not _state_of(client, step.partition_id):
        raise FabricManagerError(f"partition {step.partition_id} is not active after fmpm -a")
    journal.data["partitions"][key]["state"] = "active"
    journal.save()


def _deactivate(journal: Journal, client: FabricManagerClient, partition_id: int) -> None:
    key = str(partition_id)
    record = journal.data["partitions"].get(key)
    if record is not None:
        record["state"] = "deactivating"
        journal.save()
    try:
        client.deactivate(partition_id)
    except FabricManagerError as exc:
        if exc.status != NOT_ACTIVE:
            raise
    if _state_of(client, partition_id):
        raise FabricManagerError(f"partition {partition_id} is still active after fmpm -d")
    if key in journal.data["partitions"]:
        del journal.data["partitions"][key]
        journal.save()


def deactivate_journaled(journal: Journal, client: FabricManagerClient, partition_ids: list[int] | None = None,
                         progress: Callable[[str], None] = lambda line: None) -> dict[str, tuple[bool, str]]:
    """Deactivate the partitions the journal holds (all, or ``partition_ids``), whatever state a
    crash left them in: the restore path, and detach's step. Deactivated ones leave the journal."""
    keys = sorted(journal.data["partitions"], key=int)
    if partition_ids is not None:
        keys = [k for k in keys if int(k) in set(partition_ids)]
    results: dict[str, tuple[bool, str]] = {}
    for key in keys:
        try:
            _deactivate(journal, client, int(key))
        except FabricManagerError as exc:
            results[key] = (False, str(exc))
            progress(f"partition {key}: deactivation failed: {exc}")
            continue
        results[key] = (True, "deactivated")
        progress(f"partition {key}: deactivated")
    return results


@dataclass
class StepResult:
    done: list[str] = field(default_factory=list)


def apply_partition_steps(journal: Journal, client: FabricManagerClient, steps: list[PartitionStep],
                          progress: Callable[[str], None] = lambda line: None) -> StepResult:
    """Carry out partition steps, journaled as bind steps are (each step's state saved before
    it runs). A failed activation rolls back every partition this run activated (and the failed
    one, when FM's answer left it unknown); a failed deactivation stays in the journal."""
    result = StepResult()
    if not steps:
        return result
    journal.data["operation"] = {"kind": "fabric", "pid": os.getpid(), "started": journal.clock.time(),
                                 "devices": sorted({d for s in steps for d in s.devices}),
                                 "steps": [dict(s.to_json(), state="pending") for s in steps]}
    journal.save()
    for index, step in enumerate(steps):
        journal.set_step(index, "running")
        ours = str(step.partition_id) not in journal.data["partitions"]  # not a running guest's
        try:
            if step.kind == "activate_partition":
                _activate(journal, client, step)
            else:
                _deactivate(journal, client, step.partition_id)
        except FabricManagerError as exc:
            unknown = exc.status is None
            journal.set_step(index, "uncertain" if unknown else "failed", str(exc))
            if step.kind == "activate_partition":
                mine = [s.partition_id for s in steps[:index] if s.kind == "activate_partition"]
                mine += [step.partition_id] if ours else []
                undone = deactivate_journaled(journal, client, mine, progress)
                left = {k: m for k, (ok, m) in undone.items() if not ok}
                if left:
                    rollback = ("rollback incomplete (" + "; ".join(f"partition {k}: {m}" for k, m in left.items())
                                + "); the journal keeps them for gpuvfio restore")
                else:
                    rollback = "rolled back: " + (", ".join(f"partition {k} deactivated" for k in undone)
                                                  or "nothing was activated")
            else:
                rollback = f"partition {step.partition_id} stays in the journal for gpuvfio restore"
            # This run ended and said so: not a crashed one for status to flag (what is left
            # active is in the journal's partitions, which restore deactivates).
            journal.data["operation"]["finished"] = journal.clock.time()
            journal.data["operation"]["failed"] = str(exc)
            journal.save()
            raise FabricStepError(f"step {index + 1} ({step.describe()}) failed: {exc}; {rollback}") from None
        journal.set_step(index, "done")
        result.done.append(step.describe())
        progress(f"[{index + 1}/{len(steps)}] {step.describe()}: done")
    journal.data["operation"]["finished"] = journal.clock.time()
    journal.save()
    return result
