"""The NVIDIA vGPU scheduler policy of a physical GPU: read, set, journal, put back.

Where the host driver exposes it (NVML's vGPU scheduler API, R525 and later:
``nvmlDeviceGetVgpuSchedulerCapabilities`` / ``...GetVgpuSchedulerState`` /
``...SetVgpuSchedulerState``), the policy is best effort (1), equal share (2) or fixed
share (3), optionally with Adaptive Round Robin; NVML allows the change only while no
vGPU VM runs on that GPU, and it does not survive a reload of the nvidia module. Older
drivers only take the ``RmPVMRL`` registry key (``NVreg_RegistryDwords`` in modprobe.d)
at module load; gpuvfio does not reload the host driver, so there it refuses and says so.

Every change is journaled (``schedulers``: the GPU's previous state) before it is made,
so ``gpuvfio restore`` and the testbed's teardown put the previous policy back.
"""

from __future__ import annotations

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError, Refused
from gpuvfio.host.root import HostRoot
from gpuvfio.bind.journal import Journal, RunLock
from gpuvfio.files import Tree

POLICIES = {"best-effort": 1, "equal-share": 2, "fixed-share": 3}
NAMES = {value: name for name, value in POLICIES.items()}
ARR_MODES = {0: "default", 1: "disabled", 2: "enabled"}  # NVML_VGPU_SCHEDULER_ARR_*


class SchedulerUnavailable(GpuvfioError):
    """The host driver does not expose the vGPU scheduler for this GPU."""


def parse_policy(value: str) -> str:
    if value not in POLICIES:
        raise InputError(f"vGPU scheduler policy must be one of {', '.join(POLICIES)}, not {value!r}")
    return value


