"""A clean GPU is a healthy GPU: Xid events blamed on the test they arrived during, reset-needing or lost
GPUs, settings changed under the session, and the CUDA probe. Each check only drains Xids; the slow reads
run at start, and after a test only where something points at them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from pytest_gpuclean._model.records import (
    DeviceHealth,
    DeviceInfo,
    HealthEffect,
    HealthFinding,
    HealthKind,
    Phase,
    Reaped,
)
from pytest_gpuclean._reading.backends import HealthSource
from pytest_gpuclean._reading.devices import Device, DeviceLost

XID_CATALOGUE = "https://docs.nvidia.com/deploy/xid-errors/"
XIDS: dict[int, tuple[HealthEffect, str]] = {
    # Faults a test's own kernels cause: the test fails; the GPU stays usable.
    13: ("fault", "graphics engine exception: a kernel's illegal instruction or out-of-range access"),
    31: ("fault", "GPU memory page fault (MMU fault): a kernel accessed an illegal address"),
    43: ("fault", "GPU stopped processing: a kernel's fault made the driver reset its channel"),
    68: ("fault", "video decoder (NVDEC) exception"),
    # What the hardware or its firmware did: the GPU needs a reset, whoever ran on it.
    48: ("unusable", "double-bit ECC error: an uncorrectable memory error"),
    61: ("unusable", "internal micro-controller breakpoint/warning"),
    62: ("unusable", "internal micro-controller halt"),
    64: ("unusable", "ECC page retirement or row remapping failed to record"),
    74: ("unusable", "NVLink error"),
    94: ("unusable", "contained ECC error: the process that touched the bad memory was ended; a reset "
                     "remaps the row"),
    95: ("unusable", "uncontained ECC error: every process on the GPU is affected"),
    119: ("unusable", "GSP RPC timeout: the GPU's system processor stopped answering"),
    120: ("unusable", "GSP error: the GPU's system processor failed"),
    79: ("lost", "GPU has fallen off the bus"),
    # Information: recorded, nothing fails.
    45: ("info", "preemptive cleanup: the GPU work of a process that ended (killed, or after an error) was "
                 "removed"),
    63: ("info", "ECC page retirement or row remapping recorded (a reset applies it)"),
    92: ("info", "high single-bit ECC error rate (corrected)"),
}
"""Xid code -> (effect, meaning). Codes not here fail the test that saw them."""

CLOCKS_AFTER_S = 10.0
"""After a test this long, its GPUs' clock event reasons are read: a small cost in a test this long."""


def xid_meaning(code: int) -> tuple[HealthEffect, str]:
    """One gpuclean does not know is a ``fault`` of the test."""
    return XIDS.get(code, ("fault", f"see NVIDIA's Xid catalogue, {XID_CATALOGUE}"))


def reset_reasons(now: DeviceHealth, baseline: DeviceHealth | None) -> list[str]:
    """Why a device needs a reset: rows waiting for remapping, a failed remapping, uncorrectable ECC errors
    beyond ``baseline``'s count (any, without one)."""
    reasons: list[str] = []
    if now.remap_pending:
        rows = now.remap_pending
        reasons.append(f"{rows} memory row remap{'s' if rows > 1 else ''} pending")
    if now.remap_failed:
        reasons.append("a memory row remapping failed")
    before = baseline.ecc_uncorrected if baseline is not None else 0
    if now.ecc_uncorrected and now.ecc_uncorrected > (before or 0):
        rose = now.ecc_uncorrected - (before or 0)
        since = "during the session" if baseline is not None else "since the last reset"
        reasons.append(f"{rose} uncorrectable ECC error{'s' if rose > 1 else ''} {since}")
    return reasons


SETTINGS = (("compute_mode", "compute mode"), ("mig_mode", "MIG mode"), ("persistence", "persistence mode"))


def changes(now: DeviceHealth, baseline: DeviceHealth) -> list[str]:
    """Settings that differ from ``baseline`` (``compute mode Default -> Prohibited``)."""
    found: list[str] = []
    for field, name in SETTINGS:
        old, new = getattr(baseline, field), getattr(now, field)
        if old is not None and new is not None and old != new:
            found.append(f"{name} {old} -> {new}")
    return found


def device_problems(health: DeviceHealth) -> list[str]:
    """Unhealthy as ``gpuclean check`` sees it (no session, no baseline): a reset needed, or compute mode
    Prohibited."""
    problems = reset_reasons(health, None)
    if health.compute_mode == "Prohibited":
        problems.append("compute mode Prohibited: no process can use it")
    return problems


