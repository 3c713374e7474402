
import shutil

import pytest


@pytest.mark.needs_clean_gpus
def test_removes_the_report_directory():
    shutil.rmtree("out")
