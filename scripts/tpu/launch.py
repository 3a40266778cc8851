#!/usr/bin/env python3
"""Cloud TPU launcher: create slices, install, start Ray, launch a run, watch it, delete it all.

Dry run by default: prints the exact commands (copy-pasteable); `--execute` runs them one by
one and stops at the first failure. Step by step, with costs: scripts/tpu/README.md.
`--slice=I` makes create, setup and delete act on slice I alone (never on the head), and
`join` (re)joins slice I to the running Ray cluster: how a preempted slice is replaced while
the run goes on (`ray-up` restarts the head and would kill the run).

  python scripts/tpu/launch.py create --project=P --zone=us-west4-a \
      --accelerator=v5litepod-16 --slices=4 --spot
  python scripts/tpu/launch.py setup  --project=P --zone=us-west4-a --slices=4 --git-url=URL
  python scripts/tpu/launch.py ray-up --project=P --zone=us-west4-a \
      --accelerator=v5litepod-16 --slices=4
  python scripts/tpu/launch.py launch --project=P --zone=us-west4-a \
      --accelerator=v5litepod-16 --slices=4 --checkpoint-dir=gs://BUCKET/ckpt/run1 \
      -- --config.train.steps=1000
  python scripts/tpu/launch.py join --project=P --zone=us-west4-a \
      --accelerator=v5litepod-16 --slices=4 --slice=2
  python scripts/tpu/launch.py status --project=P --zone=us-west4-a
  python scripts/tpu/launch.py delete --project=P --zone=us-west4-a --slices=4

`--zones=Z0,Z1,...` places slice i in zone Z(i mod count), the head staying in --zone (cross-
region learners); give the same --zones to every step. `dp` starts the data-parallel
baseline on one slice, without Ray (one JAX world over the slice's hosts):

  python scripts/tpu/launch.py dp --project=P --zone=us-west4-a --accelerator=v5litepod-32 \
      --slices=1 --workdir=gs://BUCKET/runs/dp1 -- --config.train.steps=1000
"""

import argparse
import importlib.util
import os
import pathlib
import shlex
import subprocess
import sys

import tpu_cluster as cluster
import tpu_dp as dp
import tpu_provision as provision
from tpu_slices import check_name, one_slice, parse_accelerator

