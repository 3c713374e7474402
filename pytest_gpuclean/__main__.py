"""``python -m pytest_gpuclean``: the ``gpuclean`` command (for environments without the script)."""

import sys

from pytest_gpuclean._cli import main

if __name__ == "__main__":
    sys.exit(main())
