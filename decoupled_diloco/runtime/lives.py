"""A learner's incarnations ("lives"), recorded under the run's checkpoint directory.

Every process that runs a learner takes a new incarnation as it starts, and so does every
restart after a failure (a crash, a NaN restart, a killed process that came back); the
syncer refuses the Join of one it has seen end.
A learner's checkpoint holds the life it saved in, not the ones it took since, so each
life taken is also written to `<ckpt_dir>/lives/learner_<m>_<host>`, which every node of
the run reaches.
"""

from decoupled_diloco import paths


def _lives_file(ckpt_dir: str, m: int, host: int):
    return paths.resolve(ckpt_dir) / "lives" / f"learner_{m}_{host}"


def last_life(ckpt_dir: str, m: int, host: int) -> int | None:
    """The newest incarnation learner m (host `host`) took with this checkpoint directory
    (`next_life`), None if none."""
    try:
        return int(_lives_file(ckpt_dir, m, host).read_text())
    except (FileNotFoundError, ValueError):
        return None


def next_life(ckpt_dir: str, m: int, host: int, floor: int) -> int:
    """A fresh incarnation for learner m (host `host` of its slice): above every one an
    earlier life took with this checkpoint directory, and at least `floor` (e.g. its
    checkpoint's). A process that came back after a kill must not reuse a life the syncer
    has seen: the syncer would refuse its Join for good, or (Ray restarting it on another
    node) take offers its dead predecessor still had in flight as its own."""
    last = last_life(ckpt_dir, m, host)
    life = floor if last is None else max(floor, last + 1)
    path = _lives_file(ckpt_dir, m, host)
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.write_atomic(path, str(life))
    return life
