"""scripts/tpu: slice shapes, the exact generated commands, argument checks, dry run vs
--execute (subprocess faked; no gcloud is ever run), and the two TPU configs."""

import importlib.util
import json
import pathlib
import shlex
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "tpu"))

import tpu_cluster as cluster  # noqa: E402
import tpu_dp as dp  # noqa: E402
import tpu_provision as provision  # noqa: E402
from tpu_slices import check_name, node_ids, parse_accelerator  # noqa: E402

from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco import models, preflight, sharding  # noqa: E402
from decoupled_diloco.data.config import KNOWN_SPM_PIECES, T5_C4_SPM_MODEL  # noqa: E402


def _load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launch = _load(ROOT / "scripts" / "tpu" / "launch.py", "tpu_launch")

V5E = provision.Cloud("my-proj", "us-west4-a")
V5P = provision.Cloud("my-proj", "us-east5-a")
CKPT = "gs://my-bucket/checkpoints/run1"
TPU_SSH = ["gcloud", "compute", "tpus", "tpu-vm", "ssh"]


def _remote_args(cmd: list[str]) -> list[str]:
    """The words the VM's shell sees in a `--command=...` argument."""
    (script,) = [a.removeprefix("--command=") for a in cmd if a.startswith("--command=")]
    return shlex.split(script)


@pytest.mark.parametrize(
    "accelerator, chips, per_host, hosts, runtime",
    [
        ("v5litepod-1", 1, 1, 1, "v2-alpha-tpuv5-lite"),
        ("v5litepod-8", 8, 8, 1, "v2-alpha-tpuv5-lite"),
        ("v5litepod-16", 16, 4, 4, "v2-alpha-tpuv5-lite"),
        ("v5litepod-256", 256, 4, 64, "v2-alpha-tpuv5-lite"),
        ("v5p-8", 4, 4, 1, "v2-alpha-tpuv5"),
        ("v5p-16", 8, 4, 2, "v2-alpha-tpuv5"),
        ("v5p-32", 16, 4, 4, "v2-alpha-tpuv5"),
    ],
)
def test_slice_shapes(accelerator, chips, per_host, hosts, runtime):
    spec = parse_accelerator(accelerator)
    assert (spec.chips, spec.chips_per_host, spec.hosts) == (chips, per_host, hosts)
    assert spec.hosts * spec.chips_per_host == spec.chips
    assert spec.runtime_version == runtime
    assert spec.ray_head_resource == f"TPU-{accelerator}-head"


@pytest.mark.parametrize(
    "bad", ["v4-8", "v5e-16", "v5litepod-2", "v5litepod-12", "v5p-12", "v5p-4", "v5p-16384", ""]
)
def test_unknown_accelerators_raise(bad):
    with pytest.raises(ValueError, match="--accelerator"):
        parse_accelerator(bad)


@pytest.mark.parametrize("bad", ["Dd", "1dd", "dd-", "d_d", "a" * 41, ""])
def test_bad_names_raise(bad):
    with pytest.raises(ValueError, match="--name"):
        check_name(bad)


def test_bad_arguments_raise():
    spec = parse_accelerator("v5p-16")
    with pytest.raises(ValueError, match="--slices"):
        node_ids("dd", 0)
    with pytest.raises(ValueError, match="--spot and --reserved"):
        provision.queued_resource_commands(spec, "dd", 2, V5P, spot=True, reserved=True)
    with pytest.raises(ValueError, match="--zone"):
        provision.Cloud("my-proj", "")
    for bad in (("us-east5",), ("us-east5-a", "US-WEST4-A"), ("us-east5-a;rm",)):
        with pytest.raises(ValueError, match="--zone/--zones"):
            provision.Cloud("my-proj", "us-east5-a", bad)
    with pytest.raises(ValueError, match="exactly one of --git-url or --wheel"):
        cluster.Source()
    with pytest.raises(ValueError, match="exactly one of --git-url or --wheel"):
        cluster.Source(git_url="https://example.com/r.git", wheel="x.whl")
    with pytest.raises(ValueError, match="--wheel"):
        cluster.Source(wheel="dist/decoupled_diloco.tar.gz")
    with pytest.raises(ValueError, match="--config.<key>=<value>"):
        cluster.main_command("c.py", "w", 2, spec, "h:1", CKPT, overrides=("--train.steps=3",))
    for relative in ("", "ckpt", "runs/dd/checkpoints"):  # each VM would write its own
        with pytest.raises(ValueError, match="--checkpoint-dir"):
            cluster.main_command("c.py", "w", 2, spec, "h:1", relative)
    with pytest.raises(ValueError, match="--slice=2"):
        cluster.join_commands(spec, "dd", 2, 2, "10.0.0.2", V5P)
    with pytest.raises(ValueError, match="--slice=2"):
        provision.queued_resource_commands(spec, "dd", 2, V5P, only=2)
    with pytest.raises(ValueError, match="--slice=3"):
        provision.delete_commands("dd", 2, V5P, only=3)


