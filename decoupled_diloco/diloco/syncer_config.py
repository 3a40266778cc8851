"""The syncer's configuration (validated at start-up; see decoupled_diloco/config.py)."""

import dataclasses

from decoupled_diloco.diloco import compression

WEIGHTS = ("tokens", "uniform")
MERGES = ("rda", "mean")
STRATEGIES = ("balanced", "layer", "tensor")
ROUNDS = ("scheduled", "eager")


@dataclasses.dataclass(frozen=True)
class SyncerConfig:
    num_fragments: int = 1  # P
    fragment_strategy: str = "balanced"
    quorum: int = 1  # K
    # "scheduled": one round per fragment per schedule slot; K counts offers of a slot not
    # merged yet, late offers ride along with the next round. "eager": any K pending offers
    # close a round (ablation: out-of-step learners then trigger one merge each).
    rounds: str = "scheduled"
    # Drop an offer made before its learner applied the merge of its earlier offer (it
    # repeats that work). Right for learners that rebase; overwriting learners discard it.
    drop_superseded: bool = True
    grace_gamma: float = 0.5  # γ; 0 disables the grace window
    max_grace: float = 2.0  # seconds
    overlap: int = 0  # τ, for the grace window's budget τ·ξ_step
    weights: str = "tokens"
    merge: str = "rda"
    embedding_merge: str = "mean"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: str = "none"  # replies' wire format
    max_staleness: int = 64  # versions
    heartbeat_timeout: float = 300.0  # seconds
    shards: int = 1  # S
    ema_decay: float = 0.8  # of the ξ moving averages
    checkpoint_seconds: float = 5.0  # period of the syncer's orbax checkpoint (runtimes)

    def validate(self, num_learners: int) -> None:
        checks = [
            (self.num_fragments >= 1, "diloco.fragments must be >= 1"),
            (self.fragment_strategy in STRATEGIES, f"diloco.fragment_strategy not in {STRATEGIES}"),
            (1 <= self.quorum <= num_learners, "diloco.quorum must be in [1, diloco.learners]"),
            (self.rounds in ROUNDS, f"diloco.rounds not in {ROUNDS}"),
            (self.grace_gamma >= 0, "diloco.grace_gamma must be >= 0"),
            (self.max_grace >= 0, "diloco.max_grace must be >= 0"),
            (self.weights in WEIGHTS, f"diloco.weights not in {WEIGHTS}"),
            (self.merge in MERGES, f"diloco.merge not in {MERGES}"),
            (self.embedding_merge in MERGES, f"diloco.embedding_merge not in {MERGES}"),
            (self.outer_lr > 0, "diloco.outer_lr must be > 0"),
            (0 <= self.outer_momentum < 1, "diloco.outer_momentum must be in [0, 1)"),
            (self.compression in compression.METHODS, "diloco.compression unknown"),
            (self.max_staleness >= 0, "diloco.max_staleness must be >= 0"),
            (self.heartbeat_timeout > 0, "diloco.heartbeat_timeout must be > 0"),
            (1 <= self.shards <= self.num_fragments, "diloco.syncer_shards must be in [1, P]"),
            (self.checkpoint_seconds > 0, "diloco.syncer_checkpoint_seconds must be > 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"{msg} (got {self})")
