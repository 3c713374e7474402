import sys
import tempfile

# Every candidate of the temporary directory unusable (a full or read-only /tmp): only what needs it fails.
tempfile._candidate_tempdir_list = lambda: ["/nonexistent/gpuclean-test"]
import pytest  # noqa: E402 (after the patch: pytest must find no temporary directory)

sys.exit(pytest.main(sys.argv[1:]))
