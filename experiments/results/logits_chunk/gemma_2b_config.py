"""gemma_2b as the MFU bench builds it (256k vocabulary, bf16 compute, 1024 tokens per row),
for `scripts/tpu/memory_table.py`; the ARG is model.logits_chunk (0: off)."""

from decoupled_diloco import config as config_lib


def get_config(arg=None):
    c = config_lib.tiny_cpu_config("gemma_2b_memory", preset="gemma_2b", batch_size=16)
    c.data.seq_len = 1024
    c.model.dtype = "bfloat16"
    c.model.logits_chunk = int(arg or 0)
    return c
