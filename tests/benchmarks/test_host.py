"""benchmarks/harness/host.py: where a lane runs, and what its step loop costs on the host."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.harness import host


def test_a_cpulist_reads_as_the_kernel_writes_it():
    assert host.parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert host.parse_cpulist(" 5 ") == [5]
    for bad in ("", "0-", "a", "1,,2", "0 - 3"):
        with pytest.raises(ValueError, match="not a cpulist"):
            host.parse_cpulist(bad)
    with pytest.raises(ValueError, match="runs backwards"):
        host.parse_cpulist("4-2")


def test_the_gpu_node_comes_from_the_gpus_pci_device(tmp_path, monkeypatch):
    nodes = tmp_path / "node"
    for n, cpus in ((0, "0-3"), (1, "4-7")):
        (nodes / f"node{n}").mkdir(parents=True)
        (nodes / f"node{n}" / "cpulist").write_text(cpus + "\n")
    assert host.numa_nodes(nodes) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    bin_dir, pci = tmp_path / "bin", tmp_path / "pci"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # two GPUs; CUDA_VISIBLE_DEVICES picks the second
    smi.write_text("#!/bin/sh\necho 00000000:18:00.0\necho 00000000:9A:00.0\n")
    smi.chmod(0o755)
    for bus, node in (("0000:18:00.0", "0"), ("0000:9a:00.0", "1")):
        (pci / bus).mkdir(parents=True)
        (pci / bus / "numa_node").write_text(node + "\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert host.gpu_numa_node(pci) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert host.gpu_numa_node(pci) == 0
    (pci / "0000:18:00.0" / "numa_node").write_text("-1\n")  # a machine without NUMA
    assert host.gpu_numa_node(pci) is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi
    assert host.gpu_numa_node(pci) is None


def test_a_spec_naming_cpus_this_process_may_not_use_ends_the_run_naming_the_option():
    usable = sorted(os.sched_getaffinity(0))
    assert host.resolve(str(usable[0])) == [usable[0]]
    outside = max(usable) + 1
    with pytest.raises(SystemExit, match=rf"--lane-cpus: {outside}: CPUs \[{outside}\] are not"):
        host.check(str(outside), "--lane-cpus")
    with pytest.raises(SystemExit, match="expected gpu-node or a cpulist"):
        host.check("all", "--lane-cpus")


def test_pinning_holds_every_thread_of_the_process_and_the_threads_it_starts():
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import os, threading\n"
        "from benchmarks.harness import host\n"
        "early = threading.Thread(target=lambda: __import__('time').sleep(1)); early.start()\n"
        f"print(host.pin('{cpu}'))\n"
        "late = []\n"
        "t = threading.Thread(target=lambda: late.append(os.sched_getaffinity(0))); t.start()\n"
        "t.join()\n"
        "tasks = [os.sched_getaffinity(int(t)) for t in os.listdir('/proc/self/task')]\n"
        "print(sorted(map(sorted, tasks)) == [[%d]] * len(tasks), late == [{%d}])\n" % (cpu, cpu)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [f"[{cpu}]", "True True"]


def test_host_use_counts_this_threads_cpu_time_and_switches():
    with host.HostUse() as used:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # 50 ms of CPU on this thread
            pass
        time.sleep(0.02)  # and a voluntary wait
    per = used.per_step(10)
    assert per["thread_cpu_ms_per_step"] >= 5.0  # 50 ms over 10 steps
    assert per["process_cpu_ms_per_step"] >= per["thread_cpu_ms_per_step"] - 0.5
    assert per["voluntary_switches_per_step"] >= 0.1  # the sleep gave the CPU up at least once
    assert per["involuntary_switches_per_step"] >= 0
    assert per["cpus"] and set(per["cpus"]) <= os.sched_getaffinity(0)
