import os

import pytest


@pytest.mark.needs_clean_gpus
def test_asks_the_server(model_server):
    with open(os.environ["SEEN_PIDS"], "a") as f:
        f.write(f"{model_server}\n")
