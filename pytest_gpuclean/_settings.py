"""gpuclean's options: declared once, resolved once (marker > CLI > environment > ini > default), each value
with where it came from, for error messages. The ``gpuclean`` command uses the same table.

Every pytest run of an environment with the plugin imports this module: keep its imports cheap (no
pytest, no dataclasses, nothing of ``_model``)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import pytest

    from pytest_gpuclean._model.records import OnOff, OutsideAction, Scope

# ``records.Scope``, ``records.OnOff`` and ``records.OutsideAction`` spelt out, as records.py is not cheap
# to import; a test checks that they agree.
SCOPES: tuple[Scope, ...] = ("session", "host")
ON_OFF: tuple[OnOff, ...] = ("on", "off")
OUTSIDE_ACTIONS: tuple[OutsideAction, ...] = ("fail", "skip", "stop")
NO_GPU_ACTIONS = ("fail", "skip")
"""What a marked test gets when there is no GPU to check (``--gpuclean-no-gpu``)."""
_MARKER_KWARGS = ("tolerance_mib", "timeout", "count")
_PROBE_MODES = ("off", "start", "after-incident", "each")
"""As ``health.HealthWatch`` reads them."""
_DEFAULT_PROBE = "after-incident"

DEFAULT_TOLERANCE_MIB = 0
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_GRACE_S = 5.0
_DEFAULT_SETTLE_S = 1.0
_DEFAULT_LOCK_TIMEOUT_S = 600.0
# No dataclasses here: see the module's docstring.


def _default_lock_dir() -> str:
    """``<tmp>/gpuclean-locks``. Only when a session takes locks: finding the temporary directory writes
    a probe file there."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), "gpuclean-locks")


class SettingError(ValueError):
    """A bad option value; the message names the option and where the value came from."""


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise ValueError(f"{text!r} is negative; expected a whole number >= 0")
    return value


