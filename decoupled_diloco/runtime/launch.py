"""Chooses the runtime named by the config and runs it."""

import os

from decoupled_diloco.config import RunConfig


def run(cfg: RunConfig, workdir: str, verbose: bool = True) -> dict:
    os.makedirs(workdir, exist_ok=True)
    if cfg.runtime == "ray":
        from decoupled_diloco.runtime.ray.runtime import RayRuntime

        return RayRuntime(cfg, workdir, verbose=verbose).run()
    from decoupled_diloco.runtime.local import LocalRuntime

    return LocalRuntime(cfg, workdir, verbose=verbose).run()
