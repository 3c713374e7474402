# What the session left behind, written to $STATE_FILE at its end.
import json
import os
import sys

CTYPES_BEFORE = "ctypes" in sys.modules  # (another plugin's, e.g. pytest-isolate's pynvml)

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
                   "cookie": os.environ.get("GPUCLEAN_TEST"),
                   "forked": any(getattr(p, "__name__", None) in ("pytest_forked", "pytest_isolate.plugin")
                                 for p in session.config.pluginmanager.get_plugins()),
                   "plugins": sorted(name for name, _ in session.config.pluginmanager.list_name_plugin()
                                     if name and name.startswith("gpuclean-"))}, f)
