# The marker is registered here too, so that the plain run (-p no:gpuclean) collects the same tests with
# the same warnings as the run under the plugin (an unknown marker would warn in one run only).
def pytest_configure(config):
    config.addinivalue_line("markers", "needs_clean_gpus: checked by gpuclean (when it is loaded)")
