
import pytest
from prelude import hold, wait_holders

SERVER = hold(mib=8)  # started by the collection (module import): a child of pytest
wait_holders(2)


@pytest.fixture(scope="session")
def service():
    proc = hold(mib=4)
    wait_holders(3)
    yield proc
    proc.terminate()
    proc.wait(10)


def test_unchecked():
    pass


@pytest.mark.needs_clean_gpus
def test_checked(service):
    pass


@pytest.mark.needs_clean_gpus
def test_checked_again(service):
    pass
