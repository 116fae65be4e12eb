"""The suite's test order under pytest-xdist's worksteal (tests/conftest.py ``share_order``): the
workers' contiguous shares, of the sizes xdist hands out, each start with long files.

By hand: 21 tests over 3 workers are shares of 21 // 3 = 7, 14 // 2 = 7 and 7 (xdist/scheduler/
worksteal.py: ``len(pending) // nodes_remaining`` for each idle node, in order). Files taken longest
first, each to the share with the fewest seconds that has room: f0 (100 s) -> share 0, f1 (90 s) ->
share 1, f4 (50 s, 5 tests) -> share 2, f2 (5 s, 3 tests) -> share 2 has room for 2 of them, its third to
share 1 (90 s < 100 s), f5 (2 s, 6 tests) -> share 1's last 4 places, then share 0's next 2, f3 (1 s, 4
tests) -> share 0's last 4.
"""

from conftest import share_order

SECONDS = {"f0": 100, "f1": 90, "f2": 5, "f3": 1, "f4": 50, "f5": 2}
ITEMS = [f"f{i}::{j}" for i in range(6) for j in range(i + 1)]   # f0 has 1 test, f1 2 ... f5 6


def _file(item: str) -> str:
    return item.split("::")[0]


def test_each_worker_share_starts_with_a_long_file_and_every_test_runs_once():
    out = share_order(ITEMS, _file, SECONDS, 3)
    assert sorted(out) == sorted(ITEMS)
    shares = [out[:7], out[7:14], out[14:]]
    assert [_file(s[0]) for s in shares] == ["f0", "f1", "f4"]
    assert shares[0] == ["f0::0", "f5::4", "f5::5", "f3::0", "f3::1", "f3::2", "f3::3"]
    assert shares[1] == ["f1::0", "f1::1", "f2::2", "f5::0", "f5::1", "f5::2", "f5::3"]
    assert shares[2] == ["f4::0", "f4::1", "f4::2", "f4::3", "f4::4", "f2::0", "f2::1"]


def test_one_worker_runs_the_longest_files_first_each_file_in_its_order():
    out = share_order(ITEMS, _file, SECONDS, 1)
    assert [_file(i) for i in out] == ["f0"] + ["f1"] * 2 + ["f4"] * 5 + ["f2"] * 3 + ["f5"] * 6 + ["f3"] * 4
    assert [i for i in out if _file(i) == "f5"] == [f"f5::{j}" for j in range(6)]
