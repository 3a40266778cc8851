"""The fault matrix of issue 18: every attack found by hand, the test that runs it, and the
outcome that test asserts. The attacks live in four modules by what they attack:

  test_fault_matrix_workdir.py  checkpoints and workdirs (items 1 and 6)
  test_fault_matrix_offers.py   what reaches the syncer (items 2 and 3)
  test_fault_matrix_inputs.py   configs, data and Ray start-up (items 4, 5 and 8)
  test_fault_matrix_uptime.py   the downtime metric and step schedules (item 7)

This module keeps the matrix whole: a test of the matrix that is renamed or deleted turns
it red, so an attack cannot silently lose its test.
"""

import ast
import pathlib

import pytest

MATRIX = {
    # 1. silent checkpoint corruption
    "flipped bytes in a learner checkpoint -> previous kept step, run finishes": (
        "workdir", "test_a_corrupt_learner_checkpoint_falls_back_and_the_run_finishes"),
    "flipped bytes in a syncer checkpoint -> previous kept step": (
        "workdir", "test_a_corrupt_syncer_checkpoint_falls_back_to_the_previous_one"),
    "every kept step corrupt -> the run stops naming the files": (
        "workdir", "test_no_good_checkpoint_stops_the_run_naming_the_files"),
    "a NaN final model -> a failed run, not a result": (
        "workdir", "test_a_non_finite_model_is_a_failed_run"),
    # 2. finite poison
    "an offer of 1e15 values -> rejected, Θ unchanged": (
        "offers", "test_an_offer_of_finite_1e15s_is_rejected_and_theta_unchanged"),
    "offers above ratio x the running median -> rejected": (
        "offers", "test_the_norm_bound_is_the_ratio_times_the_median_of_recent_offers"),
    "c_tokens=2**53, c_steps=1 -> rejected": (
        "offers", "test_an_offer_claiming_2_53_tokens_in_one_step_is_rejected"),
    # 3. validation gaps
    "a negative base version -> rejected": (
        "offers", "test_a_negative_base_version_is_rejected"),
    "an offer many slots ahead -> rejected, K=1 keeps merging": (
        "offers", "test_an_offer_far_ahead_in_slots_is_rejected_and_k1_keeps_merging"),
    "c_steps=0 -> rejected with an event": (
        "offers", "test_an_offer_without_work_is_rejected_with_an_event"),
    "a heartbeat with a huge incarnation -> dropped, nobody locked out": (
        "offers", "test_a_heartbeat_of_a_huge_incarnation_is_dropped_and_locks_nobody_out"),
    "a heartbeat with a huge step -> dropped, future-step check holds": (
        "offers", "test_a_heartbeat_of_a_huge_step_is_dropped_and_the_future_check_holds"),
    "malformed Join/Heartbeat/Leave -> logged and dropped, never raised": (
        "offers", "test_a_malformed_control_message_is_logged_and_dropped_never_raised"),
    "every drop counted into summary.json": (
        "offers", "test_refusal_counts_survive_a_restore_and_reach_the_summary"),
    # 4. fatal errors retried forever on Ray
    "a bad data path on Ray -> the run stops, no restart loop": (
        "inputs", "test_ray_stops_at_an_error_no_restart_can_fix"),
    "config/data errors inside a process are fatal, others restart": (
        "inputs", "test_config_and_data_errors_inside_a_process_are_fatal_others_are_not"),
    # 5. Ray start-up
    "Ray start fails -> retried with a message; single host on 127.0.0.1": (
        "inputs", "test_ray_start_is_retried_with_a_message_then_fails_clearly"),
    # 6. workdirs
    "two runs on one workdir -> the second is refused": (
        "workdir", "test_two_runs_on_one_workdir_the_second_is_refused"),
    "a resume with a changed lr or seed -> refused unless forced": (
        "workdir", "test_a_resume_refuses_changed_config_unless_forced"),
    "a kill leaves a trace: summary adds up every attempt": (
        "workdir", "test_summary_adds_up_every_attempt"),
    "a Decoupled resume: learners and syncer at one cut": (
        "workdir", "test_a_decoupled_resume_meets_the_syncer_at_one_cut"),
    # 7. downtime on a slow host
    "a uniformly slow host is not downtime": (
        "uptime", "test_uniformly_slow_host_is_not_downtime"),
    "a syncer outage is downtime of about its length": (
        "uptime", "test_a_syncer_outage_is_downtime_of_about_its_length_on_any_host"),
    "crashes scheduled in steps fire at their step on any host": (
        "uptime", "test_step_crash_fires_at_its_step_on_a_fast_and_a_slow_host"),
    # 8. input checks
    "data.path without data.source -> trains on that path": (
        "inputs", "test_data_path_without_source_trains_on_that_path"),
    "data.path with another explicit source -> an error": (
        "inputs", "test_data_path_with_an_explicit_other_source_is_an_error"),
    "seed changes the data order": (
        "inputs", "test_run_seed_changes_the_data_order_unless_data_sets_its_own"),
    "a single binary file as a corpus -> refused": (
        "inputs", "test_a_single_binary_file_is_refused_as_a_corpus"),
    "devices_per_learner not dividing the devices -> refused": (
        "inputs", "test_devices_per_learner_must_divide_the_devices"),
    "H < P -> refused": (
        "inputs", "test_fewer_steps_per_period_than_fragments_is_an_error"),
    "corrupt data/fragment/JSON files -> named, before the workdir exists": (
        "inputs", "test_corrupt_inputs_are_named_and_no_workdir_is_created"),
}  # fmt: skip


def _tests_in(module: str) -> set[str]:
    path = pathlib.Path(__file__).parent / f"test_fault_matrix_{module}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("attack", sorted(MATRIX))
def test_every_attack_has_its_test(attack):
    module, name = MATRIX[attack]
    assert name in _tests_in(module), f"{attack}: test_fault_matrix_{module}.py::{name} is gone"
