"""Using what a run trained: load, evaluate, sample, export, report; re-running a finished
run; the entry points' one-line errors."""

import json
import logging
import re
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decoupled_diloco
from decoupled_diloco import config as config_lib
from decoupled_diloco import models
from decoupled_diloco.evaluate import evaluate
from decoupled_diloco.export import export
from decoupled_diloco.models.decode import generate
from decoupled_diloco.report import plot, table
from decoupled_diloco.runtime import launch
from decoupled_diloco.sample import sample

DP = {"train.steps": 8, "train.checkpoint_every": 4}  # keeps 2 saves


def _run(cfg, workdir) -> dict:
    return launch.run(config_lib.validate(cfg), str(workdir), verbose=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A data-parallel, a Decoupled (with a learner crash) and an MoE run."""
    from conftest import _small_config

    root = tmp_path_factory.mktemp("runs")
    dp = _small_config(**DP)
    dec = _small_config(**{"train.steps": 12, "diloco.learners": 2, "diloco.sync_every": 4,
                           "diloco.fragments": 2, "diloco.overlap": 1, "diloco.grace_gamma": 0.0,
                           "faults.unit": "steps", "faults.crashes": [[1, 6]],
                           "faults.restart_delay_s": 1.0,
                           "faults.speed_factors": [1.0, 3.0],
                           # a save every merge or so: two or more kept, however fast the run
                           "diloco.syncer_checkpoint_seconds": 0.2,
                           "diloco.syncer_checkpoint_duty": 1.0})  # fmt: skip
    moe = _small_config(**{"train.steps": 6, "model.preset": "tiny_moe",
                           "model.capacity_factor": 0.0})  # fmt: skip
    out = {}
    for name, cfg in (("dp", dp), ("dec", dec), ("moe", moe)):
        out[name] = (root / name, _run(cfg, root / name))
    return out


@pytest.mark.parametrize("name", ["dp", "dec"])
def test_load_then_evaluate_gives_the_runs_own_final_eval_loss(runs, name):
    workdir, summary = runs[name]
    assert summary["failures"] == (1 if name == "dec" else 0)  # its crash (at a step) happened
    model = decoupled_diloco.load(str(workdir))
    assert model.config.name == summary["name"]
    assert all(np.isfinite(v).all() for v in model.params.values())
    ids = model.tokenizer.encode("def ")
    logits, _ = model.forward([ids])
    assert logits.shape == (1, len(ids), model.config.model.vocab_size)
    with pytest.raises(ValueError, match=r"rows of one length, got lengths \[1, 4\]"):
        model.forward([ids, ids[:1]])  # ragged prompts: named, not numpy's error
    # ids outside the vocabulary (NaN logits past it, a wrap-around below 0) or not ints
    for bad, why in (([[1, 256]], r"must lie in \[0, 256\).*got 1..256"),
                     ([[-1, 3]], r"must lie in \[0, 256\).*got -1..3"),
                     ([[1.5, 2.0]], "must be integer ids, got dtype float64")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            model.forward(bad)
    loss, _ = evaluate(str(workdir))
    assert loss == pytest.approx(summary["final_eval_loss"], rel=1e-6, abs=1e-6)


def test_forward_copies_the_params_to_the_device_once_and_again_after_a_change(runs):
    """Each call copied every parameter to the device (seconds for a 2B model); the copy is
    now kept while `params` holds the same arrays, and an edit cannot leave it stale."""
    workdir, _ = runs["dp"]
    model = decoupled_diloco.load(str(workdir))
    ids = [model.tokenizer.encode("def f(x):")]
    first, _ = model.forward(ids)
    on_device = model.device_params()
    model.forward(ids)
    assert model.device_params() is on_device  # not copied again
    name = next(k for k in model.params if "embed" in k)
    model.params[name] = model.params[name] * 0.5  # a new array: copied again
    halved, _ = model.forward(ids)
    assert model.device_params() is not on_device
    with pytest.raises(ValueError, match="read-only"):
        model.params[name][0, 0] = 1.0  # in place: the device copy would not see it
    assert not np.allclose(np.asarray(halved), np.asarray(first))
    fresh = decoupled_diloco.load(str(workdir))
    fresh.params[name] = fresh.params[name] * 0.5
    np.testing.assert_allclose(np.asarray(halved), np.asarray(fresh.forward(ids)[0]), rtol=1e-6)


def test_evaluate_refuses_a_count_of_eval_batches_below_one(runs):
    workdir, _ = runs["dp"]
    for bad in (0, -1):  # -1 gave a loss of nan, 0 the run's own count
        with pytest.raises(ValueError, match=f"eval_batches must be an integer >= 1, got {bad}"):
            evaluate(str(workdir), eval_batches=bad)


def test_evaluate_refuses_a_batch_past_the_hosts_memory_before_running_it(runs, monkeypatch):
    """On XLA:CPU the OS kills a process past the host's memory without a word (exit 137):
    `evaluate --config.data.seq_len=5000` was. XLA's plan of one batch is held against the
    memory available first."""
    from decoupled_diloco.train import evaluate as evaluator

    workdir, summary = runs["dp"]
    monkeypatch.setattr(evaluator, "available_host_bytes", lambda: 2**20)
    with pytest.raises(ValueError, match=r"needs at least [0-9.]+ GiB of host memory .* 0\.0 GiB"):
        evaluate(str(workdir))
    monkeypatch.setattr(evaluator, "available_host_bytes", lambda: 2**50)
    assert evaluate(str(workdir))[0] == pytest.approx(summary["final_eval_loss"], abs=1e-6)


def test_evaluate_past_the_trained_length_is_warned_of(runs, caplog):
    workdir, _ = runs["dp"]
    trained = decoupled_diloco.load(str(workdir)).config.data.seq_len
    with caplog.at_level(logging.WARNING):
        evaluate(str(workdir), data_overrides={"seq_len": trained})
        assert "positions past" not in caplog.text
        evaluate(str(workdir), data_overrides={"seq_len": 2 * trained})
    assert f"past the {trained} it trained on" in caplog.text


def test_evaluate_on_another_corpus_differs(runs):
    workdir, summary = runs["dp"]
    other, _ = evaluate(str(workdir), data_overrides={"max_corpus_bytes": 200_000, "seed": 3,
                                                      "eval_fraction": 0.1})  # fmt: skip
    assert np.isfinite(other) and other != pytest.approx(summary["final_eval_loss"], abs=1e-6)


def test_evaluate_with_data_path_alone_scores_that_text(runs, tmp_path):
    """As in a run, --config.data.path without a source selects the path corpus."""
    workdir, summary = runs["dp"]
    text = tmp_path / "held_out.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    loss, _ = evaluate(str(workdir), data_overrides={"path": str(text)})
    assert np.isfinite(loss) and loss != pytest.approx(summary["final_eval_loss"], abs=1e-3)


@pytest.mark.parametrize("name", ["dp", "moe"])
def test_evaluate_text_predicts_every_token_of_the_files_once(runs, name, tmp_path):
    """`evaluate --text`: all of the files, not a split: their documents packed with the
    separator, windows of seq_len predictions one after another; against a float64 mean of
    the target log-probabilities from `Model.forward`, window by window. Whole batches of 8
    and an odd number left over, scored in batches of the mesh's batch split, the last
    filled up with copies (MoE too: its rows are routed on their own)."""
    from decoupled_diloco.evaluate import evaluate_text

    workdir, _ = runs[name]
    model = decoupled_diloco.load(str(workdir))
    docs = ["def f(x):\n    return x * 2\n" * 12, "import os\nprint(os.sep)\n" * 15]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    ids = []
    for d in docs:
        ids += list(model.tokenizer.encode(d)) + [model.tokenizer.eos_id]
    t = next(t for t in range(12, 30) if ((len(ids) - 1) // t) % 8 in (3, 5, 7))
    n = (len(ids) - 1) // t
    assert n > 8
    nll = []
    for i in range(n):
        window = ids[i * t : i * t + t + 1]
        logits, _ = model.forward([window[:-1]])
        logp = jax.nn.log_softmax(np.asarray(logits[0], np.float64), axis=-1)
        nll += [-float(logp[j, window[j + 1]]) for j in range(t)]
    loss, _, counts = evaluate_text(str(workdir), str(tmp_path / "corpus.jsonl"), seq_len=t)
    assert counts == {"files": 2, "tokens": len(ids), "windows": n,
                      "unscored_tokens": len(ids) - 1 - n * t}  # fmt: skip
    assert loss == pytest.approx(float(np.mean(nll)), rel=2e-5)
    with pytest.raises(ValueError, match="fewer than one window of data.seq_len"):
        evaluate_text(str(workdir), str(tmp_path / "corpus.jsonl"), seq_len=len(ids))
    with pytest.raises(ValueError, match=r"^--text='/no/such': no such file"):
        evaluate_text(str(workdir), "/no/such")


def test_export_round_trips_bit_exactly(runs, tmp_path):
    workdir, _ = runs["dec"]
    export(str(workdir), str(tmp_path / "model"))
    a, b = decoupled_diloco.load(str(workdir)), decoupled_diloco.load(str(tmp_path / "model"))
    assert a.params.keys() == b.params.keys() and a.config == b.config
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])
    # It records the step its parameters hold; --step means "at or before", as for a run.
    assert a.step == b.step == json.loads((tmp_path / "model" / "export.json").read_text())["step"]
    assert decoupled_diloco.load(str(tmp_path / "model"), step=a.step + 5).step == a.step
    with pytest.raises(ValueError, match=f"export of step {a.step}, after step {a.step - 1}"):
        decoupled_diloco.load(str(tmp_path / "model"), step=a.step - 1)
    with pytest.raises(TypeError, match="step must be a learner step .an int. or None, not '30'"):
        decoupled_diloco.load(str(workdir), step="30")
    with pytest.raises(ValueError, match="step must be >= 0, not -1"):
        decoupled_diloco.load(str(workdir), step=-1)
    # Never into a directory that holds something: an export, or a run's workdir.
    for taken in (tmp_path / "model", workdir):
        before = sorted(p.name for p in taken.iterdir())
        with pytest.raises(ValueError, match="is not empty"):
            export(str(workdir), str(taken))
        assert sorted(p.name for p in taken.iterdir()) == before


def test_relative_paths_load_export_and_evaluate(runs, tmp_path, monkeypatch):
    """A data-parallel run's learner checkpoint and an export's parameters are orbax
    checkpoints, which orbax refuses by a relative path (it read as an untrusted checkpoint,
    and an export died half-written)."""
    workdir, _ = runs["dp"]
    expected = decoupled_diloco.load(str(workdir))
    monkeypatch.chdir(workdir.parent)
    model = decoupled_diloco.load(workdir.name)
    np.testing.assert_array_equal(*(next(iter(m.params.values())) for m in (model, expected)))
    monkeypatch.chdir(tmp_path)
    export(str(workdir), "exported")
    assert decoupled_diloco.load("exported").step == expected.step
    with pytest.raises(ValueError, match="--out=.* is a file: choose a new folder"):
        export(str(workdir), "exported/export.json")
    with pytest.raises(ValueError, match="--out=.* cannot be made a folder: Not a directory"):
        export(str(workdir), "exported/export.json/model")
    with pytest.raises(FileNotFoundError):  # nothing to export: no folder is left behind
        export(str(tmp_path / "no_run"), "never")
    assert not (tmp_path / "never").exists()
    # The record names the workdir resolved: a relative one meant nothing read elsewhere.
    monkeypatch.chdir(workdir.parent)
    export(workdir.name, str(tmp_path / "from_relative"))
    assert decoupled_diloco.load(str(tmp_path / "from_relative")).source.startswith(
        f"export of {workdir}: learner step"
    )
    record = tmp_path / "from_relative" / "export.json"  # a step edited by hand is named
    record.write_text(json.dumps({**json.loads(record.read_text()), "step": "abc"}))
    with pytest.raises(ValueError, match=r"export.json: its step must be an int or null"):
        decoupled_diloco.load(str(tmp_path / "from_relative"), step=5)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exported" / "export.json").unlink()  # an export that died before its end
    with pytest.raises(ValueError, match="exported is an unfinished export"):
        decoupled_diloco.load("exported")


def test_a_workdir_under_the_home_folder_loads_by_tilde(runs, tmp_path, monkeypatch):
    """`--workdir=~/wd` read the run's config from a folder named "~" (not found), though an
    export loaded that way."""
    import shutil

    workdir, summary = runs["dp"]
    shutil.copytree(workdir, tmp_path / "wd")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert decoupled_diloco.load("~/wd").step == decoupled_diloco.load(str(workdir)).step
    assert evaluate("~/wd")[0] == pytest.approx(summary["final_eval_loss"])


@pytest.mark.parametrize("name", ["dp", "dec"])
def test_parameters_that_do_not_fit_the_runs_model_are_refused(runs, tmp_path, name):
    """Θ and an export are read without a target tree: with a config that says one layer
    (edited, or copied from another run) the model ran its first layer alone without a word
    (the other layers' parameters were ignored), or died deep in `forward`."""
    import shutil

    from decoupled_diloco import run_files

    workdir = tmp_path / name
    shutil.copytree(runs[name][0], workdir)
    file = workdir / "run_config.json"
    original = file.read_text()

    def edited(key, value):
        record = json.loads(original)
        record["model"][key] = value
        record["sha256"] = run_files._digest(record)
        file.write_text(json.dumps(record, indent=1))

    # (a data-parallel run's learner checkpoint restores into the model's tree: orbax refuses
    # it, which read as damage: "no learner checkpoint can be trusted")
    fewer = r"\d+ not in the model \(e.g. block_1/" if name == "dec" else "tree structures"
    edited("num_layers", 1)
    with pytest.raises(ValueError, match=r"do not fit the model its run_config.json describes"
                       rf".*{fewer}"):  # fmt: skip
        decoupled_diloco.load(str(workdir))
    edited("ffw_hidden", 2 * json.loads(original)["model"]["ffw_hidden"])
    other = r"\d+ of another shape \(e.g. block_0/" if name == "dec" else "stored shape"
    with pytest.raises(ValueError, match=other):
        decoupled_diloco.load(str(workdir))
    file.write_text(original)
    decoupled_diloco.load(str(workdir))  # (as the run wrote it: loads)


def test_evaluate_reads_a_run_that_recorded_keys_it_never_read(runs, tmp_path):
    """A run of before 2026-12-02 could record a tokenizer file with the byte tokenizer, or a
    TFDS folder with another source (ignored then, refused at start-up since): evaluating it
    was refused for keys the user cannot override."""
    import shutil

    from decoupled_diloco import run_files

    workdir, summary = runs["dp"]
    for key, value in (("spm_model_path", "/nowhere/t5.model"), ("tfds_data_dir", "/nowhere")):
        copy = tmp_path / key
        shutil.copytree(workdir, copy)
        record = json.loads((copy / "run_config.json").read_text())
        record["data"][key] = value
        record["sha256"] = run_files._digest(record)
        (copy / "run_config.json").write_text(json.dumps(record, indent=1))
        assert evaluate(str(copy))[0] == pytest.approx(summary["final_eval_loss"])


def test_evaluate_on_fewer_devices_takes_as_many_as_split_the_batch(small_config, monkeypatch):
    """A run of 8 devices per learner scored on a machine of 3: 3 do not split its batch of
    8 and the evaluation died in a sharding error; it takes 2. A mesh whose fixed axes need
    more devices than there are is refused naming both."""
    import jax

    from decoupled_diloco.evaluate import _learner0_mesh

    run = config_lib.validate(small_config(**{"devices_per_learner": 8}))
    fsdp = config_lib.validate(small_config(**{"devices_per_learner": 8, "mesh.fsdp": 4}))
    three = jax.devices()[:3]
    monkeypatch.setattr(jax, "devices", lambda *a: three)
    monkeypatch.setattr(jax, "device_count", lambda *a: len(three))
    assert _learner0_mesh(run).devices.size == 2
    with pytest.raises(ValueError, match=r"this machine's 3 devices .* batch of 8"):
        _learner0_mesh(fsdp)


def test_checkpoints_are_read_where_the_runtime_wrote_them(runs, tmp_path, monkeypatch):
    """The local runtime saves under the workdir whatever `ray.checkpoint_dir` says (it reads
    no ray.* key), a Ray run under `ray.checkpoint_dir`; a relative one is recorded
    absolute, so the model tools find it from any directory."""
    import dataclasses
    import shutil

    from decoupled_diloco import run_files

    workdir = tmp_path / "dp"
    shutil.copytree(runs["dp"][0], workdir)
    expected = decoupled_diloco.load(str(workdir))
    run = run_files.read_config(str(workdir))
    monkeypatch.chdir(tmp_path)
    elsewhere = dataclasses.replace(run.ray, checkpoint_dir="ray_ckpt")
    run_files.write(str(workdir), dataclasses.replace(run, ray=elsewhere))
    assert run_files.read_config(str(workdir)).ray.checkpoint_dir == str(tmp_path / "ray_ckpt")
    model = decoupled_diloco.load(str(workdir))  # local: the workdir's checkpoints
    np.testing.assert_array_equal(*(next(iter(m.params.values())) for m in (model, expected)))
    shutil.move(workdir / "checkpoints", tmp_path / "ray_ckpt")
    run_files.write(str(workdir), dataclasses.replace(run, ray=elsewhere, runtime="ray"))
    monkeypatch.chdir(workdir)  # (another directory: "ray_ckpt" is not here)
    model = decoupled_diloco.load(str(workdir))
    np.testing.assert_array_equal(*(next(iter(m.params.values())) for m in (model, expected)))


def test_an_export_of_an_earlier_step_records_the_step_it_holds(runs, tmp_path):
    workdir, summary = runs["dp"]  # learner checkpoints at steps 4 and 8
    export(str(workdir), str(tmp_path / "m"), step=6)
    info = json.loads((tmp_path / "m" / "export.json").read_text())
    assert info["step"] == 4 and decoupled_diloco.load(str(tmp_path / "m"), step=4).step == 4


def test_sampling_keeps_to_the_tokenizers_ids_when_the_embedding_is_padded_past_them():
    """model.vocab_size may exceed the tokenizer's vocabulary (a TPU config pads 32000
    pieces to 32768): `sample` failed on the ids past it (sentencepiece's OUT_OF_RANGE, the
    byte tokenizer's refusal). Greedy and sampled tokens keep below the tokenizer's size."""
    from decoupled_diloco.models.decode import sample_token

    logits = jnp.zeros((64, 512)).at[:, 300:].set(5.0)  # the padding rows look likeliest
    greedy = sample_token(logits, jax.random.key(0), 0.0, 0, vocab=256)
    drawn = sample_token(logits, jax.random.key(1), 1.0, 0, vocab=256)
    top = sample_token(logits, jax.random.key(2), 1.0, 8, vocab=256)
    assert max(int(greedy.max()), int(drawn.max()), int(top.max())) < 256
    assert int(sample_token(logits, jax.random.key(0), 0.0, 0).min()) >= 300  # vocab 0: all


@pytest.mark.parametrize("temperature", [1e-3, 1e-30, 1e-39, 1e-50])
def test_a_tiny_temperature_samples_the_greedy_token(temperature):
    """Logits over a temperature that float32 holds as a subnormal or 0 overflowed to +inf,
    where every positive logit tied and id 0 won over the greedy id 1."""
    from decoupled_diloco.models.decode import sample_token

    logits = jnp.asarray([[0.5, 3.0, 1.0, -2.0]] * 16)
    for seed in range(4):
        assert sample_token(logits, jax.random.key(seed), temperature, 0).tolist() == [1] * 16
        assert sample_token(logits, jax.random.key(seed), temperature, 2).tolist() == [1] * 16


@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_greedy_decoding_with_a_cache_equals_argmax_without_one(preset):
    """Prompts of different lengths in one batch, past the local window (64 tokens)."""
    dropless = {"capacity_factor": 0.0} if preset == "tiny_moe" else {}
    cfg = models.get_model_config(preset, **dropless)
    params = models.init_params(cfg, jax.random.key(1))
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
    out = generate(cfg, params, prompts, max_new_tokens=70, temperature=0.0)
    assert out.shape == (2, 75)
    forward = jax.jit(models.forward, static_argnums=0)
    for row, prompt in zip(out, prompts, strict=True):
        seq = list(prompt)
        while len(seq) < len(row):  # causal: padding after the last token changes nothing
            padded = jnp.asarray([seq + [0] * (len(row) - len(seq))], jnp.int32)
            logits, _ = forward(cfg, params, padded)
            seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
        np.testing.assert_array_equal(row, seq)


@pytest.mark.parametrize("group", [0, 48])
def test_a_capacity_moe_decodes_as_the_training_forward_routes_its_window(group):
    """With expert capacity a row is one routing group: decoding carries the slots its
    earlier tokens claimed, so every position's logits are those of the training forward
    over the window (the cache's length, or `group`). Each call had routed into fresh
    buffers: the prefill dropped what training kept, the steps dropped nothing (a review
    measured a next-token total variation of 0.18 on a trained model)."""
    from decoupled_diloco.models.decode import decode_step, init_cache
    from decoupled_diloco.models.transformer import Transformer

    cfg = models.get_model_config("tiny_moe", capacity_factor=0.5)  # half the tokens drop
    params = models.init_params(cfg, jax.random.key(1))
    S, prompt = 30, 9
    tokens = np.random.default_rng(0).integers(0, 256, (2, S)).astype(np.int32)
    window = max(group, S)
    logits, cache = decode_step(
        cfg, params, jnp.asarray(tokens[:, :prompt]), init_cache(cfg, 2, S), 0, window
    )
    decoded = [logits]
    for t in range(prompt, S):
        logits, cache = decode_step(
            cfg, params, jnp.asarray(tokens[:, t : t + 1]), cache, t, window
        )
        decoded.append(logits)
    padded = np.zeros((2, window), np.int32)
    padded[:, :S] = tokens
    full, aux = models.forward(cfg, params, jnp.asarray(padded))
    assert float(aux["dropped_fraction"]) > 0.2
    np.testing.assert_allclose(jnp.concatenate(decoded, axis=1), full[:, :S], atol=2e-4)
    # A write past the cache's end: XLA would move it back over earlier positions' slots.
    with pytest.raises(ValueError, match="the KV cache holds 30 positions: writing 1 at "
                                         "position 30 runs past its end"):  # fmt: skip
        decode_step(cfg, params, jnp.asarray(tokens[:, :1]), cache, S, window)
    with pytest.raises(ValueError, match="writing 2 at position 29 runs past its end"):
        Transformer(cfg).apply({"params": params}, jnp.asarray(tokens[:, :2]),
                                      init_cache(cfg, 2, S), 29, group=window)  # fmt: skip


def test_decoding_puts_the_parameters_on_the_device_once(monkeypatch):
    """`sample` hands `generate` the loaded host (numpy) parameters: passed on as they are,
    every token's step copied all of them to the accelerator again."""
    from decoupled_diloco.models import decode

    cfg = models.get_model_config("tiny")
    params = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.key(1)))
    seen, step = [], decode._next

    def spy(cfg, params, *args):
        seen.append(all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)))
        return step(cfg, params, *args)

    monkeypatch.setattr(decode, "_next", spy)
    decode.generate(cfg, params, [[1, 2, 3]], max_new_tokens=4)
    assert seen == [True] * 3