def parse_seconds(text: str) -> float:
    """A number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a number of seconds >= 0")
    return value


_TRUE = ("on", "1", "true", "yes")
_FALSE = ("off", "0", "false", "no")


def _boolean(text: str) -> bool:
    # The same spellings for every on/off option: a CI file that says GPUCLEAN_ALL=1 says GPUCLEAN_REAP=0.
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"{text!r} is not on or off (nor 1/0, true/false, yes/no)")


def _on_off(text: str) -> OnOff:
    return "on" if _boolean(text) else "off"


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse


def _device_list(text: str) -> str:
    # An empty list would check nothing while looking like a choice: refuse it rather than guess.
    tokens = parse_device_list(text)
    if not tokens:
        raise ValueError(f"{text!r} names no device")
    # A device listed twice is a slip. An index and the same GPU's UUID show only once the devices are
    # read (backends.select_devices).
    repeated = repeated_tokens(tokens)
    if repeated is not None:
        first, second = repeated
        raise ValueError(f"{text!r} lists {first!r} twice" if first == second
                         else f"{text!r} names one device twice ({first!r} and {second!r})")
    return text


def _path(text: str, base: str = "") -> str:
    # No shell expands ``~`` after ``=``, nor in an ini file or a variable quoted in a CI config.
    return os.path.join(base, os.path.expanduser(text))


def _existing_dir(text: str, base: str = "") -> str:
    path = _path(text, base)
    if not os.path.isdir(path):
        shown = repr(text) if path == text else f"{text!r} ({path!r})"
        raise ValueError(f"{shown} is not an existing directory")
    return os.path.abspath(path)


def _ray_address(text: str) -> str:
    if text in ("off", "auto"):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{text!r} is not host:port, auto or off")
    return text


def _patterns(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.replace("\n", ",").split(",") if p.strip())


class Option(NamedTuple):
    """One option: its CLI flag, ini key and environment variable all derive from ``name``."""

    name: str
    help: str
    parse: Callable[..., Any]
    """Text to value; raises ``ValueError`` with a message for the user. A ``path`` option's also takes the
    base directory."""
    metavar: str | None = None
    flag: bool = False
    """A CLI switch without a value (``--gpuclean-all``)."""
    listed: bool = False
    """Repeatable on the command line, one value per line in the ini file, comma-separated anywhere."""
    path: bool = False
    """Relative to the ini file's directory for a value from it (as pytest's ``paths`` values), so the
    same ini means the same place from anywhere; else relative to the current directory."""

    @property
    def cli(self) -> str:
        return "--gpuclean-" + self.name.replace("_", "-")

    @property
    def command_flag(self) -> str:
        """The flag of the ``gpuclean`` command (``--tolerance-mib``): no prefix there."""
        return "--" + self.name.replace("_", "-")

    @property
    def ini(self) -> str:
        return "gpuclean_" + self.name

    @property
    def env_var(self) -> str:
        return "GPUCLEAN_" + self.name.upper()

    @property
    def dest(self) -> str:
        return "gpuclean_" + self.name


OPTIONS: tuple[Option, ...] = (
    Option("all", "check every test, not only those marked needs_clean_gpus", _boolean, flag=True),
    Option("tolerance_mib", "GPU memory (MiB, NVML v2 'used') allowed per device, not counting the pytest "
           f"process's own (default {DEFAULT_TOLERANCE_MIB})", _non_negative_int, "N"),
    Option("timeout", f"seconds a check waits for GPUs and processes to become clean (default "
           f"{DEFAULT_TIMEOUT_S:g})", parse_seconds, "S"),
    Option("devices", "devices to check: indices (as nvidia-smi shows), GPU-/MIG- UUIDs or UUID prefixes, "
           "comma-separated (default: those visible through CUDA_VISIBLE_DEVICES)", _device_list, "LIST"),
    Option("scope", "session: our processes and the GPUs; host: also every Python process of this user "
           "that is not pytest or an ancestor (default session)", _choice(SCOPES), "SCOPE"),
    Option("simulate", "use simulated devices in DIR instead of NVML (DIR/<index>/<pid> holds bytes)",
           _existing_dir, "DIR", path=True),
    Option("no_gpu", "what a test marked needs_clean_gpus gets when there is no GPU to check (no driver, "
           "none of the devices selected): fail (an error) or skip (default: fail where the CI variable is "
           "set, as CI services set it, else skip)", _choice(NO_GPU_ACTIONS), "ACTION"),
    Option("ignore", "glob patterns of command lines that are never stray (host scope, GPU processes); "
           "comma-separated, repeatable", _patterns, "GLOBS", listed=True),
    Option("helpers", "glob patterns of command lines of the pytest process's children that serve it for "
           "the session (a library's worker pool): not leaks, said once, ended at the session's end; "
           "comma-separated, repeatable", _patterns, "GLOBS", listed=True),
    Option("persistent", "glob patterns of command lines of processes meant to outlive the session (a warm "
           "model server): never signalled, their GPU memory excused, said once; comma-separated, repeatable",
           _patterns, "GLOBS", listed=True),
    Option("grace", f"seconds between SIGTERM and SIGKILL when reaping (default {DEFAULT_GRACE_S:g})",
           parse_seconds, "S"),
    Option("settle", "seconds leftover processes get to exit by themselves before reaping starts "
           f"(default {_DEFAULT_SETTLE_S:g}); those that do are reported, not counted as leaks",
           parse_seconds, "S"),
    Option("reap", "on: kill what a test leaked; off: only report, and skip at once (naming the leaker) a "
           "later test whose GPUs hold only a leak already reported (default on)", _on_off, "MODE"),
    Option("dead_sessions", "on: reap what dead gpuclean sessions of this user left behind (their pytest "
           "was killed), found at the first check and whenever a GPU holds something unexplained; off: "
           "leave it (default on)", _on_off, "MODE"),
    Option("outside", "what a test gets when its GPUs are dirty only from outside the session (processes "
           "that are not the session's, memory held by no process we can see): fail (default), skip, or "
           "stop the session; a check that already waited out the same outside state does not wait again",
           _choice(OUTSIDE_ACTIONS), "ACTION"),
    Option("lock", "on: hold a cross-process lock per GPU while a checked test runs (default on)",
           _on_off, "MODE"),
    Option("lock_dir", "directory of the per-GPU lock files shared by all sessions on this host "
           "(default: <tmp>/gpuclean-locks)", _path, "DIR", path=True),
    Option("lock_timeout", f"seconds to wait for another session's GPU lock (default "
           f"{_DEFAULT_LOCK_TIMEOUT_S:g})", parse_seconds, "S"),
    Option("probe", "CUDA sanity probe (a subprocess: context, allocation, write and read back on each "
           "device, within the check's timeout): off; start (once, at session start); after-incident (before "
           "the next test on a GPU where a test had an Xid, a reaped GPU process or a failure); each (before "
           f"every checked test) (default {_DEFAULT_PROBE})", _choice(_PROBE_MODES), "MODE"),
    Option("report", "write a JSON report of every checked test to PATH", _path, "PATH", path=True),
    Option("ray", "check every node of a Ray cluster too: its GCS address (host:port); auto (RAY_ADDRESS if "
           "set, else a cluster the session's tests or fixtures start, found at the next check once its GCS "
           "server runs under pytest); or off (default off; with off, or auto before a cluster is found, "
           "Ray is never imported)", _ray_address, "ADDRESS"),
)


def option(name: str) -> Option:
    """The option called ``name`` (``tolerance_mib``)."""
    for candidate in OPTIONS:
        if candidate.name == name:
            return candidate
    raise KeyError(name)


def add_options(parser: pytest.Parser) -> None:
    """Declare every option on the command line and in the ini file."""
    group = parser.getgroup("gpuclean", "clean-GPU checks (pytest-gpuclean)")
    for option in OPTIONS:
        env_note = f" [env {option.env_var}]"
        if option.flag:
            group.addoption(option.cli, action="store_const", const="true", default=None, dest=option.dest,
                            help=option.help + env_note)
        elif option.listed:
            group.addoption(option.cli, action="append", default=None, dest=option.dest,
                            metavar=option.metavar, help=option.help + env_note)
        else:
            group.addoption(option.cli, action="store", default=None, dest=option.dest,
                            metavar=option.metavar, help=option.help + env_note)
        if option.listed:
            parser.addini(option.ini, option.help, type="linelist")
        else:
            parser.addini(option.ini, option.help, type="string")


class Settings:
    """Resolved options (immutable); ``sources`` says where each explicitly set value came from.
    ``lock_dir``'s default is found when first read."""

    all: bool = False
    tolerance_mib: int = DEFAULT_TOLERANCE_MIB
    timeout: float = DEFAULT_TIMEOUT_S
    devices: str | None = None
    scope: Scope = "session"
    simulate: str | None = None
    no_gpu: str | None = None
    """None: not chosen (``no_gpu_action`` says what applies)."""
    ignore: tuple[str, ...] = ()
    helpers: tuple[str, ...] = ()
    persistent: tuple[str, ...] = ()
    grace: float = DEFAULT_GRACE_S
    settle: float = _DEFAULT_SETTLE_S
    reap: OnOff = "on"
    dead_sessions: OnOff = "on"
    outside: OutsideAction = "fail"
    lock: OnOff = "on"
    lock_timeout: float = _DEFAULT_LOCK_TIMEOUT_S
    report: str | None = None
    probe: str = _DEFAULT_PROBE
    ray: str = "off"
    sources: Mapping[str, str]

    def __init__(self, sources: Mapping[str, str] | None = None, **values: Any) -> None:
        unknown = set(values) - set(SETTINGS_FIELDS)
        if unknown:
            raise TypeError(f"Settings got unknown field(s): {', '.join(sorted(unknown))}")
        values["_lock_dir"] = values.pop("lock_dir", None)
        self.__dict__.update(values, sources=MappingProxyType(dict(sources or {})))

    @property
    def lock_dir(self) -> str:
        given: str | None = self.__dict__["_lock_dir"]
        return given if given is not None else _default_lock_dir()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Settings are immutable (cannot set {name})")

    def _key(self) -> tuple[Any, ...]:
        return (*(getattr(self, name) for name in SETTINGS_FIELDS if name != "lock_dir"),
                self.__dict__["_lock_dir"], dict(self.sources))

    def __eq__(self, other: object) -> bool:
        return self._key() == other._key() if isinstance(other, Settings) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        given = [f"{name}={self.__dict__[name]!r}" for name in SETTINGS_FIELDS if name in self.__dict__]
        given += [f"lock_dir={self.__dict__['_lock_dir']!r}", f"sources={dict(self.sources)!r}"]
        return f"Settings({', '.join(given)})"

    def explicit(self, name: str) -> bool:
        """True if ``name`` was set on the command line, in the environment or in the ini file."""
        return name in self.sources

    def refused(self, name: str, why: object) -> str:
        """The error line for a value of ``name`` that proved unusable only once used."""
        return f"{option(name).cli}: {why} ({self.sources.get(name)})"


