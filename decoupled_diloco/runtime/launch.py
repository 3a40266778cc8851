"""Chooses the runtime named by the config and runs it in its workdir.

A workdir holds one run: the runtime writes its config and tokenizer there when it starts
(run_files.py), a re-run with the same config resumes it from its checkpoints, a re-run of a
finished run (summary.json written) changes nothing, and a run with another config is refused.
"""

import json
import os

from decoupled_diloco import preflight, run_files
from decoupled_diloco.config import RunConfig

SUMMARY = "summary.json"


def run(cfg: RunConfig, workdir: str, verbose: bool = True) -> dict:
    preflight.check(cfg, workdir)  # config, data and run-file errors, before any write
    os.makedirs(workdir, exist_ok=True)
    finished = os.path.join(workdir, SUMMARY)
    _check_same_run(cfg, workdir)
    if os.path.exists(finished):
        if verbose:
            print(f"{workdir} holds a finished run; its records are left as they were "
                  "(use another --workdir for a new run)", flush=True)  # fmt: skip
        with open(finished, encoding="utf-8") as f:
            return json.load(f)
    if cfg.runtime == "ray":
        from decoupled_diloco.runtime.ray.runtime import RayRuntime

        return RayRuntime(cfg, workdir, verbose=verbose).run()
    from decoupled_diloco.runtime.local import LocalRuntime

    return LocalRuntime(cfg, workdir, verbose=verbose).run()


def _check_same_run(cfg: RunConfig, workdir: str) -> None:
    """A workdir's earlier run must have had this config (a resume), or there is none."""
    if not os.path.exists(os.path.join(workdir, run_files.RUN_CONFIG)):
        return
    saved = run_files.config_to_json(run_files.read_config(workdir))
    now = run_files.config_to_json(cfg)
    diff = sorted(
        f"{section}.{k}"
        for section in now
        for k in (now[section] if isinstance(now[section], dict) else [None])
        if (saved.get(section) if k is None else saved.get(section, {}).get(k))
        != (now[section] if k is None else now[section][k])
    )
    if diff:
        raise ValueError(
            f"{workdir} holds a run with another config (differs in {', '.join(diff[:8])}"
            f"{' ...' if len(diff) > 8 else ''}): resume it with its own config, or use "
            "another --workdir"
        )