# A million samples: refused by the prefill's plan, or, where even their KV cache is past
# the free memory (3.8 GiB), before it.
MILLION_SAMPLES = r"1000000 sequence\(s\) of up to 8|--num_samples=1000000 x at least 5"


def test_sampling_is_deterministic_per_seed(runs):
    workdir, _ = runs["dp"]
    greedy = [sample(str(workdir), ["def "], 16, temperature=0.0) for _ in range(2)]
    assert greedy[0] == greedy[1]
    hot = [
        sample(str(workdir), ["def ", "x"], 16, 1.0, 5, seed=s, num_samples=2) for s in (0, 0, 1)
    ]
    assert hot[0] == hot[1] and hot[0] != hot[2] and len(hot[0]) == 4
    for kwargs, why in [({"temperature": -1.0}, "--temperature must be >= 0"),
                        ({"temperature": float("nan")}, "--temperature must be >= 0"),
                        ({"num_samples": 0}, "--num_samples must be >= 1"),
                        ({"top_k": 1000}, "--top_k=1000 is more than the model's"),
                        ({"top_k": -1}, "--top_k must be >= 0"),
                        ({"seed": 10**20}, r"--seed must be an int in \[0, 2\*\*63\)"),
                        ({"max_new_tokens": 0}, "--max_new_tokens must be >= 1, got 0"),
                        # a KV cache past the device's memory (the OOM killer took it),
                        # refused from its least size before the prefill's plan
                        ({"max_new_tokens": 10**10}, "at least 10000000001 tokens need"),
                        # a million samples (they ran for minutes before any check)
                        # (its KV cache fits here, 3.8 GiB: the prefill's plan does not)
                        ({"num_samples": 10**6}, MILLION_SAMPLES)]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            sample(str(workdir), ["def "], **{"max_new_tokens": 4, **kwargs})