class Nvml:
    """pynvml, initialised once; every NVML failure becomes a one-line gpuvfio error."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise SchedulerUnavailable("pynvml is not installed (pip install nvidia-ml-py)") from None
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise SchedulerUnavailable(f"NVML is not available on this host ({exc}); the vGPU scheduler "
                                       "can only be set through the nvidia module's RmPVMRL registry key "
                                       "there") from None

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass

    def __enter__(self) -> "Nvml":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, what: str, address: PciAddress, fn, *args):
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in (self.nvml.NVML_ERROR_NOT_SUPPORTED, self.nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                raise SchedulerUnavailable(f"{address}: this driver does not expose the vGPU scheduler through "
                                           f"NVML ({exc}); set RmPVMRL in the nvidia module's "
                                           "NVreg_RegistryDwords and reload it instead") from None
            raise GpuvfioError(f"{address}: {what} failed: {exc}") from None

    def handle(self, address: PciAddress):
        return self._call("finding the GPU in NVML", address, self.nvml.nvmlDeviceGetHandleByPciBusId,
                          str(address).encode())

    def read(self, address: PciAddress) -> dict:
        handle = self.handle(address)
        caps = self._call("reading vGPU scheduler capabilities", address,
                          self.nvml.nvmlDeviceGetVgpuSchedulerCapabilities, handle)
        state = self._call("reading the vGPU scheduler state", address, self.nvml.nvmlDeviceGetVgpuSchedulerState,
                           handle)
        arr = state.arrMode == 2
        params = state.schedulerParams
        return {
            "address": str(address),
            "policy": NAMES.get(state.schedulerPolicy, f"unknown({state.schedulerPolicy})"),
            "arr": ARR_MODES.get(state.arrMode, str(state.arrMode)),
            "timeslice": params.vgpuSchedDataWithARR.timeslice if arr else params.vgpuSchedData.timeslice,
            "avg_factor": params.vgpuSchedDataWithARR.avgFactor if arr else None,
            "supported": [NAMES[p] for p in caps.supportedSchedulers if p in NAMES],
            "timeslice_range": [caps.minTimeslice, caps.maxTimeslice],
            "arr_supported": bool(caps.isArrModeSupported),
        }

    def write(self, address: PciAddress, policy: str, *, arr: bool = False, timeslice: int = 0,
              avg_factor: int = 0) -> None:
        """With ARR on, NVML takes an average factor and a frequency (0: the driver's default);
        it reports a timeslice, not a frequency, so a non-default ARR frequency is not kept."""
        state = self.nvml.c_nvmlVgpuSchedulerSetState_t()
        state.schedulerPolicy = POLICIES[policy]
        state.enableARRMode = 1 if arr else 0
        if arr:
            state.schedulerParams.vgpuSchedDataWithARR.avgFactor = avg_factor
        else:
            state.schedulerParams.vgpuSchedData.timeslice = timeslice
        self._call("setting the vGPU scheduler", address, self.nvml.nvmlDeviceSetVgpuSchedulerState,
                   self.handle(address), state)


def snapshot(current: dict) -> dict:
    """What it takes to write ``current`` back (the journal's record of a GPU's scheduler)."""
    low, high = current["timeslice_range"]
    timeslice = current["timeslice"] or 0
    return {"policy": current["policy"], "arr_mode": current["arr"],
            "timeslice": timeslice if low <= timeslice <= high else 0, "avg_factor": current.get("avg_factor") or 0}


def _write_back(nvml: Nvml, address: PciAddress, record: dict) -> None:
    arr = record.get("arr_mode") == "enabled" or record.get("arr") is True  # "arr": an older record
    nvml.write(address, record["policy"], arr=arr, timeslice=record.get("timeslice", 0),
               avg_factor=record.get("avg_factor", 0))


def set_policy(host: HostRoot, nvml: Nvml, address: PciAddress, policy: str, *, state: Tree,
               lock_timeout: float = 30.0) -> dict:
    """Set ``policy`` on the GPU (its ARR mode and timeslice kept), journaling the original.

    Returns the state after, with ``before`` (what to write back to undo this call) and
    ``journaled`` (whether this call made the journal entry: an earlier change by gpuvfio
    keeps the first original for ``gpuvfio restore``). A no-op when the policy is set already.
    """
    parse_policy(policy)
    with RunLock(state, lock_timeout):
        journal = Journal.load(state)
        current = nvml.read(address)
        if policy not in current["supported"]:
            raise Refused(f"{address} supports the vGPU scheduler policies {', '.join(current['supported'])}, "
                             f"not {policy}")
        if current["policy"] == policy:
            return {**current, "result": "unchanged"}
        if current["policy"] not in POLICIES:
            raise GpuvfioError(f"{address}: the current vGPU scheduler policy ({current['policy']}) could not "
                               "be put back afterwards; not changing it")
        before = snapshot(current)
        schedulers = journal.data.setdefault("schedulers", {})
        added = str(address) not in schedulers
        schedulers.setdefault(str(address), before)  # the first original wins
        journal.save()
        try:
            _write_back(nvml, address, {**before, "policy": policy})
        except GpuvfioError:
            if added and nvml.read(address)["policy"] == current["policy"]:  # nothing changed: forget it
                del schedulers[str(address)]
                journal.save()
            raise
        after = nvml.read(address)
        if after["policy"] != policy:
            raise GpuvfioError(f"{address}: the vGPU scheduler reads back {after['policy']}, not {policy}")
        return {**after, "result": "set", "previous": current["policy"], "before": before, "journaled": added}


def undo_set(host: HostRoot, address: PciAddress, before: dict, journaled: bool, *, state: Tree, nvml_factory=Nvml,
             lock_timeout: float = 30.0) -> list[str]:
    """Undo one ``set_policy`` (a testbed variant's): write ``before`` back; drop the journal
    entry only if that call made it. Returns failures (the journal then still holds it)."""
    with RunLock(state, lock_timeout):
        journal = Journal.load(state)
        try:
            with nvml_factory() as nvml:
                _write_back(nvml, address, before)
        except GpuvfioError as exc:
            return [f"vGPU scheduler of {address}: {exc}"]
        if journaled and str(address) in journal.data.get("schedulers", {}):
            del journal.data["schedulers"][str(address)]
            journal.save()
    return []


def put_back(host: HostRoot, journal: Journal, nvml_factory=Nvml, progress=lambda line: None) -> list[str]:
    """Restore every journaled scheduler policy (for ``gpuvfio restore``)."""
    schedulers = journal.data.get("schedulers") or {}
    if not schedulers:
        return []
    failures = []
    try:
        nvml = nvml_factory()
    except GpuvfioError as exc:
        return [f"vGPU scheduler of {', '.join(schedulers)}: {exc}"]
    with nvml:
        for key, previous in list(schedulers.items()):
            address = PciAddress.parse(key)
            try:
                _write_back(nvml, address, previous)
                del schedulers[key]
                journal.save()
                progress(f"vGPU scheduler of {key}: back to {previous['policy']}")
            except GpuvfioError as exc:
                failures.append(f"vGPU scheduler of {key}: {exc}")
    return failures

