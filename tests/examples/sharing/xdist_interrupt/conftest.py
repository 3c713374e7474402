import os


def pytest_runtest_logreport(report):
    # In the controller: the leaking test's last report has arrived from its worker.
    controller = "PYTEST_XDIST_WORKER" not in os.environ
    if controller and report.when == "teardown" and report.nodeid.endswith("test_leaks"):
        open(os.environ["SEEN"], "w").close()