def test_v5e_commands():
    spec = parse_accelerator("v5litepod-16")
    create = provision.queued_resource_commands(spec, "dd", 2, V5E, spot=True)
    flags = [
        "--accelerator-type=v5litepod-16",
        "--runtime-version=v2-alpha-tpuv5-lite",
        "--zone=us-west4-a",
        "--project=my-proj",
        "--scopes=cloud-platform",  # write access to the bucket (the default reads only)
        "--spot",
    ]
    qr_create = ["gcloud", "compute", "tpus", "queued-resources", "create"]
    assert create == [
        [*qr_create, "dd-0-qr", "--node-id=dd-0", *flags],
        [*qr_create, "dd-1-qr", "--node-id=dd-1", *flags],
    ]

    worker = cluster.ray_worker_command("dd-1", spec, "10.0.0.2", V5E)
    script = (
        "dd-venv/bin/ray stop && dd-venv/bin/ray start --address=10.0.0.2:6379 "
        """--resources='{"TPU": 4, "dd-1": 1}' --disable-usage-stats"""
    )
    assert worker == [
        *TPU_SSH, "dd-1", "--worker=all", "--zone=us-west4-a", "--project=my-proj",
        f"--command={script}",
    ]  # fmt: skip
    resources = [a for a in _remote_args(worker) if a.startswith("--resources=")]
    assert json.loads(resources[0].removeprefix("--resources=")) == {"TPU": 4, "dd-1": 1}

    main = cluster.main_command(
        "configs/tpu_dense_multislice.py", "runs/dd", 2, spec, "10.0.0.2:6379", CKPT
    )
    assert main == [
        "python", "-m", "decoupled_diloco.main",
        "--config=configs/tpu_dense_multislice.py", "--workdir=runs/dd",
        "--config.runtime=ray", "--config.ray.accelerator=tpu", "--config.diloco.learners=2",
        "--config.devices_per_learner=16", "--config.ray.address=10.0.0.2:6379",
        "--config.ray.checkpoint_dir=gs://my-bucket/checkpoints/run1",
    ]  # fmt: skip
    # A TPU run must not fall back to the CPU default, and every actor writes to one bucket.
    assert "--config.ray.accelerator=tpu" in main
    assert f"--config.ray.checkpoint_dir={CKPT}" in main


def test_v5p_commands():
    spec = parse_accelerator("v5p-32")
    create = provision.queued_resource_commands(
        spec, "dd", 3, V5P, reserved=True, valid_until_duration="6h"
    )
    assert create == [
        [
            "gcloud", "compute", "tpus", "queued-resources", "create", f"dd-{i}-qr",
            f"--node-id=dd-{i}", "--accelerator-type=v5p-32",
            "--runtime-version=v2-alpha-tpuv5", "--zone=us-east5-a", "--project=my-proj",
            "--scopes=cloud-platform", "--reserved", "--valid-until-duration=6h",
        ]
        for i in range(3)
    ]  # fmt: skip
    # One queued resource per slice, never one all-or-nothing multislice request: its
    # MEGASCALE_* settings would join every slice into one JAX world (one fate).
    assert not any(a.startswith(("--node-count", "--node-prefix")) for c in create for a in c)
    assert provision.delete_commands("dd", 3, V5P) == [
        *[["gcloud", "compute", "tpus", "queued-resources", "delete", f"dd-{i}-qr",
           "--zone=us-east5-a", "--project=my-proj", "--force"] for i in range(3)],
        ["gcloud", "compute", "instances", "delete", "dd-head",
         "--zone=us-east5-a", "--project=my-proj"],
    ]  # fmt: skip

    up = cluster.ray_up_commands(spec, "dd", 3, "10.0.0.9", V5P)
    head = _remote_args(up[0])
    assert up[0][:4] == ["gcloud", "compute", "ssh", "dd-head"]
    assert "--head" in head and "--port=6379" in head and """--resources={"syncer": 1}""" in head
    assert [cmd[5] for cmd in up[1:]] == ["dd-0", "dd-1", "dd-2"]
    for i, cmd in enumerate(up[1:]):
        words = _remote_args(cmd)
        assert "--address=10.0.0.9:6379" in words
        assert f'--resources={{"TPU": 4, "dd-{i}": 1}}' in words

    main = cluster.main_command(
        "configs/tpu_moe_v5p.py", "runs/dd", 3, spec, "10.0.0.9:6379", "/mnt/shared/ckpt",
        ("--config.seed=3",),
    )  # fmt: skip
    assert main[-6:] == [
        "--config.ray.accelerator=tpu",
        "--config.diloco.learners=3",
        "--config.devices_per_learner=16",
        "--config.ray.address=10.0.0.9:6379",
        "--config.ray.checkpoint_dir=/mnt/shared/ckpt",
        "--config.seed=3",
    ]


