"""Suite-wide fixtures: shared process worlds, tests that leave nothing behind, and the tiers.

Two tiers, one suite. The full tier is every test (`pytest`, scripts/test.sh, CI). The fast
tier, `pytest -m "not slow"` (scripts/test-fast.sh), leaves out the tests listed in `SLOW`
below, each with the reason it is there, and keeps at least one test of every module: launch,
the engines, the checks, every wrapper, checkpoints, elastic, the front ends. A test is marked
here, not in its file, so that the tiers read as one list.
"""

import os
import signal

import pytest

from tandem import runtime
from tandem.job import settings
from tandem.testing import close_worlds

# A suite started in the background by a script (`bash .ci/run &`, `nohup ...`) inherits SIGINT
# ignored, and so would every `tandem run` a test starts: a launcher that finds SIGINT ignored
# leaves it so, by design (like its ranks under nohup), and the tests that press Ctrl-C on a job
# would wait for nothing. With a handler here, the jobs start with the default, as from a shell.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _shared_worlds():
    yield
    close_worlds()


@pytest.fixture(autouse=True)
def _leaves_nothing_behind():
    """Fail a test that leaks TANDEM_* variables or a tandem runtime in the test process."""
    before = {k: v for k, v in os.environ.items() if k.startswith("TANDEM_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("TANDEM_")}
    leaked_runtime = runtime.is_initialized()
    if leaked_runtime:
        runtime.shutdown()
    settings.reload()  # a test that changed TANDEM_* read them again; the next reads what is
    assert after == before, f"test leaked environment variables: {set(after) ^ set(before)}"
    assert not leaked_runtime, "test left tandem initialised in the test process"


# --- tiers -------------------------------------------------------------------------------------
# A key is a test file ("tests/test_x.py": every test in it), a test ("tests/test_x.py::test_y":
# every parametrization) or one parametrization ("tests/test_x.py::test_y[gloo]"); the value
# says why it is left to the full tier. What stays fast is named in the comment of each block.
# tests/test_tiers.py checks that every key still names a test.
SLOW: dict[str, str] = {
    # Whole files: real clusters, real faults, whole programs. Fast: the launch options and
    # one job per backend (test_launcher.py), faults by the jobs below' unit tests.
    "tests/test_cluster.py": "hosts in network namespaces over ssh: a real cluster per test",
    "tests/test_multinode.py": "two agents as two nodes, lost nodes and cut links: real faults",
    "tests/test_faults.py": "a killed or stuck rank in a fresh job per fault and backend",
    "tests/test_job_ends.py": "elastic jobs whose ranks are killed or stopped: real faults",
    "tests/test_slurm.py": "an sbatch job on a local Slurm stand-in",
    "tests/test_hf_integration.py": "Accelerate and the HF Trainer under tandem run and torchrun",
    "tests/test_examples.py": "the examples trained to their accuracy as fresh jobs",
    "tests/test_notebook.py": "a Jupyter kernel that spawns ranks",
    "tests/test_compile_tensor_parallel.py": "torch.compile of tensor-parallel models: 10-110 s each "
                                             "(fast: test_compile.py::test_compiling_twice_is_one_graph)",
    "tests/test_compile_fully_shard.py": "torch.compile of fully sharded models: 5-10 s each",
    # torch.compile: fast keeps test_compiling_twice_is_one_graph and the wrappers' checks
    "tests/test_compile.py::test_compiled_backward_is_one_node_per_bucket": "torch.compile, 30 s",
    "tests/test_compile.py::test_checkpointing_matches_one_process": "torch.compile, 20 s",
    "tests/test_compile.py::test_compiled_wrappers_match_eager": "torch.compile, 13 s",
    "tests/test_divergence.py::test_a_rank_that_skips_a_compiled_step_is_named[mpi]":
        "torch.compile, 10 s (fast: Gloo's)",
    # the recipes against one process: fast keeps Gloo at two ranks
    **{f"tests/test_recipes.py::test_recipes_give_the_one_process_result[{case}]":
       "every recipe trained again, 15 s" for case in ("mpi-2", "gloo-3", "mpi-3")},
    # launch: fast keeps the option parsing and test_two_ranks_are_prefixed_and_exit_zero (MPI
    # and Gloo jobs)
    "tests/test_launcher.py::test_an_exception_on_one_rank_stops_the_job": "a failing job per backend",
    "tests/test_launcher.py::test_a_rank_that_ignores_sigterm_is_killed": "a job, a signal, a kill",
    "tests/test_launcher.py::test_a_rank_killed_by_a_signal_is_named_in_the_summary": "a failing job",
    "tests/test_launcher.py::test_the_first_failing_ranks_exit_code_is_the_jobs": "a failing job",
    "tests/test_launcher.py::test_two_jobs_at_once_get_their_own_ports": "two jobs",
    "tests/test_launcher.py::test_a_signal_to_the_launcher_stops_every_rank": "a job per signal",
    "tests/test_launcher.py::test_a_missing_script_is_a_usage_error": "a tandem run",
    "tests/test_launcher.py::test_local_hosts_run_locally": "a job",
    "tests/test_launcher.py::test_modules_run_with_dash_m": "a job",
    "tests/test_launcher_edges.py::test_idle_and_junk_connections_neither_delay_nor_fail_the_job":
        "a job per backend",
    "tests/test_launcher_edges.py::test_a_program_the_system_refuses_is_named_without_the_usage":
        "a tandem run per case",
    "tests/test_launcher_edges.py::test_ctrl_c_during_start_up_prints_one_line_and_exits_130":
        "a job and a signal per backend",
    "tests/test_launcher_edges.py::test_ctrl_c_reaches_started_ranks_and_spares_importing_ones_a_traceback":
        "a job and a signal per backend",
    "tests/test_launcher_edges.py::test_a_killed_launchers_shared_memory_goes_with_the_next_run_and_doctor_clean":
        "a killed job, another job, tandem doctor",
    "tests/test_launch_store.py::test_a_one_node_jobs_torch_store_is_on_loopback_only_and_the_ranks_join":
        "four jobs",
    "tests/test_launch_store.py::test_a_script_with_its_own_master_port_is_seen_joining": "a job",
    "tests/test_launch_store.py::test_a_taken_master_port_is_named_with_the_fix": "a job",
    "tests/test_launch_versions.py::test_a_node_with_another_tandem_is_refused_at_admission":
        "two agents, one of another version",
    "tests/test_loopback.py::test_a_single_node_job_listens_on_loopback_only": "a job per backend",
    "tests/test_leaks.py::test_a_local_mpi_jobs_ranks_listen_on_loopback_only": "an MPI job",
    "tests/test_leaks.py::test_a_failed_mpi_job_leaves_no_shared_memory": "a failing MPI job",
    "tests/test_lazy_import.py::test_tandem_runs_a_whole_job_without_torch_in_its_parent":
        "a job per backend (fast: the import checks without one)",
    "tests/test_mpi.py::test_mpiexec_script_picks_mpi_by_default": "a job under plain mpiexec",
    "tests/test_mpi.py::test_tandem_run_mpi_prefixes_each_ranks_output": "an MPI job",
    "tests/test_mpi.py::test_tandem_run_mpi_stops_the_job_when_a_rank_fails": "failing MPI jobs",
    "tests/test_environments.py::test_an_mpi_rank_of_tandem_run_is_a_tandem_rank_under_mpi": "an MPI job",
    "tests/test_rendezvous.py::test_a_real_jobs_store_refuses_strangers": "a job",
    "tests/test_rendezvous.py::test_a_job_no_launcher_started_keys_its_store_with_tandem_store_key":
        "processes started by hand",
    "tests/test_torchrun_cli.py::test_without_np_a_machine_without_gpus_is_told_what_to_give":
        "a tandem run",
    "tests/test_torchrun_cli.py::test_a_readme_command_runs_under_python_m_tandem_run": "a job",
    "tests/test_torchrun_env.py::test_an_mpi_rank_gets_torchruns_variables_from_mpi": "an MPI job",
    "tests/test_torchrun_env.py::test_an_unchanged_torchrun_ddp_script_trains_as_under_torchrun":
        "a torchrun job and four tandem jobs",
    "tests/test_torchrun_env.py::test_the_torchrun_script_on_two_agents_trains_as_under_torchrun":
        "two agents",
    "tests/test_torchrun_env.py::test_a_job_no_rank_joined_is_named_at_its_end": "three jobs per backend",
    "tests/test_torchrun_env.py::test_td_init_on_mpi_joins_even_without_the_watchdog": "an MPI job",
    "tests/test_torchrun_env.py::test_the_ddp_script_on_tandems_backends_trains_as_torchrun_on_gloo":
        "a job per launcher and backend",
    # starting a world by hand: fast keeps td.spawn's results, the shared worlds' own init, the
    # manual template at 2 ranks and td.init's refusals (in the test process)
    "tests/test_manual_init.py::test_the_manual_template_joins_a_gloo_job[3]": "processes by hand",
    "tests/test_manual_init.py::test_init_method_tcp_instead_of_master_variables": "processes by hand",
    "tests/test_manual_init.py::test_the_template_as_a_script": "processes by hand",
    "tests/test_manual_init.py::test_two_processes_given_rank_0_are_named": "processes by hand",
    "tests/test_manual_init.py::test_a_missing_rank_is_named_on_every_rank_that_came": "processes by hand",
    "tests/test_manual_init.py::test_different_world_sizes_are_named_per_rank": "processes by hand",
    "tests/test_manual_init.py::test_a_rank_given_twice_is_named": "processes by hand",
    "tests/test_manual_init.py::test_a_job_without_rank_0_is_named": "processes by hand",
    "tests/test_runtime.py::test_script_without_launcher_is_a_world_of_one": "a fresh process",
    "tests/test_runtime.py::test_rendezvous_port_taken_by_another_program_is_a_clear_error":
        "fresh processes",
    "tests/test_runtime.py::test_multi_rank_job_without_a_port_says_how_to_fix_it": "a fresh process",
    "tests/test_runtime.py::test_unknown_backend_and_bad_timeout": "fresh processes",
    "tests/test_runtime.py::test_spawn_reraises_child_exception_with_rank_and_traceback": "td.spawn",
    "tests/test_runtime.py::test_spawn_reports_a_killed_child": "td.spawn and a kill",
    "tests/test_runtime.py::test_a_script_started_by_torchrun_joins_its_job": "a torchrun job",
    "tests/test_torch_backend.py::test_backend_tandem_without_a_launcher_is_a_world_of_one_said_so":
        "fresh processes, 19 s",
    "tests/test_torch_backend.py::test_import_tandem_registers_the_backends_before_and_after_torch":
        "fresh processes, 18 s",
    "tests/test_torch_backend.py::test_backend_mpi_without_mpi4py_names_the_install_command":
        "a fresh process",
    # faults and hangs: the watchdog's reports wait for TANDEM_TIMEOUT. Fast keeps the watchdog's
    # unit tests, and the agreement's checks in the shared worlds.
    "tests/test_pipeline.py::test_a_missing_stage_ends_in_a_timeout_that_names_it":
        "waits for the timeout, 20-25 s per check setting",
    "tests/test_mpi.py::test_timeouts_name_the_peer": "waits for the timeouts, 20 s",
    "tests/test_watchdog.py::test_a_hang_is_reported_with_who_arrived_and_every_stack":
        "a hung job per backend",
    "tests/test_watchdog.py::test_a_lost_peer_is_named": "a job per way of losing a peer",
    "tests/test_groups.py::test_a_rank_that_never_creates_the_group_is_named_by_the_watchdog":
        "a hung job per backend",
    "tests/test_divergence.py::test_pipeline_stages_out_of_step_are_named_long_before_the_timeout":
        "a desynchronised pipeline job per backend",
    "tests/test_divergence.py::test_a_stage_that_evaluates_while_stage_0_trains_raises_diverged_error":
        "a diverged pipeline job, checks off (fast: the step agreement's, in a shared world)",
    "tests/test_call_sites.py::test_torch_all_reduce_on_backend_tandem_over_gloo_names_the_skip":
        "a Gloo job",
    "tests/test_horovod_elastic_examples.py::test_horovods_synthetic_benchmark_elastic_loses_a_rank_and_finishes_on_2":
        "Horovod's example in an elastic job that loses a rank",
    "tests/test_horovod_elastic_examples.py::test_horovods_mnist_elastic_loses_a_rank_and_finishes_on_2":
        "Horovod's example in an elastic job that loses a rank",
    # checkpoints: fast keeps every save and restore in the shared worlds; a crash needs a job
    "tests/test_checkpoint.py::test_crash_between_write_and_rename_keeps_the_previous_checkpoint":
        "a job killed mid-save",
    "tests/test_checkpoint_integrity.py::test_a_dead_jobs_directory_is_taken_over": "a killed job",
    "tests/test_checkpoint_integrity.py::test_a_job_that_ends_without_wait_publishes_its_last_checkpoint":
        "a job",
    "tests/test_sharded_checkpoint.py::test_crash_during_a_sharded_save_keeps_the_previous_checkpoint":
        "a job killed mid-save",
    "tests/test_sharded_checkpoint.py::test_tandem_run_max_restarts_resumes_a_fully_sharded_job":
        "a restarted job",
    "tests/test_layout_checkpoints.py::test_a_kill_during_an_async_write_leaves_the_previous_checkpoint":
        "a job killed mid-write",
    "tests/test_restart.py::test_a_killed_job_restarts_from_its_checkpoint_and_ends_identical":
        "killed and restarted jobs",
    "tests/test_restart.py::test_a_crash_inside_save_keeps_the_previous_checkpoint": "a restarted job",
    "tests/test_restart.py::test_restarts_stop_when_exhausted": "restarted jobs",
    # elastic: fast keeps the options, td.elastic's state (test_elastic_extras.py), the refusal
    # on a fixed world and one elastic job (below --min-np); every resize is a job of agents
    **{f"tests/test_elastic.py::{name}": "an elastic job that loses or gains ranks" for name in (
        "test_a_rank_killed_at_step_5_of_3_the_job_goes_on_with_2_and_equals_one_process",
        "test_3_to_2_to_3_a_worker_joins_when_discovery_offers_a_slot_adam_equals_one_process",
        "test_a_rank_that_dies_during_the_resize_shrinks_the_job_again_horovod_api",
        "test_a_train_function_that_never_commits_warns_once_and_starts_over_exactly_ddp",
        "test_zero_optimizer_state_is_resharded_in_memory_when_the_job_grows_2_to_3",
        "test_zero_optimizer_state_lost_with_a_rank_comes_from_the_checkpointer",
        "test_zero_optimizer_state_lost_without_a_checkpointer_is_named",
        "test_a_fully_sharded_model_and_its_adam_state_are_cut_again_when_the_job_grows",
        "test_a_fully_sharded_models_optimizer_state_lost_with_a_rank",
        "test_with_a_peer_backup_sharded_state_lost_with_a_rank_is_restored_from_memory",
        "test_with_a_peer_backup_a_rank_killed_between_steps_is_restored_from_memory",
        "test_zero_adafactor_whole_parameters_peer_backup_3_to_2_equals_one_process",
        "test_no_rank_holds_a_commit_the_checkpointer_is_the_fallback_on_another_world_size",
        "test_ranks_that_commit_different_states_are_named",
        "test_a_rank_that_skips_a_commit_is_named_not_averaged",
        "test_a_node_that_vanishes_leaves_the_job_on_the_other_and_equals_one_process",
        "test_a_node_that_joins_mid_job_grows_it_to_3_adam_equals_one_process",
        "test_an_agent_of_a_fixed_job_is_refused_by_an_elastic_node_0",
        "test_an_h_job_loses_a_host_and_grows_back_when_discovery_lists_it_again",
    )},
    # front ends: fast keeps Lightning's Trainer in the shared worlds (test_lightning_names.py),
    # Horovod's API, torch's calls on the MPI engine, the metrics and the doctor's checks
    "tests/test_lightning.py::test_trainer_and_fabric_at_two_ranks_equal_one_process":
        "five Lightning trainings per backend, and the one-process reference",
    "tests/test_lightning.py::test_a_rank_that_raises_in_validation_step_ends_the_job_naming_it":
        "a failing job per backend",
    "tests/test_lightning.py::test_devices_that_disagree_with_the_launcher_are_refused_naming_both":
        "an MPI job",
    "tests/test_lightning.py::test_configure_model_that_replaces_the_world_is_refused": "a fresh process",
    "tests/test_lightning.py::test_the_lightning_digits_example_learns_on_two_ranks":
        "an example trained as a job",
    "tests/test_horovod.py::test_tandem_run_takes_horovodrun_command_forms": "a job per command form",
    "tests/test_torch_backend.py::test_every_torch_call_on_the_gloo_engine": "a Gloo job",
    "tests/test_torch_backend.py::test_backend_mpi_under_plain_mpiexec": "a job under plain mpiexec",
    "tests/test_torch_backend.py::test_the_tutorials_programs_run_on_backend_mpi": "a job per launcher",
    "tests/test_torch_backend.py::test_td_init_joins_the_group_the_script_made": "four jobs",
    "tests/test_torch_backend.py::test_td_init_asked_for_another_backend_than_the_scripts_group_is_named":
        "a job",
    "tests/test_torch_backend.py::test_after_td_init_torch_libraries_find_the_job": "a job per backend",
    "tests/test_torch_backend.py::test_a_rank_that_skips_an_all_reduce_is_named_not_waited_for":
        "a diverged job per ending",
    "tests/test_torch_backend.py::test_a_rank_that_skips_an_all_reduce_and_trains_on_is_named":
        "a diverged job",
    "tests/test_torch_backend.py::test_a_skipped_all_reduce_on_gloo_stops_the_job": "a diverged job",
    "tests/test_torch_backend.py::test_torch_calls_with_different_arguments_are_named_never_garbage":
        "a job per engine",
    "tests/test_metrics.py::test_rank0_bar_redraws_in_place_under_tandem_run_on_a_terminal":
        "a job on a pseudo-terminal per backend",
    "tests/test_timeline.py::test_two_rank_job_writes_one_trace_with_every_bucket_every_step":
        "a job (fast: the timeline's parts merged in one process)",
    "tests/test_scaling.py::test_scale_one_and_two_ranks": "tandem bench scale's jobs, 37 s "
                                                           "(fast: the allreduce benchmark's)",
    "tests/test_scaling.py::test_weak_mode_keeps_the_per_rank_batch": "tandem bench scale's jobs, 37 s",
    "tests/test_gpu_check.py::test_the_gpu_benchmarks_commands_run_and_are_read_on_the_cpu":
        "the GPU benchmarks' commands on the CPU, 85 s",
    "tests/test_doctor.py::test_doctor_prints_every_check_and_exits_zero":
        "tandem doctor as a command (fast: each check)",
    "tests/test_lazy_import.py::test_doctor_imports_torch_only_for_torchs_own_lines": "tandem doctor",
    "tests/test_recipes_doc.py::test_snippet_runs": "each recipe of the docs as a job",
    "tests/test_gpu_check.py::test_the_quick_run_skips_the_cuda_steps_and_passes_the_cpu_ones":
        "scripts/gpu-check.sh's CPU steps",
    "tests/test_gpu_check.py::test_a_failed_or_overrunning_step_does_not_stop_the_others":
        "scripts/gpu-check.sh with steps that fail",
    "tests/test_gpu_check.py::test_vendor_brings_pytest_and_cloudpickle_for_a_machine_without_them":
        "a venv without them",
    "tests/test_architecture.py::test_the_layers_contract_fails_on_a_planted_upward_import":
        "import-linter on a copy of the tree (fast: the contract on the tree itself)",
    "tests/test_preemption_launcher.py::test_resume_on_preempt_restarts_after_sigterm_and_ends_as_one_process":
        "two tandem run jobs (preempted, then restarted by --resume-on-preempt) per backend",
    "tests/test_preemption_launcher.py::test_a_second_signal_to_the_launcher_stops_for_good":
        "a tandem run job stopped by two signals",
    "tests/test_testing_harness.py::test_a_closed_world_exits_zero": "a world of its own per backend",
    "tests/test_fsdp2_parity.py::test_the_fsdp2_examples_flow_ported_resumes_bit_identically":
        "a tandem run job per backend: the FSDP2 example's flow, 12 trainings (~40 s)",
    "tests/test_elastic_loader.py::test_a_loader_in_the_elastic_state_resumes_at_the_exact_sample_when_the_job_shrinks":
        "an elastic tandem run job that loses a rank, and its one-process reference",
    "tests/test_docs_site.py::test_job_block_runs":
        "each docs block that is a job of its own: tandem run, shell, pytest (fast: those on shared worlds)",
    "tests/test_framework_hints.py::test_accelerate_that_ran_copies_is_named_with_the_line_to_add[gloo]":
        "two Accelerate jobs (fast: the MPI launch's one)",
    "tests/test_preemption_slurm.py": "sbatch jobs requeued on a local SLURM: 1-2 min each, more when busy",
    "tests/test_preemption_stress.py::test_sigterm_to_tandem_run_mpi_saves_exits_75_and_the_next_run_resumes_exactly":
        "two MPI jobs and a one-process reference",
    "tests/test_preemption_stress.py::test_sigterm_to_plain_mpiexec_saves_exits_75_and_the_next_run_resumes_exactly":
        "two mpiexec jobs and a one-process reference",
    "tests/test_preemption_stress.py::test_signals_during_a_save_twice_in_a_row_and_at_start_up_lose_at_most_one_step":
        "five tandem run jobs per backend, signalled (fast: the same signal delivered twice)",
    "tests/test_context_parallel.py::test_compiled_model_matches_one_process[alltoall-gloo]":
        "torch.compile of a context-parallel model, 20-40 s each (fast: [ring-gloo])",
    "tests/test_context_parallel.py::test_compiled_model_matches_one_process[ring-mpi]":
        "torch.compile of a context-parallel model, 20-40 s each (fast: [ring-gloo])",
    "tests/test_context_parallel.py::test_compiled_model_matches_one_process[alltoall-mpi]":
        "torch.compile of a context-parallel model, 20-40 s each (fast: [ring-gloo])",
    "tests/test_context_parallel.py::test_compiled_by_inductor_matches_one_process":
        "torch.compile with inductor (C++ code built for the model's graphs), 80 s",
    "tests/test_context_parallel.py::test_compiled_and_checkpointed_matches_one_process":
        "torch.compile of a checkpointed context-parallel model, 12-15 s each",
    "tests/test_context_parallel.py::test_compiled_rank_that_skips_an_attention_call_is_named":
        "torch.compile of two context-parallel models per backend, 20-30 s each",
    **{f"tests/test_optimizer_matrix.py::test_every_optimizer_equals_one_process_or_is_refused_with_the_reason[HSDP-{b}]":
       "a 4-rank world (HSDP, 2 replicas x 2 shards) of its own, 11-13 s" for b in ("gloo", "mpi")},
    **{f"tests/test_optimizer_matrix.py::test_a_sharded_optimizer_resumes_from_2_ranks_on_3_as_one_process[{b}]":
       "DCP checkpoints of every optimizer ZeroOptimizer, fully_shard and HSDP take, saved on 2 "
       "(HSDP: 4) ranks and restored on 3 (3 worlds), 50-90 s"
       for b in ("gloo", "mpi")},
    "tests/test_branches_checkpoint.py::test_branches_checkpoint_holds_each_branch_once_and_loads_on_another_world[mpi]":
        "a Branches checkpoint saved on 2 ranks and loaded on 3 (2 worlds), 13 s (fast: [gloo])",
    "tests/test_mpi_elastic.py::test_an_mpi_job_that_loses_a_rank_shrinks_and_ends_as_one_process":
        "tandem run on Open MPI with ULFM, a rank killed, the world shrunk: 20 s idle, minutes loaded",
    "tests/test_mpi_elastic.py::test_a_stopped_rank_of_an_mpi_job_is_the_one_dropped_and_the_job_ends_as_one_process":
        "tandem run on Open MPI with ULFM, a rank stopped: the watchdog's 10 s, then a shrink",
    **{"tests/test_optimizer_matrix.py::test_every_optimizer_equals_one_process_or_is_refused_with_the_reason"
       f"[Branches x {w}-{b}]":
       "a 4-rank world (Branches over mesh.tp_group, the wrapper over dp_group), 2-21 s (fast: [Branches-*])"
       for w in ("ZeroOptimizer", "DistributedOptimizer", "DDP") for b in ("gloo", "mpi")},
    **{f"tests/test_docs_site.py::{name}": "the docs site built by mkdocs (~25 s alone; a second build "
       "with a broken link), and chromium on it (fast: every docs block on the shared worlds)" for name in (
        "test_site_build_block_runs", "test_site_builds_with_every_part_and_the_generated_reference",
        "test_every_readme_section_of_before_is_reachable", "test_a_broken_link_fails_the_build",
        "test_the_site_in_a_browser")},
    "tests/test_horovod_elastic_examples.py::test_td_elastic_state_names_batchnorm_buffers_not_parameters":
        "an elastic tandem run job (fast: test_elastic.py's job below --min-np, td.elastic's state in "
        "test_elastic_extras.py)",
    "tests/test_mpi.py::test_in_flight_out_of_order_and_progress":
        "an MPI world of its own (TANDEM_MPI_PROGRESS=thread): 24 s to start under load (fast: every "
        "other MPI test, on the default progress)",
    "tests/test_elastic_kill_points.py": "elastic tandem run jobs (3 and 4 ranks) with ranks SIGKILLed at "
        "points of the step, 20-40 s each (fast: the resharding in memory, test_optimizer_matrix.py)",
    **{f"tests/test_optimizer_matrix.py::test_a_sharded_optimizer_shrunk_in_memory_from_3_ranks_to_2_equals_one_process[{c}]":
       "every optimizer a sharded wrapper takes, 3 -> 2 in memory, 10-15 s (fast: [fully_shard-gloo])"
       for c in ("ZeroOptimizer-gloo", "ZeroOptimizer-mpi", "fully_shard-mpi")},
    "tests/test_launch_bad_input.py::test_a_discovery_script_gone_bad_mid_job_is_named_once_each_way_and_the_job_goes_on":
        "an elastic tandem run job through a junk, a failing and a hung discovery script (two runs "
        "of each, 1.5 s timeouts) and a grown world, and its one-process reference (fast: the "
        "same scripts refused before the start)",
    "tests/test_launch_bad_input.py::test_a_second_agent_for_a_node_rank_and_agents_of_another_job_or_secret_are_refused":
        "a 3-node job of agents on loopback and three refused agents (fast: the other refusals)",
    "tests/test_elastic_grow.py": "an elastic tandem run job that grows 2 -> 3 while its ranks set up, "
        "and its one-process reference, 15-55 s (fast: none; the rounds' OVER rule is in this job)",
    **{f"tests/test_mpi_elastic.py::test_sharded_state_with_a_peer_backup_is_restored_from_memory_when_the_mpi_world_shrinks[{c}]":
       "tandem run on Open MPI with ULFM, 3 or 4 ranks, one or two SIGKILLed, sharded state "
       "restored from the peer backup, 10-25 s idle (fast: none on MPI; the Gloo backup in test_elastic.py)"
       for c in ("zero", "fsdp")},
}


# --- two workers -------------------------------------------------------------------------------
# `TEST_WORKERS=2 bash scripts/test.sh` runs the suite on two pytest-xdist workers, a file to a
# worker (`--dist loadfile`): a module's fixtures (a one-process reference, a site build, a
# network-namespace cluster) are built once, and a file's tests keep their order. Each worker
# has its own shared worlds. (`--dist loadgroup` would group by an xdist_group mark, but
# pytest-xdist 3.8 cannot rename a test's node id under pytest 9, so the mark has no effect.)


def slow_reason(nodeid: str) -> str | None:
    """Why the test `nodeid` runs in the full tier only, or None when it is in the fast tier."""
    function = nodeid.split("[", 1)[0]
    for key in (nodeid, function, function.split("::", 1)[0]):
        if key in SLOW:
            return SLOW[key]
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = slow_reason(item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.slow(reason=reason))
