"""The plugin's bytecode cache: where Python writes no bytecode (``PYTHONDONTWRITEBYTECODE=1``), what the
plugin imports itself (its own modules, pynvml) is compiled once and kept in a directory of the user's own
(``pytest_gpuclean/_imports.py``, ``_CachedBytecode``). Each case runs a fresh interpreter."""

from __future__ import annotations

import importlib.util
import marshal
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

IMPORT = """
import pytest_gpuclean
module = pytest_gpuclean._imports.import_cached("gc_probe")
print(module.VALUE, type(module.__spec__.loader).__name__)
"""


def run(code: str, tmp_path: Path, *, flag: bool = True, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCLEAN_", "PYTHONDONTWRITE"))}
    env.update({"PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), str(REPO)]),
                "XDG_CACHE_HOME": str(tmp_path / "cache"), **extra})
    if flag:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def cached_files(tmp_path: Path, name: str = "*") -> list[Path]:
    return sorted((tmp_path / "cache").glob(f"pytest-gpuclean/bytecode/*/*-{name}.pyc"))


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    source = tmp_path / "src" / "gc_probe.py"
    source.parent.mkdir()
    source.write_text("VALUE = 'from source'\n")
    return source


def test_compiled_once_then_loaded_from_the_cache(probe: Path, tmp_path: Path) -> None:
    assert run(IMPORT, tmp_path) == "from source _CachedBytecode"
    [cached] = cached_files(tmp_path, "gc_probe")  # (importing the package caches its own _version too)
    assert not (probe.parent / "__pycache__").exists()  # nothing written beside the source
    assert cached.parent.stat().st_mode & 0o777 == 0o700
    # The next run loads the cached code, not the source: a cache whose code says otherwise is believed.
    data = cached.read_bytes()
    cached.write_bytes(data[:16] + marshal.dumps(compile("VALUE = 'from the cache'\n", str(probe), "exec")))
    assert run(IMPORT, tmp_path) == "from the cache _CachedBytecode"


def test_a_changed_source_is_compiled_again(probe: Path, tmp_path: Path) -> None:
    run(IMPORT, tmp_path)
    probe.write_text("VALUE = 'changed source'\n")  # another size (and mtime)
    assert run(IMPORT, tmp_path) == "changed source _CachedBytecode"
    [cached] = cached_files(tmp_path, "gc_probe")
    assert marshal.loads(cached.read_bytes()[16:]).co_consts[0] == "changed source"


@pytest.mark.parametrize("case", ["python writes bytecode", "python's own bytecode exists", "turned off",
                                  "others may write the cache", "a user import"])
def test_no_cache_where_it_is_not_needed_or_not_safe(case: str, probe: Path, tmp_path: Path) -> None:
    extra: dict[str, str] = {}
    flag = case != "python writes bytecode"
    code = IMPORT
    if case == "python's own bytecode exists":
        compiled = importlib.util.cache_from_source(str(probe))
        os.makedirs(os.path.dirname(compiled))
        subprocess.run([sys.executable, "-m", "py_compile", str(probe)], check=True)
        assert os.path.exists(compiled)
    elif case == "turned off":
        extra["GPUCLEAN_BYTECODE_CACHE"] = "off"
    elif case == "others may write the cache":
        shared = tmp_path / "cache" / "pytest-gpuclean" / "bytecode" / sys.implementation.cache_tag
        shared.mkdir(parents=True)
        shared.chmod(0o777)
    elif case == "a user import":
        # Only the plugin's own imports go through the cache: the finder answers for nothing else.
        code = ("import pytest_gpuclean, gc_probe\n"
                "print(gc_probe.VALUE, type(gc_probe.__spec__.loader).__name__)")
    out = run(code, tmp_path, flag=flag, **extra)
    assert out.startswith("from source ") and not out.endswith("_CachedBytecode"), out
    assert cached_files(tmp_path) == []


def test_the_plugins_own_modules_are_cached(tmp_path: Path) -> None:
    # A copy of the package without bytecode, as an editable install on a GPU image runs it.
    tree = tmp_path / "src"
    shutil.copytree(REPO / "pytest_gpuclean", tree / "pytest_gpuclean",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # (an editable install's finder would find the checkout's package first: out of the way)
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path\n"
            "                   if 'editable' not in getattr(f, '__module__', '')]\n"
            "import pytest_gpuclean._check.checker as m\n"
            "print(m.__file__, type(m.__spec__.loader).__name__)")
    out = run(code, tmp_path)
    assert out == f"{tree / 'pytest_gpuclean/_check/checker.py'} _CachedBytecode", out
    names = {p.name.split("-", 2)[2] for p in cached_files(tmp_path)}
    assert {"checker.pyc", "census.pyc", "records.pyc"} <= names, names
    assert not list(tree.rglob("__pycache__"))
