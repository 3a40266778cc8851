#!/usr/bin/env python3
"""Per-device memory of one learner's train step, per TPU config x batch, from XLA's compiler.

For each config and batch size this builds the learner's jitted, sharded train step exactly as
a run does (`train.replica.Replica` on a mesh of `--devices` devices with the config's mesh
axes), lowers it with abstract arguments (`jax.ShapeDtypeStruct` with their shardings: nothing
of the model is allocated) and compiles it; `memory_analysis()` of the executable gives the
bytes per device. Columns (GiB per device):

  params     fp32 parameter shards this device holds
  optimizer  AdamW moments (+ step counters) this device holds
  temp       XLA's scratch for the step: activations kept for the backward pass, gradients,
             collectives' buffers
  TFLOP      the compiled step's FLOPs on one device (XLA's cost analysis), in 1e12; XLA
             counts a loop's body once, so with train.microbatches = N it shows about 1/N
             of the step (the 2-layer 2B cut on v5p-16: 9.14 with 1, 2.29 with 4)
  total      arguments + temp + outputs not aliased to arguments (the train step donates its
             state, so the new state reuses the old one's buffers); "OOM": XLA:TPU refused to
             compile it, temp then being what its temporaries would need
  comm       GiB one device sends per step in the step's collectives, by the ring cost model
             of `decoupled_diloco.collectives` (an estimate of volume, not of time;
             ">=" when a loop holding collectives has a length it could not read)

The numbers are those of the backend present. On a machine without TPUs that is XLA:CPU, whose
buffer assignment, fusion and layouts differ from XLA:TPU's: params and optimizer are exact for
any backend (shapes x shardings), temp is indicative only. Run it on a TPU VM for TPU numbers:

  python scripts/tpu/memory_table.py --devices=16 \
      --config=configs/tpu_dense_multislice.py:2b --batch=16,32,64

On CPU, `--devices` fake devices are created (before JAX starts) to stand in for the chips.
"""

import argparse
import importlib.util
import math
import os
import re
import sys
import time

GIB = 2**30
# XLA:TPU's refusal: "... HLO temporaries (102.04G) exceeds available HBM (15.75G)."
_OOM = re.compile(r"temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", action="append", required=True, help="FILE[:ARG], repeatable")
    p.add_argument(
        "--batch", default="", help="comma-separated sequences per step (default: config's)"
    )
    p.add_argument(
        "--devices", type=int, default=8, help="chips of one learner (its mesh; default 8)"
    )
    p.add_argument(
        "--topology",
        default="",
        help="compile for this TPU topology instead, e.g. v5e:4x8 (v5litepod-32), v5p:2x2x4 "
        "(v5p-32): needs libtpu (pip install 'jax[tpu]'), not a TPU",
    )
    p.add_argument("--seq-len", type=int, default=0, help="override data.seq_len (0: config's)")
    p.add_argument(
        "--remat", default="", help="comma-separated model.remat policies (default: config's)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every --config, e.g. --set=mesh.fsdp=4 --set=mesh.data=2 "
        "(repeatable; values read as Python literals)",
    )
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    return p.parse_args(argv)


def _overridden(config, overrides: list[str]):
    """`config` with each KEY=VALUE of `overrides` set (a ConfigDict's dotted keys)."""
    import ast

    c = config.copy_and_resolve_references()
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--set={item}: expected KEY=VALUE")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        try:
            c.update_from_flattened_dict({key: value})
        except (KeyError, AttributeError, TypeError) as e:
            raise SystemExit(f"--set={item}: {e}") from e
    return c


def _load(spec: str):
    """An ml_collections config from `FILE[:ARG]` (how absl's --config reads it)."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise SystemExit(f"--config={spec}: no such file {path}")
    mod_spec = importlib.util.spec_from_file_location("_memory_table_config", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def _shard_bytes(tree) -> int:
    """Bytes of the shards of `tree` (ShapeDtypeStructs with shardings) on one device."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