def finding(kind: HealthKind, effect: HealthEffect, device: Device, message: str, phase: Phase,
            xid: int | None = None) -> HealthFinding:
    return HealthFinding(kind, effect, device.label, device.uuid, message, phase, xid)


def xid_message(device: DeviceInfo, code: int) -> str:
    return f"{device.label}: Xid {code} ({xid_meaning(code)[1]})"


Prober = Callable[[Sequence[DeviceInfo]], dict[str, str | None]]
"""Per UUID, None if the CUDA probe passed, else the error."""


class HealthWatch:
    """The health of a session's devices. A device found unusable stays so: every later test on it fails
    its setup. gpuclean never resets a GPU nor changes its settings."""

    def __init__(self, source: HealthSource, devices: Sequence[DeviceInfo], *, probe: str = "off",
                 prober: Prober | None = None, note: Callable[[str], None] = lambda line: None) -> None:
        self.source = source
        self.devices = tuple(devices)
        self.probe = probe
        self.prober = prober
        self.note = note
        self.baseline: dict[str, DeviceHealth] = {}
        self.unusable: dict[str, HealthFinding] = {}
        """Per UUID, the finding that made the device unusable."""
        self.lost: dict[str, HealthFinding] = {}
        self.incidents: set[str] = set()
        """UUIDs where a test had an Xid, a reaped GPU process or an error: probed before their next test."""
        self.probe_s: list[float] = []
        """Seconds each probe run took, for the report."""
        self._by_uuid = {d.uuid: d for d in self.devices}
        self._last: tuple[str, Sequence[DeviceInfo]] = ("", ())
        """The last test checked after, and its devices (to say after which test an Xid came)."""
        self._started = 0.0
        self._failed = 0

    # ---- session start -------------------------------------------------------------------------------

    def start(self) -> list[HealthFinding]:
        """Register for Xid events, read the baseline and, with ``--gpuclean-probe=start``, probe. Returns
        what is wrong already."""
        self.source.watch_xids(self.devices)
        found: list[HealthFinding] = []
        for device in self.devices:
            try:
                now = self.source.health(device)
            except DeviceLost as exc:
                found.append(self._mark_lost(device, exc.reason, "setup"))
                continue
            self.baseline[device.uuid] = now
            # ECC errors from before the session are not ours (only a rise is); remapping tells if they need a
            # reset.
            reasons = reset_reasons(now, now)
            if reasons:
                found.append(self._mark_unusable(finding(
                    "needs_reset", "unusable", device, f"{device.label} needs a reset: {', '.join(reasons)}",
                    "setup")))
        if self.probe == "start":
            found.extend(self._probe(self.devices, "setup"))
        return found

    # ---- around each test ----------------------------------------------------------------------------

    def before(self, nodeid: str, devices: Sequence[DeviceInfo], tests_failed: int) -> list[HealthFinding]:
        """Before a test: drain the Xids between tests, probe where the mode says so. Returns the findings
        that make these devices unusable."""
        self._failed = tests_failed
        self._started = time.monotonic()
        events = self.source.drain_xids()
        if not events and not self.unusable and not self.lost and (
                self.probe not in ("each", "after-incident") or (self.probe == "after-incident"
                                                                 and not self.incidents)):
            return []  # the quiet path
        self._outside(events, "before " + nodeid, self._last)
        wanted = {d.uuid for d in devices}
        probe: Sequence[DeviceInfo] = ()
        if self.probe == "each":
            probe = devices
        elif self.probe == "after-incident" and self.incidents & wanted:
            probe = [d for d in devices if d.uuid in self.incidents]
        if probe:
            self.incidents -= {d.uuid for d in probe}
            self._probe([d for d in probe if d.uuid not in self.unusable and d.uuid not in self.lost],
                        "setup")
        # Found earlier, maybe after another test: this test meets them at its setup.
        return [f._replace(phase="setup") for device in devices
                for f in (self.lost.get(device.uuid), self.unusable.get(device.uuid)) if f is not None]

    def after(self, nodeid: str, devices: Sequence[DeviceInfo], reaped: Sequence[Reaped],
              tests_failed: int) -> list[HealthFinding]:
        """After a test: the Xids during it are its findings; where something points at trouble, the slow
        reads too."""
        events = self.source.drain_xids()
        long_test = time.monotonic() - self._started >= CLOCKS_AFTER_S
        last, self._last = self._last, (nodeid, devices)
        if not events and not reaped and tests_failed <= self._failed and not long_test:
            return []  # the quiet path
        wanted = {d.uuid for d in devices}
        self._outside([e for e in events if e[0] not in wanted], "during " + nodeid, last)
        found: list[HealthFinding] = []
        pointed: set[str] = set()
        for uuid, code in events:
            hit = self._by_uuid.get(uuid)
            if hit is None or uuid not in wanted:
                continue
            effect, _meaning = xid_meaning(code)
            item = finding("xid", effect, hit, xid_message(hit, code), "teardown", code)
            found.append(self._mark(item))
            pointed.add(uuid)
        # A killed GPU process or a failed test may be a fault not reported as an Xid (yet).
        held = {label for r in reaped for label, _mib in r.mib_per_device}
        pointed |= {d.uuid for d in devices if d.label in held}
        if tests_failed > self._failed:
            pointed |= wanted
        self.incidents |= pointed
        for device in devices:
            if device.uuid in self.lost or (device.uuid not in pointed and not long_test):
                continue
            try:
                if device.uuid in pointed:
                    found.extend(self._reread(device))
                reasons = self.source.clock_reasons(device)
            except DeviceLost as exc:
                found.append(self._mark_lost(device, exc.reason, "teardown"))
                continue
            if reasons:
                found.append(finding("clocks", "info", device,
                                     f"{device.label}: clock event reasons {', '.join(reasons)}", "teardown"))
        return found

    def lost_now(self, exc: DeviceLost, phase: Phase) -> HealthFinding:
        """A check found ``exc.device`` lost: recorded; the caller stops the session."""
        return self._mark_lost(exc.device, exc.reason, phase)

    # ---- the parts -----------------------------------------------------------------------------------

    def _reread(self, device: DeviceInfo) -> list[HealthFinding]:
        now = self.source.health(device)
        baseline = self.baseline.get(device.uuid)
        found: list[HealthFinding] = []
        if baseline is None:
            self.baseline[device.uuid] = now
            return found
        reasons = reset_reasons(now, baseline)
        if reasons:
            found.append(self._mark_unusable(finding(
                "needs_reset", "unusable", device, f"{device.label} needs a reset: {', '.join(reasons)}",
                "teardown")))
        changed = changes(now, baseline)
        if changed:
            found.append(finding("changed", "fault", device,
                                 f"{device.label}: {', '.join(changed)} during the test", "teardown"))
        # What changed is the new normal: the next test is blamed only for what it changes itself.
        self.baseline[device.uuid] = now._replace(ecc_uncorrected=max(now.ecc_uncorrected or 0,
                                                                     baseline.ecc_uncorrected or 0))
        return found

    def _outside(self, events: Iterable[tuple[str, int]], when: str, last: tuple[str, Sequence[DeviceInfo]]
                 ) -> None:
        """Xids outside any test: nobody's to blame, but a GPU they make unusable stays so."""
        for uuid, code in events:
            device = self._by_uuid.get(uuid)
            if device is None:
                continue
            effect, _meaning = xid_meaning(code)
            after = last[0] if any(d.uuid == uuid for d in last[1]) else None
            context = f"outside any test on it ({when}" + (f", after {after})" if after else ")")
            message = f"{xid_message(device, code)}, {context}"
            if effect in ("unusable", "lost"):
                self._mark(finding("xid", effect, device, message, "setup", code))
            self.note(f"gpuclean: {message}")
            self.incidents.add(uuid)

    def _probe(self, devices: Sequence[DeviceInfo], phase: Phase) -> list[HealthFinding]:
        if not devices or self.prober is None:
            return []
        started = time.monotonic()
        results = self.prober(devices)
        self.probe_s.append(time.monotonic() - started)
        found: list[HealthFinding] = []
        for device in devices:
            error = results.get(device.uuid, "no answer from the probe")
            if error is not None:
                found.append(self._mark_unusable(finding(
                    "probe", "unusable", device, f"{device.label} failed the CUDA probe: {error}", phase)))
        return found

    def _mark(self, item: HealthFinding) -> HealthFinding:
        if item.effect == "unusable":
            return self._mark_unusable(item)
        if item.effect == "lost":
            self.lost.setdefault(item.uuid, item)
        return item

    def _mark_unusable(self, item: HealthFinding) -> HealthFinding:
        self.unusable.setdefault(item.uuid, item)
        return item

    def _mark_lost(self, device: Device, reason: str, phase: Phase) -> HealthFinding:  # (a DeviceLost's)
        item = finding("lost", "lost", device, f"{device.label} is lost: {reason}", phase)
        self.lost.setdefault(device.uuid, item)
        return item
