"""The recipes, fully_shard, tensor parallelism and pipeline stages with everything on a GPU.

Each test runs the CPU suite's own check on the GPU (the check takes a device, or builds on
`td.device()`), in a world of two Gloo ranks that share one GPU (MPI too for the recipes): the
same comparisons with one process, the same tolerances. Skipped, with the reason, without a
GPU; `scripts/gpu-check.sh` runs them on a GPU machine.
"""

import pytest
import torch
from test_compile import check_pieces_under_compile
from test_compile_fully_shard import assert_recipes
from test_compile_fully_shard import check_recipes as check_compiled_fully_shard
from test_compile_tensor_parallel import assert_compiled, check_compiled_matches_eager
from test_cuda import requires_cuda
from test_fully_shard import CASES, _assert_equivalent
from test_fully_shard import check_equivalence as check_fully_shard
from test_pipeline import check_equivalence as check_pipeline
from test_recipes import check_recipes, recipe_failures
from test_tensor_parallel import check_transformer_matches_one_process

import tandem as td
from tandem.testing import run_distributed


@requires_cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_recipes_on_the_gpu(backend):
    """fp16 GradScaler, bf16 autocast, clipping, accumulation, schedulers: CUDA autocast and the
    CUDA GradScaler on 2 ranks give the one-process result."""
    if backend == "mpi":
        pytest.importorskip("mpi4py")
    results = run_distributed(check_recipes, world_size=2, backend=backend, timeout=240,
                              args=(None, "cuda"))
    failures = recipe_failures(results)
    assert not failures, "\n".join(failures)


@requires_cuda
@pytest.mark.timeout(300)
def test_fully_shard_on_the_gpu():
    _assert_equivalent(run_distributed(check_fully_shard, world_size=2, args=(CASES, "cuda"), timeout=240))


@requires_cuda
def test_tensor_parallel_on_the_gpu():
    for errors in run_distributed(check_transformer_matches_one_process, world_size=2, args=("cuda",)):
        assert not errors, "\n".join(errors)


def check_pipeline_on_the_gpu():
    """The CPU suite's pipeline equivalence: its stages are built on `td.device()`, the GPU here."""
    pipe = td.Pipeline(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), chunks=2)
    devices = {str(p.device) for p in pipe.parameters()}
    problems, balance = check_pipeline()
    return devices, problems, balance


@requires_cuda
@pytest.mark.timeout(300)
def test_pipeline_stages_on_the_gpu():
    results = run_distributed(check_pipeline_on_the_gpu, world_size=2, timeout=240)
    for rank, (devices, problems, _) in enumerate(results):
        assert devices == {"cuda:0"}, (rank, devices)  # both ranks share the one GPU
        assert not problems, "\n".join(problems)
    assert results[0][2] == results[1][2]


# -- torch.compile (inductor's GPU kernels) ---------------------------------------------------
# Compiled against eager on the GPU: inductor's fused kernels add in another order than
# eager's, and Adam turns a tiny gradient's difference into up to a step, so 1e-4, not 1e-5.
GPU_COMPILE_TOLERANCE = 1e-4


@requires_cuda
@pytest.mark.timeout(400)
def test_compiled_tensor_parallel_on_the_gpu():
    """The custom operators of the regions in inductor's GPU graph: one graph, eager's result."""
    assert_compiled(run_distributed(check_compiled_matches_eager, world_size=2, args=("cuda",),
                                    timeout=360), GPU_COMPILE_TOLERANCE)


@requires_cuda
@pytest.mark.timeout(400)
def test_compiled_fully_shard_on_the_gpu():
    assert_recipes(run_distributed(check_compiled_fully_shard, world_size=2, args=("cuda",),
                                   timeout=360), GPU_COMPILE_TOLERANCE)


@requires_cuda
@pytest.mark.timeout(300)
def test_compiled_backward_is_cut_at_the_buckets_on_the_gpu():
    for rank, result in enumerate(run_distributed(check_pieces_under_compile, world_size=2,
                                                  args=("cuda",), timeout=240)):
        for wrapper in ("DistributedDataParallel", "DistributedOptimizer"):
            assert result["pieces"][wrapper] == (3, 3), (rank, wrapper, result)
