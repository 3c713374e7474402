"""pytest plugin (``-p gpuclean_mark_all``): mark every collected test ``needs_clean_gpus``.

What a user of a peer suite would do in a conftest to have gpuclean check the whole suite through its
marker (rather than ``--gpuclean-all``); kept outside the peer suite, which runs unmodified.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.needs_clean_gpus)