def test_one_slice_is_replaced_without_touching_the_head():
    """create / setup / delete --slice=I and join act on slice I alone; ray-up restarts all."""
    spec = parse_accelerator("v5p-32")
    source = cluster.Source(git_url="https://example.com/dd.git")
    (create,) = provision.queued_resource_commands(spec, "dd", 4, V5P, spot=True, only=2)
    assert create[5:7] == ["dd-2-qr", "--node-id=dd-2"] and "--spot" in create
    assert provision.delete_commands("dd", 4, V5P, only=2) == [
        ["gcloud", "compute", "tpus", "queued-resources", "delete", "dd-2-qr",
         "--zone=us-east5-a", "--project=my-proj", "--force"],
    ]  # fmt: skip
    setup = cluster.setup_commands("dd", 4, V5P, source, only=2)
    assert setup == [cluster.setup_commands("dd", 4, V5P, source)[3]]  # head, dd-0, dd-1, dd-2
    (join,) = cluster.join_commands(spec, "dd", 4, 2, "10.0.0.9", V5P)
    assert join == cluster.ray_up_commands(spec, "dd", 4, "10.0.0.9", V5P)[3]
    assert join[:7] == [*TPU_SSH, "dd-2", "--worker=all"]
    for cmd in [create, *setup, join]:
        assert not any("dd-head" in word for word in cmd)


CROSS = provision.Cloud("my-proj", "us-central2-b", ("us-central2-b", "europe-west4-a"))


def _zone(cmd: list[str]) -> str:
    (zone,) = [a.removeprefix("--zone=") for a in cmd if a.startswith("--zone=")]
    return zone


def test_each_slice_is_placed_in_its_own_zone():
    """--zones cycles over the slices: every command acting on slice i names slice i's zone;
    the head's commands name --zone (the syncer's region)."""
    spec = parse_accelerator("v5litepod-16")
    zone_of = ["us-central2-b", "europe-west4-a", "us-central2-b"]
    assert [CROSS.zone_of(i) for i in range(3)] == zone_of
    create = provision.queued_resource_commands(spec, "dd", 3, CROSS, spot=True)
    assert [_zone(c) for c in create] == zone_of
    assert [c[5] for c in create] == ["dd-0-qr", "dd-1-qr", "dd-2-qr"]
    source = cluster.Source(git_url="https://example.com/dd.git")
    setup = cluster.setup_commands("dd", 3, CROSS, source)
    assert [_zone(c) for c in setup] == ["us-central2-b", *zone_of]  # head first
    up = cluster.ray_up_commands(spec, "dd", 3, "10.0.0.9", CROSS)
    assert [(c[5] if c[:5] == TPU_SSH else c[3], _zone(c)) for c in up] == [
        ("dd-head", "us-central2-b"),
        *[(f"dd-{i}", z) for i, z in enumerate(zone_of)],
    ]
    (join,) = cluster.join_commands(spec, "dd", 3, 1, "10.0.0.9", CROSS)
    assert join[5] == "dd-1" and _zone(join) == "europe-west4-a"
    (create1,) = provision.queued_resource_commands(spec, "dd", 3, CROSS, only=1)
    assert create1[5] == "dd-1-qr" and _zone(create1) == "europe-west4-a"
    delete = provision.delete_commands("dd", 3, CROSS)
    assert [_zone(c) for c in delete] == [*zone_of, "us-central2-b"]
    assert delete[-1][3:5] == ["delete", "dd-head"]
    status = cluster.status_commands("dd", CROSS)
    assert [_zone(c) for c in status] == ["us-central2-b", "europe-west4-a", "us-central2-b"]
    assert all(c[:5] == [*provision.QUEUED, "list"] for c in status[:2])
    # No --zones: every slice in --zone, exactly as before.
    assert [_zone(c) for c in provision.queued_resource_commands(spec, "dd", 3, V5E)] == [
        "us-west4-a"
    ] * 3


