"""What a compiled step sends between devices, read from its optimized HLO text.

`traffic(compiled.as_text())` walks the module from its entry computation through every
called computation (fusions, async wrappers, conditionals, while bodies) and adds up, per
collective kind, how often it runs per execution and how many bytes one device puts on the
wire for it. A collective inside a while loop counts once per trip: the trip count is XLA's
`known_trip_count` where the backend records it (XLA:CPU, XLA:GPU), else the constant the
loop's condition compares its counter against (XLA:TPU's loops, which start at 0 and count
up by one: `i < n`). A loop whose count cannot be read counts once, and
`Traffic.unknown_trips` says how many such loops hold collectives. A conditional runs one
of its branches: it counts as its costliest. A collective XLA:TPU has split into chained
continuation pieces (one channel, each piece naming the whole result) counts once per trip
of the loops that hold all of its pieces: XLA:TPU starts one before a loop, continues it
in the loop's body, a piece per trip, and ends it after the loop (one collective), while
one whose pieces all lie in a loop's body runs on every trip.

Bytes on the wire per device, for a collective over a group of n devices whose result has
S bytes on each (ring algorithms, the usual cost model):

  all-gather          S * (n - 1) / n      (S is the gathered array)
  reduce-scatter      S * (n - 1)          (S is one shard)
  all-reduce          2 * S * (n - 1) / n
  all-to-all          S * (n - 1) / n
  collective-permute  S                    (what one device receives)

These are estimates of the volume, not of the time: XLA may overlap collectives with compute
(XLA:TPU decomposes FSDP matmuls into loops of collective-permutes that run beside the
matmul's pieces), and links differ. Use them to compare two compilations of one step.
"""

import dataclasses
import math
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition)=%([\w.\-]+)")
# A collective XLA:TPU has split into continuation fusions carries a `chain_id`; its pieces
# share one channel and together move the collective's result once.
_CHAINED = re.compile(r"channel_id=(\d+).*chain_id=")
_CALL_LISTS = re.compile(r"\bcalled_computations=\{([^}]*)\}")
# A conditional's branches: an index's list, or a predicate's two.
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_PRED_BRANCHES = re.compile(r"\b(?:true|false)_computation=%([\w.\-]+)")


@dataclasses.dataclass
class Traffic:
    """Per collective kind: executions per run of the module and bytes sent per device."""

    count: dict[str, int] = dataclasses.field(default_factory=dict)
    wire_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    unknown_trips: int = 0  # loops with collectives inside whose trip count was not found
    # Chained pieces not yet counted: channel -> (kind, wire bytes, loops), `loops` the
    # (while, trips) that hold every piece seen so far, outermost first (`resolved`).
    chained: dict[str, tuple[str, float, tuple]] = dataclasses.field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return sum(self.wire_bytes.values())

    def add(self, other: "Traffic", times: int = 1, loop: tuple | None = None) -> None:
        """Adds `other` run `times` times: the body of `loop` = (while, trips) when given."""
        for k, n in other.count.items():
            self.count[k] = self.count.get(k, 0) + n * times
        for k, b in other.wire_bytes.items():
            self.wire_bytes[k] = self.wire_bytes.get(k, 0.0) + b * times
        self.unknown_trips += other.unknown_trips
        for channel, (kind, wire, loops) in other.chained.items():
            self.add_piece(channel, kind, wire, (loop, *loops) if loop else loops)

    def add_piece(self, channel: str, kind: str, wire: float, loops: tuple = ()) -> None:
        """A piece of a chained collective inside `loops`: the collective is inside the
        loops that hold all its pieces."""
        if channel in self.chained:
            held = self.chained[channel][2]
            common = 0
            while common < min(len(held), len(loops)) and held[common] == loops[common]:
                common += 1
            loops = loops[:common]
        self.chained[channel] = (kind, wire, loops)

    def count_one(self, kind: str, wire: float, times: int = 1) -> None:
        self.count[kind] = self.count.get(kind, 0) + times
        self.wire_bytes[kind] = self.wire_bytes.get(kind, 0.0) + wire * times

    def resolved(self) -> "Traffic":
        """The same with each chained collective counted, once per trip of its loops."""
        out = Traffic(dict(self.count), dict(self.wire_bytes), self.unknown_trips)
        for kind, wire, loops in self.chained.values():
            out.count_one(kind, wire, math.prod(trips for _, trips in loops))
        return out


def array_bytes(shape_text: str) -> int:
    """Bytes of every array named in an HLO shape (a tuple's arrays added up)."""
    return sum(
        _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape_text)
    )


def _elements(shape_text: str) -> list[str]:
    """The top-level elements of a tuple shape; a shape that is not a tuple, alone."""
    text = shape_text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                parts.append(text[start:i])
                break
        elif ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    return [p.strip() for p in parts if p.strip()]


def _result_bytes(shape_text: str, op: str) -> int:
    """Bytes of a collective's result. An async `-start` op's shape is a tuple of its
    operand(s), its result(s) and scalar contexts (u32[]), except `all-reduce-start`'s,
    which is its result(s) as the synchronous op's."""
    if op.endswith("-start") and op != "all-reduce-start":
        parts = _elements(shape_text)
        return array_bytes(parts[1] if len(parts) > 1 else parts[0])
    return array_bytes(shape_text)


