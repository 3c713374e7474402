def pytest_runtest_logreport(report):
    if report.when == "teardown":
        print("PROPS", report.nodeid.split("::")[-1], sorted(name for name, _ in report.user_properties))
