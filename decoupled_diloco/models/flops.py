"""Model FLOPs per trained token, from a ModelConfig alone (pure arithmetic, no tracing).

    train_flops_per_token = 6 * N_mm + 12 * sum over layers of H * G * c_layer

N_mm ("activated matmul parameters") is every weight a token is multiplied by: per layer the
q, k, v and out projections, D*H*G + 2*D*K*G + H*G*D, plus the dense GeGLU 3*D*F, or for an
MoE layer the router D*E, the k chosen experts k*3*D*F_e and the shared expert 3*D*F_e;
plus V*D for the output logits (the tied embedding; its input lookup is a gather, not a
matmul). A matmul costs 2 FLOPs per weight per token forward, and training (forward + the
backward's two matmuls per forward matmul) three times that: 6 * N_mm.

Attention's own matmuls (scores q.k and the mix probs.v) cost 2*H*G FLOPs each per
(query, key) pair forward, so 12*H*G per pair in training. c_layer is the mean number of
keys a query may attend to under the layer's mask, for training sequences of T tokens:
causal global layers (T + 1) / 2, local layers mean_t min(t + 1, W) for window W. Masked
pairs are not counted, whatever a kernel computes for them (the causal half of a dense
score matrix, blocks a fused kernel skips or not): these are model FLOPs, the numerator of
MFU. Not counted either: norms, rotary, softmax, gelu, softcaps, routing and MoE
dispatch/combine (implementation work, not the model's), and remat's recomputation
(MFU, not hardware FLOPs utilisation).
"""

from decoupled_diloco.models.config import ModelConfig


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """N_mm: weights each token is multiplied by in a forward pass (module doc)."""
    D, H, K, G = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention = D * H * G + 2 * D * K * G + H * G * D
    total = cfg.vocab_size * D  # output logits through the tied embedding
    for layer in range(cfg.num_layers):
        total += attention
        if cfg.is_moe_layer(layer):
            experts = cfg.experts_per_token + (1 if cfg.shared_expert else 0)
            total += D * cfg.num_experts + experts * 3 * D * cfg.expert_hidden
        else:
            total += 3 * D * cfg.ffw_hidden
    return total


def mean_attended_keys(seq_len: int, window: int = 0) -> float:
    """Mean over the T query positions of the keys each may attend to: causal, and with
    `window` > 0 at most the last `window` positions (itself included)."""
    T = seq_len
    if window <= 0 or window >= T:
        return (T + 1) / 2
    return (window * (window + 1) / 2 + (T - window) * window) / T


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the score and mix matmuls, summed over layers."""
    total = 0.0
    for layer in range(cfg.num_layers):
        window = cfg.sliding_window if cfg.attention_kind(layer) == "local" else 0
        total += 12 * cfg.num_heads * cfg.head_dim * mean_attended_keys(seq_len, window)
    return total


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward) in sequences of `seq_len`."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return 6.0 * matmul_params_per_token(cfg) + attention_flops_per_token(cfg, seq_len)
