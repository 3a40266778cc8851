"""The ablation scripts under experiments/: their configs (cheap) and end-to-end runs (slow).

Each script runs in its own process (absl flags are process-global).
- Cheap: `--check_configs` builds and validates every arm's config for --smoke, --quick and
  full mode at CPU scale and for TPU scale (TPU meshes shrunk to the fake CPU devices), runs
  nothing, and dumps them; the tests check the invariants the tables rely on.
- `slow`: `--smoke` runs (~6 steps, first and last arm, every arm validated), minutes in all.
"""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = (
    "quality_ladder",
    "quality_targets",
    "quality_equal_tokens",
    "learners_sweep",
    "quorum_grace",
    "heterogeneous",
    "merge_rule",
    "precision",
    "fragmentation",
    "scavenging",
    "cross_region",
    "goodput_failures",
)


def _run(name: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "experiments" / f"{name}.py"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def configs_of(tmp_path_factory):
    """name -> {(scale, mode): {(arm, seed): config dict}} from --check_configs (cached)."""
    cache = {}

    def get(name: str) -> dict:
        if name not in cache:
            tmp = tmp_path_factory.mktemp(name)
            _run(name, "--check_configs", f"--out={tmp}", timeout=300)
            out = defaultdict(dict)
            for key, c in json.loads((tmp / "configs.json").read_text()).items():
                scale, mode, arm, seed = key.split("/")
                out[scale, mode][arm, int(seed)] = c
            cache[name] = out
        return cache[name]

    return get


def _synchronous(c: dict) -> bool:
    d = c["diloco"]
    return d["sync_every"] > 0 and d["learners"] > 1 and d["quorum"] == d["learners"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_arm_config_builds_and_validates(name, configs_of):
    configs = configs_of(name)
    for scale in ("cpu", "tpu"):
        for mode in ("smoke", "quick", "full"):
            runs = configs[scale, mode]
            assert runs, (scale, mode)
            seeds = {seed for _, seed in runs}
            assert len(seeds) >= (2 if mode == "full" else 1), (scale, mode, seeds)
            # Every arm is scored on the same held-out sequences.
            evals = {c["train"]["eval_batches"] * c["train"]["batch_size"] for c in runs.values()}
            assert len(evals) == 1, (scale, mode, evals)
            for (arm, _), c in runs.items():
                # Synchronous baselines wait for the merge at t + tau (design brief); the
                # ladder's no_wait rung and the targets' decoupled_km are K = M that does
                # not wait, on purpose.
                never_waits = {("quality_ladder", "no_wait"), ("quality_targets", "decoupled_km")}
                if _synchronous(c) and (name, arm) not in never_waits:
                    assert c["diloco"]["max_wait"] == -1, (scale, mode, arm)
    for (arm, seed), c in configs["cpu", "quick"].items():
        full = configs["cpu", "full"].get((arm, seed))
        if full is not None:
            assert c["train"]["steps"] < full["train"]["steps"], arm


@pytest.mark.parametrize("name", SCRIPTS)
def test_tpu_scale_keeps_tpu_settings_and_the_ablation(name, configs_of):
    configs = configs_of(name)
    cpu, tpu = configs["cpu", "full"], configs["tpu", "full"]
    assert cpu.keys() == tpu.keys()
    scale = set()
    for key, t in tpu.items():
        c = cpu[key]
        assert t["model"]["preset"].startswith(("gemma", "moe_")), key
        assert t["data"]["source"] == "tfds" and t["train"]["learning_rate"] == 4e-4, key
        if c["diloco"]["sync_every"]:
            assert t["runtime"] == "ray" and t["diloco"]["sync_every"] == 24, key
            assert t["diloco"]["outer_lr"] == 0.7 and t["diloco"]["heartbeat_timeout"] == 600
            assert t["diloco"]["alpha"] == 0.5  # the mixing that goes with that outer step
        else:
            assert t["runtime"] == "local" and t["diloco"]["sync_every"] == 0, key
        for k in ("learners", "quorum", "max_wait", "merge", "weights", "compression",
                  "reply_compression", "apply", "overlap"):  # fmt: skip
            assert t["diloco"][k] == c["diloco"][k], (key, k)
        assert t["faults"] == c["faults"], key
        total = t["train"]["batch_size"] * t["diloco"]["learners"]
        scale.add(total / (c["train"]["batch_size"] * c["diloco"]["learners"]))
    assert len(scale) == 1, scale  # every arm's share of the total batch carries over


def test_ladder_changes_one_thing_per_rung_and_scales_to_mid(configs_of):
    configs = configs_of("quality_ladder")
    full = {arm: c for (arm, seed), c in configs["cpu", "full"].items() if seed == 0}
    rungs = ["diloco", "streaming", "overlap", "land", "no_wait", "quorum1", "grace", "tokens",
             "rda", "mixing", "outer_lr"]  # fmt: skip
    assert set(full) == {"dp", *rungs}
    for below, above in zip(rungs, rungs[1:], strict=False):
        changed = {k for k, v in full[above]["diloco"].items() if full[below]["diloco"][k] != v}
        assert len(changed) == 1, (below, above, changed)
    assert full["rda"]["diloco"]["merge"] == "rda" and full["rda"]["diloco"]["quorum"] == 1
    assert full["diloco"]["diloco"]["alpha"] == 0.0 and full["mixing"]["diloco"]["alpha"] == 0.5
    assert full["overlap"]["diloco"]["apply"] == "rebase"
    assert full["land"]["diloco"]["apply"] == "land"
    # synchronous DiLoCo's outer step up to the last rung, which is tiny_decoupled as shipped
    assert full["mixing"]["diloco"]["outer_lr"] == full["diloco"]["diloco"]["outer_lr"] == 1.0
    shipped = configs_of("quality_targets")["cpu", "full"]["decoupled", 0]["diloco"]
    assert full["outer_lr"]["diloco"] == shipped
    tokens = {c["train"]["batch_size"] * c["diloco"]["learners"] for c in full.values()}
    assert len(tokens) == 1  # equal tokens per step in every arm
    mid = {arm: c for (arm, seed), c in configs["mid", "full"].items() if seed == 0}
    assert {c["model"]["preset"] for c in mid.values()} == {"mid"}
    assert mid["rda"]["train"]["batch_size"] == 32 and mid["dp"]["train"]["batch_size"] == 128
    assert mid["rda"]["data"]["seq_len"] == 256 and mid["rda"]["train"]["steps"] == 1000


def test_quality_targets_arms_differ_from_the_shipped_decoupled_in_one_setting(configs_of):
    configs = configs_of("quality_targets")
    for scale in ("cpu", "mid"):
        arms = {arm: c for (arm, seed), c in configs[scale, "full"].items() if seed == 0}
        ref = arms["decoupled"]["diloco"]
        assert ref["quorum"] == 1 and ref["merge"] == "rda" and ref["max_wait"] == 0

        def changed(arm, arms=arms, ref=ref):
            return {k for k, v in arms[arm]["diloco"].items() if ref[k] != v}

        assert changed("decoupled_km") == {"quorum"}
        # DiLoCo's outer Nesterov, with the mixing (tiny_decoupled's) it needs when decoupled
        assert changed("decoupled_nag") == {"outer_lr", "outer_momentum"}
        assert arms["decoupled_nag"]["diloco"]["alpha"] == ref["alpha"] == 0.5
        assert changed("decoupled_mom") == {"outer_lr", "outer_momentum"}
        mom = arms["decoupled_mom"]["diloco"]  # the steady-state step lr / (1 - mu) of ref's
        assert mom["outer_lr"] / (1 - mom["outer_momentum"]) == pytest.approx(
            ref["outer_lr"] / (1 - ref["outer_momentum"])
        )
        assert mom["outer_momentum"] >= 0.5
        assert changed("decoupled_lr1") == {"outer_lr"}
        assert arms["decoupled_lr1"]["diloco"]["outer_lr"] == 1.0 > ref["outer_lr"]
        sync = arms["streaming_sync"]["diloco"]
        assert sync["outer_lr"] == 1.0 and sync["outer_momentum"] == 0.0  # DiLoCo's step
        assert sync["quorum"] == 4 and sync["max_wait"] == -1 and sync["overlap"] == 0
        assert sync["fragments"] == ref["fragments"] == 6
        sync_nag = arms["streaming_sync_nag"]["diloco"]
        assert {k for k, v in sync_nag.items() if sync[k] != v} == {"outer_lr", "outer_momentum"}
        assert sync_nag["outer_momentum"] == arms["decoupled_nag"]["diloco"]["outer_momentum"]
        sync_mom = arms["streaming_sync_mom"]["diloco"]
        # the same momentum, at the synchronous arm's own steady-state step
        assert {k for k, v in sync_mom.items() if sync[k] != v} == {"outer_lr", "outer_momentum"}
        assert sync_mom["outer_momentum"] == mom["outer_momentum"]
        assert sync_mom["outer_lr"] / (1 - sync_mom["outer_momentum"]) == pytest.approx(
            sync["outer_lr"] / (1 - sync["outer_momentum"])
        )
        tokens = {c["train"]["batch_size"] * c["diloco"]["learners"] for c in arms.values()}
        assert len(tokens) == 1, (scale, tokens)  # equal tokens per step in every arm


def test_quality_covers_dense_and_moe_families(configs_of):
    arms = {arm for arm, _ in configs_of("quality_equal_tokens")["cpu", "full"]}
    assert {"dp", "diloco", "streaming", "decoupled_m2", "decoupled_m4", "decoupled_m8"} <= arms
    assert {"dp_moe", "diloco_moe", "streaming_moe", "decoupled_moe_m4"} <= arms


def test_run_all_lists_every_experiment():
    cmd = [sys.executable, str(ROOT / "experiments" / "run_all.py"), "--dry_run", "--quick"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in SCRIPTS:
        assert f"experiments/{name}.py" in proc.stdout and "--quick" in proc.stdout
        # Quick runs never write over the published full-mode results.
        assert f"--out=experiments/results_quick/{name} " in proc.stdout
    # Every scale the scripts take is passed through (run_all refused --scale=mid).
    harness = (ROOT / "experiments" / "harness.py").read_text()
    scales = re.search(r'"scale", "cpu", (\[[^]]*\])', harness).group(1)
    for scale in ast.literal_eval(scales):
        proc = subprocess.run([*cmd, f"--scale={scale}", "--only=merge_rule"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (f"--scale={scale}" in proc.stdout) == (scale != "cpu"), proc.stdout


def test_only_full_mode_writes_the_published_results(monkeypatch):
    sys.path.insert(0, str(ROOT / "experiments"))
    from outputs import results_dir

    published = "experiments/results/merge_rule"
    assert str(results_dir(published, "full", given=False)) == published
    assert (
        str(results_dir(published, "smoke", given=False)) == "experiments/results_smoke/merge_rule"
    )
    assert str(results_dir(published, "quick", given=True)) == published  # --out was given
    assert str(results_dir("/tmp/mine", "quick", given=False)) == "/tmp/mine"
    # A default lies in the checkout wherever the script starts (was experiments/experiments/
    # results/... from experiments/).
    monkeypatch.chdir(ROOT / "experiments")
    assert results_dir(published, "full", given=False).resolve() == ROOT / published
    assert str(results_dir(published, "quick", given=True)) == published


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_smoke_writes_table_plot_and_runs(name, tmp_path):
    out = tmp_path / name
    args = ("--quick", "--smoke", f"--out={out}")
    proc = _run(name, *args)
    assert "step " in proc.stdout  # progress lines while a run trains
    table = (out / f"{name}.md").read_text()
    assert table.count("|---") >= 1 and "nan ±" not in table
    assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    runs = json.loads((out / f"{name}.json").read_text())
    assert runs and all(r["summary"]["steps"] > 0 for r in runs)
    # Resumable: a second invocation finds every summary and runs nothing.
    again = _run(name, *args, timeout=300)
    assert again.stdout.count("(cached)") == len(runs)


@pytest.mark.slow
def test_device_check_stops_at_its_deadline_and_returns_the_tables_so_far(tmp_path):
    """scripts/device_check.sh, as a lent GPU would run it, at the tiny CPU scale (SMOKE=1),
    with runs assumed to take at least as long as the whole deadline (EXPECTED_RUN_S): after
    its first two runs, which always go, it starts a run only if one as long as the last
    would end before DEADLINE_S, so it stops there however fast this machine is, and $OUT
    holds the table of every run that ended."""
    out, deadline, expected = tmp_path / "out", 150, 150
    env = {**os.environ, "SMOKE": "1", "DEADLINE_S": str(deadline), "OUT": str(out),
           "EXPECTED_RUN_S": str(expected), "DEVICE_CHECK_DIR": str(tmp_path)}  # fmt: skip
    script = ROOT / "scripts" / "device_check.sh"
    proc = subprocess.run(["bash", str(script), "quality"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (out / "quality.log").read_text()
    # "[T s] ARMS seeds SEEDS: rc 0, D s" after each run
    done = re.findall(r"\[(\d+) s\] (\S+) seeds (\S+): rc 0, (\d+) s", log)
    assert [(a, s) for _, a, s, _ in done][:2] == [("streaming_sync", "0"),
                                                   ("streaming_sync,decoupled", "0")]  # fmt: skip
    assert len(done) < 4  # stopped: the next run would have ended past the deadline
    assert log.rstrip().endswith("stopped: no time for another run")
    t, last = int(done[-1][0]), int(done[-1][3])
    assert t + max(last, expected) + 15 >= deadline
    runs = json.loads((out / "mid_2arms.json").read_text())
    arms, seeds = done[-1][1].split(","), [int(x) for x in done[-1][2].split(",")]
    assert sorted((r["arm"], r["seed"]) for r in runs) == sorted(
        (a, s) for a in arms for s in seeds
    )
    assert "| Streaming, synchronous |" in (out / "mid_2arms.md").read_text()


def test_device_check_starts_nothing_when_no_time_is_left(tmp_path):
    """With the deadline passed, a part says so and runs nothing (it ran `timeout` with a
    negative limit, an error, or 0: no limit at all)."""
    env = {**os.environ, "SMOKE": "1", "DEADLINE_S": "5", "OUT": str(tmp_path / "out"),
           "DEVICE_CHECK_DIR": str(tmp_path)}  # fmt: skip
    script = ROOT / "scripts" / "device_check.sh"
    proc = subprocess.run(["bash", str(script), "mfu"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "s left before DEADLINE_S" in proc.stderr
    assert not (tmp_path / "out" / "speed_mfu.log").exists()


@pytest.mark.slow
def test_cached_run_reruns_when_its_config_changes(tmp_path):
    args = ("--smoke", "--arms=none", f"--out={tmp_path}")
    _run("precision", *args)
    assert "(cached)" in _run("precision", *args).stdout
    changed = _run("precision", *args, "--set=train.learning_rate=0.002").stdout
    assert "another config, rerunning" in changed and "(cached)" not in changed
    # A run made by other code (an older package) reruns too, unless asked to keep it.
    stamp_path = next(tmp_path.glob("runs/*/experiment.json"))
    stamp = json.loads(stamp_path.read_text())
    stamp_path.write_text(json.dumps({**stamp, "code": "0123456789abcdef"}))
    kept = _run("precision", *args, "--set=train.learning_rate=0.002", "--reuse_other_code")
    assert "made by other code (0123456789abcdef)" in kept.stdout and "(cached)" in kept.stdout
    rerun = _run("precision", *args, "--set=train.learning_rate=0.002").stdout
    assert "made by other code (0123456789abcdef" in rerun and "(cached)" not in rerun
    assert "0123456789abcdef" not in stamp_path.read_text()


@pytest.mark.slow
def test_quality_ratios_are_to_each_familys_own_dp(tmp_path):
    arms = "dp,decoupled_m2,dp_moe,decoupled_moe_m4"
    _run("quality_equal_tokens", "--smoke", f"--arms={arms}", f"--out={tmp_path}")
    table = (tmp_path / "quality_equal_tokens.md").read_text()
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {
        r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])
    }
    assert len(rows) == 4
    loss, ratio = header.index("final eval loss"), header.index("ratio to its DP")
    families = {
        "Decoupled DiLoCo (M=2)": "data-parallel",
        "MoE Decoupled DiLoCo (M=4)": "MoE data-parallel",
    }
    for arm, dp in families.items():
        assert rows[dp][ratio] == "1.0000"  # each family's reference is its own DP run
        expected = float(rows[arm][loss]) / float(rows[dp][loss])
        assert float(rows[arm][ratio]) == pytest.approx(expected, abs=2e-4)


@pytest.mark.slow
def test_inner_lr_sweep_compares_each_arm_at_its_best_lr(tmp_path):
    _run(
        "quality_equal_tokens",
        "--smoke",
        "--arms=dp,decoupled_m2",
        "--inner_lrs=0.003,0.006",
        f"--out={tmp_path}",
    )
    table = (tmp_path / "quality_equal_tokens.md").read_text()
    best = table.split("Each arm at its best swept inner lr:")[1]
    rows = [
        line for line in best.splitlines() if line.startswith("| ") and "best inner lr" not in line
    ]
    rows = [r for r in rows if not r.startswith("|---")]
    assert len(rows) == 2
    for row in rows:
        assert row.split("|")[2].strip() in ("0.003", "0.006")
    assert next(r for r in rows if "data-parallel" in r).split("|")[4].strip() == "1.0000"
    # Every arm ran at every lr.
    assert len(list((tmp_path / "runs").glob("*@lr*"))) == 4


@pytest.mark.parametrize(
    "args, why",
    [
        (["--seeds=a,b"], "--seeds=a,b: seeds are integers >= 0"),
        (["--seeds=0,0"], "--seeds=0,0: give one or more distinct integers >= 0"),
        (["--smoke", "--budget_s=-1"], "--budget_s=-1: a cap in seconds"),
        (["--arms=K4,no_such_arm"], "--arms: unknown ['no_such_arm']"),
        (["--set=foo"], "--set='foo': expected key=value"),
        (["--set=diloco.no_such_key=1"], ": diloco.no_such_key is not a known key"),
    ],
)
def test_bad_seeds_and_budgets_fail_before_any_run(tmp_path, args, why):
    """They ran: letters as a traceback, a repeated seed as a spread of 0, a negative budget
    stopping every run after one step, with tables written as if valid. Nor is the output
    folder made for a run refused (an unknown arm left an empty one). A usage error, not a
    traceback."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "experiments" / "quorum_grace.py"), f"--out={out}"]
    proc = subprocess.run([*cmd, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and why in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize(
    "script, args, why",
    [
        ("quality_ladder", ["--outer=0.7"], "--outer takes lr,momentum"),
        ("cross_region", ["--step_s=0"], "--step_s: seconds, > 0"),
        ("goodput_sensitivity", ["--horizon_days=0"], "--horizon_days: > 0"),
        ("run_all", ["--seeds=a", "--quick"], "--seeds=a: seeds are integers >= 0"),
    ],
)
def test_bad_script_flags_are_refused_before_anything_runs(tmp_path, script, args, why):
    """--outer=0.7 unpacked into a traceback; --step_s=0 divided by zero after every run of
    cross_region; run_all started each experiment to fail on the same --seeds."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "experiments" / f"{script}.py"), f"--out={out}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and why in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not out.exists(), proc.stderr[-2000:]


def test_an_experiments_help_lists_the_flags_it_takes():
    """The shared flags (harness.define_flags) are listed by each script's --help, not only
    by --helpfull (where absl otherwise puts another module's flags)."""
    cmd = [sys.executable, str(ROOT / "experiments" / "merge_rule.py"), "--help"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    for flag in ("--[no]quick", "--seeds", "--out", "--scale", "--set"):
        assert flag in proc.stdout + proc.stderr, proc.stdout[-2000:]
    assert proc.returncode == 0  # absl's own --help exits 1


LADDER_TABLE = """
import sys
sys.path.insert(0, "experiments")
sys.argv = ["quality_ladder.py", "--smoke"]
import quality_ladder as q
from absl import flags
from tables import Result
flags.FLAGS(sys.argv)
arms = {a.name: a for a in q.arms()}
loss = {"dp": 1.0, "diloco": 1.2, "streaming": 1.1, "rda": 1.5, "mixing": 1.8}
summary = lambda v: {"final_eval_loss": v, "mean_learners_per_merge": 4.0,
                     "dropped_offers": 0, "tokens": 1000}
print(q.markdown([Result(arms[n], 0, summary(v), None, None) for n, v in loss.items()]))
"""


def test_the_ladders_rung_below_is_the_one_it_climbs_from_or_none():
    """With rungs left out (--arms, --smoke) "÷ rung below" divided by whichever rung ran
    before: `+ RDA` by DiLoCo, three rungs down. Only the rung directly below counts."""
    proc = subprocess.run([sys.executable, "-c", LADDER_TABLE], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {
        cells[0]: cells
        for cells in (
            [c.strip() for c in line.strip("|").split("|")]
            for line in proc.stdout.splitlines()
            if line.startswith("| ")
        )
    }
    below = rows["rung"].index("÷ rung below")
    assert rows["DiLoCo (P=1, K=M, wait)"][below] == "-"
    assert rows["+ P=6 fragments"][below] == f"{1.1 / 1.2:.4f}"
    assert rows["+ RDA"][below] == "-"  # its rung below (token weights) did not run
    assert rows["+ mixing alpha 0.5"][below] == f"{1.8 / 1.5:.4f}"


SCAVENGING_TABLE = """
import sys
sys.path.insert(0, "experiments")
sys.argv = ["scavenging.py", "--smoke"]
import scavenging as s
from absl import flags
from tables import Result
flags.FLAGS(sys.argv)
arms = {a.name: a for a in s.arms()}
summary = {"final_eval_loss": 2.0, "tokens": 10, "mean_learners_per_merge": 4.0,
           "wall_seconds": 9.0}
print(s.markdown([Result(arms["plus4"], 0, summary, "/nonexistent", None)]))
"""


def test_scavenging_without_its_base_arm_still_writes_its_table():
    """--arms=plus4 (documented) trained, then failed on the missing base arm's loss."""
    proc = subprocess.run([sys.executable, "-c", SCAVENGING_TABLE], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("| M=4 + 4")]
    assert row.split("|")[2].strip() == "-" and "2.0000" in row