def target_devices(devices: int, topology: str = "") -> list:
    """The devices to compile for: `devices` of this backend's, or every device of the TPU
    `topology` (e.g. "v5e:4x8"; XLA:TPU's compile-only client: needs libtpu, not a TPU)."""
    import jax

    if not topology:
        return jax.devices()[:devices]
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def measure(config, batch: int, devices: list, seq_len: int = 0, remat: str = "") -> dict:
    """Compiles the train step of `config` at `batch` on `devices` (with `remat` as
    model.remat unless empty); bytes and FLOPs per device."""
    import jax

    from decoupled_diloco import config as config_lib
    from decoupled_diloco import sharding
    from decoupled_diloco.train.replica import Replica

    c = config.copy_and_resolve_references()
    # Memory is the learner's alone: validate as a one-process run of one learner.
    c.runtime, c.devices_per_learner, c.train.batch_size = "local", len(devices), batch
    c.ray.accelerator = "cpu"  # (the ray.* section is not read by a one-process run)
    if seq_len:
        c.data.seq_len = seq_len
    if remat:
        c.model.remat = remat
    run = config_lib.validate(c)
    mesh = sharding.make_mesh(devices, run.mesh)
    replica = Replica(run.model, run.train, mesh)
    state = replica.abstract_state()
    batch_arg = jax.ShapeDtypeStruct(
        (batch, run.data.seq_len + 1), "int32", sharding=replica.batch_sharding
    )
    row = {
        "preset": c.model.preset,
        "mesh": "x".join(str(n) for n in sharding.mesh_shape(run.mesh, len(devices))),
        "remat": run.model.remat,
        "batch": batch,
        "seq_len": run.data.seq_len,
        "devices": len(devices),
        "params": _shard_bytes(state.params),
        "optimizer": _shard_bytes(state.opt_state) + _shard_bytes(state.step),
        "backend": devices[0].platform,
    }
    t0 = time.perf_counter()
    try:
        compiled = replica._train_step.lower(state, batch_arg).compile()
    except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a step that cannot fit
        need = _OOM.search(str(e))
        if need is None:
            raise
        temp = float(need.group(1)) * GIB  # XLA prints "G" meaning GiB
        return {**row, "temp": temp, "total": None, "compile_s": time.perf_counter() - t0,
                "hbm": float(need.group(2)) * GIB, "flops": None, "comm": None}  # fmt: skip
    from decoupled_diloco import collectives

    traffic = collectives.traffic(compiled.as_text())
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # (a list in older jax)
    args, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
    return {
        **row,
        "temp": mem.temp_size_in_bytes,
        "total": args + mem.temp_size_in_bytes + out - mem.alias_size_in_bytes,
        "flops": (cost or {}).get("flops"),
        "comm": traffic.total_bytes,
        "unknown_trips": traffic.unknown_trips,
        "compile_s": time.perf_counter() - t0,
    }


def _comm(r: dict) -> str:
    if r["comm"] is None:
        return "-"
    # A loop of unread length counted once: at least this much.
    return f"{'>=' * bool(r.get('unknown_trips'))}{r['comm'] / GIB:.2f}"


def _row(r: dict, markdown: bool) -> str:
    cells = [
        r["preset"],
        r["mesh"],
        r["remat"],
        str(r["batch"]),
        str(r["seq_len"]),
        str(r["devices"]),
        *(f"{r[k] / GIB:.2f}" for k in ("params", "optimizer", "temp")),
        f"{r['total'] / GIB:.2f}" if r["total"] is not None else f"OOM (HBM {r['hbm'] / GIB:.2f})",
        f"{r['flops'] / 1e12:.2f}" if r["flops"] else "-",
        _comm(r),
        f"{r['compile_s']:.0f}",
    ]
    return "| " + " | ".join(cells) + " |" if markdown else "\t".join(cells)


HEADER = [
    "preset", "mesh (data x fsdp x tensor x expert)", "remat", "batch", "seq", "devices",
    "params", "optimizer", "temp", "total", "TFLOP", "comm", "compile s",
]  # fmt: skip


def main(argv=None) -> int:
    args = _args(argv)
    if args.topology:  # the validation of a config counts devices: fake as many as chips
        dims = args.topology.partition(":")[2].split("x")
        if not all(d.isdigit() for d in dims):
            raise SystemExit(f"--topology={args.topology}: expected e.g. v5e:4x8 or v5p:2x2x4")
        args.devices = math.prod(int(d) for d in dims)
    if args.devices < 1:
        raise SystemExit(f"--devices={args.devices}: need at least 1")
    # Fake CPU devices must exist before JAX starts its backend (a TPU VM ignores this flag).
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    if jax.device_count() < args.devices:
        raise SystemExit(f"--devices={args.devices}: only {jax.device_count()} devices here")
    devices = target_devices(args.devices, args.topology)
    kind = f"{devices[0].platform} ({devices[0].device_kind})"
    print(f"# compiled for: {kind} x {len(devices)}; GiB per device")
    sep = "| " + " | ".join(HEADER) + " |" if args.markdown else "\t".join(HEADER)
    print(sep)
    if args.markdown:
        print("|" + "---|" * len(HEADER))
    for spec in args.config:
        config = _overridden(_load(spec), args.set)
        batches = [int(b) for b in args.batch.split(",") if b] or [config.train.batch_size]
        for remat in [p for p in args.remat.split(",") if p] or [""]:
            for b in batches:
                try:
                    r = measure(config, b, devices, args.seq_len, remat)
                except ValueError as e:  # e.g. a batch the mesh cannot split
                    print(f"# {spec} remat {remat or 'default'} batch {b}: {e}", flush=True)
                    continue
                print(_row(r, args.markdown), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