def test_sample_refuses_what_the_free_memory_cannot_hold(runs, monkeypatch):
    """XLA's plan of the prefill is held against the memory free now (on the CPU the host's
    available memory, not its total: a process past it is killed without a word)."""
    from decoupled_diloco.models import decode

    workdir, _ = runs["dp"]
    cfg = decoupled_diloco.load(str(workdir)).config.model
    # (room for the least KV cache the sample checks first: the prefill's plan needs more)
    monkeypatch.setattr(decode, "available_host_bytes", lambda: decode.cache_bytes(cfg, 1, 5))
    with pytest.raises(ValueError, match=r"need [0-9.]+ GiB .* more than the 0\.0 GiB free"):
        sample(str(workdir), ["def "], 4)
    monkeypatch.setattr(decode, "available_host_bytes", lambda: 2**40)
    assert len(sample(str(workdir), ["def "], 4)[0][1]) == 4
    # A count of samples whose KV cache alone is past the memory is refused before the
    # batch's lists are made (a billion samples made gigabytes of them first).
    with pytest.raises(ValueError, match=r"--num_samples=1000000000 x at least 5 tokens need"):
        sample(str(workdir), ["def "], 4, num_samples=10**9)


def test_sample_takes_one_prompt_as_text_and_refuses_bad_arguments_by_name(runs):
    """A str was read as a list of one-character prompts; an empty list failed in max()
    after loading the model; a float count failed deep in JAX; text that is not UTF-8 said
    nothing of --prompt."""
    workdir = str(runs["dp"][0])
    assert [p for p, _ in sample(workdir, "def ", 2)] == ["def "]
    for prompts in ([], [b"def"]):
        with pytest.raises(ValueError, match="--prompt: give one or more prompts as text"):
            sample(workdir, prompts, 2)
    with pytest.raises(ValueError, match=r"--prompt='\\udcff' is not valid UTF-8"):
        sample(workdir, ["\udcff"], 2)
    for name in ("max_new_tokens", "top_k", "seed", "num_samples"):
        args = {"max_new_tokens": 2, name: 2.0}
        with pytest.raises(ValueError, match=f"--{name} must be an int, got 2.0"):
            sample(workdir, ["a"], **args)


