"""The pytest integration below ``plugin.py``: the started session, each test's check, gpuclean's own hook
specs (how an extension, the Ray cluster's checks, takes part), the report outputs. (Empty: importing a layer
loads none of its modules.)"""

