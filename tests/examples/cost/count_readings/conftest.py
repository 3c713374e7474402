# How many device readings the session still holds at its end, written to $STATE_FILE.
import gc
import json
import os


def pytest_unconfigure(config):
    from pytest_gpuclean._model.records import DeviceSnapshot, DeviceState
    alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, (DeviceSnapshot, DeviceState))]
    with open(os.environ["STATE_FILE"], "w") as f:
        json.dump({name: alive.count(name) for name in ("DeviceSnapshot", "DeviceState")}, f)
