"""Where experiment results go. Full-mode results are published: experiments/results/<name>/
is tracked in git and quoted by the READMEs. --quick and --smoke runs default to
experiments/results_<mode>/<name>/ (untracked), so trying a script never replaces them."""

import pathlib

PUBLISHED = "experiments/results"  # full-mode results, tracked in git


def results_dir(default: str, mode_name: str, given: bool) -> pathlib.Path:
    """Where a script writes: `default` (under experiments/results/, the published full-mode
    results) in full mode; experiments/results_<mode>/... for --quick and --smoke runs, so
    they never replace published results; --out (`given`) wins either way."""
    path = pathlib.PurePosixPath(default)
    if given or mode_name == "full" or not path.is_relative_to(PUBLISHED):
        return pathlib.Path(default)
    return pathlib.Path(f"{PUBLISHED}_{mode_name}") / path.relative_to(PUBLISHED)
