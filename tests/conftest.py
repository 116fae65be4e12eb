"""Session-wide test settings.

The stream cache (oomtune.plan.stream_cache) is off for every test and every process a test starts
(the environment is inherited): a plan or search in one test must capture what it asserts about,
not read what another test left, and nothing is written to the user's ~/.cache. The cache's own
tests (tests/test_stream_cache.py) point OOMTUNE_CACHE_DIR at a temporary directory.

Tests run the experiment scripts (tests/test_gpu_scripts.py) in a checkout that may have uncommitted
changes: OOMTUNE_ALLOW_DIRTY=1 lets experiments/_provenance.py write their header, marked
"(uncommitted changes: yes)"; tests/test_experiments_results.py checks the refusal without it.

``pg``: a throwaway PostgreSQL server per test module that asks for it (tests/pg_server.py: skipped
where the OS package is missing, a failure under CI).
"""

import os

import pytest

os.environ["OOMTUNE_CACHE_DIR"] = "off"
os.environ["OOMTUNE_ALLOW_DIRTY"] = "1"


@pytest.fixture(scope="module")
def pg():
    from pg_server import start_or_skip

    server = start_or_skip()
    yield server
    server.stop()
