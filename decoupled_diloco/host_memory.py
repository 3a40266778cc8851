"""The memory this process may still use on the host: what the OS kills a process for
exceeding, where XLA:CPU (unlike an accelerator's allocator) has no error of its own."""


def available_host_bytes(root: str = "/") -> int | None:
    """The host memory this process may still use, or None if unknown: Linux's MemAvailable,
    or less where the process's memory cgroup (a container's `--memory`) leaves less."""
    free = [int(n) * 1024 for n in _fields(root + "proc/meminfo", "MemAvailable:")]
    headroom = cgroup_headroom(root)
    if headroom is not None:
        free.append(headroom)
    return min(free, default=None)


def cgroup_headroom(root: str = "/") -> int | None:
    """Bytes left under the memory limit of this process's cgroup (v2 `memory.max`, v1
    `memory.limit_in_bytes`) above its usage, counting its page cache (file pages, active or
    inactive, which the kernel reclaims before it kills) as free, as MemAvailable counts
    the host's; None without a limit."""
    try:
        with open(root + "proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if controllers == "":  # v2: the unified hierarchy
            folder, names = f"{root}sys/fs/cgroup{path}", ("memory.max", "memory.current")
            cache = ("inactive_file", "active_file")
        elif "memory" in controllers.split(","):
            folder = f"{root}sys/fs/cgroup/memory{path}"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            cache = ("total_inactive_file", "total_active_file")
        else:
            continue
        for where in (folder.rstrip("/"), folder[: len(folder) - len(path)].rstrip("/")):
            # (In a container's cgroup namespace its own group is the mount's root.)
            values = [_read_int(f"{where}/{name}") for name in names]
            if None in values:
                continue
            limit, usage = values
            if limit >= 2**60:  # "max", or v1's page-rounded 2**63
                break
            # Active file pages too: a file read twice (a corpus, a checkpoint) is active,
            # and counting only the inactive ones refused runs that fit once it was reclaimed.
            stat = f"{where}/memory.stat"
            reclaimable = sum(int(n) for name in cache for n in _fields(stat, name + " "))
            return max(limit - usage + reclaimable, 0)
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return 2**63 if text == "max" else int(text) if text.isdigit() else None


def _fields(path: str, prefix: str) -> list[str]:
    """The first value of each line of `path` starting with `prefix` ([] if unreadable)."""
    try:
        with open(path) as f:
            return [line.split()[1] for line in f if line.startswith(prefix)]
    except OSError:
        return []
