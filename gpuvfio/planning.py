"""The one vocabulary of plans: a check with its verdict, a step of a run.

Every operation that changes the host (bind, persist, unpersist, reset, attach, detach,
unbind, restore, xml --define, vgpu create/remove/scheduler, testbed run) says what it will
do in these words: its checks (each a verdict and the reason) and its steps (each a kind from
StepKind, with the device, file, value or name it acts on). The run carries out the plan's
steps and records each under the same kind, so what ran can be compared with what was
planned, step for step (Step.key). Dry runs, Ansible check mode and ``testbed plan`` print
these values through one renderer.

Lives at the top of the package: bind/ (bind's own checks and steps) and ops/ (the plans of
every operation) both speak it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["CheckStatus", "Check", "StepKind", "Step"]


class CheckStatus(str, Enum):
    """A check's verdict; ``skip``: the check could not be asked (libvirt not consulted)."""

    OK = "ok"
    WARN = "warn"
    REFUSE = "refuse"
    SKIP = "skip"

    def __str__(self) -> str:
        return self.value


FORCE_HINT = " (--force to proceed)"  # after an overridable check's message, wherever it is shown


@dataclass(slots=True)
class Check:
    check_id: str
    status: CheckStatus
    message: str
    overridable: bool = False  # --force overrides the refusal (a foreign device in the group, boot VGA)

    def __post_init__(self) -> None:
        # The Fabric Manager's checks carry their verdicts as the same words (host.fabric).
        self.status = CheckStatus(self.status)

    @property
    def reason(self) -> str:
        """The message as a refusal's line gives it: one --force overrides says so."""
        return self.message + (FORCE_HINT if self.overridable else "")

    def to_json(self) -> dict:
        return {"id": self.check_id, "status": self.status.value, "message": self.message,
                "overridable": self.overridable}


class StepKind(str, Enum):
    """Every kind of step a run takes, by the name the run records it under."""

    # bind (gpuvfio.bind.apply): the kernel's bind-by-address sequence
    MODPROBE = "modprobe"
    STOP_SERVICE = "stop_service"
    OVERRIDE = "override"
    UNBIND = "unbind"
    PROBE = "probe"
    # unbind (no journal): the same sequence backwards
    CLEAR_OVERRIDE = "clear override"
    # persist / unpersist: a boot-time file written or removed
    WRITE_FILE = "write file"
    REMOVE_FILE = "remove file"
    # restore, and detach's give-back
    DEACTIVATE_PARTITION = "deactivate partition"
    REMOVE_VGPU = "remove vGPU"
    PUT_BACK_SCHEDULER = "put back vGPU scheduler"
    RESTORE = "restore"
    START_SERVICE = "start service"
    FORGET_OPERATION = "forget unfinished operation"
    # reset
    RESET = "reset"
    SETTLE = "settle"
    # qualify
    SELECT_RESET = "select reset method"
    # attach
    BIND = "bind"
    ACTIVATE_PARTITION = "activate partition"
    SEED = "cloud-init seed"
    DEFINE = "define"
    START = "start"
    FIND_ADDRESS = "find address"
    WAIT_FOR_SSH = "wait for ssh"
    NCCL_TOPOLOGY = "nccl topology"
    VERIFY = "verify"
    # detach
    STOP = "stop"
    UNDEFINE = "undefine"
    RESTORE_DEVICES = "restore devices"
    # vgpu
    CREATE_VGPU = "create vGPU"
    PERSIST_VGPU = "persist vGPU"
    FORGET_VGPU = "forget vGPU"
    SET_SCHEDULER = "set vGPU scheduler"
    # testbed run, per variant
    DETACH_LEFTOVER = "detach leftover"
    ATTACH = "attach"
    MEASURE = "measure"
    VERIFY_HOST = "verify on the host"
    TEARDOWN = "teardown"

    def __str__(self) -> str:
        return self.value


_BIND_WORDS = {StepKind.MODPROBE, StepKind.STOP_SERVICE, StepKind.OVERRIDE, StepKind.UNBIND, StepKind.PROBE}


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a run: its kind and what it acts on. ``path`` is a file the run writes (as a
    path beneath the host's root; the writer opens it afresh, never through a resolved link),
    ``value`` what it writes there, ``expect`` the driver a bind step must leave, ``name`` a
    module, service, domain, instance or partition; ``detail`` the words for people."""

    kind: StepKind
    address: str | None = None
    path: str | None = None
    value: str | None = None
    expect: str | None = None
    name: str | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StepKind(self.kind))

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        """What identifies the step when a run's record is compared with its plan."""
        return (self.kind.value, self.address, self.name)

    def describe(self) -> str:
        if self.kind in _BIND_WORDS and not self.detail:
            return self._bind_words()
        return f"{self.kind.value}: {self.detail}" if self.detail else self.kind.value

    def _bind_words(self) -> str:
        if self.kind is StepKind.MODPROBE:
            return f"load module {self.name}"
        if self.kind is StepKind.STOP_SERVICE:
            return f"stop service {self.name} (restarted by restore)"
        if self.kind is StepKind.OVERRIDE:
            return f"{self.address}: driver_override <- {self.value}"
        if self.kind is StepKind.UNBIND:
            return f"{self.address}: unbind from {self.name}"
        return f"{self.address}: drivers_probe, expect {self.expect}"

    def to_json(self, root: str | None = None) -> dict:
        """``root``: show the path as the host itself names it (a plan made on a recorded host)."""
        path = self.path
        if root and path and path.startswith(root.rstrip("/") + "/"):
            path = path[len(root.rstrip("/")):]
        return {"kind": self.kind.value, "address": self.address, "path": path, "value": self.value,
                "expect": self.expect, "name": self.name, "detail": self.detail, "description": self.describe()}
