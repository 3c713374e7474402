"""``gpuclean status|check|reap``: the plugin's check and reaper as a command for CI runner hooks: what each
GPU holds, the pre-job gate, and the post-job cleanup of the user's GPU processes (and ``--cookie``
carriers).

The command has no process tree of its own: "clean" means no process on the devices and memory within the
tolerance."""

from __future__ import annotations

import argparse
import configparser
import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from pytest_gpuclean import _settings as settings
from pytest_gpuclean._check import reap_plan
from pytest_gpuclean._check.checker import Checker, CheckSettings
from pytest_gpuclean._check.decisions import mib_of
from pytest_gpuclean._check.reaping import reaped_record
from pytest_gpuclean._model.records import Credentials, DeviceInfo, DeviceSnapshot, ProcessInfo, Reaped
from pytest_gpuclean._ownership.cookie import COOKIE_VAR
from pytest_gpuclean._reading import backends, credentials, devices, processes, procfs
from pytest_gpuclean._reading.backends import open_backend
from pytest_gpuclean._version import __version__
from pytest_gpuclean.report import commands, terminal
from pytest_gpuclean.report.commands import PROG as _PROG
from pytest_gpuclean.report.commands import ReapTarget

# The exit statuses are documented interface (README).

EXIT_CLEAN = 0
EXIT_DIRTY = 1
"""``check``: not clean; ``reap``: a process survived SIGKILL."""
EXIT_ERROR = 2
"""A usage error (the message names the option) or the devices could not be read."""
EXIT_UNHEALTHY = 3
"""``check``: a GPU needs a reset, is Prohibited, or is lost; waiting does not help, so the runner should be
taken out of service. ``reap``: a GPU could not be read; what was provably the job's was ended anyway."""

class _CliError(Exception):
    """A problem the user must fix (bad option or environment value, no devices)."""


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
    """The options ``names`` from the command line, else the plugin's environment variables: a runner
    configured once configures both."""
    chosen = [settings.option(name) for name in names]
    given = {option.dest: getattr(args, option.name, None) for option in chosen}
    try:
        return settings.resolve_options(chosen, given, os.environ, flag=lambda option: option.command_flag)
    except settings.SettingError as exc:
        raise _CliError(str(exc)) from None


