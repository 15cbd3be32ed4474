"""Process, build and memory-limit metrics for the stage's own registry.

prometheus_client registers its process (RSS, CPU, open fds), platform (python_info) and GC
collectors only on its default registry; the stage exports a registry of its own, so they are
registered here. ``rollout_reassembler_memory_limit_bytes`` is the container's cgroup memory
limit (the pod limit under Kubernetes), so RSS can be read against it and against the buffer cap.
"""

from __future__ import annotations

import functools
import json
import subprocess
from importlib import metadata
from pathlib import Path

from prometheus_client import GCCollector, Info, PlatformCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PACKAGE = "rollout-reassembler"
# cgroup v2, then v1; v1 reports "no limit" as a huge number (the page-rounded max of int64).
CGROUP_LIMIT_FILES = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
NO_LIMIT_ABOVE = 1 << 60


def register_process_metrics(registry) -> None:
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    build = Info("rollout_reassembler_build", "The stage's version and the git commit it was built from",
                 registry=registry)
    build.info({"version": version(), "commit": commit()})
    registry.register(CgroupMemoryLimit())


@functools.cache
def version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def commit() -> str:
    """The git commit: of the checkout the package is imported from, else the one pip recorded
    when installing from a VCS URL (PEP 610 direct_url.json), else "unknown"."""
    source = Path(__file__).resolve().parents[2]
    if (source / ".git").exists():
        try:
            result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True,
                                    text=True, timeout=5)
            if result.returncode == 0 and result.stdout.strip():
                return result.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        direct = json.loads(metadata.distribution(PACKAGE).read_text("direct_url.json") or "{}")
        return direct.get("vcs_info", {}).get("commit_id") or "unknown"
    except (metadata.PackageNotFoundError, ValueError):
        return "unknown"


def memory_limit_bytes(files=CGROUP_LIMIT_FILES) -> int | None:
    """The cgroup memory limit of this process, None when there is none (or no cgroup)."""
    for path in files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            return None
        return limit if 0 < limit < NO_LIMIT_ABOVE else None
    return None


class CgroupMemoryLimit(Collector):
    """Read at every scrape (Kubernetes can resize a pod's limits in place); no sample without a
    limit, so ratios against it are absent rather than divided by zero."""

    name = "rollout_reassembler_memory_limit_bytes"

    def __init__(self, files=CGROUP_LIMIT_FILES) -> None:
        self.files = files

    def describe(self):
        return [GaugeMetricFamily(self.name, self._doc())]

    def collect(self):
        family = GaugeMetricFamily(self.name, self._doc())
        limit = memory_limit_bytes(self.files)
        if limit is not None:
            family.add_metric([], limit)
        yield family

    @staticmethod
    def _doc() -> str:
        return "The container's cgroup memory limit (the pod limit); absent when unlimited"
