"""The threads a process computes with: cgroup files written under tmp_path and read by the
real parser; the load passed in (or pinned by $STREAM_CTR_LOAD_AVG) so the choice is
deterministic on a busy machine."""
import os
import subprocess
import sys

import pytest

from stream_ctr.threads import (LOAD_ENV, cgroup_cpu_limit, choose_threads, measured_load,
                                usable_cores)


def cgroup(tmp_path, proc_line: str, files: dict[str, str]):
    """A fake /proc/self/cgroup holding `proc_line` and a cgroup root holding `files`."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    proc = tmp_path / "proc_self_cgroup"
    proc.write_text(proc_line + "\n")
    return {"cgroup_root": root, "proc_cgroup": proc}


@pytest.fixture
def no_quota(tmp_path):
    return cgroup(tmp_path, "0::/", {})


def test_an_explicit_thread_count_wins_over_cores_and_load(no_quota):
    choice = choose_threads(3, load=50.0, affinity=2, online=2, **no_quota)
    assert (choice.threads, choice.reason, choice.load) == (3, "configured", None)
    assert "train.threads = 3 is more than the 2 core(s)" in choice.warning      # honoured, but said
    assert choose_threads(2, load=50.0, affinity=2, online=2, **no_quota).warning is None


def test_an_idle_machine_uses_every_usable_core(no_quota):
    choice = choose_threads(0, load=0.0, affinity=8, online=8, **no_quota)
    assert (choice.threads, choice.usable, choice.reason, choice.warning) == (8, 8, "usable", None)


def test_a_cgroup_v2_quota_caps_the_cores(tmp_path):
    files = cgroup(tmp_path, "0::/user.slice/job.scope",
                   {"cpu.max": "max 100000",                               # the root: no quota
                    "user.slice/cpu.max": "max 100000",
                    "user.slice/job.scope/cpu.max": "250000 100000"})      # 2.5 cores
    assert cgroup_cpu_limit(**files) == 2.5
    assert usable_cores(affinity=16, **files) == 2                       # rounded down
    choice = choose_threads(0, load=0.0, affinity=16, online=16, **files)
    assert (choice.threads, choice.usable, choice.reason) == (2, 2, "usable")


def test_a_parents_quota_binds_its_children(tmp_path):
    files = cgroup(tmp_path, "0::/kubepods/pod1/ctr",
                   {"kubepods/pod1/cpu.max": "300000 100000",
                    "kubepods/pod1/ctr/cpu.max": "max 100000"})
    assert cgroup_cpu_limit(**files) == 3.0


def test_a_container_without_a_cgroup_namespace_reads_its_mounted_root(tmp_path):
    # /proc/self/cgroup names the host's path, but the container sees its own cgroup at the root.
    files = cgroup(tmp_path, "0::/docker/0123abcd", {"cpu.max": "100000 100000"})
    assert cgroup_cpu_limit(**files) == 1.0


def test_a_cgroup_v1_quota_is_read_from_the_cpu_controller(tmp_path):
    files = cgroup(tmp_path, "12:memory:/job\n4:cpu,cpuacct:/job\n0::/",
                   {"cpu,cpuacct/job/cpu.cfs_quota_us": "400000",
                    "cpu,cpuacct/job/cpu.cfs_period_us": "100000",
                    "cpu,cpuacct/cpu.cfs_quota_us": "-1",
                    "cpu,cpuacct/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(**files) == 4.0
    assert usable_cores(affinity=64, **files) == 4


def test_no_quota_and_no_cgroup_files_leave_the_affinity(tmp_path):
    unlimited = cgroup(tmp_path, "1:cpu:/\n0::/", {"cpu/cpu.cfs_quota_us": "-1",
                                                   "cpu/cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(**unlimited) is None
    missing = {"cgroup_root": tmp_path / "absent", "proc_cgroup": tmp_path / "absent_proc"}
    assert cgroup_cpu_limit(**missing) is None
    assert usable_cores(affinity=6, **missing) == 6


def test_the_real_cgroup_files_parse():
    limit = cgroup_cpu_limit()
    assert limit is None or limit > 0
    assert usable_cores() >= 1


def test_ranks_on_a_host_share_its_cores(no_quota):
    choice = choose_threads(0, processes_per_host=4, load=0.0, affinity=16, online=16, **no_quota)
    assert (choice.threads, choice.usable, choice.reason) == (4, 4, "usable")
    assert usable_cores(3, affinity=16, **no_quota) == 5


def test_a_busy_machine_gets_fewer_threads_and_says_so(no_quota):
    choice = choose_threads(0, load=3.0, affinity=2, online=2, **no_quota)
    assert (choice.threads, choice.usable, choice.reason) == (1, 2, "load")
    assert choice.warning == ("stream-ctr: the machine's load (3.0) exceeds its free cores (2 usable): "
                              "training with 1 thread(s) (--threads sets it)")
    # 16 cores, 10 kept busy by others: the 6 free ones, split between 2 ranks.
    assert choose_threads(0, load=10.0, affinity=16, online=16, **no_quota).threads == 6
    assert choose_threads(0, processes_per_host=2, load=10.0, affinity=16, online=16, **no_quota).threads == 3
    # A load under half a core takes nothing away.
    assert choose_threads(0, load=0.4, affinity=2, online=2, **no_quota).reason == "usable"


def test_never_fewer_than_one_thread(no_quota):
    choice = choose_threads(0, processes_per_host=4, load=100.0, affinity=2, online=2, **no_quota)
    assert choice.threads == 1 and choice.usable == 1
    assert choice.warning is None                 # one usable core: nothing was taken away


def test_the_host_load_is_weighed_against_the_hosts_cores_not_the_quota(tmp_path):
    # A container allowed 2 cores of a 64-core host that others load with 40: its 2 are free.
    files = cgroup(tmp_path, "0::/", {"cpu.max": "200000 100000"})
    choice = choose_threads(0, load=40.0, affinity=64, online=64, **files)
    assert (choice.threads, choice.reason) == (2, "usable")


def test_the_load_can_be_pinned_by_the_environment(monkeypatch):
    monkeypatch.setenv(LOAD_ENV, "7.5")
    assert measured_load() == 7.5
    monkeypatch.setenv(LOAD_ENV, "busy")
    with pytest.raises(ValueError, match=LOAD_ENV):
        measured_load()
    monkeypatch.delenv(LOAD_ENV)
    assert measured_load() >= 0.0                  # the machine's own, whatever it is now


@pytest.mark.skipif(usable_cores() < 2, reason="one usable core: the load cannot take a thread away")
def test_train_warns_once_when_the_load_takes_threads_away(tmp_path):
    def train(*extra):
        env = {**os.environ, LOAD_ENV: "100000"}
        out = subprocess.run([sys.executable, "-m", "stream_ctr", "train", "--limit", "2000", "--quiet",
                              "--run-dir", str(tmp_path / f"run{len(extra)}"), *extra],
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr
        return [line for line in out.stderr.splitlines() if "exceeds its free cores" in line]
    warned = train()
    assert len(warned) == 1 and "training with 1 thread(s) (--threads sets it)" in warned[0], warned
    assert train("--threads", "2") == []            # an explicit count: no warning