def _check_environment(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Check every GPUCLEAN_ variable, read or not, as a pytest session does. A bad one is named by the
    ``gpuclean`` flag that takes its value (``--grace (of gpuclean reap)``), else by the plugin's option:
    the name its user knows it by in a runner's environment."""
    takes = _value_flags(parser)

    def flag(option: settings.Option) -> str:
        commands = takes.get(option.name, [])
        if args.command in commands:
            return option.command_flag
        return f"{option.command_flag} (of {_PROG} {commands[0]})" if commands else option.cli

    try:
        warnings = settings.check_environment(os.environ, flag)
    except settings.SettingError as exc:
        raise _CliError(str(exc)) from None
    for line in warnings:
        print(f"{_PROG} {args.command}: warning: {line}", file=sys.stderr)


def _value_flags(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Option name -> the subcommands that take its value (``--grace S``; no switch)."""
    takes: dict[str, list[str]] = {}
    # The subcommands are the one action whose choices map names to parsers.
    subcommands = next(a.choices for a in parser._actions if isinstance(a.choices, dict))
    for command, sub in subcommands.items():
        for option in sub._actions:
            if option.option_strings and option.nargs != 0:
                takes.setdefault(option.dest, []).append(command)
    return takes


def _env_note(name: str) -> str:
    return f"[env {settings.option(name).env_var}]"


# ---- a Ray cluster (--ray) -----------------------------------------------------------------------------

_RAY_EXCLUSIVE = ("devices", "cookie", "dead_sessions", "all_users")


def _ray_settings(args: argparse.Namespace, *names: str) -> tuple[str | None, settings.Settings]:
    """The cluster ``--ray`` (or ``GPUCLEAN_RAY``) names, None for the local devices; and the options.
    Ray is imported only when a cluster is named."""
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
    from pytest_gpuclean.ray import command_line
    try:
        return run()
    except command_line.RayCliError as exc:
        raise _CliError(str(exc)) from None


# ---- devices -----------------------------------------------------------------------------------------

class _Devices(NamedTuple):
    """The devices a command works on."""

    backend: backends.Backend
    chosen: tuple[DeviceInfo, ...]
    source: str
    """For the header and error messages."""


@contextlib.contextmanager
def _open_devices(resolved: settings.Settings, command: str) -> Iterator[_Devices]:
    # A runner pinned to some GPUs through CUDA_VISIBLE_DEVICES checks and reaps only those.
    try:
        backend = open_backend(resolved.simulate)
    except devices.SimulationError as exc:
        raise _CliError(f"--simulate: {exc} ({resolved.sources.get('simulate')})") from None
    except devices.BackendUnavailable as exc:
        raise _CliError(f"{exc}{_ini_simulate_hint()}") from None
    try:
        try:
            selection = backends.choose_devices(backend, resolved.devices,
                                                resolved.sources.get("devices", ""),
                                                option=settings.option("devices").command_flag)
        except devices.DeviceSelectionError as exc:
            raise _CliError(str(exc)) from None
        yield _Devices(backend, selection.devices, selection.source)
    finally:
        for line in backend.notices:  # a simulated device file that may not speak for its process
            print(f"{_PROG} {command}: warning: {line}", file=sys.stderr)
        backend.close()


def _ini_simulate_hint() -> str:
    """Where NVML cannot be opened: if the project's ini sets ``gpuclean_simulate`` (which this command
    does not read), a hint to name the devices."""
    option = settings.option("simulate")
    found = ini_value(Path.cwd(), option.ini)
    if found is None:
        return ""
    path, value = found
    where = os.path.normpath(os.path.join(path.parent, os.path.expanduser(value)))  # as the plugin reads it
    return (f" (the gpuclean command reads no ini file: {path} sets {option.ini} = {value}, for pytest; give "
            f"{option.command_flag} {where} or {option.env_var}={where} for those devices)")


def _checker(backend: backends.Backend, *, grace: float = settings.DEFAULT_GRACE_S, ignore: Sequence[str] = ()
             ) -> Checker:
    # No xdist run: a hook started from inside a test run must not excuse that run's workers. Dead
    # sessions' debris off the GPUs does not make them dirty: only ``reap --dead-sessions`` ends it.
    return Checker(backend, CheckSettings(reap=False, grace=grace, ignore=tuple(ignore), dead_sessions=False))


def _selection(found: _Devices) -> commands.Selection:
    backend = found.backend
    return commands.Selection(backend.kind, backend.driver_version(), found.source, len(found.chosen),
                              len(backend.devices()))


# ---- health ------------------------------------------------------------------------------------------

def _read_health(found: _Devices, chosen: Sequence[DeviceInfo] | None = None) -> list[commands.Health]:
    """Each device's health (of ``chosen`` where given)."""
    from pytest_gpuclean._check.health import device_problems
    source = found.backend
    if not isinstance(source, backends.HealthSource):
        return []
    read: list[commands.Health] = []
    for device in found.chosen if chosen is None else chosen:
        try:
            reading = source.health(device)
            source.snapshot(device)  # a lost GPU may still answer the health reads
        except devices.DeviceLost as exc:
            read.append(commands.Health(device, None, (f"lost: {exc.reason}",), exc.reason))
            continue
        read.append(commands.Health(device, reading, tuple(device_problems(reading))))
    return read


def _described(snaps: Sequence[DeviceSnapshot]) -> dict[int, ProcessInfo | None]:
    return {p.pid: processes.describe(p.pid) for s in snaps for p in s.processes}


def _print(lines: Sequence[str], out: TextIO) -> None:
    for line in lines:
        print(line, file=out)


def _cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    """``gpuclean status``: memory and processes of each device."""
    address, ray_resolved = _ray_settings(args)
    if address is not None:
        from pytest_gpuclean.ray import command_line
        return _ray_command(lambda: command_line.cmd_status(args, out, ray_resolved, address,
                                                       commands.status_lines, commands.print_json))
    with _open_devices(_settings(args, "simulate", "devices"), args.command) as found:
        read = _read_health(found)
        lost = {h.device.uuid for h in read if h.lost is not None}
        snaps = [found.backend.snapshot(d) for d in found.chosen if d.uuid not in lost]
        described = _described(snaps)
        if args.json:
            commands.print_json({**commands.status_json(_selection(found), snaps, described),
                                 "health": commands.health_json(read)}, out)
            return EXIT_CLEAN
        _print(commands.status_text(_selection(found), snaps, described, read), out)
    return EXIT_CLEAN


# ---- check -------------------------------------------------------------------------------------------

def _debris(checker: Checker) -> list[commands.Debris]:
    """The live processes that gpuclean sessions which died left behind (``reap --dead-sessions``)."""
    found: list[commands.Debris] = []
    for f in checker.dead_session_debris():
        info = processes.describe(f.pid, f.start_ticks)
        if info is not None and f.debris_of is not None:
            found.append(commands.Debris(info, f.debris_of.describe(), f.owner_name))
    return found


def _cmd_check(args: argparse.Namespace, out: TextIO) -> int:
    """``gpuclean check``: exit 0 if the devices are clean (waiting up to ``--wait``), 1 if not."""
    address, ray_resolved = _ray_settings(args, "tolerance_mib", "ignore")
    if address is not None:
        from pytest_gpuclean.ray import command_line
        return _ray_command(lambda: command_line.cmd_check(args, out, ray_resolved, address,
                                                           commands.check_lines,
                                                      commands.print_json))
    resolved = _settings(args, "simulate", "devices", "tolerance_mib", "ignore")
    with _open_devices(resolved, args.command) as found:
        if not found.chosen:
            raise _CliError(f"no devices to check ({commands.header(_selection(found))})")
        read = _read_health(found)
        unusable = [h for h in read if h.problems]
        if unusable:
            # Waiting does not make a GPU usable: answer at once, with a status of its own.
            if args.json:
                commands.print_json(commands.unusable_json(found.backend.kind, found.source, read), out)
            else:
                _print(commands.unusable_lines(unusable), out)
            return EXIT_UNHEALTHY
        checker = _checker(found.backend, ignore=resolved.ignore)
        result = checker.check("check", found.chosen, tolerance_mib=resolved.tolerance_mib, timeout=args.wait,
                               reap=False)
        if args.json:
            debris = _debris(checker)
            commands.print_json(commands.check_json(_selection(found), result, _described(result.devices),
                                                    debris, read), out)
        else:
            _print([*commands.check_lines(result, args.wait, checker.uid),
                    *commands.debris_lines(_debris(checker))], out)
    return EXIT_CLEAN if result.clean else EXIT_DIRTY


# ---- reap --------------------------------------------------------------------------------------------

def _process_uids() -> set[int]:
    uids: set[int] = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                uids.add(os.stat(f"/proc/{name}").st_uid)
    return uids


def plan_reap(snaps: Sequence[DeviceSnapshot], *, my_uid: int, never_touch: set[int], all_users: bool,
              cookie: str | None, require_device_file: bool = False, debris: Sequence[commands.Debris] = ()
              ) -> tuple[dict[int, ReapTarget], list[str]]:
    """What ``reap`` may end, and why it leaves each other process alone: the devices' processes, the
    ``cookie`` carriers and ``debris``, each through the signal gate (``reap_plan.plan``).

    ``require_device_file`` (real GPUs): in a container the driver may list host pids, and the same number
    can name an unrelated local process; so a target must have a GPU device file open.
    """
    def candidates() -> Iterator[reap_plan.ReapCandidate]:
        for pid in sorted({p.pid for s in snaps for p in s.processes}):
            info = processes.describe(pid)
            yield reap_plan.ReapCandidate(
                pid, info, mib_of(pid, snaps), "gpu", gpuclean_itself=pid in never_touch,
                no_device_file=info is not None and require_device_file
                and not procfs.has_nvidia_device_open(pid), credentials=_credentials(info))
        if cookie is not None:
            # Every user's carriers where they can be read (root): another user's is named as left alone.
            for uid in sorted(_process_uids()) if all_users or os.geteuid() == 0 else [my_uid]:
                for pid, _value in processes.cookie_holders(COOKIE_VAR, cookie, uid):
                    # The planner passes over one already a target.
                    info = processes.describe(pid)
                    yield reap_plan.ReapCandidate(pid, info, mib_of(pid, snaps), "cookie",
                                                  gpuclean_itself=pid in never_touch,
                                                  credentials=_credentials(info))
        for item in debris:
            pid = item.info.pid
            yield reap_plan.ReapCandidate(pid, item.info, mib_of(pid, snaps), "dead session",
                                          gpuclean_itself=pid in never_touch,
                                          credentials=_credentials(item.info))

    chosen, left_alone = reap_plan.plan(candidates(), my_uid=my_uid, all_users=all_users,
                                        cmd_width=commands.CMDLINE_WIDTH)
    return {c.pid: ReapTarget(c.info, c.found_by, c.mib) for c in chosen if c.info is not None}, left_alone


def _credentials(info: ProcessInfo | None) -> Credentials | None:
    """Whom a signal to the process ``info`` describes could reach (None: it is gone)."""
    return None if info is None else credentials.credentials(info.pid, info.start_ticks)


def _kill_targets(targets: dict[int, ReapTarget]) -> list[processes.KillTarget]:
    # Children before their parents: a parent that restarts dead children then has nothing to restart.
    pids = set(targets)
    return [processes.KillTarget(pid, t.info.start_ticks, len((processes.ancestors(pid) - {pid}) & pids))
            for pid, t in targets.items()]


def _reap_targets(checker: Checker, chosen: Sequence[DeviceInfo], targets: dict[int, ReapTarget]
                  ) -> tuple[list[Reaped], float | None]:
    """End ``targets`` with the kill ladder; returns what happened, and the seconds from the first signal
    until the driver listed none of them (None if none held a GPU, or they never disappeared)."""
    holders = {pid for pid, t in targets.items() if t.mib}
    ended, all_released = checker.kill_and_confirm(_kill_targets(targets), chosen, holders)
    reaped = [reaped_record(target.info, pid, None, target.found_by, ended[pid], target.mib)
              for pid, target in sorted(targets.items())]
    return reaped, all_released


def _unreadable(device: DeviceInfo, error: devices.DeviceError) -> commands.Unreadable:
    if isinstance(error, devices.DeviceLost):
        return commands.Unreadable(device, True, f"lost: {error.reason}")
    return commands.Unreadable(device, False, str(error))


def _read_what_can_be_read(checker: Checker, chosen: Sequence[DeviceInfo],
                           unreadable: list[commands.Unreadable]) -> tuple[DeviceSnapshot, ...]:
    """The readings of ``chosen``; unreadable devices go to ``unreadable`` once and are not read again: a
    lost GPU must not cost the job's cleanup on the others."""
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
            unreadable.append(_unreadable(device, exc))
    return tuple(snaps)


def _reap_json(found: _Devices, snaps: Sequence[DeviceSnapshot], run: commands.ReapRun) -> dict[str, Any]:
    """``gpuclean reap --json`` (``commands.reap_json``), with the devices' health read anew."""
    skip = {u.device.uuid for u in run.unreadable if not u.lost}  # a lost one's health says it is lost
    health = _read_health(found, [d for d in found.chosen if d.uuid not in skip])
    return commands.reap_json(_selection(found), snaps, _described(snaps), health, run)


def _cmd_reap(args: argparse.Namespace, out: TextIO) -> int:
    """``gpuclean reap``: end this user's processes on the devices (and ``--cookie`` carriers)."""
    address, ray_resolved = _ray_settings(args, "grace")
    if address is not None:
        if args.json:
            # Not built for a cluster yet: a hook that asked for JSON must not get text it cannot parse.
            raise _CliError(f"--json is not available with --ray {ray_resolved.ray} "
                           f"({ray_resolved.sources.get('ray', '')}) yet; use the text output")
        from pytest_gpuclean.ray import command_line
        return _ray_command(lambda: command_line.cmd_reap(args, out, ray_resolved, address))
    resolved = _settings(args, "simulate", "devices", "grace")
    if args.cookie is not None and not args.cookie.strip():
        raise _CliError("--cookie: the value is empty, and an empty prefix would match every process "
                       f"that has {COOKIE_VAR} set")
    if args.all_users and os.geteuid() != 0:
        raise _CliError("--all-users: only root may end other users' processes")
    with _open_devices(resolved, args.command) as found:
        checker = _checker(found.backend, grace=resolved.grace)
        unreadable: list[commands.Unreadable] = []
        snaps = _read_what_can_be_read(checker, found.chosen, unreadable)
        # Leaks of a gpuclean session that provably died: nobody else will ever reap them.
        debris = _debris(checker) if args.dead_sessions else []
        targets, left_alone = plan_reap(snaps, my_uid=checker.uid, never_touch=checker.never_touch,
                                        all_users=args.all_users, cookie=args.cookie,
                                        require_device_file=found.backend.kind == "nvml", debris=debris)
        debris_notes = [commands.dead_session_note(item) for item in debris
                        if (target := targets.get(item.info.pid)) is not None
                        and target.found_by == "dead session"]
        text: TextIO = io.StringIO() if args.json else out  # with --json, the document alone, at the end

        def account(now: Sequence[DeviceSnapshot], reaped: Sequence[Reaped] = (),
                    released_s: float | None = None) -> None:
            if args.json:
                run = commands.ReapRun(args.cookie, args.dry_run, targets, left_alone, debris_notes,
                                       unreadable, reaped, released_s)
                document = _reap_json(found, now, run)
                commands.print_json(document, out)

        def ending(status: int) -> int:
            # An unreadable device is said last, where a hook's log ends, and in the status.
            _print(commands.unreadable_lines(unreadable, args.cookie, EXIT_UNHEALTHY), text)
            return EXIT_UNHEALTHY if unreadable else status

        _print(commands.reap_opening_lines(_selection(found), args.cookie, left_alone, debris_notes), text)
        if not targets:
            print(f"{_PROG} reap: nothing to end", file=text)
            account(snaps)
            return ending(EXIT_CLEAN)
        if args.dry_run:
            listed = [terminal.DryRunTarget("", t.info, f"found as {t.found_by}", t.mib)
                      for _, t in sorted(targets.items())]
            _print(terminal.dry_run_lines(_PROG, listed), text)
            account(snaps)
            return ending(EXIT_CLEAN)
        readable = [s.device for s in snaps]
        reaped, released_s = _reap_targets(checker, readable, targets)
        _print(commands.reap_ended_lines(reaped, resolved.grace, released_s), text)
        now = _read_what_can_be_read(checker, readable, unreadable)
        _print(["  now: " + terminal.device_line(snap) for snap in now], text)
        account(now, reaped, released_s)
        survived = [r for r in reaped if r.ended_by == "survived"]
        return ending(EXIT_DIRTY if survived else EXIT_CLEAN)


# ---- entry point -------------------------------------------------------------------------------------

def _build_parser() -> argparse.ArgumentParser:
    """The argument parser: the commands and their options."""
    # Option values stay text: settings parses them, naming the source in any error.
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
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        _check_environment(args, parser)
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


_FILES = (("pytest.ini", "pytest"), (".pytest.ini", "pytest"), ("pyproject.toml", ""), ("tox.ini", "pytest"),
          ("setup.cfg", "tool:pytest"))
"""pytest's candidates, in its order, with the section that makes one its file (any ``pytest.ini`` is)."""


def ini_value(start: Path, key: str) -> tuple[Path, str] | None:
    """The file pytest would take for its configuration from ``start`` upwards, and its value of ``key``;
    None if there is none, or it does not set ``key``. Unreadable files count as absent."""
    for folder in (start, *start.parents):
        for name, section in _FILES:
            path = folder / name
            if not path.is_file():
                continue
            try:
                found = _read(path, section, key)
            except (OSError, ValueError, configparser.Error):
                continue
            if found is not None:
                return (path, found[1]) if found[1] is not None else None
    return None


def _read(path: Path, section: str, key: str) -> tuple[bool, str | None] | None:
    """(it is pytest's file, the value of ``key`` there); None if the file is not pytest's."""
    if path.suffix == ".toml":
        import importlib

        try:
            tomllib: Any = importlib.import_module("tomllib")
        except ImportError:  # Python 3.10: tomli, pytest's own dependency there
            tomllib = importlib.import_module("tomli")
        with open(path, "rb") as f:
            tool = tomllib.load(f).get("tool", {}).get("pytest")
        if not isinstance(tool, dict):
            return None
        table = tool.get("ini_options", tool)  # pytest 9 reads [tool.pytest] too
        value = table.get(key) if isinstance(table, dict) else None
        return True, value if isinstance(value, str) else None
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(path, encoding="utf-8")
    if not parser.has_section(section):
        return (True, None) if path.name in ("pytest.ini", ".pytest.ini") else None
    value = parser.get(section, key, fallback=None)
    return True, value.strip() if value is not None else None
