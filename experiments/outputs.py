"""Where experiment results go. Full-mode results are published: experiments/results/<name>/
is tracked in git and quoted by the READMEs. --quick and --smoke runs default to
experiments/results_<mode>/<name>/ (untracked), so trying a script never replaces them.
Default folders lie in this checkout wherever the script is started from; an --out is
taken as given (relative to the working directory)."""

import os
import pathlib

PUBLISHED = "experiments/results"  # full-mode results, tracked in git
ROOT = pathlib.Path(__file__).resolve().parent.parent  # the checkout


def results_dir(default: str, mode_name: str, given: bool) -> pathlib.Path:
    """Where a script writes: `default` (under experiments/results/, the published full-mode
    results) in full mode; experiments/results_<mode>/... for --quick and --smoke runs, so
    they never replace published results; --out (`given`) wins either way."""
    path = pathlib.PurePosixPath(default)
    if given or path.is_absolute():
        return pathlib.Path(default)
    if mode_name != "full" and path.is_relative_to(PUBLISHED):
        path = pathlib.PurePosixPath(f"{PUBLISHED}_{mode_name}") / path.relative_to(PUBLISHED)
    # (relative to the working directory, as short as that allows: "experiments/results/x"
    # from the checkout, "results/x" from experiments/)
    return pathlib.Path(os.path.relpath(ROOT / path))


def parse_seeds(texts: list[str]) -> list[int]:
    """--seeds as distinct integers >= 0 (ValueError naming the flag otherwise)."""
    try:
        out = [int(s) for s in texts]
    except ValueError:
        raise ValueError(f"--seeds={','.join(texts)}: seeds are integers >= 0") from None
    if not out or min(out) < 0 or len(set(out)) < len(out):
        raise ValueError(f"--seeds={','.join(texts)}: give one or more distinct integers >= 0")
    return out
