# What the session left behind, written to $STATE_FILE at its end.
import json
import os
import sys

import pytest

# Mark the package's modules for assertion rewriting, as pytest does at start for a distribution installed
# from a wheel: an editable install lists no module of it, so pytest would rewrite nothing and the test could
# not see whether the package's own imports go around the rewriting (pytest_gpuclean/__init__.py). Only
# modules not imported yet (marking one already imported is a warning), found from the files, importing none.
_package = os.path.dirname(sys.modules["pytest_gpuclean"].__file__)
_names = []
for _dir, _, _files in os.walk(_package):
    _rel = os.path.relpath(_dir, _package)
    _prefix = ".".join(["pytest_gpuclean"] + ([] if _rel == "." else _rel.split(os.sep)))
    _names += [_prefix if f == "__init__.py" else f"{_prefix}.{f[:-3]}" for f in _files if f.endswith(".py")]
pytest.register_assert_rewrite(*(n for n in _names if n not in sys.modules))

CTYPES_BEFORE = "ctypes" in sys.modules  # (another plugin's, e.g. pytest-isolate's pynvml)


def _loader(module):
    return type(getattr(sys.modules[module], "__loader__", None)).__name__


def pytest_sessionfinish(session):
    modules = sorted(m for m in sys.modules if m.split(".")[0] in ("psutil", "pynvml")
                     or m.startswith("pytest_gpuclean."))
    ctypes_loaded = "ctypes" in sys.modules and not CTYPES_BEFORE  # before this probe loads it itself
    import ctypes
    subreaper = ctypes.c_int(-1)
    ctypes.CDLL(None, use_errno=True).prctl(37, ctypes.byref(subreaper), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
    with open(os.environ["STATE_FILE"], "w") as f:
        json.dump({"subreaper": subreaper.value,
                   "modules": modules,
                   "ctypes_loaded": ctypes_loaded,
                   "rewritten": sorted(m for m in sys.modules if m.split(".")[0] == "pytest_gpuclean"
                                       and _loader(m) == "AssertionRewritingHook"),
                   "conftest_rewritten": _loader(__name__),
                   "cookie": os.environ.get("GPUCLEAN_TEST"),
                   "forked": any(getattr(p, "__name__", None) in ("pytest_forked", "pytest_isolate.plugin")
                                 for p in session.config.pluginmanager.get_plugins()),
                   "plugins": sorted(name for name, _ in session.config.pluginmanager.list_name_plugin()
                                     if name and name.startswith("gpuclean-"))}, f)
