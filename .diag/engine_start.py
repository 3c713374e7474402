"""Time one offline engine start of the example suite's tiny model, and one extraction (exploration)."""
import os, sys, time, tempfile
from pathlib import Path
t0 = time.perf_counter()
sys.path.insert(0, os.getcwd())
from example_suite.tiny_model import build_tiny_llama
from example_suite.settings import EngineSettings, ALL_LAYERS
model = build_tiny_llama(Path(tempfile.mkdtemp()) / "m")
t1 = time.perf_counter()
from example_suite.offline import OfflineExtractor
import vllm  # noqa
t2 = time.perf_counter()
if __name__ == "__main__":
    extra = dict(a.split("=", 1) for a in sys.argv[1:])
    extra = {k: (int(v) if v.isdigit() else (v == "True" if v in ("True", "False") else v)) for k, v in extra.items()}
    with OfflineExtractor(model, layer_ids=ALL_LAYERS, **EngineSettings("cuda").offline(**extra)) as ex:
        t3 = time.perf_counter()
        ex.extract([[1, 17, 42, 99, 5]], Path(tempfile.mkdtemp()))
        t4 = time.perf_counter()
    t5 = time.perf_counter()
    print(f"TIMES model {t1-t0:.1f}s import-vllm {t2-t1:.1f}s engine-start {t3-t2:.1f}s extract {t4-t3:.1f}s close {t5-t4:.1f}s extra={extra}", flush=True)
