import pytest

# Before helper.py is imported: its asserts are rewritten, with and without gpuclean's import finder.
pytest.register_assert_rewrite("helper")


# Registered here too, so that the plain run (-p no:gpuclean) collects the same tests with the same
# warnings as the run under the plugin.
def pytest_configure(config):
    config.addinivalue_line("markers", "needs_clean_gpus: checked by gpuclean (when it is loaded)")
