import os

import pytest
import torch
from torch._inductor.async_compile import AsyncCompile


@pytest.mark.needs_clean_gpus
def test_first_compile_starts_the_pool():
    # What torch.compile does at its first Triton compile (``maybe_warm_pool``); a CPU build without Triton
    # compiles in threads, so the pool is started here the way torch starts it on a GPU box.
    AsyncCompile.warm_pool()
    AsyncCompile.wakeup()
    pool = AsyncCompile.process_pool()
    with open(os.environ["POOL_PIDFILE"], "w") as f:
        f.write(f"{pool.process.pid}\n")
    assert pool.submit(os.getpid).result(timeout=120) != os.getpid()
    assert torch.compile(lambda x: x * 2 + 1)(torch.ones(2)).tolist() == [3.0, 3.0]


@pytest.mark.needs_clean_gpus
def test_a_later_compile_still_has_its_pool():
    pool = AsyncCompile.process_pool()
    assert pool.submit(os.getpid).result(timeout=120) != os.getpid()
    assert torch.compile(lambda x: x - 1)(torch.ones(2)).tolist() == [0.0, 0.0]
