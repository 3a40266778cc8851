"""The `diloco.*` config section: one frozen dataclass, the single source of its defaults.

`decoupled_diloco/config.py` builds the ConfigDict section from these defaults and, after
absl overrides, validates it back into this dataclass; the learner protocol and the syncer
read it directly. Allowed values live with the code that implements them.
"""

import dataclasses
import math

from decoupled_diloco.diloco import compression, merge, outer
from decoupled_diloco.diloco.fragments import STRATEGIES

APPLY_MODES = ("rebase", "land", "overwrite")
ROUNDS = ("scheduled", "eager")


# Seconds-valued keys and their bound: a wait or period longer than a week is no setting a
# run lives through (max_wait = -1 is "forever" and stays allowed).
SECONDS_KEYS = (
    "max_wait",
    "max_grace",
    "heartbeat_timeout",
    "heartbeat_every",
    "confirm_timeout",
    "join_timeout",
    "syncer_checkpoint_seconds",
    "final_wait",
)
MAX_SECONDS = 7 * 24 * 3600.0


@dataclasses.dataclass(frozen=True)
class DilocoConfig:
    """Learners, fragments, rounds, merge and outer step. Units in the comments."""

    learners: int = 1  # M: independent learners (disjoint device subsets, data shards)
    sync_every: int = 0  # H: inner steps between two syncs of a fragment; 0 = no syncer (DP)
    fragments: int = 1  # P: parameter fragments synced on staggered schedules
    fragment_strategy: str = "balanced"  # "balanced" | "layer" | "tensor" (fragments.py)
    overlap: int = 0  # tau: steps between offering a fragment and applying its merge
    # How a learner applies a merged fragment: "rebase" keeps its work the merge does not
    # hold in θ; "land" sets θ to the merge as the overwrite does, and keeps the steps
    # since its offer aside, on the devices, for its next offer (one more copy of the
    # parameters in device memory at most); "overwrite" replaces the fragment and drops
    # those steps (Streaming DiLoCo). See diloco/learner.py. "rebase" here, where one
    # learner with outer lr 1 is plain training; decoupled configs (`set_decoupled`, the TPU
    # presets) land.
    apply: str = "rebase"
    # Mixing: a learner takes 1 - alpha of each merge's move (overwrite: theta <- alpha*theta +
    # (1-alpha)*merged); 0 = the merge whole. 0.5 with DiLoCo's outer (0.7, 0.9) when learners
    # never wait (README, "How outer lr and momentum relate to M, K, P and H").
    alpha: float = 0.0
    max_wait: float = 0.0  # seconds a learner waits at t+tau for a late merge; -1 = forever
    quorum: int = 1  # K: fresh offers needed before a fragment's round may close
    # "scheduled": one round per fragment per schedule slot, late offers join the next one;
    # "eager": any K pending offers merge (ablation). See diloco/syncer.py.
    rounds: str = "scheduled"
    grace_gamma: float = 0.5  # gamma of the adaptive grace window; 0 disables grace
    max_grace: float = 2.0  # seconds: cap of the grace window
    weights: str = "tokens"  # "tokens" (by tokens per step) | "uniform" (merge.py)
    # "roster": a merge moves Θ by the share of the roster's weight it holds, so
    # every learner's work enters Θ with the same coefficient whichever round carries it;
    # "merged": weights normalised over the offers merged (partial merges move Θ as far as
    # full ones). See diloco/merge.py.
    normalize: str = "roster"
    merge: str = "rda"  # "rda" (radial-directional) | "mean", non-embedding fragments
    embedding_merge: str = "mean"  # merge rule of the embedding fragment: "mean" | "rda"
    outer_lr: float = 0.7  # outer lr (DiLoCo: 0.7; Streaming DiLoCo: 0.4)
    outer_momentum: float = 0.9  # outer momentum mu, in [0, 1)
    nesterov: bool = True  # Nesterov (True) or heavy-ball (False) outer momentum
    # "work": momentum advances by the share of one full round of work a merge carries
    # (a full round is DiLoCo's step; stable when merges are partial or late); "merge":
    # one momentum step per merge. See diloco/outer.py.
    momentum_clock: str = "work"
    compression: str = "none"  # offers' wire format: none | bf16 | int8 | int4 | int2 | int1
    # Replies' wire format (merged parameters, not gradients: lossy formats perturb the
    # model itself, so the default stays lossless): none | bf16 | int8 | int4 | int2 | int1.
    reply_compression: str = "none"
    # Offers whose base is more than this many versions old are rejected: outer gradients
    # are anchored on their own base version, so staleness is safe for the math and the
    # bound only guards against zombies. At least learners - 1 (one merge of each other
    # learner's offer of the fragment between two of one's own is routine).
    max_staleness: int = 64
    # Offers whose outer gradient (RMS per parameter and step of work) is more than this
    # many times the median of the fragment's recent accepted offers are rejected: finite
    # poison (1e15s) passes every other check. 0 = off. Generous: honest offers stay within
    # a few times the median (at most 4.3x in the tiny CPU runs, a learner crash and rejoin
    # included; diloco/offer_scale.py).
    max_offer_norm_ratio: float = 100.0
    # Seconds of silence before a learner counts as dead. Generous: the first step of an
    # incarnation includes XLA compilation, minutes for large models.
    heartbeat_timeout: float = 300.0
    heartbeat_every: float = 0.5  # seconds between a learner's heartbeats
    # Seconds a learner restored from the syncer's checkpoint counts as live with no message
    # of its life. A restored syncer announces itself to every learner it knows, and a live
    # one answers at its next step boundary; one that left (or died) before the restore,
    # its Leave lost with the syncer's last seconds, would otherwise hold up the rounds that
    # wait for everyone (a K = M round, the final sync) for heartbeat_timeout.
    confirm_timeout: float = 30.0
    join_timeout: float = 600.0  # seconds a (re)joining learner waits for the snapshot
    ema_decay: float = 0.8  # of the syncer's step / quorum / merge time averages (grace)
    # Seconds between the syncer's orbax checkpoints (streamed from a saver thread one
    # fragment at a time, fragment_checkpoint.py): a syncer crash loses the merges since.
    syncer_checkpoint_seconds: float = 5.0
    # Most of the wall time the saver may spend writing: after a save of s seconds the next
    # starts no sooner than s / duty after it (nor than syncer_checkpoint_seconds). Saves
    # hold the GIL in orbax's Python for much of their time, which the syncer's merges and
    # (in-process runtime) the learners' dispatch wait for: at the `mid` size on 2 CPU cores
    # checkpoints every 5 s cost a learner 10-20% of its steps. 0.1 leaves the tiny configs'
    # 5 s (a save ~0.35 s) and spaces a `mid` one (~2 s) ~20 s apart. 1 = no bound.
    syncer_checkpoint_duty: float = 0.1
    syncer_shards: int = 1  # S: syncer shards, each owning a subset of fragments
    # Threads one merge splits each leaf over (numpy releases the GIL): 0 = every core of
    # the syncer's host; a learner's rebase math (updates.rebase_delta) uses as many of its
    # host's. Any count gives the same bits (diloco/chunks.py).
    merge_threads: int = 0
    # Replies (uncompressed) no learner holds any more that the syncer keeps per fragment
    # for the next merge to write into: fresh memory page-faults on the merge's critical path
    # (diloco/reply_buffers.py). Costs up to this many copies of Θ on the syncer's host;
    # 0: every reply in new memory.
    reply_spares: int = 1
    # At the end every learner resolves its offers in flight (waiting up to final_wait
    # seconds), then offers all its unmerged work; the syncer merges it: Θ holds all work.
    # final_wait also bounds its wait for the link to deliver them (runtime/boundary.py).
    final_sync: bool = True
    final_wait: float = 120.0  # seconds
    # True: a merged version's update is computed (decode, Θ_new − G + v̂) and placed on the
    # learner's devices by a worker thread as soon as it arrives, so the step boundary that
    # applies it only dispatches the add (runtime/boundary.py). False: all of it happens at
    # that boundary, on the learner's thread. Same result either way.
    stage_merges: bool = True
    # With stage_merges: a rebase's δ = Θ_new − G + v̂ is computed on the learner's devices
    # (the stager only places Θ_new, and v̂ when the version holds our offer; G is the
    # previous version it placed, kept there) instead of on the host, and so is an offer's
    # v = G − θ when that G is its anchor. Host math on ~23 MB
    # per `mid` merge took the stager longer than a step on an H100's host. Costs one copy
    # of the parameters in device memory (the last Θ_p placed, per fragment): turn it off
    # where that does not fit. Same bits either way (but for subnormals, |x| < 1.2e-38,
    # which XLA may flush to zero).
    device_rebase: bool = True

    @property
    def wait_seconds(self) -> float:
        """`max_wait` in seconds (inf = wait forever)."""
        return math.inf if self.max_wait < 0 else self.max_wait

    @property
    def uses_syncer(self) -> bool:
        return self.sync_every > 0

    def validate(self) -> None:
        """Raises ValueError naming the first bad `diloco.*` key."""
        one_of = [
            ("fragment_strategy", STRATEGIES),
            ("apply", APPLY_MODES),
            ("rounds", ROUNDS),
            ("weights", merge.WEIGHTINGS),
            ("normalize", merge.NORMALIZATIONS),
            ("merge", merge.RULES),
            ("embedding_merge", merge.RULES),
            ("momentum_clock", outer.CLOCKS),
            ("compression", compression.METHODS),
            ("reply_compression", compression.METHODS),
        ]
        for key, allowed in one_of:
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"diloco.{key} must be one of {allowed}, got {getattr(self, key)!r}"
                )
        M, H = self.learners, self.sync_every
        checks = [
            (M >= 1, "learners", ">= 1"),
            (H >= 0, "sync_every", ">= 0"),
            (self.fragments >= 1, "fragments", ">= 1"),
            (self.overlap >= 0 and (H == 0 or self.overlap < H), "overlap",
             "in [0, sync_every): a merge must land before the fragment is due again"),
            (0.0 <= self.alpha < 1.0, "alpha", "in [0, 1)"),
            (self.max_wait >= 0 or self.max_wait == -1, "max_wait", ">= 0, or -1 (forever)"),
            (1 <= self.quorum <= M, "quorum", "in [1, diloco.learners]"),
            (self.grace_gamma >= 0, "grace_gamma", ">= 0"),
            (self.max_grace >= 0, "max_grace", ">= 0"),
            (0 < self.outer_lr <= 1e6, "outer_lr", "> 0 and at most 1e6"),
            (0 <= self.outer_momentum < 1, "outer_momentum", "in [0, 1)"),
            (self.max_staleness >= 0, "max_staleness", ">= 0"),
            (self.max_offer_norm_ratio == 0 or self.max_offer_norm_ratio >= 1,
             "max_offer_norm_ratio", "0 (off) or >= 1 (a multiple of the median offer)"),
            (self.heartbeat_timeout > 0, "heartbeat_timeout", "> 0"),
            (0 < self.heartbeat_every < self.heartbeat_timeout, "heartbeat_every",
             "> 0 and below diloco.heartbeat_timeout (a learner silent that long is dead)"),
            (self.confirm_timeout > 0, "confirm_timeout", "> 0"),
            (self.join_timeout > 0, "join_timeout", "> 0"),
            (0 <= self.ema_decay < 1, "ema_decay", "in [0, 1)"),
            (self.syncer_checkpoint_seconds > 0, "syncer_checkpoint_seconds", "> 0"),
            (0 < self.syncer_checkpoint_duty <= 1, "syncer_checkpoint_duty", "in (0, 1]"),
            (1 <= self.syncer_shards <= self.fragments, "syncer_shards",
             "in [1, diloco.fragments]"),
            (self.final_wait >= 0, "final_wait", ">= 0"),
            (self.merge_threads >= 0, "merge_threads", ">= 0 (0 = the host's cores)"),
            (self.reply_spares >= 0, "reply_spares", ">= 0 (0 = every reply in new memory)"),
        ]  # fmt: skip
        for ok, key, want in checks:
            if not ok:
                raise ValueError(f"diloco.{key} must be {want}, got {getattr(self, key)!r}")
        for key in SECONDS_KEYS:  # (waits past threading's limit, ~9e9 s, killed a thread)
            value = getattr(self, key)
            if value > MAX_SECONDS and not (key == "max_wait" and value == -1):
                raise ValueError(f"diloco.{key} must be at most {MAX_SECONDS:g} s (7 days), "
                                 f"got {value!r}")  # fmt: skip
        if not math.isfinite(self.grace_gamma):  # (a multiplier: no seconds bound)
            raise ValueError(f"diloco.grace_gamma must be finite, got {self.grace_gamma!r}")
        if self.max_staleness < M - 1:
            raise ValueError(
                f"diloco.max_staleness must be >= diloco.learners - 1 = {M - 1}, got "
                f"{self.max_staleness}: between two of a learner's offers of a fragment each "
                "other learner's offer of it may merge, so honest offers routinely arrive that "
                "many versions behind (more when merges come back late), and the bound is "
                "only meant to stop zombies"
            )
        if H == 0 and M > 1:
            raise ValueError(
                f"diloco.sync_every=0 (no syncer) needs diloco.learners=1, got {M}: independent "
                "learners that never sync would train M separate models"
            )
