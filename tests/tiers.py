"""The test tiers: which tier each test file belongs to, and which tests `make test-fast` runs.

- ``unit``: one process, no engine start, no sleeps; seconds per file.
- ``contract``: the transport contract and the transports' own tests, real processes over localhost.
- ``e2e``: engines, trainers and frameworks end to end (vLLM, TRL, Ray, Megatron, examples).
- ``faults``: processes killed, stalled or cut off while versions flow (the fault matrix).

``make test-fast`` runs the unit tier and the contract on one transport (``FAST_TRANSPORT``): the
run before every commit. It skips the other tiers' files unread (:func:`may_select`), and its
property tests draw a fifth of their examples (tests/budget.py). ``make test`` runs every tier except the tests marked ``heavy``
(``make test-heavy``): engines with several workers for minutes each, and tests that check what
another test of the default run checks, at a higher cost (each names that test beside its mark). A test file missing from this table
fails collection, naming the file, so that every new file is placed in a tier.
"""

from __future__ import annotations

TIERS: dict[str, frozenset[str]] = {
    "unit": frozenset({
        "test_architecture.py", "test_box.py", "test_cli_plan.py", "test_combinations.py", "test_delta.py",
        "test_device_model.py", "test_devices.py", "test_digest.py",
        "test_engine_sglang.py", "test_frontier_planner.py", "test_gpu_paths.py", "test_guards.py",
        "test_job_spec.py", "test_layouts.py", "test_leases.py", "test_meta_reducer.py", "test_meta_units.py",
        "test_nccl_comm.py", "test_nccl_delta.py", "test_nccl_paths.py", "test_planner.py", "test_quant.py",
        "test_quant_offers.py", "test_roster.py", "test_rollouts.py", "test_rollouts_trl.py",
        "test_trl_switch.py", "test_validate.py", "test_wait_logs.py", "test_wire.py", "test_device_memory.py",
        "test_side_streams.py", "test_meta_state_dir.py", "test_transport_base.py", "test_fleet_decide.py", "test_fleet_invariants.py",
        "test_fleet_sim.py", "test_completion.py", "test_elastic.py", "test_sites.py", "test_invalid_on_failure.py", "test_version_readback.py", "test_tiers.py",
    }),
    "contract": frozenset({
        "test_transport_contract.py", "test_transport_delta.py", "test_transport_nixl.py",
        "test_transport_routed.py", "test_transport_shm.py", "test_transport_file.py", "test_transport_registry.py", "test_quant_transports.py", "test_integrity.py", "test_phases.py",
        "test_prefetch.py", "test_fleet_commit.py", "test_async.py", "test_lora.py", "test_meta_server.py", "test_meta_store.py",
        "test_meta_durability.py", "test_meta_fuzz.py", "test_process_state.py", "test_meta_etcd.py",
        "test_meta_etcd_async.py",
        "test_fleet_server.py", "test_launcher.py", "test_peer_copies.py",
    }),
    "e2e": frozenset({
        "test_bench.py", "test_doctor.py", "test_doctor_checks.py", "test_engine_hf.py", "test_engine_vllm.py",
        "test_example_fsdp_to_vllm.py", "test_examples.py", "test_engine_matrix.py", "test_engine_state.py",
        "test_draft_models.py", "test_draft_paths.py", "test_draft_vllm.py", "test_quant_block.py", "test_eplb.py", "test_sites_netns.py", "test_invalid_vllm.py", "test_integration_trl.py",
        "test_integration_verl.py", "test_launch.py", "test_megatron_frontier.py", "test_ray_multinode.py",
        "test_readme.py", "test_rollouts_vllm.py", "test_scripts.py", "test_sources_deepspeed.py",
        "test_sources_dtensor.py", "test_sources_megatron.py", "test_sync_e2e.py", "test_vllm_layout.py",
        "test_vllm_native.py", "test_vllm_parallel.py", "test_vllm_tp.py", "test_vllm_trainer_errors.py",
        "test_doctor_workloads.py", "test_vllm_worker_gpu.py",
    }),
    "faults": frozenset({"test_faults.py", "test_meta_etcd_faults.py"}),
}

#: the one transport whose contract cases `make test-fast` runs
FAST_TRANSPORT = "shm"


def tier_of(filename: str) -> str:
    """The tier of a test file; a file in no tier (or in two) is an error that names it."""
    found = [tier for tier, files in TIERS.items() if filename in files]
    if len(found) != 1:
        where = "in no tier" if not found else f"in tiers {found}"
        raise ValueError(f"tests/{filename} is {where}: add it to exactly one tier in tests/tiers.py")
    return found[0]


def may_select(filename: str, markexpr: str) -> bool:
    """Whether a run selecting ``markexpr`` can select any test of ``filename``: a run of one tier
    (``-m fast``, ``-m unit``, ...) does not import the other tiers' files. Collecting a file
    imports what it imports (vLLM alone takes ten seconds), on every xdist worker. A file in no
    tier is collected, so that the run names it."""
    expr = markexpr.strip()
    if expr != "fast" and expr not in TIERS:
        return True
    try:
        tier = tier_of(filename)
    except ValueError:
        return True
    if expr == "fast":
        return tier == "unit" or filename == "test_transport_contract.py"
    return tier == expr


def is_fast(filename: str, test_id: str, *, stack: bool = False) -> bool:
    """A unit test, or a contract test that runs on FAST_TRANSPORT or on no transport at all, that
    does not pay for a stack (``stack``: it carries ``pytest.mark.stack``)."""
    if stack:
        return False
    tier = tier_of(filename)
    if tier == "unit":
        return True
    if filename != "test_transport_contract.py":
        return False
    param = test_id.partition("[")[2].rstrip("]")
    return param in ("", FAST_TRANSPORT)
