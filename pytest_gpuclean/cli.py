"""``gpuclean status|check|reap``: the plugin's clean check and reaper as a command for CI runner hooks.

* ``gpuclean status [--json]``: what each GPU holds, and who.
* ``gpuclean check [--wait S] [--json]``: the pre-job gate; exit 0 clean, 1 not clean, 2 usage or
  driver error, 3 a GPU is not usable (it needs a reset, or is lost): take the runner out of service.
* ``gpuclean reap [--dry-run] [--json]``: post-job cleanup of the invoking user's GPU processes (and of the
  processes carrying a ``--cookie``), with the plugin's TERM -> grace -> KILL ladder; exit 0 done, 1 a
  process survived, 2 usage or driver error, 3 a GPU could not be read (what was provably the job's was
  ended all the same; the output names the GPU).

Nothing here talks to NVML or signals a process itself: devices come from ``opening.open_backend``,
verdicts from ``checker.Checker``, process details and kills from ``processes``, option values from
``settings`` (the plugin's parsers and environment variables). The CLI has no process tree of its own,
so for it "clean" means: no process on the devices and memory within the tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, TextIO

from pytest_gpuclean import __version__
from pytest_gpuclean.core.acting.reaping import reaped_record
from pytest_gpuclean.core.checking.checker import Checker
from pytest_gpuclean.core.deciding import reap_plan
from pytest_gpuclean.core.deciding.verdict import mib_of
from pytest_gpuclean.core.options import settings
from pytest_gpuclean.core.ownership.cookie import COOKIE_VAR
from pytest_gpuclean.core.reading import backends, devices, processes, procfs
from pytest_gpuclean.core.reading.opening import open_backend
from pytest_gpuclean.model.records import (
    MIB,
    CheckResult,
    DeviceHealth,
    DeviceInfo,
    DeviceSnapshot,
    Fields,
    FoundBy,
    ProcessInfo,
    Reaped,
)
from pytest_gpuclean.report import jsonreport, report

# The command is the interface (README): its exit statuses, main() for __main__.py and the tests, and
# the plan of a reap, which the tests hold against real processes.
__all__ = [
    "EXIT_CLEAN",
    "EXIT_DIRTY",
    "EXIT_ERROR",
    "EXIT_UNHEALTHY",
    "main",
    "plan_reap",
]

EXIT_CLEAN = 0
EXIT_DIRTY = 1
"""``check``: not clean; ``reap``: a process survived SIGKILL."""
EXIT_ERROR = 2
"""A usage error (the message names the option) or the devices could not be read."""
EXIT_UNHEALTHY = 3
"""``check``: a GPU needs a reset (row remapping pending or failed, uncorrectable ECC errors), its compute
mode is Prohibited, or it is lost. Waiting does not help: the runner should be taken out of service.
``reap``: a GPU could not be read (lost, or its reads fail); what could be proven the job's (its cookie's
carriers, this user's processes on the other GPUs) was ended all the same, and a survivor is named too."""

_PROG = "gpuclean"
_CMDLINE_WIDTH = 200


class _CliError(Exception):
    """A problem the user must fix (bad option or environment value, no devices): exit status 2."""


# ---- option values -----------------------------------------------------------------------------------