SETTINGS_FIELDS: tuple[str, ...] = (*(name for name in Settings.__annotations__ if name != "sources"),
                                    "lock_dir")
"""One per option."""


_NOT_CI = ("", "0", "false", "no", "off")


def no_gpu_action(settings: Settings, env: Mapping[str, str]) -> tuple[str, str]:
    """``fail`` or ``skip`` for a marked test without a GPU, and why ('' for the default outside CI). By
    default ``fail`` where ``CI`` is set: a runner that lost its GPUs must not skip every GPU test to a
    green run."""
    flag = option("no_gpu").cli
    if settings.no_gpu is not None:
        return settings.no_gpu, f"{flag}={settings.no_gpu}, {settings.sources['no_gpu']}"
    ci = env.get("CI")
    if ci is not None and ci.strip().lower() not in _NOT_CI:
        return "fail", f"{flag}=fail: the default where CI is set (CI={ci!r}); {flag}=skip to skip instead"
    return "skip", ""


def _describe_source(kind: str, option: Option, inifile: str | None) -> str:
    if kind == "cli":
        return "from the command line"
    if kind == "env":
        return f"from environment variable {option.env_var}"
    where = f" in {inifile}" if inifile else ""
    return f"from ini option {option.ini}{where}"


def _no_ini(name: str) -> None:
    return None


