"""Model FLOPs utilisation: achieved model FLOP/s over the devices' peak.

    mfu = tokens/s * train_flops_per_token / (devices * peak FLOP/s per device)

with model FLOPs from `models/flops.py` and the peak of the device kind JAX reports
(`jax.devices()[0].device_kind`): the dense bfloat16 matmul peak, the usual MFU
denominator, whatever the run's compute dtype (a float32 run reads low, honestly so).
Unknown kinds (CPU, a GPU not listed) have no MFU: None, never a guess.
"""

from decoupled_diloco.models.flops import train_flops_per_token

# Dense bf16 peak FLOP/s per chip, keyed by the lower-cased device_kind. TPUs report exact
# names ("TPU v5 lite" is v5e, "TPU v5" is v5p, "TPU v6 lite" is v6e), so they match exactly.
TPU_PEAK_FLOPS = {
    "tpu v4": 275e12,  # cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16 per chip
    "tpu v5 lite": 197e12,  # cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16 per chip
    "tpu v5e": 197e12,
    "tpu v5": 459e12,  # cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16 per chip
    "tpu v5p": 459e12,
    "tpu v6 lite": 918e12,  # cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16 per chip
    "tpu v6e": 918e12,
}
# GPU names carry memory and form factor ("NVIDIA H100 80GB HBM3" is the SXM part), so
# they match by substring, most specific first. NVIDIA's datasheets list bf16 tensor-core
# FLOPs "with sparsity"; the dense peak is half of it.
GPU_PEAK_FLOPS = (
    ("h100 pcie", 756e12),  # H100 datasheet (nvidia.com/en-us/data-center/h100): 1513 sparse
    ("h100 nvl", 835e12),  # same datasheet: 1671 sparse
    ("h200 nvl", 835e12),  # H200 datasheet (nvidia.com/en-us/data-center/h200): 1671 sparse
    ("gh200", 989e12),  # GH200 datasheet: the H100 SXM tensor cores, 1979 sparse
    ("h100", 989e12),  # H100 SXM (device_kind "NVIDIA H100 80GB HBM3"): 1979 sparse
    ("h200", 989e12),  # H200 SXM ("NVIDIA H200"): 1979 sparse, H100 SXM's tensor cores
    ("a100", 312e12),  # A100 datasheet (nvidia.com/en-us/data-center/a100): 312 dense
)


def peak_flops(device_kind: str) -> float | None:
    """Dense bf16 peak FLOP/s of one device of this kind; None if not in the tables."""
    kind = device_kind.strip().lower()
    if kind in TPU_PEAK_FLOPS:
        return TPU_PEAK_FLOPS[kind]
    if kind.startswith("tpu"):
        return None
    for name, peak in GPU_PEAK_FLOPS:
        if name in kind:
            return peak
    return None


def mfu(
    tokens_per_second: float, flops_per_token: float, num_devices: int, device_kind: str
) -> float | None:
    """Model FLOPs utilisation of a learner on `num_devices` devices of `device_kind`;
    None where the peak is unknown (e.g. CPU)."""
    peak = peak_flops(device_kind)
    if peak is None:
        return None
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    return tokens_per_second * flops_per_token / (num_devices * peak)


def row_fields(run, mesh, tokens_per_second: float) -> dict:
    """{"mfu": x} for a learner's metrics row (`run`: RunConfig; `mesh`: the learner's
    mesh; `tokens_per_second`: the row's rate), or {} where the device's peak is unknown or
    no rate has been measured yet."""
    kind = mesh.devices.flat[0].device_kind
    flops = train_flops_per_token(run.model, run.data.seq_len)
    value = mfu(tokens_per_second, flops, mesh.devices.size, kind)
    if value is None or not tokens_per_second > 0:
        return {}
    return {"mfu": value}


def largest_fitting_batch(plan, first: int, cap: int, budget: float) -> tuple[int, int] | None:
    """(batch, planned bytes) of the largest batch first·2^k <= cap whose step fits `budget`
    bytes, with few compilations; None if `first` does not fit (or exceeds `cap`).

    `plan(batch)`: the step's planned device bytes (one compilation of a large model's step:
    tens of seconds on a GPU), or None when compiling it ran out of memory. A step's plan
    grows about linearly with the batch (activations and their gradients; parameters and
    optimizer state are fixed), so the line through the two largest batches known to fit
    (first `first` and 2·`first`) predicts the largest that fits; it is compiled to confirm,
    halving while it does not fit, and the line is redrawn through it until it predicts
    nothing larger. Exact when the plan grows linearly or faster (a compilation per halving
    then); one growing slower than its line may stop a doubling short. Three compilations
    for a linear plan, where doubling from `first` takes one per power of two up to the
    answer and one past it.
    """
    if first < 1:
        raise ValueError(f"first batch must be >= 1, got {first}")
    if first > cap:
        return None
    known: dict[int, int | None] = {}

    def fits(batch: int) -> bool:
        if batch not in known:
            known[batch] = plan(batch)
        return known[batch] is not None and known[batch] <= budget

    if not fits(first):
        return None
    if 2 * first > cap or not fits(2 * first):
        return first, known[first]
    small, big = first, 2 * first  # the two largest batches known to fit
    too_big = 2 * cap  # smallest batch known not to fit (beyond cap: none yet)
    while True:
        per = max(known[big] - known[small], 0) / (big - small)  # bytes per sequence
        batch = big
        while (
            2 * batch <= cap
            and 2 * batch < too_big
            and (known[big] + per * (2 * batch - big) <= budget)
        ):
            batch *= 2
        while batch > big and not fits(batch):
            too_big, batch = batch, batch // 2
        if batch == big:
            return big, known[big]
        small, big = big, batch