def test_every_sample_has_max_new_tokens_whatever_its_prompts_length(runs, monkeypatch):
    """Prompts of different lengths share a batch that runs to the longest one plus
    max_new_tokens; a shorter prompt's sample still ends after max_new_tokens (it got the
    difference in extra tokens)."""
    from decoupled_diloco.data.tokenizer import ByteTokenizer

    workdir, _ = runs["dp"]
    monkeypatch.setattr(ByteTokenizer, "decode", lambda self, ids: f"<{len(ids)} ids>")
    out = sample(str(workdir), ["a", "a much longer prompt"], 5, temperature=0.0)
    assert [text for _, text in out] == ["<5 ids>", "<5 ids>"]


def test_an_empty_prompt_starts_a_document_and_long_samples_are_warned_of(runs, caplog):
    workdir, _ = runs["dp"]
    ((prompt, text),) = sample(str(workdir), [""], 8, temperature=0.0)
    assert prompt == "" and isinstance(text, str)  # from the separator (it was refused)
    seq_len = json.loads((workdir / "run_config.json").read_text())["data"]["seq_len"]
    with caplog.at_level(logging.WARNING):
        prompt = "a" * seq_len  # bytes: seq_len tokens
        sample(str(workdir), [prompt], 1, temperature=0.0)  # the model reads seq_len tokens
        assert "past the" not in caplog.text
        sample(str(workdir), [prompt], 2, temperature=0.0)
    assert f"to position {seq_len + 1}, past the {seq_len}" in caplog.text