def group_size(line: str, num_partitions: int) -> int:
    """Devices in one replica group of the collective on `line` (all of them if unlisted)."""
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)  # iota form: [groups,size]<=...
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # named mesh axes
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    return num_partitions


def _wire(kind: str, out_bytes: int, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "reduce-scatter":
        return out_bytes * (n - 1)
    if kind == "all-reduce":
        return 2 * out_bytes * (n - 1) / n
    if kind == "collective-permute":
        return float(out_bytes)
    return out_bytes * (n - 1) / n  # all-gather, all-to-all


class _Module:
    def __init__(self, hlo_text: str):
        self.computations: dict[str, list[str]] = {}
        self.entry = None
        current = None
        for line in hlo_text.splitlines():
            header = _HEADER.match(line) if not line.startswith(" ") else None
            if header:
                current = header.group(2)
                self.computations[current] = []
                if header.group(1):
                    self.entry = current
            elif current is not None and line.startswith("  "):
                self.computations[current].append(line)
        if self.entry is None:
            raise ValueError("no ENTRY computation in the HLO text")
        m = re.search(r"num_partitions=(\d+)", hlo_text)
        self.num_partitions = int(m.group(1)) if m else 1
        self._memo: dict[str, Traffic] = {}

    def total(self) -> Traffic:
        """One execution of the entry computation."""
        return self.traffic(self.entry).resolved()

    def sliced_by_root(self, computation: str, name: str) -> int | None:
        """Bytes of `computation`'s ROOT when it is a dynamic-slice of instruction `name`
        (an all-reduce whose result is cut to this device's shard is a reduce-scatter)."""
        for line in self.computations.get(computation, []):
            if line.lstrip().startswith("ROOT "):
                m = _INSTR.match(line)
                if m and m.group(3) == "dynamic-slice" and f"dynamic-slice(%{name}," in line:
                    return array_bytes(m.group(2))
                return None
        return None

    def trip_count(self, line: str) -> int | None:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        if m:
            return int(m.group(1))
        cond = re.search(r"condition=%([\w.\-]+)", line)
        body = "\n".join(self.computations.get(cond.group(1), [])) if cond else ""
        root = re.search(r"ROOT .*compare\(%([\w.\-]+), %([\w.\-]+)\).*direction=(LT|GT)", body)
        if root is None:
            return None
        # The bound: i < n, or n > i (a constant compared the other way round is a count
        # down from a start this does not read).
        bound = root.group(2) if root.group(3) == "LT" else root.group(1)
        k = re.search(r"%" + re.escape(bound) + r" = \S+ constant\((\d+)\)", body)
        return int(k.group(1)) if k else None

    def traffic(self, name: str) -> Traffic:
        if name in self._memo:
            return self._memo[name]
        self._memo[name] = Traffic()  # (a cycle would be malformed HLO: count it once)
        total = Traffic()
        for line in self.computations.get(name, []):
            m = _INSTR.match(line)
            if not m:
                continue
            shape, op = m.group(2), m.group(3)
            kind = op.removesuffix("-start")
            if kind in KINDS and not op.endswith(("-update", "-done")):
                out = _result_bytes(shape, op)
                sliced = self.sliced_by_root(name, m.group(1))
                if kind == "all-reduce" and sliced is not None:
                    kind, out = "reduce-scatter", sliced  # XLA:TPU's all-reduce-scatter fusion
                n = 2 if kind == "collective-permute" else group_size(line, self.num_partitions)
                chained = _CHAINED.search(line)
                if chained:  # one piece of a collective XLA:TPU runs in steps beside compute
                    total.add_piece(chained.group(1), kind, _wire(kind, out, n))
                else:
                    total.count_one(kind, _wire(kind, out, n))
            if op.endswith(("-update", "-done")):
                continue  # (an async op's computation is its start's, run once)
            if op == "conditional":
                # One branch runs: the costliest, as the estimate.
                listed = _BRANCHES.search(line)
                names = (re.findall(r"%?([\w.\-]+)", listed.group(1)) if listed
                         else _PRED_BRANCHES.findall(line))  # fmt: skip
                ran = [self.traffic(b).resolved() for b in names]
                if ran:
                    total.add(max(ran, key=lambda t: (t.total_bytes, sum(t.count.values()))))
                continue
            callees = _CALLS.findall(line)
            for group in _CALL_LISTS.findall(line):
                callees += re.findall(r"%([\w.\-]+)", group)
            trips = self.trip_count(line) if op == "while" else 1
            for callee in callees:
                inner = self.traffic(callee)
                if trips is None and (inner.count or inner.chained):
                    total.unknown_trips += 1
                loop = (m.group(1), trips or 1) if op == "while" else None
                total.add(inner, trips or 1, loop)
        self._memo[name] = total
        return total


def traffic(hlo_text: str) -> Traffic:
    """Collectives of one execution of the module in `hlo_text` (`compiled.as_text()`)."""
    return _Module(hlo_text).total()


def loops(hlo_text: str) -> list[tuple[str, int | None, Traffic]]:
    """The entry computation's while loops: (name, trip count, one trip's collectives,
    a chained one counted whole in each trip that holds a piece of it)."""
    module = _Module(hlo_text)
    out = []
    for line in module.computations[module.entry]:
        m = _INSTR.match(line)
        if m and m.group(3) == "while":
            body = re.search(r"body=%([\w.\-]+)", line).group(1)
            out.append((m.group(1), module.trip_count(line), module.traffic(body).resolved()))
    return out
