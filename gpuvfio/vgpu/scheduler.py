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

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

from gpuvfio.address import PciAddress
from gpuvfio.errors import GpuvfioError, InputError
from gpuvfio.planning import Step
from gpuvfio.bind.journal import Journal

POLICIES = {"best-effort": 1, "equal-share": 2, "fixed-share": 3}
NAMES = {value: name for name, value in POLICIES.items()}
ARR_MODES = {0: "default", 1: "disabled", 2: "enabled"}  # NVML_VGPU_SCHEDULER_ARR_*


@dataclass(frozen=True)
class SchedulerState:
    """A GPU's vGPU scheduler as NVML reports it."""

    address: str
    policy: str  # best-effort | equal-share | fixed-share, or unknown(N) for a value NVML added later
    arr: str  # Adaptive Round Robin: default | disabled | enabled
    timeslice: int
    avg_factor: int | None  # with ARR enabled only
    supported: list[str]
    timeslice_range: tuple[int, int]
    arr_supported: bool

    def to_json(self) -> dict:
        return {"address": self.address, "policy": self.policy, "arr": self.arr, "timeslice": self.timeslice,
                "avg_factor": self.avg_factor, "supported": list(self.supported),
                "timeslice_range": list(self.timeslice_range), "arr_supported": self.arr_supported}


@dataclass(frozen=True)
class SchedulerSnapshot:
    """What it takes to write a GPU's scheduler back: the journal's record of it."""

    policy: str
    arr_mode: str
    timeslice: int = 0
    avg_factor: int = 0

    @property
    def arr(self) -> bool:
        return self.arr_mode == "enabled"

    @classmethod
    def from_json(cls, record: dict) -> "SchedulerSnapshot":
        """A journal record; one written before ``arr_mode`` existed says ``"arr": true``."""
        arr_mode = "enabled" if record.get("arr") is True else record.get("arr_mode") or "disabled"
        return cls(record["policy"], arr_mode, record.get("timeslice", 0), record.get("avg_factor", 0))

    def to_json(self) -> dict:
        return {"policy": self.policy, "arr_mode": self.arr_mode, "timeslice": self.timeslice,
                "avg_factor": self.avg_factor}


class SchedulerOutcome(str, Enum):
    SET = "set"
    UNCHANGED = "unchanged"  # the policy was set already: nothing written, nothing journaled


@dataclass(frozen=True)
class SchedulerChange:
    """A policy set (apply_policy): the state after it; for a change, the policy before, what writes it back
    (``before``) and whether this call made the journal's entry (an earlier change by gpuvfio
    keeps the first original for ``gpuvfio restore``)."""

    state: SchedulerState
    result: SchedulerOutcome
    previous: str | None = None
    before: SchedulerSnapshot | None = None
    journaled: bool = False
    steps: list[Step] = field(default_factory=list)  # the plan's steps, as carried out

    def to_json(self) -> dict:
        out = {**self.state.to_json(), "result": self.result.value}
        if self.result is SchedulerOutcome.SET:
            out.update(previous=self.previous, before=self.before.to_json() if self.before else None,
                       journaled=self.journaled)
        out["steps"] = [s.to_json() for s in self.steps]
        return out


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

    def read(self, address: PciAddress) -> SchedulerState:
        handle = self.handle(address)
        caps = self._call("reading vGPU scheduler capabilities", address,
                          self.nvml.nvmlDeviceGetVgpuSchedulerCapabilities, handle)
        state = self._call("reading the vGPU scheduler state", address, self.nvml.nvmlDeviceGetVgpuSchedulerState,
                           handle)
        arr = state.arrMode == 2
        params = state.schedulerParams
        return SchedulerState(
            address=str(address),
            policy=NAMES.get(state.schedulerPolicy, f"unknown({state.schedulerPolicy})"),
            arr=ARR_MODES.get(state.arrMode, str(state.arrMode)),
            timeslice=params.vgpuSchedDataWithARR.timeslice if arr else params.vgpuSchedData.timeslice,
            avg_factor=params.vgpuSchedDataWithARR.avgFactor if arr else None,
            supported=[NAMES[p] for p in caps.supportedSchedulers if p in NAMES],
            timeslice_range=(caps.minTimeslice, caps.maxTimeslice),
            arr_supported=bool(caps.isArrModeSupported),
        )

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


def snapshot(current: SchedulerState) -> SchedulerSnapshot:
    """What it takes to write ``current`` back (the journal's record of a GPU's scheduler)."""
    low, high = current.timeslice_range
    timeslice = current.timeslice or 0
    return SchedulerSnapshot(current.policy, current.arr, timeslice if low <= timeslice <= high else 0,
                             current.avg_factor or 0)


def _write_back(nvml: Nvml, address: PciAddress, record: SchedulerSnapshot) -> None:
    nvml.write(address, record.policy, arr=record.arr, timeslice=record.timeslice, avg_factor=record.avg_factor)


def apply_policy(nvml: Nvml, journal: Journal, address: PciAddress, policy: str,
                 current: SchedulerState) -> SchedulerChange:
    """Set ``policy`` on the GPU (its ARR mode and timeslice kept), journaling the original
    ``current`` first (SchedulerChange says what undoes this call). The checks are the plan's
    (gpuvfio.ops.vgpu.plan_scheduler: a supported policy, a current one that can be put back),
    made under the run lock the caller holds."""
    before = snapshot(current)
    schedulers = journal.data.setdefault("schedulers", {})
    added = str(address) not in schedulers
    schedulers.setdefault(str(address), before.to_json())  # the first original wins
    journal.save()
    try:
        _write_back(nvml, address, dataclasses.replace(before, policy=policy))
    except GpuvfioError:
        if added and nvml.read(address).policy == current.policy:  # nothing changed: forget it
            del schedulers[str(address)]
            journal.save()
        raise
    after = nvml.read(address)
    if after.policy != policy:
        raise GpuvfioError(f"{address}: the vGPU scheduler reads back {after.policy}, not {policy}")
    return SchedulerChange(after, SchedulerOutcome.SET, current.policy, before, added)


def undo_set(journal: Journal, address: PciAddress, before: SchedulerSnapshot, journaled: bool, *,
             nvml_factory=Nvml) -> list[str]:
    """Undo one ``set_policy`` (a testbed variant's): write ``before`` back; drop the journal
    entry only if that call made it, under the run lock the caller holds. Returns failures (the
    journal then still holds it)."""
    try:
        with nvml_factory() as nvml:
            _write_back(nvml, address, before)
    except GpuvfioError as exc:
        return [f"vGPU scheduler of {address}: {exc}"]
    if journaled and str(address) in journal.data.get("schedulers", {}):
        del journal.data["schedulers"][str(address)]
        journal.save()
    return []


def put_back(journal: Journal, nvml_factory=Nvml, progress=lambda line: None) -> list[str]:
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
                record = SchedulerSnapshot.from_json(previous)
                _write_back(nvml, address, record)
                del schedulers[key]
                journal.save()
                progress(f"vGPU scheduler of {key}: back to {record.policy}")
            except GpuvfioError as exc:
                failures.append(f"vGPU scheduler of {key}: {exc}")
    return failures