def test_the_table_of_an_unfinished_run_says_so(runs, tmp_path):
    workdir, _ = runs["dp"]
    for name in ("metrics.jsonl", "run_config.json"):  # a run without its summary.json
        (tmp_path / name).write_bytes((workdir / name).read_bytes())
    text = table(str(tmp_path))
    assert "no summary.json: the run has not finished" in text
    assert "| summary | value |" not in text and "no summary.json" not in table(str(workdir))


@pytest.mark.parametrize("name", ["dp", "dec", "moe"])
def test_report_writes_a_png_and_a_table(runs, name, tmp_path):
    workdir, summary = runs[name]
    out = tmp_path / "report.png"
    titles = plot(str(workdir), str(out))
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert ("merges" in titles) == (name == "dec") and ("MoE expert load" in titles) == (
        name == "moe"
    )
    text = table(str(workdir))
    assert f"{summary['final_eval_loss']:.4g}" in text and "| learner |" in text
    # each learner's median host share / CPU share of its rows
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        rows = [r for r in map(json.loads, f) if r.get("learner") == 0 and "host_cpu_share" in r]
    host = statistics.median(r["host_share"] for r in rows)
    cpu = statistics.median(r["host_cpu_share"] for r in rows)
    assert re.search(rf"^\| 0 \| .* \| {host:.2f} / {cpu:.2f} \|$", text, re.M), text
    if name == "dec":  # the syncer's own time per merge, from merges.jsonl
        with open(workdir / "merges.jsonl", encoding="utf-8") as f:
            merges = [json.loads(line) for line in f]
        ms = 1e3 * sum(r["merge_seconds"] for r in merges) / len(merges)
        assert f"| mean merge time (ms) | {ms:.1f} |" in text


