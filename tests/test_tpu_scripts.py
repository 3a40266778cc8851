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
import tpu_provision as provision  # noqa: E402
from tpu_slices import check_name, node_ids, parse_accelerator  # noqa: E402

from decoupled_diloco import config as config_lib  # noqa: E402
from decoupled_diloco import models, sharding  # noqa: E402


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
    with pytest.raises(ValueError, match="--multislice"):
        provision.queued_resource_commands(spec, "dd", 1, V5P, multislice=True)
    with pytest.raises(ValueError, match="--zone"):
        provision.Cloud("my-proj", "")
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
    with pytest.raises(ValueError, match="--multislice"):
        provision.queued_resource_commands(spec, "dd", 2, V5P, multislice=True, only=1)
    with pytest.raises(ValueError, match="--multislice"):
        provision.delete_commands("dd", 2, V5P, multislice=True, only=0)


def test_v5e_commands():
    spec = parse_accelerator("v5litepod-16")
    create = provision.queued_resource_commands(spec, "dd", 2, V5E, spot=True)
    flags = [
        "--accelerator-type=v5litepod-16",
        "--runtime-version=v2-alpha-tpuv5-lite",
        "--zone=us-west4-a",
        "--project=my-proj",
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


def test_v5p_multislice_commands():
    spec = parse_accelerator("v5p-32")
    create = provision.queued_resource_commands(
        spec, "dd", 3, V5P, reserved=True, multislice=True, valid_until_duration="6h"
    )
    assert create == [
        [
            "gcloud", "compute", "tpus", "queued-resources", "create", "dd-qr",
            "--node-count=3", "--node-prefix=dd", "--accelerator-type=v5p-32",
            "--runtime-version=v2-alpha-tpuv5", "--zone=us-east5-a", "--project=my-proj",
            "--reserved", "--valid-until-duration=6h",
        ]
    ]  # fmt: skip
    assert provision.delete_commands("dd", 3, V5P, multislice=True) == [
        ["gcloud", "compute", "tpus", "queued-resources", "delete", "dd-qr",
         "--zone=us-east5-a", "--project=my-proj", "--force"],
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
    ["delete", *COMMON, "--slices=2"],
]


def _no_subprocess(*args, **kwargs):
    raise AssertionError(f"a dry run must not run anything: {args}")


@pytest.mark.parametrize("argv", STEPS, ids=[f"{s[0]}{i}" for i, s in enumerate(STEPS)])
def test_dry_run_prints_exact_commands_and_runs_nothing(argv, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    assert launch.main(argv) == 0
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
    ],
)
def test_cli_rejects_bad_arguments(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", _no_subprocess)
    with pytest.raises(SystemExit) as exit_info:
        launch.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


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
    assert c.model.vocab_size == c.data.spm_vocab_size

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
