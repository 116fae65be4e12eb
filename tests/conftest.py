"""Session-wide test settings.

The stream cache (oomtune.plan.stream_cache) is off for every test and every process a test starts
(the environment is inherited): a plan or search in one test must capture what it asserts about,
not read what another test left, and nothing is written to the user's ~/.cache. The cache's own
tests (tests/test_stream_cache.py) point OOMTUNE_CACHE_DIR at a temporary directory.
"""

import os

os.environ["OOMTUNE_CACHE_DIR"] = "off"