def test_a_finished_run_rerun_changes_nothing(runs):
    workdir, summary = runs["dp"]
    before = {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file()}
    from conftest import _small_config

    again = _run(_small_config(**DP), workdir)
    assert again == json.loads((workdir / "summary.json").read_text()) == summary
    assert {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file()} == before
    # A knob free to change (a preset's new memory default, say) reads the same run back.
    knobs = {"model.logits_chunk": 8, "model.remat": "full", "train.log_every": 3}
    assert _run(_small_config(**{**DP, **knobs}), workdir) == summary
    assert {p.name: p.read_bytes() for p in workdir.iterdir() if p.is_file()} == before
    with pytest.raises(ValueError, match="another config"):
        _run(_small_config(**{**DP, "train.steps": 9}), workdir)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_entry_points_fail_in_one_clear_line(tmp_path):
    typo = _cli("decoupled_diloco.main", "--config=configs/tiny_dense.py",
                f"--workdir={tmp_path}", "--config.diloco.learnrs=8")  # fmt: skip
    assert typo.returncode != 0 and "Traceback" not in typo.stderr
    assert 'unknown config key diloco.learnrs (Did you mean "learners"' in typo.stderr
    missing = _cli("decoupled_diloco.main", "--config=configs/nope.py", f"--workdir={tmp_path}")
    assert missing.returncode != 0 and "config file configs/nope.py not found" in missing.stderr
    helped = _cli("decoupled_diloco.main", "--help")
    assert helped.returncode == 0 and "decoupled_diloco/config.py" in helped.stdout
    typo = _cli("decoupled_diloco.evaluate", f"--workdir={tmp_path}", "--config.data.sourc=x")
    assert typo.returncode != 0 and "Traceback" not in typo.stderr
    assert 'unknown config key data.sourc (Did you mean "source"' in typo.stderr
    nothing = _cli("decoupled_diloco.evaluate", f"--workdir={tmp_path}/none")
    assert nothing.returncode != 0 and "run_config.json not found" in nothing.stderr


def test_a_run_without_saves_and_a_damaged_export_are_named(runs, tmp_path):
    """A run killed before its first save read "no learner checkpoint at or before step
    None: kept []"; a damaged export.json, JSON's own error with no file named."""
    import shutil

    from decoupled_diloco.loading import load

    workdir, _ = runs["dp"]
    bare = tmp_path / "bare"
    (bare / "checkpoints" / "learner_0").mkdir(parents=True)
    shutil.copy(workdir / "run_config.json", bare / "run_config.json")
    with pytest.raises(
        FileNotFoundError, match=r"no learner checkpoint in .*learner_0: the run saved none yet"
    ):
        load(str(bare))
    export(str(workdir), str(tmp_path / "export"))
    (tmp_path / "export" / "export.json").write_text("{bad")
    with pytest.raises(ValueError, match=r"export/export.json is not the export's record"):
        load(str(tmp_path / "export"))