def _argument(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    # argparse reports an ArgumentTypeError's own message; a plain ValueError becomes "invalid value".
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _settings(args: argparse.Namespace, *names: str) -> settings.Settings:
    """The options ``names`` from the command line, else the plugin's environment variables.

    The command's flags are the plugin's options without the ``gpuclean-`` prefix and read the same
    variables (``GPUCLEAN_SIMULATE``, ...), so a runner configured once applies to both the hooks and
    the pytest sessions they guard.
    """
    chosen = [settings.option(name) for name in names]
    given = {option.dest: getattr(args, option.name, None) for option in chosen}
    try:
        return settings.resolve_options(chosen, given, os.environ, flag=lambda option: option.command_flag)
    except settings.SettingError as exc:
        raise _CliError(str(exc)) from None


def _check_environment(args: argparse.Namespace) -> None:
    """Every command checks every GPUCLEAN_ variable at start-up, as a pytest session does, whether or not
    it reads it (settings.check_environment), and warns of one nothing reads. A bad one is named as the
    command's flag where it has one for the option (a value, not a switch like reap's --dead-sessions,
    which is another thing), else as the plugin's option."""
    def flag(option: settings.Option) -> str:
        value = getattr(args, option.name, False)
        return option.command_flag if value is None or isinstance(value, (str, list)) else option.cli

    try:
        warnings = settings.check_environment(os.environ, flag)
    except settings.SettingError as exc:
        raise _CliError(str(exc)) from None
    for line in warnings:
        print(f"{_PROG} {args.command}: warning: {line}", file=sys.stderr)


def _env_note(name: str) -> str:
    return f"[env {settings.option(name).env_var}]"


# ---- a Ray cluster (--ray) -----------------------------------------------------------------------------

_RAY_EXCLUSIVE = ("devices", "cookie", "dead_sessions", "all_users")


def _ray_settings(args: argparse.Namespace, *names: str) -> tuple[str | None, settings.Settings]:
    """The cluster ``--ray`` (or ``GPUCLEAN_RAY``) names, None for the local devices; and the options.

    Ray (and the modules that drive it) is imported only when a cluster is named.
    """
    resolved = _settings(args, "ray", "timeout", *names)
    if resolved.ray == "off":
        return None, resolved
    from pytest_gpuclean.ray import cluster

    address = cluster.resolve_address(resolved.ray)
    if address is None:
        return None, resolved
    for name in _RAY_EXCLUSIVE:
        if getattr(args, name, None):
            flag = "--" + name.replace("_", "-")
            raise _CliError(f"{flag} cannot be combined with --ray {resolved.ray} "
                           f"({resolved.sources.get('ray', '')}): each node's own devices are checked there")
    return address, resolved


def _ray_command(run: Callable[[], int]) -> int:
    from pytest_gpuclean.ray import cli_ray

    try:
        return run()
    except cli_ray.RayCliError as exc:
        raise _CliError(str(exc)) from None


# ---- devices -----------------------------------------------------------------------------------------

class _Devices(Fields):
    """The devices a command works on: its backend, those chosen of it, and where the choice came from."""

    __slots__ = ("backend", "chosen", "source")
    backend: Final[backends.Backend]
    chosen: Final[tuple[DeviceInfo, ...]]
    source: Final[str]
    """Where the device list came from, for the header and error messages."""

    def __init__(self, backend: backends.Backend, chosen: tuple[DeviceInfo, ...], source: str) -> None:
        self.backend = backend
        self.chosen = chosen
        self.source = source


@contextlib.contextmanager
def _open_devices(resolved: settings.Settings) -> Iterator[_Devices]:
    # A runner pinned to some GPUs through CUDA_VISIBLE_DEVICES checks and reaps only those, as the
    # pytest sessions it runs do.
    try:
        backend = open_backend(resolved.simulate)
    except devices.SimulationError as exc:
        raise _CliError(f"--simulate: {exc} ({resolved.sources.get('simulate')})") from None
    try:
        try:
            selection = backends.choose_devices(backend, resolved.devices,
                                                resolved.sources.get("devices", ""),
                                                option=settings.option("devices").command_flag)
        except devices.DeviceSelectionError as exc:
            raise _CliError(str(exc)) from None
        yield _Devices(backend, selection.devices, selection.source)
    finally:
        backend.close()


def _checker(backend: backends.Backend, *, grace: float = settings.DEFAULT_GRACE_S, ignore: Sequence[str] = ()
             ) -> Checker:
    # No xdist run: the plugin excuses sibling xdist workers of its own run; the CLI has no run, and a
    # hook started from inside a test run (as our own tests do) must not excuse that run's processes.
    # Dead sessions' debris is listed on its own (``_debris_lines``) and ended only by ``reap
    # --dead-sessions``: off the GPUs it does not make them dirty.
    return Checker(backend, reap=False, grace=grace, ignore=ignore, dead_sessions=False)


def _header(found: _Devices) -> str:
    backend = found.backend
    return (f"{backend.kind} devices, driver {backend.driver_version()}; "
            f"{len(found.chosen)} of {len(backend.devices())} device(s) ({found.source})")


def _cmd(cmdline: str) -> str:
    # One line per process: a ``python -c "<script>"`` command line carries newlines.
    return report.one_line(cmdline, _CMDLINE_WIDTH)


def _mib_text(num_bytes: int | None) -> str:
    return "?" if num_bytes is None else f"{num_bytes / MIB:.0f}"


# ---- health ------------------------------------------------------------------------------------------

class _Health(Fields):
    """One device's health as a command shows it."""

    __slots__ = ("device", "reading", "problems", "lost")
    device: Final[DeviceInfo]
    reading: Final[DeviceHealth | None]
    """None: the device is lost (``lost``), or its backend has no health reads."""
    problems: Final[tuple[str, ...]]
    lost: Final[str | None]

    def __init__(self, device: DeviceInfo, reading: DeviceHealth | None, problems: tuple[str, ...],
                 lost: str | None = None) -> None:
        self.device = device
        self.reading = reading
        self.problems = problems
        self.lost = lost


def _read_health(found: _Devices, chosen: Sequence[DeviceInfo] | None = None) -> list[_Health]:
    """Each chosen device's health (the slow NVML reads: milliseconds per GPU, nothing for a command); of
    ``chosen`` where given."""
    from pytest_gpuclean.core.reading.health import device_problems

    source = found.backend
    if not isinstance(source, backends.HealthSource):
        return []
    read: list[_Health] = []
    for device in found.chosen if chosen is None else chosen:
        try:
            reading = source.health(device)
            source.snapshot(device)  # a lost GPU may still answer the health reads
        except devices.DeviceLost as exc:
            read.append(_Health(device, None, (f"lost: {exc.reason}",), exc.reason))
            continue
        read.append(_Health(device, reading, tuple(device_problems(reading))))
    return read


def _health_lines(read: Sequence[_Health]) -> list[str]:
    """One line per device: ``ok`` with its settings, or what makes it unusable."""
    lines: list[str] = []
    for item in read:
        label = f"{item.device.label:<10} health:"
        if item.lost is not None:
            lines.append(f"{label} LOST: {item.lost}")
            continue
        reading = item.reading
        assert reading is not None
        settings_text = ", ".join(f"{name} {value}" for name, value in (
            ("compute mode", reading.compute_mode), ("persistence", reading.persistence),
            ("MIG", reading.mig_mode)) if value is not None)
        if item.problems:
            lines.append(f"{label} NOT USABLE: {'; '.join(item.problems)} ({settings_text})")
        else:
            lines.append(f"{label} ok ({settings_text})")
    return lines


def _health_json(read: Sequence[_Health]) -> list[dict[str, Any]]:
    """The ``health`` list of ``status --json`` and ``check --json``."""
    return [{"device": item.device.label, "uuid": item.device.uuid, "usable": not item.problems,
             "problems": list(item.problems), "lost": item.lost is not None,
             **({} if item.reading is None else {
                 "remap_pending": item.reading.remap_pending, "remap_failed": item.reading.remap_failed,
                 "ecc_uncorrected": item.reading.ecc_uncorrected, "compute_mode": item.reading.compute_mode,
                 "mig_mode": item.reading.mig_mode, "persistence": item.reading.persistence})}
            for item in read]


# ---- status ------------------------------------------------------------------------------------------

def _status_lines(snaps: Sequence[DeviceSnapshot], described: dict[int, ProcessInfo | None]) -> list[str]:
    """The compact per-GPU table of ``gpuclean status``."""
    lines: list[str] = []
    for snap in snaps:
        device = snap.device
        busy = f"{len(snap.processes)} process(es)" if snap.processes else "no processes"
        lines.append(f"{device.label:<10} {device.name}  {device.uuid}  "
                     f"{_mib_text(snap.used_bytes)} / {_mib_text(snap.total_bytes)} MiB used  {busy}")
        if not snap.processes:
            continue
        lines.append(f"    {'PID':>8}  {'USER':<12} {'MiB':>8}  COMMAND")
        for proc in snap.processes:
            info = described.get(proc.pid)
            user = info.user if info else "?"
            command = _cmd(info.cmdline) if info else "(not visible here: exited, or another PID namespace)"
            lines.append(f"    {proc.pid:>8}  {user:<12} {_mib_text(proc.used_bytes):>8}  {command}")
    return lines


def _described(snaps: Sequence[DeviceSnapshot]) -> dict[int, ProcessInfo | None]:
    return {p.pid: processes.describe(p.pid) for s in snaps for p in s.processes}


def _status_json(found: _Devices, snaps: Sequence[DeviceSnapshot],
                 described: dict[int, ProcessInfo | None]) -> dict[str, Any]:
    # ``check --json`` extends this document with the verdict: one shape for a CI script to read.
    return {"gpuclean_version": __version__, "backend": found.backend.kind,
            "driver": found.backend.driver_version(), "device_source": found.source,
            "devices": [jsonreport.snapshot_json(s, described) for s in snaps]}


def _print_json(document: dict[str, Any], out: TextIO) -> None:
    json.dump(document, out, indent=2)
    out.write("\n")


def _cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    """``gpuclean status``: memory and processes of each device; ``--json`` for machines."""
    address, ray_resolved = _ray_settings(args)
    if address is not None:
        from pytest_gpuclean.ray import cli_ray

        return _ray_command(lambda: cli_ray.cmd_status(args, out, ray_resolved, address, _status_lines,
                                                       _print_json))
    with _open_devices(_settings(args, "simulate", "devices")) as found:
        read = _read_health(found)
        lost = {h.device.uuid for h in read if h.lost is not None}
        snaps = [found.backend.snapshot(d) for d in found.chosen if d.uuid not in lost]
        described = _described(snaps)
        if args.json:
            _print_json({**_status_json(found, snaps, described), "health": _health_json(read)}, out)
            return EXIT_CLEAN
        print(f"{_PROG} status: {_header(found)}", file=out)
        for line in [*(_status_lines(snaps, described) or ["(no devices)"]), *_health_lines(read)]:
            print(line, file=out)
    return EXIT_CLEAN


# ---- check -------------------------------------------------------------------------------------------

def _processes_note(result: CheckResult) -> str | None:
    """Why a check with a tolerance still fails: a process on a device fails it, whatever it holds."""
    listed = [o for o in result.offenders if o.process is not None]
    if not listed or not result.tolerance_mib:
        return None
    labels = sorted({label for o in listed for label, _ in o.mib_per_device})
    where = f" on {', '.join(labels)}" if labels else ""
    count = "1 process" if len(listed) == 1 else f"{len(listed)} processes"
    return f"{count}{where}; processes fail the check whatever the tolerance"


def _check_lines(result: CheckResult, wait: float, my_uid: int) -> list[str]:
    """Why ``gpuclean check`` found the devices clean or not."""
    lines: list[str] = []
    if result.clean:
        waited = f", after {result.waited_s:.1f}s" if wait else ""
        lines.append(f"{_PROG} check: clean ({len(result.devices)} device(s), tolerance "
                     f"{result.tolerance_mib} MiB{waited})")
    else:
        waited = f" after waiting {result.waited_s:.1f}s" if wait else ""
        lines.append(f"{_PROG} check: NOT clean{waited} (tolerance {result.tolerance_mib} MiB):")
        note = _processes_note(result)
        if note:
            lines.append(f"  {note}")
        for offender in result.offenders:
            proc = offender.process
            if proc is None:
                lines.append(f"  {offender.detail}")
                continue
            lines.append(f"  pid {proc.pid} (user {proc.user}, {proc.state}) is on "
                         f"{report.mib_list(offender.mib_per_device) or 'the devices'}: {_cmd(proc.cmdline)}")
        mine = [o.process.pid for o in result.offenders if o.process is not None and o.process.uid == my_uid]
        if mine:
            lines.append(f"  `{_PROG} reap` would end the processes of this user: pid(s) "
                         + ", ".join(map(str, mine)))
    lines.extend("  " + report.device_line(s) for s in result.devices)
    return lines


def _check_json(found: _Devices, result: CheckResult, checker: Checker) -> dict[str, Any]:
    """``gpuclean check --json``: the ``status --json`` document of the devices as the check last read
    them, plus the verdict and what ``reap --dead-sessions`` would end."""
    note = _processes_note(result)
    debris: list[dict[str, Any]] = []
    for f in checker.dead_session_debris():
        info = processes.describe(f.pid, f.start_ticks)
        if info is not None and f.debris_of is not None:
            debris.append({"pid": f.pid, "user": info.user, "cmdline": info.cmdline,
                           "left_by": f.debris_of.describe(), "owner": f.owner_name})
    return {**_status_json(found, result.devices, _described(result.devices)),
            "clean": result.clean, "tolerance_mib": result.tolerance_mib,
            "waited_s": round(result.waited_s, 6),
            "offenders": [jsonreport.offender_json(o) for o in result.offenders],
            "notes": [*([note] if note else []), *result.notes], "dead_session_debris": debris}


def _cmd_check(args: argparse.Namespace, out: TextIO) -> int:
    """``gpuclean check``: exit 0 if the devices are clean (waiting up to ``--wait``), 1 if not."""
    address, ray_resolved = _ray_settings(args, "tolerance_mib", "ignore")
    if address is not None:
        from pytest_gpuclean.ray import cli_ray

        return _ray_command(lambda: cli_ray.cmd_check(args, out, ray_resolved, address, _check_lines,
                                                      _print_json))
    resolved = _settings(args, "simulate", "devices", "tolerance_mib", "ignore")
    with _open_devices(resolved) as found:
        if not found.chosen:
            raise _CliError(f"no devices to check ({_header(found)})")
        read = _read_health(found)
        unusable = [h for h in read if h.problems]
        if unusable:
            # Waiting does not make a GPU usable: answer at once, with a status of its own.
            if args.json:
                _print_json({"gpuclean_version": __version__, "backend": found.backend.kind,
                             "device_source": found.source, "clean": False, "usable": False,
                             "health": _health_json(read)}, out)
            else:
                print(f"{_PROG} check: NOT USABLE: {len(unusable)} GPU(s) need a reset or are lost; take "
                      "this runner out of service (gpuclean never resets a GPU):", file=out)
                for item in unusable:
                    print(f"  {item.device.label} ({item.device.uuid}): {'; '.join(item.problems)}", file=out)
            return EXIT_UNHEALTHY
        checker = _checker(found.backend, ignore=resolved.ignore)
        result = checker.check("check", found.chosen, tolerance_mib=resolved.tolerance_mib, timeout=args.wait,
                               reap=False)
        if args.json:
            _print_json({**_check_json(found, result, checker), "usable": True,
                         "health": _health_json(read)}, out)
        else:
            for line in [*_check_lines(result, args.wait, checker.uid), *_debris_lines(checker)]:
                print(line, file=out)
    return EXIT_CLEAN if result.clean else EXIT_DIRTY


def _debris_lines(checker: Checker) -> list[str]:
    """What ``reap --dead-sessions`` would end: processes left by gpuclean sessions that died."""
    lines: list[str] = []
    for f in checker.dead_session_debris():
        info = processes.describe(f.pid, f.start_ticks)
        if info is None or f.debris_of is None:
            continue
        owner = f", spawned by {f.owner_name}" if f.owner_name else ""
        lines.append(f"  pid {f.pid} ({_cmd(info.cmdline)}): left by {f.debris_of.describe()}{owner}")
    if lines:
        lines.insert(0, f"{_PROG} check: `{_PROG} reap --dead-sessions` would end {len(lines)} process(es) "
                        "that dead pytest sessions left behind:")
    return lines


# ---- reap --------------------------------------------------------------------------------------------

class _Target(Fields):
    """A process ``reap`` sets out to end."""

    __slots__ = ("info", "found_by", "mib")
    info: Final[ProcessInfo]
    found_by: Final[FoundBy]
    """``gpu`` (listed on a device), ``cookie`` (carries the ``--cookie`` value) or ``dead session``."""
    mib: Final[tuple[tuple[str, float], ...]]

    def __init__(self, info: ProcessInfo, found_by: FoundBy, mib: tuple[tuple[str, float], ...]) -> None:
        self.info = info
        self.found_by = found_by
        self.mib = mib


def _process_uids() -> set[int]:
    uids: set[int] = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                uids.add(os.stat(f"/proc/{name}").st_uid)
    return uids


def plan_reap(snaps: Sequence[DeviceSnapshot], *, my_uid: int, never_touch: set[int], all_users: bool,
              cookie: str | None, require_device_file: bool = False) -> tuple[dict[int, _Target], list[str]]:
    """What ``reap`` may end, and a line for each process it leaves alone (and why).

    With ``require_device_file`` (real GPUs), a pid the driver lists is a target only if that process
    has a GPU device file open: in a container the driver may list host pids, and the same number can
    name an unrelated local process.
    """
    def candidates() -> Iterator[reap_plan.ReapCandidate]:
        for pid in sorted({p.pid for s in snaps for p in s.processes}):
            info = processes.describe(pid)
            yield reap_plan.ReapCandidate(
                pid, info, mib_of(pid, snaps), "gpu", gpuclean_itself=pid in never_touch,
                no_device_file=info is not None and require_device_file
                and not procfs.has_nvidia_device_open(pid))
        if cookie is not None:
            for uid in sorted(_process_uids()) if all_users else [my_uid]:
                for pid, _value in processes.cookie_holders(COOKIE_VAR, cookie, uid):
                    # (One that is a target already, as listed on a device, the planner passes over.)
                    yield reap_plan.ReapCandidate(pid, processes.describe(pid), mib_of(pid, snaps), "cookie",
                                        gpuclean_itself=pid in never_touch, any_user=True)

    chosen, left_alone = reap_plan.plan(candidates(), my_uid=my_uid, all_users=all_users,
                                        cmd_width=_CMDLINE_WIDTH)
    return {c.pid: _Target(c.info, c.found_by, c.mib) for c in chosen if c.info is not None}, left_alone


def _kill_targets(targets: dict[int, _Target]) -> list[processes.KillTarget]:
    # Children before their parents: a parent that restarts dead children then has nothing to restart.
    pids = set(targets)
    return [processes.KillTarget(pid, t.info.start_ticks, len((processes.ancestors(pid) - {pid}) & pids))
            for pid, t in targets.items()]


def _reap_targets(checker: Checker, chosen: Sequence[DeviceInfo], targets: dict[int, _Target]
                  ) -> tuple[list[Reaped], float | None]:
    """End ``targets`` with the kill ladder (and the checker's grace); returns what happened and when the
    devices let go.

    The second value is the seconds from the first signal until the driver listed none of the GPU
    holders among ``targets`` any more (None if none held a GPU or they never disappeared).
    """
    holders = {pid for pid, t in targets.items() if t.mib}
    ended, all_released = checker.kill_and_confirm(_kill_targets(targets), chosen, holders)
    reaped = [reaped_record(target.info, pid, None, target.found_by, ended[pid], target.mib)
              for pid, target in sorted(targets.items())]
    return reaped, all_released


class _Unreadable(Fields):
    """A device ``reap`` could not read: what it holds, and whose, is unknown."""

    __slots__ = ("device", "error")
    device: Final[DeviceInfo]
    error: Final[devices.DeviceError]

    def __init__(self, device: DeviceInfo, error: devices.DeviceError) -> None:
        self.device = device
        self.error = error

    @property
    def lost(self) -> bool:
        return isinstance(self.error, devices.DeviceLost)

    @property
    def why(self) -> str:
        error = self.error
        return f"lost: {error.reason}" if isinstance(error, devices.DeviceLost) else str(error)


def _read_what_can_be_read(checker: Checker, chosen: Sequence[DeviceInfo],
                           unreadable: list[_Unreadable]) -> tuple[DeviceSnapshot, ...]:
    """The readings of ``chosen``, less the devices that cannot be read, which go to ``unreadable`` (once
    each) and are not read again: ``reap`` needs no device to end what carries the job's cookie, and a lost
    GPU must not cost the job's cleanup on the others (as ``Checker.final_sweep`` copes)."""
    skip = {u.device.uuid for u in unreadable}
    readable = [d for d in chosen if d.uuid not in skip]
    try:
        return checker.snapshot(readable)
    except devices.DeviceError:
        pass
    snaps: list[DeviceSnapshot] = []
    for device in readable:
        try:
            snaps.extend(checker.snapshot([device]))
        except devices.DeviceError as exc:
            unreadable.append(_Unreadable(device, exc))
    return tuple(snaps)


def _unreadable_lines(unreadable: Sequence[_Unreadable], cookie: str | None) -> list[str]:
    """Which devices ``reap`` could not read, and what that means for what ran on them."""
    if not unreadable:
        return []
    lines = [f"{_PROG} reap: could not read {u.device.label} ({u.device.uuid}): {u.why}" for u in unreadable]
    labels = ", ".join(u.device.label for u in unreadable)
    if cookie is not None:
        reach = f"a process on {labels} was ended only if it carries the cookie {cookie!r}"
    else:
        reach = f"no process on {labels} could be found (--cookie finds the job's wherever they run)"
    lines.append(f"{_PROG} reap: {reach}; a GPU that cannot be read is no GPU for the next job: exit "
                 f"{EXIT_UNHEALTHY}, take this runner out of service (gpuclean never resets a GPU)")
    return lines


def _reap_json(found: _Devices, snaps: Sequence[DeviceSnapshot], *, cookie: str | None, dry_run: bool,
               targets: dict[int, _Target], left_alone: Sequence[str], notes: Sequence[str],
               reaped: Sequence[Reaped], released_s: float | None,
               unreadable: Sequence[_Unreadable] = ()) -> dict[str, Any]:
    """``gpuclean reap --json``: the ``status --json`` document of the devices as last read (after the
    reaping; before it with ``--dry-run`` or nothing to end), what it set out to end (``targets``: with
    ``--dry-run``, what it would end), how each one ended, what it left alone and why, and the devices it
    could not read."""
    skip = {u.device.uuid for u in unreadable if not u.lost}  # (a lost one's health says it is lost)
    health = _read_health(found, [d for d in found.chosen if d.uuid not in skip])
    return {**_status_json(found, snaps, _described(snaps)), "health": _health_json(health),
            "unreadable": [{"device": u.device.label, "uuid": u.device.uuid, "lost": u.lost, "error": u.why}
                           for u in unreadable],
            "cookie": cookie, "dry_run": dry_run,
            "targets": [{"process": jsonreport.process_json(t.info), "found_by": t.found_by,
                         "mib_per_device": jsonreport.mib_pairs_json(t.mib)}
                        for _pid, t in sorted(targets.items())],
            "reaped": [jsonreport.reaped_json(r) for r in reaped],
            "survived": [r.process.pid for r in reaped if r.ended_by == "survived"],
            "release_s": None if released_s is None else round(released_s, 6),
            "left_alone": list(left_alone), "notes": list(notes)}


def _cmd_reap(args: argparse.Namespace, out: TextIO) -> int:
    """``gpuclean reap``: end this user's processes on the devices (and ``--cookie`` carriers); ``--json``
    for machines."""
    address, ray_resolved = _ray_settings(args, "grace")
    if address is not None:
        if args.json:
            # Not built for a cluster yet: a hook that asked for JSON must not get text it cannot parse.
            raise _CliError(f"--json is not available with --ray {ray_resolved.ray} "
                           f"({ray_resolved.sources.get('ray', '')}) yet; use the text output")
        from pytest_gpuclean.ray import cli_ray

        return _ray_command(lambda: cli_ray.cmd_reap(args, out, ray_resolved, address))
    resolved = _settings(args, "simulate", "devices", "grace")
    if args.cookie is not None and not args.cookie.strip():
        raise _CliError("--cookie: the value is empty, and an empty prefix would match every process "
                       f"that has {COOKIE_VAR} set")
    if args.all_users and os.geteuid() != 0:
        raise _CliError("--all-users: only root may end other users' processes")
    with _open_devices(resolved) as found:
        checker = _checker(found.backend, grace=resolved.grace)
        unreadable: list[_Unreadable] = []
        snaps = _read_what_can_be_read(checker, found.chosen, unreadable)
        targets, left_alone = plan_reap(snaps, my_uid=checker.uid, never_touch=checker.never_touch,
                                        all_users=args.all_users, cookie=args.cookie,
                                        require_device_file=found.backend.kind == "nvml")
        debris_notes: list[str] = []
        if args.dead_sessions:
            # Processes whose cookie names a gpuclean session that provably died (its pytest was killed):
            # that session's leaks, which nobody else will ever reap.
            for debris in checker.dead_session_debris():
                info = processes.describe(debris.pid, debris.start_ticks)
                if info is None or debris.pid in targets or debris.debris_of is None:
                    continue
                targets[debris.pid] = _Target(info, "dead session", mib_of(debris.pid, snaps))
                debris_notes.append(f"pid {debris.pid}: left by {debris.debris_of.describe()}"
                                    + (f", spawned by {debris.owner_name}" if debris.owner_name else ""))
        text: TextIO = io.StringIO() if args.json else out  # with --json, the document alone, at the end

        def account(now: Sequence[DeviceSnapshot], reaped: Sequence[Reaped] = (),
                    released_s: float | None = None) -> None:
            if args.json:
                _print_json(_reap_json(found, now, cookie=args.cookie, dry_run=args.dry_run, targets=targets,
                                      left_alone=left_alone, notes=debris_notes, reaped=reaped,
                                      released_s=released_s, unreadable=unreadable), out)

        def ending(status: int) -> int:
            # A device that could not be read says so last, where a hook's log ends, and in the status:
            # what could be proven the job's was ended all the same.
            for line in _unreadable_lines(unreadable, args.cookie):
                print(line, file=text)
            return EXIT_UNHEALTHY if unreadable else status

        print(f"{_PROG} reap: {_header(found)}" + (f"; cookie {args.cookie!r}" if args.cookie else ""),
              file=text)
        for line in left_alone:
            print(f"  left alone: {line}", file=text)
        for line in debris_notes:
            print(f"  dead session: {line}", file=text)
        if not targets:
            print(f"{_PROG} reap: nothing to end", file=text)
            account(snaps)
            return ending(EXIT_CLEAN)
        if args.dry_run:
            listed = [report.DryRunTarget("", t.info, f"found as {t.found_by}", t.mib)
                      for _, t in sorted(targets.items())]
            for line in report.dry_run_lines(_PROG, listed):
                print(line, file=text)
            account(snaps)
            return ending(EXIT_CLEAN)
        readable = [s.device for s in snaps]
        reaped, released_s = _reap_targets(checker, readable, targets)
        print(f"{_PROG} reap: ended {len(reaped)} process(es) (SIGTERM, SIGKILL after {resolved.grace:g}s):",
              file=text)
        for item in reaped:
            for line in report.reaped_lines(item):
                print(line, file=text)
        if released_s is not None:
            print(f"{_PROG} reap: the driver released their GPU memory {released_s:.2f}s after the first "
                  "signal", file=text)
        now = _read_what_can_be_read(checker, readable, unreadable)
        for snap in now:
            print("  now: " + report.device_line(snap), file=text)
        account(now, reaped, released_s)
        survived = [r for r in reaped if r.ended_by == "survived"]
        return ending(EXIT_DIRTY if survived else EXIT_CLEAN)


# ---- entry point -------------------------------------------------------------------------------------

def _build_parser() -> argparse.ArgumentParser:
    """The argument parser: the commands and their options."""
    # Option values stay text here: settings parses them with the source named in any error.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--simulate", metavar="DIR",
                        help=f"use simulated devices in DIR instead of NVML {_env_note('simulate')}")
    common.add_argument("--devices", metavar="LIST",
                        help="devices: NVML indices, GPU-/MIG- UUIDs or UUID prefixes, comma-separated "
                             f"(default: those in CUDA_VISIBLE_DEVICES, else all) {_env_note('devices')}")
    common.add_argument("--ray", metavar="ADDRESS",
                        help="check every alive node of this Ray cluster (host:port of its GCS, auto: "
                             "RAY_ADDRESS, off) instead of this host's devices; reap ends only what "
                             f"finished Ray jobs left (docs/multinode.md) {_env_note('ray')}")
    common.add_argument("--timeout", metavar="S",
                        help="with --ray: seconds the cluster has to answer each request (default "
                             f"{settings.DEFAULT_TIMEOUT_S:g}) {_env_note('timeout')}")
    parser = argparse.ArgumentParser(
        prog=_PROG, description="Check and clean GPUs around CI jobs (the pytest-gpuclean plugin's check "
                               "and reaper as a command).",
        epilog="exit status: 0 clean / done, 1 not clean (check) or a process survived (reap), "
               "2 usage error or the devices could not be read, 3 a GPU is not usable: it needs a reset or "
               "is lost (check), or could not be read, the rest reaped all the same (reap)")
    parser.add_argument("--version", action="version", version=f"{_PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    status = commands.add_parser("status", parents=[common], help="show memory and processes per GPU")
    status.add_argument("--json", action="store_true", help="print JSON instead of the table")

    check = commands.add_parser("check", parents=[common],
                                help="exit 0 if the GPUs are clean, 1 if not, 3 if one is not usable "
                                     "(pre-job gate)")
    check.add_argument("--tolerance-mib", metavar="N",
                       help="memory (MiB, NVML v2 'used') allowed per device (default "
                            f"{settings.DEFAULT_TOLERANCE_MIB}); any process on a device fails the check "
                            f"whatever it holds {_env_note('tolerance_mib')}")
    check.add_argument("--wait", metavar="S", type=_argument(settings.parse_seconds), default=0.0,
                       help="wait up to S seconds for the GPUs to become clean (default 0)")
    check.add_argument("--ignore", metavar="GLOBS", action="append",
                       help="command-line globs of processes that never count (comma-separated, "
                            f"repeatable) {_env_note('ignore')}")
    check.add_argument("--json", action="store_true",
                       help="print the verdict as JSON (the status --json document plus clean, "
                            "tolerance_mib, waited_s, offenders, notes)")

    reap = commands.add_parser("reap", parents=[common],
                               help="end this user's processes on the GPUs (post-job cleanup)")
    reap.add_argument("--grace", metavar="S",
                      help=f"seconds between SIGTERM and SIGKILL (default {settings.DEFAULT_GRACE_S:g}) "
                           f"{_env_note('grace')}")
    reap.add_argument("--dry-run", action="store_true", help="only list what would be ended")
    reap.add_argument("--cookie", metavar="VALUE",
                      help=f"also end processes whose {COOKIE_VAR} environment variable starts with VALUE, "
                           "on a GPU or not")
    reap.add_argument("--dead-sessions", action="store_true",
                      help="also end this user's processes that gpuclean sessions which died (pytest "
                           "killed) left behind, on a GPU or not; each names its session")
    reap.add_argument("--all-users", action="store_true",
                      help="root only: also end other users' processes on the devices")
    reap.add_argument("--json", action="store_true",
                      help="print what it ended (or, with --dry-run, would end) as JSON: the status --json "
                           "document of the devices afterwards plus targets, reaped, survived, release_s, "
                           "left_alone, notes")
    return parser


_COMMANDS: dict[str, Callable[[argparse.Namespace, TextIO], int]] = {
    "status": _cmd_status, "check": _cmd_check, "reap": _cmd_reap}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gpuclean``; returns the exit status (argparse itself exits 2 on a malformed command line)."""
    args = _build_parser().parse_args(argv)
    try:
        _check_environment(args)
        return _COMMANDS[args.command](args, sys.stdout)
    except _CliError as exc:
        print(f"{_PROG} {args.command}: error: {exc}", file=sys.stderr)
    except devices.DeviceLost as exc:
        # Lost while the command ran (the health reads found it answering): not a usage error.
        print(f"{_PROG} {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNHEALTHY if args.command == "check" else EXIT_ERROR
    except devices.DeviceError as exc:
        # NVML missing or failing, or a device unreadable: the gate cannot vouch for the GPUs.
        print(f"{_PROG} {args.command}: error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader (``| head``) went away; Python would complain again when flushing at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR
    return EXIT_ERROR
