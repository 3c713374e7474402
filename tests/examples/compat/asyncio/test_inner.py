import asyncio
import sys

import pytest
from prelude import PIDFILE, SIM, wait_holders


@pytest.mark.asyncio
async def test_awaits_its_child():
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "print('hi')",
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert out.strip() == b"hi"


@pytest.mark.asyncio
async def test_forgets_its_child():
    await asyncio.create_subprocess_exec(sys.executable, "-m", "pytest_gpuclean.simulate", "hold",
                                         "--dir", SIM, "--device", "0", "--mib", "100",
                                         "--pidfile", PIDFILE)
    wait_holders(1)


@pytest.mark.asyncio
async def test_after():
    await asyncio.sleep(0)