DRY_RUN_NOTE = "# dry run: nothing was executed; add --execute to run these commands"
HEAD_IP_PLACEHOLDER = "HEAD_IP"
# The checkout holding this script: the head VM runs `launch`'s config path from its own
# checkout, so a relative path is checked against this one's configs/.
ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK_NEEDS = ("jax", "ml_collections", "absl")  # what `main --check_config` imports
CHECK_TIMEOUT_S = 300


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--project", required=True, help="Google Cloud project id")
    common.add_argument("--zone", required=True, help="the head VM's (and default slices') zone")
    common.add_argument(
        "--zones",
        default="",
        help="comma-separated zones of the slices: slice i in zone i mod their count "
        "(cross-region runs); default: every slice in --zone",
    )
    common.add_argument("--name", default="dd", help="prefix of every resource name")
    common.add_argument("--execute", action="store_true", help="run the commands (default: print)")
    slices = argparse.ArgumentParser(add_help=False)
    slices.add_argument("--slices", type=int, required=True, help="M: slices = learners")
    one = argparse.ArgumentParser(add_help=False)
    one.add_argument("--slice", type=int, default=None, help="slice I alone; not the head")
    accel = argparse.ArgumentParser(add_help=False)
    accel.add_argument("--accelerator", required=True, help="v5litepod-N or v5p-N, per slice")
    ray = argparse.ArgumentParser(add_help=False)
    ray.add_argument("--head-ip", default="", help="head VM internal IP (default: look it up)")
    ray.add_argument("--ray-port", type=int, default=cluster.RAY_PORT)
    checked = argparse.ArgumentParser(add_help=False)
    checked.add_argument(
        "--no-config-check",
        action="store_true",
        help="skip checking the run's config and overrides here first (`python -m "
        "decoupled_diloco.main --check_config`, which needs this checkout's packages "
        "installed: pip install -e .)",
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    c = sub.add_parser("create", parents=[common, slices, one, accel], help="slices + head")
    c.add_argument("--runtime-version", default="", help="default: the generation's JAX image")
    c.add_argument("--spot", action="store_true", help="Spot TPUs: cheaper, preemptible")
    c.add_argument("--reserved", action="store_true", help="use the project's TPU reservation")
    c.add_argument("--valid-until-duration", default="", help="e.g. 6h: give up waiting after")
    c.add_argument("--head-machine-type", default="n2-highmem-32", help="CPU VM of the syncer")
    c.add_argument("--head-disk-size", default="200GB")
    c.add_argument("--no-head", action="store_true", help="the head VM exists already")
    s = sub.add_parser("setup", parents=[common, slices, one], help="install on head, TPU hosts")
    s.add_argument("--git-url", default="", help="repository to install from")
    s.add_argument("--git-ref", default="main", help="branch, tag or commit")
    s.add_argument("--wheel", default="", help="local wheel instead of --git-url")
    s.add_argument("--configs-dir", default="configs", help="copied to the head with --wheel")
    s.add_argument("--python-version", default=cluster.Versions.python)
    s.add_argument("--jax-version", default=cluster.Versions.jax)
    s.add_argument("--ray-version", default=cluster.Versions.ray)
    sub.add_parser("ray-up", parents=[common, slices, accel, ray], help="(re)start Ray: all")
    j = sub.add_parser("join", parents=[common, slices, accel, ray], help="(re)join one slice")
    j.add_argument("--slice", type=int, required=True, help="the slice I to (re)join")
    la = sub.add_parser(
        "launch", parents=[common, slices, accel, ray, checked], help="start the driver"
    )
    la.add_argument("--config", default="configs/tpu_dense_multislice.py")
    la.add_argument("--workdir", default="", help="default: runs/<name> in the head's checkout")
    la.add_argument(
        "--checkpoint-dir",
        required=True,
        help="where learners and syncer checkpoint, reachable from every VM: gs://BUCKET/...",
    )
    la.add_argument("overrides", nargs="*", help="after --: --config.<key>=<value> overrides")
    b = sub.add_parser(
        "dp", parents=[common, slices, accel, checked], help="DP baseline on one slice"
    )
    b.add_argument("--slice", type=int, default=0, help="the slice I that runs it")
    b.add_argument("--config", default="configs/tpu_dense_multislice.py")
    b.add_argument("--workdir", required=True, help="gs://BUCKET/runs/RUN: every host's path")
    b.add_argument("--worker0-ip", default="", help="the slice's worker 0 IP (default: look up)")
    b.add_argument("overrides", nargs="*", help="after --: --config.<key>=<value> overrides")
    sub.add_parser("status", parents=[common], help="queued resources, Ray status, driver log")
    d = sub.add_parser("delete", parents=[common, slices, one], help="delete slices, head VM")
    d.add_argument("--keep-head", action="store_true", help="delete only the TPU slices")
    return p


def _cloud(args) -> provision.Cloud:
    zones = tuple(z.strip() for z in args.zones.split(",") if z.strip())
    return provision.Cloud(args.project, args.zone, zones)


def _lookup(args, cloud: provision.Cloud) -> tuple[str, list[str]] | None:
    """(placeholder, gcloud command printing it) of the address the step needs and was not
    given: the head VM's IP (Ray), or a multi-host DP slice's worker 0 IP."""
    if args.step in ("ray-up", "join", "launch") and not args.head_ip:
        return HEAD_IP_PLACEHOLDER, provision.head_ip_command(args.name, cloud)
    if args.step == "dp" and not args.worker0_ip and parse_accelerator(args.accelerator).hosts > 1:
        node = one_slice(args.name, args.slices, args.slice)
        return dp.WORKER0_IP_PLACEHOLDER, dp.worker0_ip_command(node, cloud.of_slice(args.slice))
    return None


def _address(args, cloud: provision.Cloud, given: str) -> str:
    """`given`, else looked up with gcloud (a placeholder in a dry run)."""
    lookup = _lookup(args, cloud)
    if lookup is None:
        return given
    placeholder, command = lookup
    if not args.execute:
        return placeholder
    ip = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()
    if not ip:
        raise ValueError(f"no internal IP from: {shlex.join(command)}")
    return ip


def plan(args) -> list[list[str]]:
    """The commands of one step, from parsed arguments; ValueError on bad arguments."""
    name = check_name(args.name)
    cloud = _cloud(args)
    spec = parse_accelerator(args.accelerator) if hasattr(args, "accelerator") else None
    if args.step == "create":
        cmds = provision.queued_resource_commands(
            spec,
            name,
            args.slices,
            cloud,
            runtime_version=args.runtime_version,
            spot=args.spot,
            reserved=args.reserved,
            valid_until_duration=args.valid_until_duration,
            only=args.slice,
        )
        if not args.no_head and args.slice is None:
            cmds.append(
                provision.head_vm_command(name, cloud, args.head_machine_type, args.head_disk_size)
            )
        return cmds
    if args.step == "setup":
        source = cluster.Source(args.git_url, args.git_ref, args.wheel, args.configs_dir)
        versions = cluster.Versions(args.python_version, args.jax_version, args.ray_version)
        return cluster.setup_commands(name, args.slices, cloud, source, versions, args.slice)
    if args.step == "ray-up":
        ip = _address(args, cloud, args.head_ip)
        return cluster.ray_up_commands(spec, name, args.slices, ip, cloud, args.ray_port)
    if args.step == "join":
        ip = _address(args, cloud, args.head_ip)
        return cluster.join_commands(spec, name, args.slices, args.slice, ip, cloud, args.ray_port)
    if args.step == "launch":
        cluster.check_overrides(args.overrides)  # before any look-up
        cluster.check_checkpoint_dir(args.checkpoint_dir)
        address = f"{_address(args, cloud, args.head_ip)}:{args.ray_port}"
        main = _launch_main(args, spec, address, f"../{cluster.VENV}/bin/python")
        return [cluster.launch_command(name, cloud, main)]
    if args.step == "dp":
        cluster.check_overrides(args.overrides)  # before any look-up
        dp.check_workdir(args.workdir)
        one_slice(name, args.slices, args.slice)
        ip = _address(args, cloud, args.worker0_ip)
        return dp.dp_commands(
            spec, name, args.slices, args.slice, args.config, args.workdir, ip, cloud,
            tuple(args.overrides),
        )  # fmt: skip
    if args.step == "status":
        return cluster.status_commands(name, cloud)
    return provision.delete_commands(name, args.slices, cloud, args.keep_head, args.slice)


def _launch_main(args, spec, address: str, python: str) -> list[str]:
    """`launch`'s entry-point command: run by `python`, joining Ray at `address`."""
    workdir = args.workdir or f"runs/{args.name}"
    return cluster.main_command(
        args.config, workdir, args.slices, spec, address, args.checkpoint_dir,
        tuple(args.overrides), python,
    )  # fmt: skip


def _check_command(args) -> tuple[list[str], dict, pathlib.Path | None]:
    """(command, environment, working directory) that runs the step's entry point here with
    `--check_config`: the same config file and flags the remote command gets, on CPU, with
    as many fake devices as the slice has chips."""
    spec = parse_accelerator(args.accelerator)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={spec.chips}"
    if args.step == "launch":
        cmd = _launch_main(args, spec, f"{HEAD_IP_PLACEHOLDER}:{args.ray_port}", sys.executable)
        cwd = ROOT
    else:  # dp: worker 0's command; the hosts run a copy of the local config file
        ip = dp.WORKER0_IP_PLACEHOLDER
        overrides = tuple(args.overrides)
        cmd = dp.dp_main_command(args.config, args.workdir, spec, 0, ip, overrides, sys.executable)
        cmd = [f"--config={args.config}" if a.startswith("--config=") else a for a in cmd]
        cwd = None
    return [*cmd, "--check_config", f"--check_hosts={spec.hosts}"], env, cwd


def check_config(args) -> str:
    """Runs the step's config through the entry point's start-up checks here, so that a bad
    key or value fails now rather than in a driver log on the cluster; returns a comment line
    (what was checked), ValueError when the run would not start. Without the packages to check
    with: a comment in a dry run, an error with --execute."""
    cmd, env, cwd = _check_command(args)  # (checks the arguments it is built from)
    missing = [m for m in CHECK_NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        why = (
            f"the run's config was not checked: {', '.join(missing)} not installed in this "
            "Python (pip install -e . in this checkout, or --no-config-check)"
        )
        if args.execute:
            raise ValueError(why)
        return f"# {why}"
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=CHECK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:  # e.g. a gs:// tokenizer this machine cannot reach
        raise ValueError(
            f"the config check here did not finish within {CHECK_TIMEOUT_S} s (a path this "
            "machine cannot reach?); --no-config-check skips it"
        ) from e
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    if done.returncode:
        errors = [ln for ln in lines if ln.startswith(("error:", "config error:"))]
        why = errors[0] if errors else (lines[-1] if lines else f"exit {done.returncode}")
        raise ValueError(
            f"the run would stop at start-up: {why} (checked here by `python -m "
            "decoupled_diloco.main --check_config` with the step's flags; --no-config-check "
            "skips the check)"
        )
    ok = [ln for ln in lines if ln.startswith("config ok:")]
    return f"# checked here: {ok[-1] if ok else lines[-1]}"


def run(commands: list[list[str]], execute: bool) -> None:
    """Prints every command; with `execute`, runs each and stops at the first failure."""
    for cmd in commands:
        print(("+ " if execute else "") + shlex.join(cmd), flush=True)
        if execute:
            subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        checked = None  # before plan(), which looks addresses up with --execute
        if args.step in ("launch", "dp") and not args.no_config_check:
            checked = check_config(args)
        commands = plan(args)
        if not args.execute:
            print(DRY_RUN_NOTE)
        if checked:
            print(checked, flush=True)
        lookup = None if args.execute else _lookup(args, _cloud(args))
        if lookup is not None:
            print(f"# {lookup[0]} is the output of: {shlex.join(lookup[1])}")
        run(commands, args.execute)
    except ValueError as e:
        parser.error(str(e))
    except subprocess.CalledProcessError as e:
        print(f"failed ({e.returncode}): {shlex.join(e.cmd)}", file=sys.stderr)
        return e.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
