"""The CI examples of docs/examples/ as a runner meets them: every YAML file loads; the GitHub workflow, the
GitLab pipeline and the Buildkite pipeline are valid against their schemas (vendored in tests/data/ci-schemas,
see its README); none installs pytest-gpuclean from a package index (none serves it); and the runner hooks,
run with bash against simulated devices as an unprivileged runner user, gate, take the runner out of service
through exactly the sudo command docs/ci.md's sudoers rule allows, and reap after the job. ``sudo``,
``systemctl`` and ``logger`` are fakes on PATH that record how they were called."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]
from helpers import NOBODY_UID, alive, clean_environment, wait_dead

from pytest_gpuclean import simulate

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
SCHEMAS = Path(__file__).resolve().parent / "data" / "ci-schemas"
CI_DOC = ROOT / "docs" / "ci.md"
WHEEL_DIR = "/opt/gpuclean/dist"
"""Where docs/ci.md's install builds the wheel that the examples' jobs install."""


def load_yaml(path: Path) -> Any:
    document = yaml.safe_load(path.read_text())
    # YAML 1.1 reads a bare `on:` key as the boolean true; GitHub reads it as "on".
    if isinstance(document, dict) and True in document:
        document["on"] = document.pop(True)
    return document


YAML_FILES = sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".yml", ".yaml"))


def test_the_examples_include_github_buildkite_and_gitlab() -> None:
    assert {str(p.relative_to(EXAMPLES)) for p in YAML_FILES} >= {
        "github/gpu-tests.yml", "buildkite/pipeline.yml", "gitlab/.gitlab-ci.yml"}


@pytest.mark.parametrize("path", YAML_FILES, ids=[str(p.relative_to(EXAMPLES)) for p in YAML_FILES])
def test_every_yaml_example_loads(path: Path) -> None:
    assert isinstance(load_yaml(path), dict)


def _break_github(document: dict[str, Any]) -> None:
    del document["jobs"]["gpu"]["runs-on"]  # where the job runs: every job needs it


def _break_gitlab(document: dict[str, Any]) -> None:
    document["gpu-tests"]["when"] = "sometimes"  # not one of on_success, on_failure, always, manual, ...


def _break_buildkite(document: dict[str, Any]) -> None:
    document["steps"][0]["artifact_paths"] = {"reports": True}  # a glob or a list of them


SCHEMA_OF = [("github/gpu-tests.yml", "github-workflows.json", _break_github),
             ("gitlab/.gitlab-ci.yml", "gitlab-ci.json", _break_gitlab),
             ("buildkite/pipeline.yml", "buildkite.json", _break_buildkite)]


@pytest.mark.parametrize(("example", "schema", "break_it"), SCHEMA_OF, ids=[s[0] for s in SCHEMA_OF])
def test_the_pipelines_are_valid_against_their_schemas(example: str, schema: str,
                                                       break_it: Callable[[dict[str, Any]], None]) -> None:
    validator = jsonschema.Draft7Validator(yaml.safe_load((SCHEMAS / schema).read_text()))
    document = load_yaml(EXAMPLES / example)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]
    assert errors == []
    # The schema bites: the same document with one mistake is refused.
    break_it(document)
    assert not validator.is_valid(document)


def test_no_example_installs_pytest_gpuclean_from_a_package_index() -> None:
    # No index serves it: the jobs install the wheel docs/ci.md builds on the runner.
    installs = []
    for path in sorted(p for p in EXAMPLES.rglob("*") if p.is_file()):
        for line in path.read_text().splitlines():
            if "pip install" in line and not line.lstrip().startswith("#"):
                installs.append((path.relative_to(EXAMPLES), line))
    assert len(installs) >= 3  # GitHub, Buildkite, GitLab
    for where, line in installs:
        words = shlex.split(line.split("pip install", 1)[1], comments=True)
        by_name = [w for w in words if re.fullmatch(r"pytest[-_]gpuclean([<>=!~\[;@ ].*)?", w)]
        assert not by_name, (where, line)
        assert f"{WHEEL_DIR}/pytest_gpuclean-*.whl" in words, (where, line)
    assert f"--wheel-dir {WHEEL_DIR} " in CI_DOC.read_text()


def _strings(document: Any) -> Iterator[str]:
    if isinstance(document, str):
        yield document
    elif isinstance(document, dict):
        for value in document.values():
            yield from _strings(value)
    elif isinstance(document, list):
        for value in document:
            yield from _strings(value)


def pytest_command(example: str) -> list[str]:
    """The pipeline's pytest command line, as the job's shell splits it."""
    lines = [line for text in _strings(load_yaml(EXAMPLES / example))
             for line in text.replace("\\\n", " ").splitlines() if "-m pytest -p gpuclean" in line]
    assert len(lines) == 1, lines
    words = shlex.split(lines[0])
    return words[words.index("pytest"):]


@pytest.mark.parametrize("example", [s[0] for s in SCHEMA_OF])
def test_each_pipeline_fails_its_gpu_tests_where_the_runner_has_no_gpu(
        example: str, pytester: pytest.Pytester, sim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A job that lost its GPUs (a container started without them, a broken driver) must not skip its GPU
    # tests to a green run. Each pipeline says so itself (--gpuclean-no-gpu=fail), not only through the CI
    # variable its service sets: its pytest's gpuclean options, run where no GPU is selected and CI is unset.
    command = pytest_command(example)
    assert "--gpuclean-no-gpu=fail" in command, command
    options = [word for word in command if word.startswith("--gpuclean-")]
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the runner's GPUs: none
    (pytester.path / "reports").mkdir()
    pytester.copy_example("test_marked.py")
    result = pytester.runpytest_subprocess("-p", "gpuclean", "-p", "no:cacheprovider", *options, timeout=120)
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*gpuclean: no GPU to check: none of the 2 simulated device(s) is selected*"
                                 "(--gpuclean-no-gpu=fail, from the command line)"])


# ---- the hooks, run ----------------------------------------------------------------------------------

@functools.cache
def runner_user() -> tuple[tuple[str, ...], str, str]:
    """How the hooks run as an unprivileged runner user: setpriv's prefix that makes a root test user nobody,
    a Python that nobody's shell can start with gpuclean and psutil, and the PYTHONPATH that gives it them.
    This venv's interpreter may live under root's home (mode 700), where nobody cannot start it from a shell:
    then the system's Python of the same version, with this checkout's package and this venv's psutil. Where
    neither works (or no setpriv), the hooks run as this user, with this Python; they write nowhere either
    way, and the fake sudo records what they ask for."""
    import psutil

    path = os.pathsep.join(dict.fromkeys([str(Path(simulate.__file__).resolve().parents[1]),
                                          str(Path(psutil.__file__).resolve().parents[1]),
                                          *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and setpriv is not None:
        prefix = (setpriv, f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups")
        for python in (sys.executable, f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
            start = f'exec "{python}" -c "import pytest_gpuclean._cli, psutil"'
            probe = subprocess.run([*prefix, "/bin/sh", "-c", start], env={**os.environ, "PYTHONPATH": path},
                                   cwd="/", capture_output=True, timeout=60)
            if probe.returncode == 0:
                return prefix, python, path
    return (), sys.executable, path


@dataclass
class Runner:
    """A runner's box: simulated GPUs, the hooks' gpuclean, fake sudo/systemctl/logger, and what they
    recorded."""

    sim: Path
    env: dict[str, str]
    calls_file: Path
    public: Path

    def run(self, command: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
        """``command`` (a hook) as the runner's user (``runner_user``)."""
        return subprocess.run([*runner_user()[0], *command], cwd=self.public, env={**self.env, **extra},
                              capture_output=True, text=True, timeout=180)

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []

    def start_leftover(self, cookie: str) -> subprocess.Popen[bytes]:
        """A process of the runner's user that a job left behind, carrying the job's cookie, holding no GPU;
        returned once /proc shows it as ``sleep`` with its environment (setpriv execs it)."""
        proc = subprocess.Popen([*runner_user()[0], "sleep", "600"],
                                env={**self.env, "GPUCLEAN_TEST": cookie}, cwd=self.public)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if (Path(f"/proc/{proc.pid}/cmdline").read_bytes() == b"sleep\x00600\x00"
                        and b"GPUCLEAN_TEST=" in Path(f"/proc/{proc.pid}/environ").read_bytes()):
                    return proc
            time.sleep(0.01)
        proc.kill()
        proc.wait()
        raise AssertionError("the leftover did not start")


