"""Option resolution: marker > CLI > environment > ini > default, and the source of each value; in-process,
then in inner sessions (pytester) and ``gpuclean`` commands where what matters is what a real run does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import pytest
from helpers import run_inner

import pytest_gpuclean
from pytest_gpuclean import _settings as settings
from pytest_gpuclean._check import outside
from pytest_gpuclean._locks import held
from pytest_gpuclean._model import records as model
from pytest_gpuclean._ownership import cookie
from pytest_gpuclean._settings import (
    OPTIONS,
    SettingError,
    Settings,
    for_marker,
    option,
    resolve,
    resolve_options,
)


def ini_of(values: dict[str, Any]) -> Callable[[str], Any]:
    # pytest's getini answers "" for an unset string option and [] for an unset linelist.
    return lambda name: values.get(name, [] if name == "gpuclean_ignore" else "")


def test_defaults_when_nothing_is_set() -> None:
    resolved = resolve({}, {}, ini_of({}))
    assert resolved == Settings()
    assert (resolved.timeout, resolved.grace, resolved.reap, resolved.sources) == (
        settings.DEFAULT_TIMEOUT_S, settings.DEFAULT_GRACE_S, "on", {})


def test_command_line_beats_environment_beats_ini() -> None:
    ini = ini_of({"gpuclean_timeout": "30", "gpuclean_grace": "2", "gpuclean_settle": "4"})
    env = {"GPUCLEAN_TIMEOUT": "20", "GPUCLEAN_GRACE": "3"}
    resolved = resolve({"gpuclean_timeout": "10"}, env, ini, "/repo/pytest.ini")
    assert (resolved.timeout, resolved.grace, resolved.settle) == (10.0, 3.0, 4.0)
    assert resolved.sources == {"timeout": "from the command line",
                                "grace": "from environment variable GPUCLEAN_GRACE",
                                "settle": "from ini option gpuclean_settle in /repo/pytest.ini"}


def test_an_empty_environment_variable_or_ini_value_counts_as_unset() -> None:
    resolved = resolve({}, {"GPUCLEAN_TOLERANCE_MIB": "", "GPUCLEAN_SCOPE": ""},
                       ini_of({"gpuclean_scope": "host", "gpuclean_tolerance_mib": ""}))
    assert (resolved.tolerance_mib, resolved.scope) == (0, "host")
    assert not resolved.explicit("tolerance_mib") and resolved.explicit("scope")


def test_repeated_and_multi_line_patterns_are_joined() -> None:
    resolved = resolve({"gpuclean_ignore": ["a*, b*", "c*"]}, {}, ini_of({}))
    assert resolved.ignore == ("a*", "b*", "c*")
    from_ini = resolve({}, {}, ini_of({"gpuclean_ignore": ["x*", "y*,z*"]}))
    assert from_ini.ignore == ("x*", "y*", "z*")


@pytest.mark.parametrize(("cli", "env", "message"), [
    ({"gpuclean_timeout": "abc"}, {},
     "--gpuclean-timeout: 'abc' is not a number of seconds (from the command line)"),
    ({}, {"GPUCLEAN_REAP": "maybe"},
     "--gpuclean-reap: 'maybe' is not on or off (nor 1/0, true/false, yes/no) (from environment variable "
     "GPUCLEAN_REAP)"),
    ({"gpuclean_devices": ","}, {}, "--gpuclean-devices: ',' names no device (from the command line)"),
    ({"gpuclean_devices": "0,1,0"}, {},
     "--gpuclean-devices: '0,1,0' lists '0' twice (from the command line)"),
    ({}, {"GPUCLEAN_DEVICES": "GPU-ab,gpu-abc"},
     "--gpuclean-devices: 'GPU-ab,gpu-abc' names one device twice ('GPU-ab' and 'gpu-abc') (from "
     "environment variable GPUCLEAN_DEVICES)"),
    ({}, {"GPUCLEAN_OUTSIDE": "wait"},
     "--gpuclean-outside: 'wait' is not one of fail, skip, stop "
     "(from environment variable GPUCLEAN_OUTSIDE)"),
    ({"gpuclean_all": "sometimes"}, {},
     "--gpuclean-all: 'sometimes' is not on or off (nor 1/0, true/false, yes/no) (from the command line)"),
])
def test_a_bad_value_is_a_usage_error_naming_option_and_source(cli: dict[str, str], env: dict[str, str],
                                                               message: str) -> None:
    with pytest.raises(pytest.UsageError, match="^" + re.escape(message) + "$"):
        resolve(cli, env, ini_of({}))


@pytest.mark.parametrize("where", ["cli", "env", "ini"])
def test_a_tilde_in_a_path_option_is_the_home_directory(where: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # No shell expands ``~`` after ``=`` (``--gpuclean-simulate=~/sim``), in an ini file or a quoted variable.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "sim").mkdir()
    given = {"simulate": "~/sim", "lock_dir": "~/locks", "report": "~/reports/gpuclean.json"}
    cli = {f"gpuclean_{name}": value for name, value in given.items()} if where == "cli" else {}
    env = {f"GPUCLEAN_{name.upper()}": value for name, value in given.items()} if where == "env" else {}
    ini = ini_of({f"gpuclean_{name}": value for name, value in given.items()} if where == "ini" else {})
    resolved = resolve(cli, env, ini)
    assert (resolved.simulate, resolved.lock_dir, resolved.report) == (
        str(tmp_path / "sim"), str(tmp_path / "locks"), str(tmp_path / "reports" / "gpuclean.json"))


def test_a_missing_simulated_directory_names_what_its_tilde_became(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    message = (f"--gpuclean-simulate: '~/nope' ('{tmp_path}/nope') is not an existing directory (from the "
               "command line)")
    with pytest.raises(pytest.UsageError, match="^" + re.escape(message) + "$"):
        resolve({"gpuclean_simulate": "~/nope"}, {}, ini_of({}))


def test_the_command_resolves_a_subset_under_its_own_flag_names() -> None:
    # gpuclean check reads the plugin's variables, and names its own flags in errors.
    names = [option("tolerance_mib"), option("grace")]
    resolved = resolve_options(names, {"gpuclean_grace": "1.5"}, {"GPUCLEAN_TOLERANCE_MIB": "64",
                                                                  "GPUCLEAN_TIMEOUT": "not read"},
                               flag=lambda o: o.command_flag)
    assert (resolved.tolerance_mib, resolved.grace, resolved.timeout) == (64, 1.5, settings.DEFAULT_TIMEOUT_S)
    message = ("--tolerance-mib: '-1' is negative; expected a whole number >= 0 (from environment variable "
               "GPUCLEAN_TOLERANCE_MIB)")
    with pytest.raises(SettingError, match="^" + re.escape(message) + "$"):
        resolve_options(names, {}, {"GPUCLEAN_TOLERANCE_MIB": "-1"}, flag=lambda o: o.command_flag)


def test_every_option_has_its_three_names_and_a_settings_field() -> None:
    assert sorted(o.name for o in OPTIONS) == sorted(settings.SETTINGS_FIELDS)
    grace = option("grace")
    assert (grace.cli, grace.ini, grace.env_var, grace.command_flag) == (
        "--gpuclean-grace", "gpuclean_grace", "GPUCLEAN_GRACE", "--grace")
    with pytest.raises(KeyError, match="nonesuch"):
        option("nonesuch")


def test_the_spelt_out_choices_are_the_models_words() -> None:
    assert get_args(model.Scope) == settings.SCOPES
    assert get_args(model.OnOff) == settings.ON_OFF
    assert get_args(model.OutsideAction) == settings.OUTSIDE_ACTIONS


def test_the_spelt_out_variables_are_the_packages_own() -> None:
    # (settings.py names them without importing the modules that set them: see INTERNAL_VARIABLES)
    assert {cookie.COOKIE_VAR, cookie.OWNER_VAR, cookie.WORKERS_SINCE_VAR, held.HELD_VAR, outside.STATE_VAR,
            pytest_gpuclean._imports._CACHE_ENV} == settings.INTERNAL_VARIABLES


@pytest.mark.parametrize("where", ["cli", "env", "ini"])
def test_the_marker_beats_command_line_environment_and_ini(where: str) -> None:
    # The most specific setting wins, as a test's own timeout marker does in pytest-timeout.
    given = {"tolerance_mib": "100", "timeout": "120"}
    resolved = resolve({f"gpuclean_{k}": v for k, v in given.items()} if where == "cli" else {},
                       {f"GPUCLEAN_{k.upper()}": v for k, v in given.items()} if where == "env" else {},
                       ini_of({f"gpuclean_{k}": v for k, v in given.items()} if where == "ini" else {}))
    applied = for_marker(resolved, {"tolerance_mib": 5, "timeout": 2, "count": 1}, "t.py::test")
    assert (applied.tolerance_mib, applied.timeout, applied.count) == (5, 2.0, 1)
    partly = for_marker(resolved, {"timeout": 2}, "t.py::test")
    assert (partly.tolerance_mib, partly.timeout) == (100, 2.0)
    unset = for_marker(Settings(), {"tolerance_mib": 5}, "t.py::test")
    assert (unset.tolerance_mib, unset.timeout, unset.count) == (5, settings.DEFAULT_TIMEOUT_S, None)
    bare = for_marker(resolved, {}, "t.py::test")  # (the bare marker's shortcut)
    assert (bare.tolerance_mib, bare.timeout, bare.count) == (100, 120.0, None)


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((2,), {}, "needs_clean_gpus(2) on t.py::test: positional arguments are not accepted; use keyword "
               "arguments: tolerance_mib=..., timeout=..., count=..."),
    ((), {"count": 0}, "needs_clean_gpus(count=0) on t.py::test: count must be >= 1"),
    ((), {"timeout": "5"}, "needs_clean_gpus(timeout='5') on t.py::test: not a number"),
    ((), {"tolerence_mib": 1}, "needs_clean_gpus got unknown argument(s) tolerence_mib on t.py::test; known: "
                               "tolerance_mib, timeout, count"),
])
def test_bad_marker_arguments_name_the_test(args: tuple[Any, ...], kwargs: dict[str, Any],
                                            message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        for_marker(Settings(), kwargs, "t.py::test", args)


# ---- paths in the ini file (issue 38, item 6) ------------------------------------------------------------

def test_a_relative_path_in_the_ini_file_is_relative_to_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As pytest's own ``paths`` ini values: the same ini file means the same directories from any directory.
    (tmp_path / "sim").mkdir()
    (tmp_path / "tests").mkdir()
    monkeypatch.chdir(tmp_path / "tests")
    ini = ini_of({"gpuclean_simulate": "sim", "gpuclean_lock_dir": "locks",
                  "gpuclean_report": "reports/gpuclean.json"})
    resolved = resolve({}, {}, ini, str(tmp_path / "pytest.ini"))
    assert (resolved.simulate, resolved.lock_dir, resolved.report) == (
        str(tmp_path / "sim"), str(tmp_path / "locks"), str(tmp_path / "reports" / "gpuclean.json"))
    message = (f"--gpuclean-simulate: 'nope' ('{tmp_path}/nope') is not an existing directory (from ini "
               f"option gpuclean_simulate in {tmp_path}/pytest.ini)")
    with pytest.raises(pytest.UsageError, match="^" + re.escape(message) + "$"):
        resolve({}, {}, ini_of({"gpuclean_simulate": "nope"}), str(tmp_path / "pytest.ini"))


@pytest.mark.parametrize("where", ["cli", "env"])
def test_a_relative_path_elsewhere_is_relative_to_the_current_directory(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tests" / "sim").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "tests")
    given = {"simulate": "sim", "lock_dir": "locks", "report": "gpuclean.json"}
    cli = {f"gpuclean_{name}": value for name, value in given.items()} if where == "cli" else {}
    env = {f"GPUCLEAN_{name.upper()}": value for name, value in given.items()} if where == "env" else {}
    resolved = resolve(cli, env, ini_of({}), str(tmp_path / "pytest.ini"))
    assert (resolved.simulate, resolved.lock_dir, resolved.report) == (
        str(tmp_path / "tests" / "sim"), "locks", "gpuclean.json")


def test_a_session_run_from_a_subdirectory_finds_the_ini_files_paths(
        pytester: pytest.Pytester, sim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.copy_example("settings/ini_paths")  # tox.ini: gpuclean_simulate = sim, ...; tests/test_inner.py
    for index in (0, 1):
        (pytester.path / "sim" / str(index)).mkdir(parents=True)
    monkeypatch.delenv("GPUCLEAN_SIMULATE")
    monkeypatch.delenv("GPUCLEAN_LOCK_DIR")
    monkeypatch.chdir(pytester.path / "tests")
    result = run_inner(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gpuclean: simulated devices *checking 2*"])
    assert (pytester.path / "reports" / "gpuclean.json").is_file()
    assert any((pytester.path / "locks").iterdir())
    assert not (pytester.path / "tests" / "reports").exists()


# ---- the marker beats the session's settings (issue 38, item 7) ------------------------------------------

@pytest.mark.parametrize("where", ["cli", "env", "ini"])
def test_a_markers_timeout_and_tolerance_beat_the_sessions(
        where: str, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
        outside_holder: Callable[..., int]) -> None:
    # A global timeout longer, and a tolerance tighter, than the markers': each test gets its own, as the
    # check reports it (not as a wall clock measures it).
    outside_holder(mib=10)
    pytester.copy_example("settings/marker_beats_global")
    given = {"timeout": "5", "tolerance_mib": "0"}
    args = [f"--gpuclean-{name.replace('_', '-')}={value}" for name, value in given.items()] \
        if where == "cli" else []
    if where == "env":
        for name, value in given.items():
            monkeypatch.setenv(f"GPUCLEAN_{name.upper()}", value)
    ini = "".join(f"gpuclean_{name} = {value}\n" for name, value in given.items()) if where == "ini" else ""
    pytester.makeini("[pytest]\ngpuclean_ignore = *simulate hold*\n" + ini)
    result = run_inner(pytester, *args)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at setup of test_waits_its_own_timeout*",
        "gpuclean: GPUs not clean before the test (waited 0.5s of a 0.5s timeout)",
    ])
    result.stdout.fnmatch_lines(["PASSED test_inner.py::test_within_its_own_tolerance"])


# ---- environment variables (issue 38, item 8) ------------------------------------------------------------

def test_a_misspelt_or_unknown_variable_is_named_with_the_closest_known_one() -> None:
    env = {"GPUCLEAN_TIMOUT": "5", "GPUCLEAN_FOO": "1", "GPUCLEAN_TIMEOUT": "5", "PATH": "/bin",
           "gpuclean_timeout": "5", "GPUCLEAN_REQUIRE_GPU": "1"}
    assert settings.unknown_variables(env) == [
        "environment variable GPUCLEAN_FOO is not gpuclean's: ignored",
        # (the option --gpuclean-no-gpu=fail|skip replaced the switch --gpuclean-require-gpu)
        "environment variable GPUCLEAN_REQUIRE_GPU is not gpuclean's: ignored (did you mean "
        "GPUCLEAN_NO_GPU=fail?)",
        "environment variable GPUCLEAN_TIMOUT is not gpuclean's: ignored (did you mean GPUCLEAN_TIMEOUT?)",
    ]


def test_the_variables_the_package_sets_itself_are_known() -> None:
    # Every GPUCLEAN_ constant of the package (the cookie, its owner, held locks, ...): a session's children
    # inherit them, and an inner session must not warn of its outer session's.
    package = Path(settings.__file__).resolve().parent
    constants = {name for path in package.rglob("*.py")
                 for name in re.findall(r'^[A-Z_]+ = "(GPUCLEAN_[A-Z_]+)"$', path.read_text(), re.M)}
    assert {"GPUCLEAN_TEST", "GPUCLEAN_OWNER", "GPUCLEAN_HELD_LOCKS"} <= constants
    assert settings.unknown_variables(dict.fromkeys(constants, "x")) == []
    assert settings.unknown_variables({o.env_var: "x" for o in OPTIONS}) == []


ON_OFF_OPTIONS = {"reap": ("on", "off"), "dead_sessions": ("on", "off"), "lock": ("on", "off"),
                  "all": (True, False)}


@pytest.mark.parametrize("where", ["cli", "env", "ini"])
@pytest.mark.parametrize(("spelling", "truth"), [
    ("on", True), ("OFF", False), ("1", True), ("0", False), ("true", True), ("False", False), ("YES", True),
    ("no", False)])
def test_every_on_off_option_takes_the_same_spellings(where: str, spelling: str, truth: bool) -> None:
    named = {f"gpuclean_{name}": spelling for name in ON_OFF_OPTIONS}
    resolved = resolve(named if where == "cli" else {},
                       {name.upper(): spelling for name in named} if where == "env" else {},
                       ini_of(named if where == "ini" else {}))
    for name, (yes, no) in ON_OFF_OPTIONS.items():
        assert getattr(resolved, name) == (yes if truth else no), name


def test_every_variable_set_is_checked_even_where_the_command_line_overrides_it() -> None:
    # One rule: a variable set is a variable read, whether or not this run needs it.
    message = ("--gpuclean-timeout: 'abc' is not a number of seconds (from environment variable "
               "GPUCLEAN_TIMEOUT)")
    with pytest.raises(pytest.UsageError, match="^" + re.escape(message) + "$"):
        resolve({"gpuclean_timeout": "3"}, {"GPUCLEAN_TIMEOUT": "abc"}, ini_of({}))


def test_a_session_warns_of_a_misspelt_variable(pytester: pytest.Pytester, sim: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUCLEAN_TIMOUT", "5")
    monkeypatch.setenv("GPUCLEAN_REAP", "0")  # accepted, as GPUCLEAN_ALL=1 is
    pytester.copy_example("test_marked.py")
    result = run_inner(pytester)
    result.assert_outcomes(passed=1, warnings=0)
    # A note in the header, and among the session's notes in the summary (tests/test_messages.py).
    result.stdout.fnmatch_lines([
        "gpuclean: environment variable GPUCLEAN_TIMOUT is not gpuclean's: ignored (did you mean "
        "GPUCLEAN_TIMEOUT?)", "gpuclean: simulated devices*reap off*"])


def gpuclean(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_gpuclean", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


@pytest.mark.parametrize("command", ["status", "check", "reap"])
def test_every_command_warns_of_an_unknown_variable_and_checks_every_known_one(command: str,
                                                                              sim: Path) -> None:
    result = gpuclean(command, "--dry-run" if command == "reap" else "--json",
                      env={"GPUCLEAN_FOO": "1", "GPUCLEAN_TIMOUT": "5", "GPUCLEAN_REAP": "0",
                           "GPUCLEAN_ALL": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"gpuclean {command}: warning: environment variable GPUCLEAN_FOO is not gpuclean's: ignored",
        f"gpuclean {command}: warning: environment variable GPUCLEAN_TIMOUT is not gpuclean's: ignored (did "
        "you mean GPUCLEAN_TIMEOUT?)",
    ]
    # A variable of an option the command has no flag for is named as the flag of the gpuclean command that
    # has it (tests/test_messages.py); one it has, as its own.
    bad = gpuclean(command, env={"GPUCLEAN_GRACE": "abc"})
    assert (bad.returncode, bad.stdout) == (2, "")
    flag = "--grace" if command == "reap" else "--grace (of gpuclean reap)"
    assert bad.stderr == (f"gpuclean {command}: error: {flag}: 'abc' is not a number of seconds (from "
                          "environment variable GPUCLEAN_GRACE)\n")


# ---- markers valid with the plugin off (issue 38, item 9) ------------------------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"


def markers_recipe() -> str:
    """The ini file README.md's Usage section gives for a repository that runs with the plugin off."""
    found = re.search(r"^<!-- markers-recipe -->\n```ini\n(.*?)^```$", README.read_text(encoding="utf-8"),
                      re.M | re.S)
    assert found, "README.md lost its markers recipe"
    return found.group(1)


def test_with_the_plugin_off_the_readmes_markers_line_keeps_strict_markers_passing(
        pytester: pytest.Pytester, sim: Path) -> None:
    pytester.copy_example("settings/markers_with_the_plugin_off")
    off = ("-p", "no:gpuclean", "-p", "no:cacheprovider", "--strict-markers")
    without = pytester.runpytest_subprocess(*off)
    assert without.ret == pytest.ExitCode.INTERRUPTED
    without.stdout.fnmatch_lines(["*'needs_clean_gpus' not found in `markers` configuration option*"])
    pytester.makeini(markers_recipe())
    pytester.runpytest_subprocess(*off, "-W", "error").assert_outcomes(passed=1)
    # The plugin on as well: its marker and the ini file's are one marker, and the test is checked.
    result = run_inner(pytester, "--strict-markers", "-W", "error")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*1 checked test(s)*"])
