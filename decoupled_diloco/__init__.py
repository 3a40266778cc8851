"""decoupled_diloco: Decoupled DiLoCo (arXiv 2604.21428) in JAX.

`decoupled_diloco.load(workdir)` returns a run's config, tokenizer and global model
(decoupled_diloco/loading.py); importing the package does not start JAX.
"""

__version__ = "0.1.0"


def load(path: str, step: int | None = None):
    """The global model of the run (or exported model) at `path`: a `loading.Model` with
    `.config`, `.tokenizer`, `.params` (flat numpy) and `.forward(tokens_BT)`; `step`: the
    newest checkpoint saved at or before that learner step."""
    from decoupled_diloco.loading import load as _load

    return _load(path, step)
