def pytest_sessionfinish(session):
    raise RuntimeError("conftest broke at session end")