def _parse(option: Option, raw: Any, kind: str, inifile: str | None, flag: Callable[[Option], str]
           ) -> tuple[Any, str]:
    """``raw`` from source ``kind`` as ``option``'s value, and the words for where it came from."""
    if isinstance(raw, list):
        raw = ",".join(raw)
    source = _describe_source(kind, option, inifile)
    try:
        if option.path:
            base = os.path.dirname(inifile) if kind == "ini" and inifile else ""
            return option.parse(str(raw), base), source
        return option.parse(str(raw)), source
    except ValueError as exc:
        raise SettingError(f"{flag(option)}: {exc} ({source})") from None


def resolve_options(
    options: Iterable[Option],
    cli: Mapping[str, Any],
    env: Mapping[str, str],
    ini: Callable[[str], Any] = _no_ini,
    inifile: str | None = None,
    *,
    flag: Callable[[Option], str] = lambda option: option.cli,
) -> Settings:
    """Build ``Settings`` from ``options`` as found in the sources (``cli`` is keyed by ``Option.dest``).
    Raises ``SettingError`` naming the option. A set variable is checked even where the command line
    overrides it."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in options:
        found: tuple[Any, str] | None = None
        if cli.get(option.dest) is not None:
            found = _parse(option, cli[option.dest], "cli", inifile, flag)
        if env.get(option.env_var) not in (None, ""):
            from_env = _parse(option, env[option.env_var], "env", inifile, flag)
            found = from_env if found is None else found
        if found is None:
            ini_value = ini(option.ini)
            if ini_value not in ("", [], None):
                found = _parse(option, ini_value, "ini", inifile, flag)
        if found is not None:
            values[option.name], sources[option.name] = found
    return Settings(**values, sources=sources)


INTERNAL_VARIABLES = frozenset((
    "GPUCLEAN_TEST",  # cookie.COOKIE_VAR
    "GPUCLEAN_OWNER",  # cookie.OWNER_VAR
    "GPUCLEAN_XDIST_WORKERS_SINCE",  # cookie.WORKERS_SINCE_VAR
    "GPUCLEAN_HELD_LOCKS",  # locks.HELD_VAR
    "GPUCLEAN_OUTSIDE_STATE",  # outside.STATE_VAR
    "GPUCLEAN_BYTECODE_CACHE",  # _imports._CACHE_ENV: read before any option, so not one
))
"""Variables the package sets for what it starts, so a session may inherit them from an outer one. Spelt
out: importing their modules would cost every pytest run."""
_VARIABLE_PREFIX = "GPUCLEAN_"
_REPLACED = {"GPUCLEAN_REQUIRE_GPU": "GPUCLEAN_NO_GPU=fail"}
"""Variables of options that another one replaced, and what says the same now."""


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """A line for each unknown ``GPUCLEAN_`` variable, naming the closest: ``GPUCLEAN_TIMOUT=5`` would
    otherwise change nothing, silently."""
    options = {option.env_var for option in OPTIONS}
    unknown = sorted(name for name in env if name.startswith(_VARIABLE_PREFIX)
                     and name not in options and name not in INTERNAL_VARIABLES)
    if not unknown:
        return []
    import difflib  # only for a slip

    # Matched without the prefix, which every candidate shares: GPUCLEAN_FOO is like none of them.
    suffixes = {name[len(_VARIABLE_PREFIX):]: name for name in sorted(options)}
    lines = []
    for name in unknown:
        close = [_REPLACED[name]] if name in _REPLACED else [
            suffixes[m] for m in difflib.get_close_matches(name[len(_VARIABLE_PREFIX):], list(suffixes), n=1)]
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"environment variable {name} is not gpuclean's: ignored{hint}")
    return lines


def check_environment(env: Mapping[str, str], flag: Callable[[Option], str]) -> list[str]:
    """For the ``gpuclean`` command, as ``resolve`` for a session: check every set option variable, read or
    not; return the warnings for unknown ``GPUCLEAN_`` ones."""
    resolve_options(OPTIONS, {}, env, flag=flag)
    return unknown_variables(env)


def resolve(
    cli: Mapping[str, Any],
    env: Mapping[str, str],
    ini: Callable[[str], Any],
    inifile: str | None = None,
) -> Settings:
    """Build ``Settings`` from the three sources; raise ``pytest.UsageError`` naming the bad one."""
    import pytest  # here, not at the top: the gpuclean command uses this module without pytest

    try:
        return resolve_options(OPTIONS, cli, env, ini, inifile)
    except SettingError as exc:
        raise pytest.UsageError(str(exc)) from None


class TestSettings:
    """What applies to one test once its marker is taken into account."""

    __slots__ = ("count", "timeout", "tolerance_mib")

    def __init__(self, tolerance_mib: int, timeout: float, count: int | None) -> None:
        self.tolerance_mib, self.timeout, self.count = tolerance_mib, timeout, count

    def __repr__(self) -> str:
        return f"TestSettings(tolerance_mib={self.tolerance_mib}, timeout={self.timeout}, count={self.count})"


def for_marker(settings: Settings, kwargs: Mapping[str, Any], where: str, args: Sequence[Any] = ()
               ) -> TestSettings:
    """Apply a ``needs_clean_gpus(...)`` marker's arguments over the session's settings, wherever those
    came from: as in pytest-timeout, a CI-wide ``GPUCLEAN_TIMEOUT`` must not undo a test's own.
    Raises ``ValueError`` naming the marker argument and the test."""
    if not kwargs and not args:  # a bare marker (most tests)
        return TestSettings(tolerance_mib=settings.tolerance_mib, timeout=settings.timeout, count=None)
    if args:
        # needs_clean_gpus(2) reads as "2 GPUs" to some and "2 MiB" to others: make the reader say which.
        given = ", ".join(map(repr, args))
        raise ValueError(f"needs_clean_gpus({given}) on {where}: positional arguments are not accepted; "
                         f"use keyword arguments: {', '.join(f'{name}=...' for name in _MARKER_KWARGS)}")
    unknown = sorted(set(kwargs) - set(_MARKER_KWARGS))
    if unknown:
        raise ValueError(f"needs_clean_gpus got unknown argument(s) {', '.join(unknown)} on {where}; "
                         f"known: {', '.join(_MARKER_KWARGS)}")

    def pick(name: str, check: Callable[[str], Any]) -> Any:
        if name not in kwargs or kwargs[name] is None:
            return None
        value = kwargs[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"needs_clean_gpus({name}={value!r}) on {where}: not a number")
        try:
            return check(str(value))
        except ValueError as exc:
            raise ValueError(f"needs_clean_gpus({name}={value!r}) on {where}: {exc}") from None

    tolerance = pick("tolerance_mib", _non_negative_int)
    timeout = pick("timeout", parse_seconds)
    count = pick("count", _non_negative_int)
    if count == 0:
        raise ValueError(f"needs_clean_gpus(count=0) on {where}: count must be >= 1")
    return TestSettings(tolerance_mib=settings.tolerance_mib if tolerance is None else tolerance,
                        timeout=settings.timeout if timeout is None else timeout, count=count)


def parse_device_list(spec: str) -> list[str]:
    """Split a CUDA_VISIBLE_DEVICES-style list into tokens; CUDA stops at ``-1``."""
    tokens: list[str] = []
    for raw in spec.split(","):
        token = raw.strip()
        if not token:
            continue
        if token.startswith("-"):
            break  # CUDA treats a negative index as the end of the list
        tokens.append(token)
    return tokens


def repeated_tokens(tokens: Sequence[str]) -> tuple[str, str] | None:
    """Two tokens that name the same device whatever the devices are (``0,00``; a UUID and its prefix,
    case aside), or None."""
    for i, later in enumerate(tokens):
        for earlier in tokens[:i]:
            if earlier.isdigit() != later.isdigit():
                continue  # an index and a UUID: only the devices can tell
            a, b = earlier.lower(), later.lower()
            if int(a) == int(b) if a.isdigit() else a.startswith(b) or b.startswith(a):
                return earlier, later
    return None
