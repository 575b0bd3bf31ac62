"""The host side of a measurement: which CPUs a lane runs on, and what its step loop costs there.

A lane may be pinned to a set of CPUs (``BENCH_LANE_CPUS`` in its environment: ``gpu-node``,
the CPUs of the GPU's NUMA node, or a cpulist such as ``0-7,16``), set for every lane with
``--lane-cpus`` or for a variant's lane alone with ``--variant-env BENCH_LANE_CPUS=...``, so a
paired run A/Bs the placement. Each window records its main thread's CPU time, the whole
process's, the thread's context switches and the CPUs it was seen on (:class:`HostUse`): a step
whose wall time grows while its CPU time does not waited (on the GPU, a lock, the scheduler); one
whose CPU time grows did more work or ran slower.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import time
from pathlib import Path

LANE_CPUS = "BENCH_LANE_CPUS"
GPU_NODE = "gpu-node"
_CPULIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def parse_cpulist(text: str) -> list[int]:
    """``0-3,8`` -> [0, 1, 2, 3, 8] (the kernel's cpulist format); ValueError otherwise."""
    text = text.strip()
    if not _CPULIST.match(text):
        raise ValueError(f"{text!r} is not a cpulist such as 0-7,16")
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"{text!r}: the range {part} runs backwards")
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from sysfs ({} where the machine does not say)."""
    nodes = {}
    for path in sorted(root.glob("node[0-9]*/cpulist")):
        text = path.read_text().strip()
        if text:
            nodes[int(path.parent.name[4:])] = parse_cpulist(text)
    return nodes


def gpu_numa_node(sysfs: Path = Path("/sys/bus/pci/devices")) -> int | None:
    """The NUMA node of the first visible GPU's PCI device, or None (no GPU, no NUMA)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if not out:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    bus_id = out[int(visible)] if visible.isdigit() and int(visible) < len(out) else out[0]
    domain, _, rest = bus_id.lower().partition(":")  # 00000000:18:00.0 -> 0000:18:00.0
    node_file = sysfs / f"{domain[-4:]}:{rest}" / "numa_node"
    try:
        node = int(node_file.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def resolve(spec: str) -> list[int]:
    """The CPUs ``spec`` names on this machine; ValueError (saying why) where it names none."""
    if spec == GPU_NODE:
        node = gpu_numa_node()
        if node is None:
            raise ValueError(f"{GPU_NODE}: the GPU's NUMA node is unknown here (no nvidia-smi, "
                             "or sysfs gives none)")  # fmt: skip
        cpus = numa_nodes().get(node)
        if not cpus:
            raise ValueError(f"{GPU_NODE}: NUMA node {node} lists no CPUs")
    else:
        cpus = parse_cpulist(spec)
    usable = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - usable)
    if outside:
        raise ValueError(f"{spec}: CPUs {outside} are not among this process's {sorted(usable)}")
    return cpus


def check(spec: str, option: str) -> None:
    """End the run, naming ``option``, if ``spec`` does not resolve here."""
    try:
        resolve(spec)
    except ValueError as exc:
        raise SystemExit(f"{option}: {exc} (expected {GPU_NODE} or a cpulist such as 0-7)")


def pin(spec: str) -> list[int]:
    """Pin every thread of this process (and the threads it starts later) to ``spec``'s CPUs."""
    cpus = resolve(spec)
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return cpus


def machine_layout() -> str:
    """``node0 0-7, node1 8-15; GPU on node 0`` (what ``BENCH_LANE_CPUS=gpu-node`` would pick)."""
    nodes = numa_nodes()
    parts = [f"node{n} {_compact(c)}" for n, c in nodes.items()]
    gpu = gpu_numa_node()
    return ", ".join(parts or ["no NUMA nodes listed"]) + (
        f"; GPU on node {gpu}" if gpu is not None else ""
    )


def _compact(cpus: list[int]) -> str:
    runs, start = [], None
    for i, cpu in enumerate(cpus):
        if start is None:
            start = cpu
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            runs.append(f"{start}-{cpu}" if cpu != start else f"{cpu}")
            start = None
    return ",".join(runs)


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (``/proc/thread-self/stat``), None off Linux."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[36])  # field 39: processor


class HostUse:
    """While active (``with``): this thread's CPU time and context switches, the process's CPU
    time, and the CPUs the thread was seen on (:meth:`sample`, called now and then)."""

    def __enter__(self) -> HostUse:
        self.cpus: set[int] = set()
        self._thread0, self._process0 = time.thread_time(), time.process_time()
        self._usage0 = resource.getrusage(resource.RUSAGE_THREAD)
        self.sample()
        return self

    def sample(self) -> None:
        cpu = current_cpu()
        if cpu is not None:
            self.cpus.add(cpu)

    def __exit__(self, *exc) -> None:
        self.sample()
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        self.thread_s = time.thread_time() - self._thread0
        self.process_s = time.process_time() - self._process0
        self.voluntary = usage.ru_nvcsw - self._usage0.ru_nvcsw
        self.involuntary = usage.ru_nivcsw - self._usage0.ru_nivcsw

    def per_step(self, steps: int) -> dict:
        n = max(steps, 1)
        return {
            "thread_cpu_ms_per_step": self.thread_s * 1e3 / n,
            "process_cpu_ms_per_step": self.process_s * 1e3 / n,
            "voluntary_switches_per_step": self.voluntary / n,
            "involuntary_switches_per_step": self.involuntary / n,
            "cpus": sorted(self.cpus),
        }