FAKE = {
    "sudo": '#!/bin/sh\necho "sudo $*" >> "$CALLS"\n'
            'if [ -n "${FAKE_SUDO_REFUSES:-}" ]; then echo "sudo: a password is required" >&2; exit 1; fi\n'
            '[ "$1" = -n ] && shift\nexec "$@"\n',
    "systemctl": '#!/bin/sh\necho "systemctl $*" >> "$CALLS"\n',
    "logger": '#!/bin/sh\necho "logger $*" >> "$CALLS"\n',
}


@pytest.fixture
def runner(public_tmp: Path) -> Iterator[Runner]:
    sim = public_tmp / "sim"
    simulate.init(str(sim), 2, 1024)
    bindir = public_tmp / "bin"
    bindir.mkdir()
    _prefix, python, pythonpath = runner_user()
    wrapper = f'#!/bin/sh\nexec "{python}" -m pytest_gpuclean "$@"\n'
    for name, text in {**FAKE, "gpuclean": wrapper}.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    records = public_tmp / "records"
    records.mkdir()
    records.chmod(0o777)  # the runner's user writes there
    github_env = records / "github_env"
    github_env.touch()
    github_env.chmod(0o666)
    env = clean_environment(PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
                            GPUCLEAN=str(bindir / "gpuclean"), GPUCLEAN_SIMULATE=str(sim),
                            CALLS=str(records / "calls"), GITHUB_ENV=str(github_env), HOME=str(public_tmp),
                            PYTHONPATH=pythonpath)
    yield Runner(sim, env, records / "calls", public_tmp)