def _flip_arrays(step_dir) -> None:
    """Bad bytes in the middle of every array file of a checkpoint step (Θ, moments)."""
    for path in step_dir.rglob("*"):
        if path.is_file() and "arrays" in str(path) and path.stat().st_size > 1024:
            with open(path, "r+b") as f:
                f.seek(f.seek(0, 2) // 2)
                f.write(b"\xff" * 64)


def _unsealed(record: dict) -> dict:  # (a record of before 2026-11-30: no digest)
    record.pop("sha256")
    record["model"]["d_model"] = "abc"
    return record


def _key_renamed(record: dict) -> dict:
    """One damaged byte in a key's name: the model would read the default (all global
    attention), silently another model (a review found it, 2026-11-30)."""
    record["model"]["attention_patterm"] = record["model"].pop("attention_pattern")
    return record


@pytest.mark.parametrize(
    "damage, why",
    [
        (b"[]", "holds a JSON list, not a run's config"),
        (b"\xff\xfe", "is not valid JSON \\('utf-8' codec"),
        (_unsealed, "does not hold a config this version reads"),
        (_key_renamed, "does not match the sha256 recorded in it"),
    ],
)
def test_a_damaged_run_config_is_named_by_the_model_tools(runs, tmp_path, damage, why):
    import shutil

    workdir = tmp_path / "dp"
    shutil.copytree(runs["dp"][0], workdir)
    file = workdir / "run_config.json"
    if callable(damage):
        damage = json.dumps(damage(json.loads(file.read_text())), indent=1).encode()
    file.write_bytes(damage)
    with pytest.raises(ValueError, match=f"run_config.json {why}"):
        decoupled_diloco.load(str(workdir))


# orbax leaves the failed read's coroutines behind; collected, they warn of a closed loop
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow
def test_an_unreadable_learner_checkpoint_is_named_in_one_line(runs, tmp_path):
    """A truncated array file fails in orbax's read, whose error holds TensorStore's whole
    state (~60 lines, printed in every warning and in the model's source): its first line."""
    import gc
    import shutil

    workdir = tmp_path / "dp"
    shutil.copytree(runs["dp"][0], workdir)
    ckpt = workdir / "checkpoints" / "learner_0"
    newest = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    for data in (ckpt / str(newest) / "arrays").glob("ocdbt.process_*/d/*"):  # the values
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    source = decoupled_diloco.load(str(workdir)).source
    assert f"learner_0/{newest}: " in source and "\n" not in source and len(source) < 600, source
    gc.collect()  # (the read's leftovers, inside this test's warning filter)
    # From the command line: the refusal and the loss, without what the failed read leaves
    # (tracebacks of a closed event loop and of abandoned tasks, 15-1500 lines when the
    # b-tree is damaged too).
    for tree in (ckpt / str(newest) / "arrays" / "d").iterdir():
        tree.write_bytes(tree.read_bytes()[: tree.stat().st_size // 2])
    out = _cli("decoupled_diloco.evaluate", f"--workdir={workdir}")
    assert out.returncode == 0 and "eval_loss=" in out.stdout, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) < 5, out.stderr[-2000:]


@pytest.mark.parametrize("name,kind", [("dp", "learner_0"), ("dec", "syncer_0")])
@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_passed_over_then_named(runs, name, kind, tmp_path):
    """Reading the model, a checkpoint that does not verify is never used: the newest good
    one is, and the model's `source` says which was refused; with none good the entry points
    say so in one line."""
    import shutil

    workdir = tmp_path / name
    shutil.copytree(runs[name][0], workdir)
    ckpt = workdir / "checkpoints" / kind
    steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert len(steps) >= 2, steps
    _flip_arrays(ckpt / str(steps[-1]))
    model = decoupled_diloco.load(str(workdir))
    assert "1 newer refused" in model.source and f"/{steps[-1]}" in model.source, model.source
    assert "\n" not in model.source and len(model.source) < 1000, model.source  # one line
    assert str(steps[-2]) in model.source.split("[")[0]
    assert all(np.isfinite(v).all() for v in model.params.values())
    for n in steps[:-1]:
        _flip_arrays(ckpt / str(n))
    with pytest.raises(decoupled_diloco.checkpoint.CorruptCheckpointError, match="trusted") as e:
        decoupled_diloco.load(str(workdir))
    assert "step None" not in str(e.value)  # no --step: no step to name
    for tool, *args in (("evaluate",), ("sample", "--prompt=a"), ("export", f"--out={tmp_path}/x")):
        out = _cli(f"decoupled_diloco.{tool}", f"--workdir={workdir}", *args)
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert "can be trusted" in out.stderr
    (workdir / "run_config.json").write_text('{"model": {"pre')
    out = _cli("decoupled_diloco.evaluate", f"--workdir={workdir}")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "run_config.json is not valid JSON" in out.stderr


@pytest.mark.slow
def test_evaluate_elsewhere_keeps_the_runs_tokenizer_and_drops_its_path(small_config, tmp_path):
    """A sentencepiece run trained on a text file, scored on the stdlib corpus: with the
    run's own tokenizer.model (no tokenizer trained for the other corpus), the run's path
    dropped for the other source, and tokenizer overrides refused."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over a lazy dog.\n"
                            for i in range(3000)))  # fmt: skip
    cache = tmp_path / "cache"
    cfg = small_config(**{"train.steps": 4, "data.path": str(text), "data.cache_dir": str(cache),
                          "data.tokenizer": "sentencepiece", "data.spm_vocab_size": 300,
                          "model.vocab_size": 300})  # fmt: skip
    _run(cfg, tmp_path / "run")
    trained = sorted(p.name for p in cache.rglob("*"))
    elsewhere = {"source": "stdlib", "max_corpus_bytes": 100_000}
    loss, _ = evaluate(str(tmp_path / "run"), data_overrides=elsewhere)
    assert np.isfinite(loss)
    assert sorted(p.name for p in cache.rglob("*")) == trained  # nothing trained anew
    for key, value in (("tokenizer", "byte"), ("spm_vocab_size", 500)):
        with pytest.raises(ValueError, match=f"data.{key} cannot change"):
            evaluate(str(tmp_path / "run"), data_overrides={key: value})


@pytest.mark.slow
def test_out_of_device_memory_is_one_line_with_what_to_change(tmp_path):
    """A window of 100k tokens does not fit: a one-line error naming the knobs, after the
    thread's own one-line log of the failure (no traceback)."""
    out = _cli("decoupled_diloco.main", "--config=configs/tiny_dense.py", f"--workdir={tmp_path}",
               "--config.data.seq_len=100000", "--config.train.steps=2")  # fmt: skip
    assert out.returncode != 0, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: a learner ran out of device memory (RESOURCE_EXHAUSTED")
    assert "train.microbatches" in last and "model.remat" in last and "logits_chunk" in last
    assert "Traceback" not in out.stderr and "ran out of memory: RESOURCE_EXHAUSTED" in out.stderr


@pytest.mark.slow
def test_the_model_tools_say_out_of_memory_in_one_line(runs, tmp_path):
    """evaluate --text in windows of 200k tokens, and sample with a prompt of 120k (the
    longest argument Linux passes is 128 KiB): their attention scores need 0.6 TB and
    230 GB (a traceback of XLA's before). On the CPU both refuse from XLA's plan before
    running it (`Evaluator.check_host_memory`, `decode._checked_prefill`)."""
    workdir, _ = runs["dp"]
    text = tmp_path / "long.txt"
    text.write_text("abcdefgh " * 25_000)  # 225k bytes: one window of 200k tokens
    cases = [
        ("decoupled_diloco.evaluate", f"--text={text}", "--config.data.seq_len=200000",
         "GiB of host memory (XLA's plan)", "a shorter --config.data.seq_len"),
        ("decoupled_diloco.sample", f"--prompt={'x' * 120_000}", "--max_new_tokens=1",
         "GiB free on the cpu", "shorter prompts"),
    ]  # fmt: skip
    for tool, *args, what, advice in cases:
        out = _cli(tool, f"--workdir={workdir}", *args)
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and what in last and advice in last, last


def test_a_resumed_runs_records_are_drawn_on_one_clock():
    """Each attempt's records count from its own start: the second attempt's move by the
    first attempt's wall seconds (attempts.jsonl), or by its last record's time."""
    from decoupled_diloco.report import run_time

    rows = [{"time": t} for t in (0.5, 10.0, 9.8, 30.0, 1.0, 5.0, 4.5, 20.0)] + [{"step": 3}]
    shifted = [r.get("time") for r in run_time(rows, [31.0, 25.0])]
    assert shifted == [0.5, 10.0, 9.8, 30.0, 32.0, 36.0, 35.5, 51.0, None]
    assert [r["time"] for r in run_time(rows[:6])] == [0.5, 10.0, 9.8, 30.0, 31.0, 35.0]


@pytest.mark.slow
def test_evaluate_warns_when_the_runs_corpus_changed_since(small_config, tmp_path, caplog):
    """`evaluate` on the run's own eval split reads its corpus again: a file added or edited
    since may move text between the splits, which corpus.json tells (a resume is refused
    there; an evaluation says so and scores what is there now)."""
    from decoupled_diloco.data import corpus as corpus_cache

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"f{i}.txt").write_text("".join(f"line {j} of file {i}\n" for j in range(300)))
    cfg = small_config(**{"train.steps": 2, "data.path": str(corpus), "data.seq_len": 32})
    summary = _run(cfg, tmp_path / "wd")
    with caplog.at_level(logging.WARNING):
        assert evaluate(str(tmp_path / "wd"))[0] == pytest.approx(summary["final_eval_loss"])
        assert "corpus changed" not in caplog.text
        with open(corpus / "f0.txt", "a") as f:
            f.write("a line added later\n")
        corpus_cache._CACHE.clear()  # (read once per process; a new `evaluate` reads it anew)
        evaluate(str(tmp_path / "wd"))
    assert "the run's corpus changed since it trained (" in caplog.text


def test_evaluate_warns_when_overrides_put_trained_text_in_the_eval_split(
    small_config, tmp_path, caplog
):
    """Another data.eval_fraction on the run's own files cuts them another way: the new eval
    split holds files the model trained on, and its loss is no held-out loss. It said
    nothing; it names how many (and nothing for a split of files the run never saw)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"f{i}.txt").write_text("".join(f"line {j} of file {i}\n" for j in range(60)))
    cfg = small_config(**{"train.steps": 2, "data.path": str(corpus), "data.seq_len": 32,
                          "data.eval_fraction": 0.1})  # fmt: skip
    _run(cfg, tmp_path / "wd")
    workdir = str(tmp_path / "wd")
    with caplog.at_level(logging.WARNING):
        evaluate(workdir, data_overrides={"eval_fraction": 0.1, "seq_len": 16})  # same cut
        assert "training split" not in caplog.text
        evaluate(workdir, data_overrides={"eval_fraction": 0.4})
    warned = re.search(r"(\d+) of the 8 documents of this eval split are in the run's "
                       r"training split \(--config.data.eval_fraction\)", caplog.text)  # fmt: skip
    assert warned and int(warned.group(1)) >= 6, caplog.text  # 2 of the 8 were held out
    caplog.clear()
    other = tmp_path / "other"
    other.mkdir()
    for i in range(4):
        (other / f"g{i}.txt").write_text("".join(f"row {j} of g{i}\n" for j in range(80)))
    with caplog.at_level(logging.WARNING):
        evaluate(workdir, data_overrides={"path": str(other), "eval_fraction": 0.5})
    assert "training split" not in caplog.text


def test_evaluate_tells_trained_text_by_position_in_a_corpus_split_by_characters(
    small_config, tmp_path, caplog
):
    """One file is split by characters: the run trained on its first 90%. Scoring its last
    5% is held-out text, though the file's name is in both splits (it warned that the model
    trained on it, comparing names); its last 30% holds text the model trained on."""
    one = tmp_path / "one.txt"
    one.write_text("".join(f"line {j} of the only file\n" for j in range(600)))
    cfg = small_config(**{"train.steps": 2, "data.path": str(one), "data.seq_len": 32,
                          "data.eval_fraction": 0.1})  # fmt: skip
    _run(cfg, tmp_path / "wd")
    workdir = str(tmp_path / "wd")
    with caplog.at_level(logging.WARNING):
        evaluate(workdir, data_overrides={"eval_fraction": 0.05})
        assert "training split" not in caplog.text
        evaluate(workdir, data_overrides={"eval_fraction": 0.3})
    assert "1 of the 1 documents of this eval split are in the run's training split" in (
        caplog.text
    )


def test_a_run_config_reads_back_however_it_is_laid_out(small_config, tmp_path):
    """The digest covers the record's content, not its bytes: re-indented or re-ordered it
    reads back the same; without the digest (an older run's) it is read unchecked."""
    from decoupled_diloco import config as config_lib
    from decoupled_diloco import run_files

    run = config_lib.validate(small_config(**{"model.attention_pattern": ("local", "global")}))
    run_files.write(str(tmp_path), run)
    file = tmp_path / run_files.RUN_CONFIG
    record = json.loads(file.read_text())
    assert record["sha256"]
    file.write_text(json.dumps(dict(reversed(record.items()))))
    assert run_files.read_config(str(tmp_path)) == run_files.recorded(run)
    del record["sha256"]
    file.write_text(json.dumps(record))
    assert run_files.read_config(str(tmp_path)).model == run.model
