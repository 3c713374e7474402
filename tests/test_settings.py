"""Option resolution, in-process: CLI > environment > ini > marker > default, and the source of each value."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import pytest

from pytest_gpuclean.core import settings
from pytest_gpuclean.core.settings import (
    OPTIONS,
    SettingError,
    Settings,
    for_marker,
    option,
    resolve,
    resolve_options,
)
from pytest_gpuclean.model import records as model


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
     "--gpuclean-reap: 'maybe' is not one of on, off (from environment variable GPUCLEAN_REAP)"),
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
     "--gpuclean-all: 'sometimes' is not a boolean (use true/false, 1/0, yes/no) (from the command line)"),
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


def test_the_marker_applies_below_command_line_environment_and_ini() -> None:
    from_ini = resolve({}, {}, ini_of({"gpuclean_tolerance_mib": "100"}))
    applied = for_marker(from_ini, {"tolerance_mib": 5, "timeout": 2, "count": 1}, "t.py::test")
    assert (applied.tolerance_mib, applied.timeout, applied.count) == (100, 2.0, 1)
    unset = for_marker(Settings(), {"tolerance_mib": 5}, "t.py::test")
    assert (unset.tolerance_mib, unset.timeout, unset.count) == (5, settings.DEFAULT_TIMEOUT_S, None)
    bare = for_marker(resolve({}, {}, ini_of({"gpuclean_tolerance_mib": "100", "gpuclean_timeout": "7"})),
                      {}, "t.py::test")  # (the bare marker's shortcut)
    assert (bare.tolerance_mib, bare.timeout, bare.count) == (100, 7.0, None)


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