def runner_env_value(name: str) -> str:
    """A variable as the example runner.env sets it (what the runner's .env gets)."""
    for line in (EXAMPLES / "github" / "runner.env").read_text().splitlines():
        if line.startswith(f"{name}="):
            return line.split("=", 1)[1]
    raise AssertionError(f"runner.env sets no {name}")


def gitlab_script(name: str) -> str:
    """config.toml's ``name`` script, with the hooks where this checkout has them."""
    tomllib = pytest.importorskip("tomllib")
    [entry] = tomllib.loads((EXAMPLES / "gitlab" / "config.toml").read_text())["runners"]
    return str(entry[name]).replace("/opt/gpuclean/gitlab/", f"{EXAMPLES / 'gitlab'}/")


@dataclass(frozen=True)
class Gate:
    name: str
    command: Callable[[], list[str]]
    env: dict[str, str]
    unit: Callable[[], str]
    """The systemd unit it stops, as its example configuration names it."""


GATES = [
    Gate("github", lambda: ["bash", str(EXAMPLES / "github" / "job-started.sh")],
         {"RUNNER_NAME": "gpu-runner-1", "GITHUB_RUN_ID": "5", "GITHUB_RUN_ATTEMPT": "1"},
         lambda: runner_env_value("GPUCLEAN_RUNNER_UNIT")),
    Gate("buildkite", lambda: ["bash", str(EXAMPLES / "buildkite" / "hooks" / "pre-command")],
         {"BUILDKITE_AGENT_NAME": "agent-1"}, lambda: "buildkite-agent.service"),
    # As the runner runs it: in the job's shell, with the runner's `set -eo pipefail`; the job's script
    # then sees what it exported.
    Gate("gitlab", lambda: ["bash", "-c", "set -eo pipefail\n" + gitlab_script("pre_build_script")
                            + 'echo "job script sees GPUCLEAN_TEST=$GPUCLEAN_TEST"'],
         {"CI_JOB_ID": "77", "CI_RUNNER_DESCRIPTION": "gpu-runner-1"}, lambda: "gitlab-runner.service"),
]


def gate_env(gate: Gate) -> dict[str, str]:
    env = dict(gate.env)
    if gate.name == "github":
        env["GPUCLEAN_RUNNER_UNIT"] = gate.unit()  # from the runner's .env
    return env


