"""The `lab` fixture of the stand-in tests; the harness itself is in harness.py."""

import pytest
from harness import Lab


@pytest.fixture
def lab(tmp_path):
    """A private lab under tmp_path; every process it started is killed and reaped afterwards."""
    lab = Lab(tmp_path)
    yield lab
    lab.close()
