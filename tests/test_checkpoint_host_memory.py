"""host_memory's headroom under a container's memory limit counts the page cache the
kernel reclaims before it kills, active as well as inactive: a corpus or checkpoint read
twice is active cache, and counting it as used refused evaluations that fit."""

import pytest

from decoupled_diloco.host_memory import cgroup_headroom

GiB = 2**30


def _root(tmp_path, cgroup: str, files: dict) -> str:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(tmp_path) + "/"


@pytest.mark.parametrize(
    "cgroup, folder, limit, usage, stat",
    [
        # v2: 8 GiB limit, 7 used: 1 of anonymous memory, 5.5 active and 0.5 inactive cache
        ("0::/\n", "sys/fs/cgroup", "memory.max", "memory.current",
         f"anon {GiB}\nactive_file {11 * GiB // 2}\ninactive_file {GiB // 2}\n"),
        # v1 (its hierarchical totals; the group's own counts are smaller)
        ("4:memory:/a\n", "sys/fs/cgroup/memory/a", "memory.limit_in_bytes",
         "memory.usage_in_bytes",
         f"active_file 1\ninactive_file 1\ntotal_rss {GiB}\n"
         f"total_active_file {11 * GiB // 2}\ntotal_inactive_file {GiB // 2}\n"),
    ],
)  # fmt: skip
def test_active_page_cache_counts_as_headroom(tmp_path, cgroup, folder, limit, usage, stat):
    files = {f"{folder}/{limit}": f"{8 * GiB}\n", f"{folder}/{usage}": f"{7 * GiB}\n",
             f"{folder}/memory.stat": stat}  # fmt: skip
    # All but the 1 GiB of anonymous memory can be had: the cache is dropped first.
    assert cgroup_headroom(_root(tmp_path, cgroup, files)) == 7 * GiB