def test_cli_zones_flag_reaches_every_slice_command(monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    argv = ["create", "--project=my-proj", "--zone=us-east5-a", "--accelerator=v5p-16",
            "--slices=4", "--zones=us-east5-a, europe-west4-b,asia-east1-c"]  # fmt: skip
    assert launch.main(argv) == 0
    printed = [shlex.split(x) for x in capsys.readouterr().out.splitlines() if x[0] != "#"]
    assert [_zone(c) for c in printed] == [
        "us-east5-a",
        "europe-west4-b",
        "asia-east1-c",
        "us-east5-a",
        "us-east5-a",  # + head
    ]
    assert printed[-1][3:5] == ["create", "dd-head"]
    # Every VM may write to the bucket (a VM's default access scopes read Cloud Storage only).
    assert all("--scopes=cloud-platform" in c for c in printed if "create" in c)


def _apply(c, overrides):
    """--config.<key>=<value> words applied to a ConfigDict (values typed as the key's)."""
    for word in overrides:
        key, _, value = word.removeprefix("--config.").partition("=")
        *parents, leaf = key.split(".")
        node = c
        for part in parents:
            node = node[part]
        node[leaf] = type(node[leaf])(value)
    return c


def test_dp_baseline_runs_on_every_host_of_a_slice_as_one_world():
    """`dp`: the config file to every host of the slice, then one process per TPU worker w
    with process id w in a world of the slice's hosts, coordinator on worker 0, in the
    slice's own zone; the command's overrides turn a TPU config into a valid DP run."""
    from decoupled_diloco import jax_world

    assert dp.COORDINATOR_PORT == jax_world.COORDINATOR_PORT
    spec = parse_accelerator("v5litepod-16")  # 4 hosts
    config = "configs/tpu_dense_multislice.py:2b"
    cmds = dp.dp_commands(
        spec, "dd", 2, 1, config, "gs://b/dp", "10.0.1.5", CROSS, ("--config.seed=2",)
    )
    assert cmds[0] == [
        *provision.TPU_VM, "scp", "configs/tpu_dense_multislice.py", "dd-1:", "--worker=all",
        "--zone=europe-west4-a", "--project=my-proj",
    ]  # fmt: skip
    runs = cmds[1:]
    assert [c[:7] for c in runs] == [[*TPU_SSH, "dd-1", f"--worker={w}"] for w in range(4)]
    assert all(_zone(c) == "europe-west4-a" for c in runs)
    for w, cmd in enumerate(runs):
        words = _remote_args(cmd)
        assert words[:5] == ["(nohup", "dd-venv/bin/python", "-m", "decoupled_diloco.main",
                             "--config=tpu_dense_multislice.py:2b"]  # fmt: skip
        main = dp.dp_main_command(config, "gs://b/dp", spec, w, "10.0.1.5", ("--config.seed=2",))
        assert words[1 : 1 + len(main)] == main and words[1 + len(main)] == ">"
        assert "--config.distributed.coordinator_address=10.0.1.5:8482" in main
        assert "--config.distributed.num_processes=4" in main
        assert f"--config.distributed.process_id={w}" in main
        run = config_lib.validate(_apply(_tpu_config("tpu_dense_multislice.py"), main[5:]))
        assert (run.runtime, run.num_learners, run.uses_syncer) == ("local", 1, False)
        assert run.distributed.world() == jax_world.World("10.0.1.5:8482", 4, w)
    # A single-host slice is a world of one: no jax.distributed arguments.
    one = dp.dp_main_command(config, "/mnt/d", parse_accelerator("v5litepod-8"), 0, "")
    assert not any("distributed" in w for w in one)
    with pytest.raises(ValueError, match="--workdir"):
        dp.dp_main_command(config, "runs/dp", spec, 0, "10.0.1.5")


def test_dp_execute_looks_up_worker_0(monkeypatch, capsys):
    calls = []

    def fake_run(cmd, check=False, capture_output=False, text=False):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="10.9.8.7\n" if "describe" in cmd else "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    _checked(monkeypatch)
    argv = ["dp", *COMMON, "--accelerator=v5p-16", "--slices=1", "--workdir=gs://b/x", "--execute"]
    assert launch.main(argv) == 0
    assert calls[0] == dp.worker0_ip_command("dd-0", V5E)
    assert calls[0][-1] == "--format=value(networkEndpoints[0].ipAddress)"
    assert len(calls) == 1 + 1 + 2  # look-up, scp, one ssh per host of v5p-16
    assert all("--config.distributed.coordinator_address=10.9.8.7:8482" in c[-1] for c in calls[2:])


@pytest.mark.parametrize("wheel", ["", "dist/decoupled_diloco-0.1.0-py3-none-any.whl"])
def test_setup_installs_the_same_versions_everywhere(wheel):
    source = cluster.Source(git_url="" if wheel else "https://example.com/dd.git", wheel=wheel)
    versions = cluster.Versions(python="3.11.9", jax="0.10.1", ray="2.50.0")
    cmds = cluster.setup_commands("dd", 2, V5E, source, versions)
    installs = [c for c in cmds if any(a.startswith("--command=") for a in c)]
    assert [c[:4] for c in installs] == [["gcloud", "compute", "ssh", "dd-head"]] + [
        TPU_SSH[:4]
    ] * 2
    for cmd in installs:
        words = _remote_args(cmd)  # balanced quoting: the remote shell can parse it
        assert "ray[default]==2.50.0" in words and "3.11.9" in words
    head_words, tpu_words = _remote_args(installs[0]), _remote_args(installs[1])
    assert "jax==0.10.1" in head_words and "jax[tpu]==0.10.1" in tpu_words
    assert all("--worker=all" in c for c in installs[1:])
    copies = [c for c in cmds if "scp" in c]
    if wheel:  # copied before it is installed, to the head (with configs/) and every slice
        assert len(copies) == 3 and all(wheel in c for c in copies)
        assert cmds.index(copies[0]) < cmds.index(installs[0])
        assert "decoupled_diloco[tpu] @ ./decoupled_diloco-0.1.0-py3-none-any.whl" in tpu_words
        assert "decoupled_diloco[tpu] @ ./decoupled_diloco-0.1.0-py3-none-any.whl" in head_words
    else:
        assert not copies
        assert "decoupled_diloco[tpu] @ git+https://example.com/dd.git@main" in tpu_words
        assert "decoupled_diloco[tpu] @ ./decoupled_diloco" in head_words


def test_the_tpu_extra_holds_what_a_tpu_host_needs():
    """The extra the launcher installs exists in setup.py, with gcsfs (gs:// without
    TensorFlow) and sentencepiece (the TPU configs' tokenizer)."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.keywords)
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    names = {r.split(">")[0].split("=")[0].split("[")[0] for r in extras[cluster.EXTRA]}
    assert {"gcsfs", "sentencepiece"} <= names


COMMON = ["--project=my-proj", "--zone=us-west4-a"]
STEPS = [
    ["create", *COMMON, "--accelerator=v5litepod-16", "--slices=2", "--spot"],
    ["setup", *COMMON, "--slices=2", "--git-url=https://example.com/dd.git"],
    ["ray-up", *COMMON, "--accelerator=v5litepod-16", "--slices=2"],
    [
        "launch",
        *COMMON,
        "--accelerator=v5litepod-16",
        "--slices=2",
        f"--checkpoint-dir={CKPT}",
        "--",
        "--config.seed=1",
    ],
    ["join", *COMMON, "--accelerator=v5litepod-16", "--slices=2", "--slice=1"],
    ["create", *COMMON, "--accelerator=v5litepod-16", "--slices=2", "--slice=1", "--spot"],
    ["setup", *COMMON, "--slices=2", "--slice=0", "--wheel=dist/dd-0.1-py3-none-any.whl"],
    ["delete", *COMMON, "--slices=2", "--slice=1"],
    ["status", *COMMON],
    ["dp", *COMMON, "--accelerator=v5litepod-16", "--slices=1", "--workdir=gs://b/dp", "--"],
    ["dp", *COMMON, "--accelerator=v5litepod-8", "--slices=2", "--slice=1", "--workdir=/mnt/d"],
    ["delete", *COMMON, "--slices=2"],
]


def _no_subprocess(*args, **kwargs):
    raise AssertionError(f"a dry run must not run anything: {args}")


def _checked(monkeypatch) -> list:
    """The local config check replaced by a recorder (it runs the entry point: tested below)."""
    steps = []

    def fake(args):
        steps.append(args.step)
        return "# checked here: (faked)"

    monkeypatch.setattr(launch, "check_config", fake)
    return steps


@pytest.mark.parametrize("argv", STEPS, ids=[f"{s[0]}{i}" for i, s in enumerate(STEPS)])
def test_dry_run_prints_exact_commands_and_runs_nothing(argv, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    checked = _checked(monkeypatch)
    assert launch.main(argv) == 0
    assert checked == ([argv[0]] if argv[0] in ("launch", "dp") else [])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == launch.DRY_RUN_NOTE
    printed = [shlex.split(line) for line in lines if not line.startswith("#")]
    assert printed == launch.plan(launch._parser().parse_args(argv))
    assert all(cmd[0] == "gcloud" for cmd in printed)


def test_execute_runs_every_command_and_looks_up_the_head_ip(monkeypatch, capsys):
    calls = []

    def fake_run(cmd, check=False, capture_output=False, text=False):
        calls.append(cmd)
        assert check
        out = "10.1.2.3\n" if "describe" in cmd else ""
        return subprocess.CompletedProcess(cmd, 0, stdout=out)

    monkeypatch.setattr(subprocess, "run", fake_run)
    argv = ["ray-up", *COMMON, "--accelerator=v5litepod-16", "--slices=2", "--execute"]
    assert launch.main(argv) == 0
    spec = parse_accelerator("v5litepod-16")
    expected = cluster.ray_up_commands(spec, "dd", 2, "10.1.2.3", V5E)
    assert calls == [provision.head_ip_command("dd", V5E), *expected]
    assert launch.DRY_RUN_NOTE not in capsys.readouterr().out


def test_execute_stops_at_the_first_failure(monkeypatch):
    calls = []

    def failing_run(cmd, check=False, **kwargs):
        calls.append(cmd)
        raise subprocess.CalledProcessError(3, cmd)

    monkeypatch.setattr(subprocess, "run", failing_run)
    assert launch.main(["delete", *COMMON, "--slices=2", "--execute"]) == 3
    assert len(calls) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["create", *COMMON, "--accelerator=v6e-8", "--slices=1"], "--accelerator"),
        (["create", *COMMON, "--accelerator=v5p-8", "--slices=0"], "--slices"),
        (["setup", *COMMON, "--slices=1"], "--git-url or --wheel"),
        (
            [
                "launch",
                *COMMON,
                "--accelerator=v5p-8",
                "--slices=1",
                f"--checkpoint-dir={CKPT}",
                "--",
                "-x",
            ],
            "--config.",
        ),
        (["launch", *COMMON, "--accelerator=v5p-8", "--slices=1"], "--checkpoint-dir"),
        (
            ["launch", *COMMON, "--accelerator=v5p-8", "--slices=1", "--checkpoint-dir=ck"],
            "--checkpoint-dir",
        ),
        (["join", *COMMON, "--accelerator=v5p-8", "--slices=2"], "--slice"),
        (["join", *COMMON, "--accelerator=v5p-8", "--slices=2", "--slice=2"], "--slice=2"),
        (["create", *COMMON, "--accelerator=v5p-8", "--slices=2", "--multislice"], "--multislice"),
        (["status", *COMMON, "--zones=us-west4-a,mars-1"], "--zones"),
    ],
)
def test_cli_rejects_bad_arguments(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    with pytest.raises(SystemExit) as exit_info:
        launch.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


LAUNCH_V5E = [
    "launch",
    *COMMON,
    "--accelerator=v5litepod-16",
    "--slices=2",
    f"--checkpoint-dir={CKPT}",
]
DP_V5E = ["dp", *COMMON, "--accelerator=v5litepod-16", "--slices=1", "--workdir=gs://b/dp"]


@pytest.mark.slow
def test_launch_checks_the_runs_config_here_before_printing_or_running(tmp_path, capsys):
    """`launch` and `dp` run the entry point's `--check_config` on the command they would
    start (config file, the launcher's keys, the overrides; as many CPU devices as the slice
    has chips): a config that would stop at start-up on the cluster stops here, before
    anything is printed or created; a good one is summarised in a comment. Nothing written."""
    workdir = tmp_path / "never"
    assert launch.main([*LAUNCH_V5E, f"--workdir={workdir}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == launch.DRY_RUN_NOTE
    assert out[1].startswith("# checked here: config ok: tpu_dense_multislice_2b: ray runtime, ")
    assert "2 learners x 16 devices (mesh fsdp 16)" in out[1]  # --slices, --accelerator
    assert not workdir.exists()

    with pytest.raises(SystemExit) as exit_info:
        launch.main([*LAUNCH_V5E, "--", "--config.train.stepz=3"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "would stop at start-up: error: unknown config key train.stepz" in captured.err
    assert not captured.out  # not one command printed

    # dp checks the local file its hosts get a copy of, with the slice's 16 chips.
    with pytest.raises(SystemExit):
        launch.main([*DP_V5E, "--", "--config.train.batch_size=24"])
    assert "train.batch_size (24) must be divisible" in capsys.readouterr().err

    # A v5litepod-16 is 4 hosts of 4 chips, each reading its own rows: a tensor axis of 8
    # runs across two hosts, which the slice would refuse at its first batch.
    with pytest.raises(SystemExit):
        launch.main([*LAUNCH_V5E, "--", "--config.mesh.fsdp=2", "--config.mesh.tensor=8"])
    assert "does not split the batch rows evenly across the learner's 4 hosts" in (
        capsys.readouterr().err
    )


def test_a_config_check_that_hangs_is_one_line(monkeypatch, capsys):
    """A check that cannot finish (a gs:// tokenizer out of reach) is an error, not a
    TimeoutExpired traceback."""
    monkeypatch.setattr(launch, "CHECK_TIMEOUT_S", 0.01)
    with pytest.raises(SystemExit) as exit_info:
        launch.main(LAUNCH_V5E)
    assert exit_info.value.code == 2
    assert "did not finish within 0.01 s" in capsys.readouterr().err


def test_overrides_of_the_launchers_own_keys_are_refused():
    """An override comes last on the command line and would win: 8 learners on 4 slices."""
    spec = parse_accelerator("v5litepod-16")
    with pytest.raises(ValueError, match=r"diloco.learners=8: the launcher sets that key"):
        cluster.main_command("c.py", "w", 4, spec, "h:1", CKPT, ("--config.diloco.learners=8",))
    with pytest.raises(ValueError, match=r"--config.ray.checkpoint_dir=gs://elsewhere"):
        cluster.main_command(
            "c.py",
            "w",
            4,
            spec,
            "h:1",
            CKPT,
            (f"--config.{cluster.CHECKPOINT_KEY}=gs://elsewhere",),
        )
    with pytest.raises(ValueError, match=r"--config.diloco.sync_every=0\)"):
        dp.dp_main_command("c.py", "gs://b/dp", spec, 0, "h", ("--config.diloco.sync_every=12",))
    assert cluster.main_command("c.py", "w", 4, spec, "h:1", CKPT, ("--config.seed=3",))[-1] == (
        "--config.seed=3"
    )


def test_launch_without_the_packages_to_check_with(monkeypatch, capsys):
    """No JAX here (a bare cloud shell): a dry run says the config went unchecked; --execute
    refuses until the packages are installed or --no-config-check is given."""
    monkeypatch.setattr(launch, "CHECK_NEEDS", ("no_such_module_for_the_test",))
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    assert launch.main(LAUNCH_V5E) == 0
    assert "# the run's config was not checked: no_such_module_for_the_test not installed" in (
        capsys.readouterr().out
    )
    with pytest.raises(SystemExit):
        launch.main([*LAUNCH_V5E, "--execute"])
    assert "--no-config-check" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    assert launch.main([*LAUNCH_V5E, "--execute", "--no-config-check", "--head-ip=10.0.0.2"]) == 0
    assert len(calls) == 1 and calls[0][:3] == ["gcloud", "compute", "ssh"]


def _has_key(c, dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    for part in parents:
        if part not in c:
            return False
        c = c[part]
    return leaf in c


def _tpu_config(file: str):
    return _load(ROOT / "configs" / file, file.removesuffix(".py")).get_config()


@pytest.mark.parametrize(
    "file, preset, accelerator, mesh",
    [
        ("tpu_dense_multislice.py", "gemma_2b", "v5litepod-32", (1, 32, 1, 1)),
        ("tpu_moe_v5p.py", "moe_2p8b_active", "v5p-32", (1, 2, 1, 8)),
    ],
)
def test_tpu_configs(file, preset, accelerator, mesh):
    c = _tpu_config(file)
    d = c.diloco
    assert (d.fragments, d.sync_every, d.overlap, d.quorum) == (24, 24, 2, 1)  # P, H, tau, K
    assert (c.runtime, c.model.preset, c.model.dtype) == ("ray", preset, "bfloat16")
    assert c.data.source == "tfds" and c.data.tfds_name.startswith("c4/")
    # A pre-trained tokenizer by default (T5's C4 model), no start-up training on any host.
    assert c.data.spm_model_path == T5_C4_SPM_MODEL
    assert c.model.vocab_size >= KNOWN_SPM_PIECES[T5_C4_SPM_MODEL]

    # Ray on TPU: learners on their chips, restarted however often Spot preempts them, Θ
    # evaluated on a learner's slice rather than on the head VM's CPU.
    assert (c.ray.accelerator, c.ray.max_restarts, c.ray.evaluate) == ("tpu", -1, "learner")

    # What the launcher passes: every key it overrides exists in the config file.
    spec = parse_accelerator(accelerator)
    main = cluster.main_command(file, "w", 4, spec, "10.0.0.2:6379", CKPT)
    for flag in main:
        key = flag.removeprefix("--config.").split("=")[0]
        if flag.startswith("--config.") and key != cluster.RAY_ADDRESS_KEY:
            assert _has_key(c, key), key
    c.diloco.learners, c.devices_per_learner = 4, spec.chips
    with pytest.raises(ValueError, match="ray.checkpoint_dir"):  # no shared path, no TPU run
        config_lib.validate(c)
    c.ray.checkpoint_dir = CKPT
    run = config_lib.validate(c)  # no TPU needed: the slice only enters through the mesh shape
    assert run.ray.checkpoint_dir == CKPT
    assert sharding.mesh_shape(run.mesh, run.devices_per_learner) == mesh
    preflight.check_hosts(run, spec.hosts)  # each host of the slice reads its own rows

    params = jax.eval_shape(lambda: models.init_params(run.model, jax.random.key(0)))
    leaves = jax.tree.leaves(params)
    assert all(leaf.dtype == jax.numpy.float32 for leaf in leaves)  # bf16 is compute only
    total = sum(leaf.size for leaf in leaves)
    assert total == models.count_params(run.model)
    assert 2.0e9 < models.count_params(run.model, activated=True) < 2.4e9


def test_moe_config_needs_a_slice_of_at_least_8_chips():
    c = _tpu_config("tpu_moe_v5p.py")
    c.ray.checkpoint_dir = CKPT
    c.devices_per_learner = parse_accelerator("v5p-8").chips  # 4 chips < expert axis 8
    with pytest.raises(ValueError, match="mesh"):
        config_lib.validate(c)


@pytest.mark.slow
def test_memory_table_counts_each_devices_shards(small_config):
    """memory_table.py on this backend: params and AdamW moments are the per-device shards
    of the model (fp32; moments 2x params), XLA's scratch is positive, the total holds all."""
    table = _load(ROOT / "scripts" / "tpu" / "memory_table.py", "memory_table")
    c = small_config(**{"mesh.fsdp": -1, "mesh.data": 1})
    r = table.measure(c, 16, jax.devices()[:8])
    run = config_lib.validate(small_config(**{"devices_per_learner": 8}))
    params = models.count_params(run.model) * 4
    assert params / 8 <= r["params"] < params  # FSDP over 8: about an eighth each
    assert 2 * r["params"] <= r["optimizer"] <= 2 * r["params"] + 64  # mu, nu (+ counters)
    assert r["temp"] > 0 and r["total"] >= r["params"] + r["optimizer"]
    assert (r["batch"], r["devices"], r["backend"]) == (16, 8, jax.default_backend())
    # Each device gathers at least the 7/8 of the parameters it does not hold, once.
    assert r["comm"] >= params * 7 / 8, (r["comm"], params)
    # XLA:CPU records its loops' lengths; a loop of unread length marks the cell a bound.
    assert r["unknown_trips"] == 0 and not table._comm(r).startswith(">=")
    assert table._comm({**r, "unknown_trips": 1}) == ">=" + table._comm(r)
    # --remat overrides the config's policy; recomputing each block's forward costs FLOPs.
    full = table.measure(c, 16, jax.devices()[:8], remat="full")
    assert (r["remat"], full["remat"]) == ("none", "full")
    assert full["flops"] > r["flops"] > 0
    # --set changes the config before it is measured; rows name their mesh.
    assert r["mesh"] == "1x8x1x1"
    data = table.measure(table._overridden(c, ["mesh.fsdp=1", "mesh.data=-1"]), 16,
                         jax.devices()[:8])  # fmt: skip
    assert data["mesh"] == "8x1x1x1" and data["params"] == params  # replicated
    with pytest.raises(SystemExit, match="--set=mesh: expected KEY=VALUE"):
        table._overridden(c, ["mesh"])