@pytest.mark.parametrize("gate", GATES, ids=[g.name for g in GATES])
def test_the_gate_passes_clean_gpus_and_tags_the_job(runner: Runner, gate: Gate) -> None:
    result = runner.run(gate.command(), **gate_env(gate))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gpuclean check: clean (2 device(s)" in result.stdout
    assert runner.calls() == []
    if gate.name == "github":
        assert Path(runner.env["GITHUB_ENV"]).read_text() == "GPUCLEAN_TEST=gha-gpu-runner-1-5-1:job\n"
    if gate.name == "gitlab":
        assert "job script sees GPUCLEAN_TEST=gitlab-77:job" in result.stdout


def sudoers_rule(unit: str) -> list[str]:
    """The systemctl arguments docs/ci.md's sudoers rule allows for ``unit``."""
    rules = re.findall(r"^\S+ ALL=\(root\) NOPASSWD: (/\S*/systemctl) (.+)$", CI_DOC.read_text(), re.M)
    allowed = [args.split() for _path, args in rules if args.split()[-1] == unit]
    assert len(allowed) == 1, f"docs/ci.md has no single sudoers rule for {unit}: {rules}"
    return allowed[0]


@pytest.mark.parametrize("gate", GATES, ids=[g.name for g in GATES])
def test_the_gate_takes_the_runner_out_of_service_for_a_gpu_that_needs_a_reset(runner: Runner,
                                                                                gate: Gate) -> None:
    # As the runner's user, who may not write where gpuclean is installed (root's /opt/gpuclean): the
    # GitHub hook used to `touch` a marker there, and `set -e` ended it before the runner was stopped.
    simulate.set_state(str(runner.sim), 1, "remap_pending", "1")
    unit = gate.unit()
    result = runner.run(gate.command(), **gate_env(gate))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gpuclean check: NOT USABLE: 1 GPU(s) need a reset or are lost" in result.stdout
    assert "out of service" in result.stdout
    calls = runner.calls()
    assert [c for c in calls if not c.startswith("logger ")] == [
        f"sudo -n systemctl stop --no-block {unit}", f"systemctl stop --no-block {unit}"]
    assert [c for c in calls if c.startswith("logger -t gpuclean ")]  # the journal says why
    # Exactly what the documented sudoers rule lets the runner's user run.
    assert calls[-1].split()[1:] == sudoers_rule(unit)
    if gate.name == "gitlab":
        assert "job script sees" not in result.stdout  # the job's script never ran


@pytest.mark.parametrize("gate", GATES, ids=[g.name for g in GATES])
def test_the_gate_fails_the_job_but_keeps_the_runner_when_the_gpus_are_not_clean(runner: Runner,
                                                                                 gate: Gate) -> None:
    # Any other failure of the check (here a bad setting: exit 2) fails the job and keeps the runner.
    result = runner.run(gate.command(), **gate_env(gate), GPUCLEAN_TOLERANCE_MIB="lots")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "gpuclean check: error: --tolerance-mib: 'lots' is not a whole number" in result.stderr
    assert "exit 2" in result.stdout
    assert runner.calls() == []


@pytest.mark.parametrize("gate", GATES, ids=[g.name for g in GATES])
def test_a_refused_sudo_still_fails_the_job_and_says_why(runner: Runner, gate: Gate) -> None:
    simulate.set_state(str(runner.sim), 0, "lost", "fell off the bus")
    result = runner.run(gate.command(), **gate_env(gate), FAKE_SUDO_REFUSES="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"sudo -n systemctl stop --no-block {gate.unit()} failed; see the sudoers rule in docs/ci.md" in (
        result.stdout)


def test_the_github_gate_says_when_it_does_not_know_the_runners_unit(runner: Runner) -> None:
    gate = GATES[0]
    simulate.set_state(str(runner.sim), 0, "lost", "fell off the bus")
    result = runner.run(gate.command(), **gate.env)  # no GPUCLEAN_RUNNER_UNIT
    assert result.returncode == 1, result.stdout + result.stderr
    assert "GPUCLEAN_RUNNER_UNIT is not set in the runner's .env; stop the runner by hand" in result.stdout
    assert [c for c in runner.calls() if not c.startswith("logger ")] == []


REAPERS = [
    ("github", lambda: ["bash", str(EXAMPLES / "github" / "job-completed.sh")],
     {"RUNNER_NAME": "gpu-runner-1", "GITHUB_RUN_ID": "5", "GITHUB_RUN_ATTEMPT": "1"},
     "gha-gpu-runner-1-5-1:job"),
    ("buildkite", lambda: ["bash", str(EXAMPLES / "buildkite" / "hooks" / "pre-exit")],
     {"BUILDKITE_JOB_ID": "0190-ab"}, "buildkite-0190-ab:job"),
    ("gitlab-post_build_script",
     lambda: ["bash", "-c", "set -eo pipefail\n" + gitlab_script("post_build_script")],
     {"CI_JOB_ID": "77"}, "gitlab-77:job"),
    # (another job id than the case above: under xdist the two run side by side, and each reaps its job's)
    ("gitlab-after_script", lambda: ["bash", "-c", "\n".join(
        load_yaml(EXAMPLES / "gitlab" / ".gitlab-ci.yml")["gpu-tests"]["after_script"]).replace(
        "/opt/gpuclean/gitlab/", f"{EXAMPLES / 'gitlab'}/")], {"CI_JOB_ID": "78"}, "gitlab-78:job"),
]


@pytest.mark.parametrize(("name", "command", "env", "cookie"), REAPERS, ids=[r[0] for r in REAPERS])
def test_the_post_job_hook_ends_what_carries_the_jobs_cookie(
        runner: Runner, name: str, command: Callable[[], list[str]], env: dict[str, str],
        cookie: str) -> None:
    leftover = runner.start_leftover(cookie)
    other_job = runner.start_leftover(cookie.replace(":job", "0:job"))  # job 50 vs job 5: not this one's
    try:
        result = runner.run(command(), **env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"pid {leftover.pid} ended by SIGTERM" in result.stdout
        assert wait_dead([leftover.pid]) == []
        assert alive(other_job.pid)
    finally:
        for proc in (leftover, other_job):
            proc.kill()
            proc.wait()


def test_the_buildkite_environment_hook_gives_the_job_its_cookie(runner: Runner) -> None:
    hook = EXAMPLES / "buildkite" / "hooks" / "environment"
    result = runner.run(["bash", "-c", f'. "{hook}"; echo "$GPUCLEAN_TEST"'], BUILDKITE_JOB_ID="0190-ab")
    assert (result.returncode, result.stdout) == (0, "buildkite-0190-ab:job\n")
