"""Evidence of the OOM killer for a SIGKILL: cgroup counters and the kernel log,
read from fake /proc and /sys trees written here (formats: Documentation/admin-guide/cgroup-v2.rst
memory.events, cgroup-v1/memory.rst memory.oom_control, Documentation/ABI/testing/dev-kmsg)."""

from __future__ import annotations

from pathlib import Path

from oomtune.trial.oomkill import OomKillWatch, kernel_log_kills, read_oom_kill_counters


def _tree(root: Path, *, v2_count: int | None = None, v1_count: int | None = None) -> Path:
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    mounts, cgroups = [], []
    if v2_count is not None:
        mounts.append(f"30 25 0:26 / {root}/sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw")
        cgroups.append("0::/user.slice/job")
        events = root / "sys/fs/cgroup/unified/user.slice/job/memory.events"
        events.parent.mkdir(parents=True)
        events.write_text(f"low 0\nhigh 0\nmax 2\noom 1\noom_kill {v2_count}\noom_group_kill 0\n")
    if v1_count is not None:
        mounts.append(f"33 25 0:29 / {root}/sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory")
        cgroups.append("4:memory:/process_api/abc")
        ctl = root / "sys/fs/cgroup/memory/process_api/abc/memory.oom_control"
        ctl.parent.mkdir(parents=True)
        ctl.write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {v1_count}\n")
    (proc / "self" / "mountinfo").write_text("\n".join(mounts) + "\n")
    (proc / "self" / "cgroup").write_text("\n".join(cgroups) + "\n")
    return proc


def test_counters_of_cgroup_v2_and_v1(tmp_path):
    proc = _tree(tmp_path, v2_count=5, v1_count=2)
    found = read_oom_kill_counters(proc=proc)
    assert sorted(found.values()) == [2, 5]
    assert any(k.endswith("user.slice/job/memory.events") for k in found)
    assert any(k.endswith("process_api/abc/memory.oom_control") for k in found)
    assert read_oom_kill_counters(proc=tmp_path / "missing") == {}


def test_a_grown_counter_is_evidence_an_unchanged_one_is_not(tmp_path):
    proc = _tree(tmp_path, v2_count=0)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    watch = OomKillWatch(proc=proc, kmsg=kmsg)
    assert watch.evidence({123}) is None
    assert watch.sources() == "memory.events oom_kill unchanged; kernel log names no OOM kill of the trial"
    events = next((tmp_path / "sys").rglob("memory.events"))
    events.write_text(events.read_text().replace("oom_kill 0", "oom_kill 1"))
    assert "oom_kill 0 -> 1" in watch.evidence({123})


def test_kernel_log_names_the_killed_pid(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "6,1001,5000,-;python invoked oom-killer: gfp_mask=0x140cca, order=0, oom_score_adj=0\n"
        " SUBSYSTEM=memory\n"
        "6,1002,5001,-;oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),task=python,pid=4242,uid=0\n"
        "3,1003,5002,-;Out of memory: Killed process 4242 (python) total-vm:9000kB, anon-rss:8000kB\n")
    hits = kernel_log_kills({4242}, path=kmsg)
    assert len(hits) == 2 and hits[1].startswith("Out of memory: Killed process 4242")
    assert kernel_log_kills({4243}, path=kmsg) == []          # another pid: no evidence
    assert kernel_log_kills({1}, path=tmp_path / "absent") is None   # unreadable
    watch = OomKillWatch(proc=tmp_path / "no-proc", kmsg=kmsg)
    assert watch.evidence({4242}).startswith("kernel log: Out of memory: Killed process 4242")
    assert OomKillWatch(proc=tmp_path / "no-proc", kmsg=tmp_path / "absent").evidence({4242}) is None
