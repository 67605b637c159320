"""torchrun's command line on `tandem run` (launch/torchrun_flags.py), and `-np` from the GPUs
(launch/gpus.py).

The command lines are copied from pytorch/examples (commit 77f55b9: READMEs, run_example.sh
files, slurm/sbatch_run.sh) and from torch's own and the DDP tutorials' docs, with `torchrun`
replaced by `tandem run` and nothing else; a run_example.sh line is read as the script runs
with no arguments (its `${2:-4}` is 4). Most are checked as options, without processes; one runs
as a real job, through `python -m tandem.run`. The GPU count is a pure function of the
driver's list and CUDA_VISIBLE_DEVICES, tested here without a GPU; the message of a machine
without one comes from a real command.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.cli.command import build_parser
from tandem.launch import LaunchError, config_from_args
from tandem.launch.gpus import ranks_without_np, started_note, visible_count
from tandem.launch.local.processes import cores
from tandem.launch.torchrun_flags import processes_per_node

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
JOB_TIMEOUT_S = 150


def _config(line: str, environ: dict | None = None):
    """`line`, a torchrun command, as `tandem run` reads it (torchrun -> tandem run)."""
    line = re.sub(r"\$\{\d+:-([^}]*)\}", r"\1", line)  # run_example.sh run without arguments
    words = shlex.split(line.replace("\\\n", " "))
    assert words[0] == "torchrun"
    return config_from_args(build_parser().parse_args(["run", *words[1:]]), environ or {})


# --- the commands of the READMEs, as options ------------------------------------------------

README_LINES = [  # (line, np, program, args)
    ("torchrun --nnodes 1 --nproc_per_node 4  T5_training.py", 4, "T5_training.py", ()),
    ("torchrun --nproc_per_node 2 example.py", 2, "example.py", ()),
    ("torchrun --nproc_per_node 2 example.py --explicit-prefetch", 2, "example.py",
     ("--explicit-prefetch",)),
    ("torchrun --nproc_per_node 2 example.py --mixed-precision", 2, "example.py",
     ("--mixed-precision",)),
    ("torchrun --nproc_per_node 2 example.py --dcp-api", 2, "example.py", ("--dcp-api",)),
    ("torchrun --nnodes=1 --nproc_per_node=${2:-4} ${1:-example.py}", 4, "example.py", ()),
    ("torchrun --nnodes=1 --nproc_per_node=8 example.py", 8, "example.py", ()),
    ('torchrun --nnodes=1 --nproc_per_node=${2:-2} --rdzv_id=101 '
     '--rdzv_endpoint="localhost:5972" ${1:-example.py}', 2, "example.py", ()),
    ("torchrun --standalone --nproc_per_node=${2:-16} ${1:-main.py}", 16, "main.py", ()),
    ("torchrun --nnodes=1 --nproc_per_node=4 tensor_parallel_example.py", 4,
     "tensor_parallel_example.py", ()),
    ("torchrun --nnodes=1 --nproc_per_node=4 sequence_parallel_example.py", 4,
     "sequence_parallel_example.py", ()),
    ("torchrun --nnodes=1 --nproc_per_node=4 fsdp_tp_example.py", 4, "fsdp_tp_example.py", ()),
    ('torchrun --nnodes=1 --nproc_per_node=${2:-4} --rdzv_id=101 '
     '--rdzv_endpoint="localhost:5972" ${1:-fsdp_tp_example.py}', 4, "fsdp_tp_example.py", ()),
    ("torchrun --nnodes 1 --nproc-per-node 4 tensor_parallel_example.py", 4,
     "tensor_parallel_example.py", ()),
    ("torchrun --nnodes=1 --nproc_per_node=2 --rdzv_id=100 --rdzv_backend=c10d "
     "--rdzv_endpoint=localhost:29400 elastic_ddp.py", 2, "elastic_ddp.py", ()),
    ("torchrun --standalone --nnodes=1 --nproc-per-node=4 YOUR_TRAINING_SCRIPT.py --arg1 a",
     4, "YOUR_TRAINING_SCRIPT.py", ("--arg1", "a")),
]


@pytest.mark.parametrize("line, np, program, args", README_LINES)
def test_a_one_machine_readme_command_is_that_job(line, np, program, args):
    config = _config(line)
    assert (config.np, config.nnodes, config.program, config.args) == (np, 1, program, args)
    # one machine: tandem hosts the rendezvous on a free port, whatever endpoint was named
    assert (config.master, config.min_np, config.max_np, config.secret) == (None,) * 4


def test_a_multi_machine_command_names_node_0_and_the_secret():
    # the DDP tutorial series' multinode command, on node 0
    config = _config("torchrun --nproc_per_node=4 --nnodes=2 --node_rank=0 --rdzv_id=456 "
                     "--rdzv_backend=c10d --rdzv_endpoint=172.31.43.139:29603 "
                     "multinode_torchrun.py 50 10")
    assert (config.np, config.nnodes, config.node_rank) == (4, 2, 0)
    assert config.master == ("172.31.43.139", 29603)
    assert config.secret == "456"  # torchrun's rendezvous admits anyone; tandem's the id holders
    assert config.args == ("50", "10")
    static = _config("torchrun --nnodes=2 --node_rank=1 --master_addr=10.0.0.1 train.py")
    assert (static.np, static.master, static.node_rank) == (1, ("10.0.0.1", 29500), 1)
    assert _config("torchrun --nnodes 2 --node-rank 1 --rdzv-endpoint h x.py").master == (
        "h", 29400)  # c10d's port when none is given


def test_a_range_of_machines_is_an_elastic_job():
    config = _config("torchrun --nnodes=1:4 --nproc-per-node=2 --node-rank 0 "
                     "--rdzv-id=7 --rdzv-backend=c10d --rdzv-endpoint=node0:29400 train.py")
    assert (config.np, config.nnodes, config.min_np, config.max_np) == (2, 4, 2, 8)
    assert config.elastic and config.master == ("node0", 29400)
    assert _config("torchrun --nnodes=2:2 --nproc-per-node=2 --master-addr h x.py").nnodes == 2


def test_torchruns_own_defaults_and_spellings():
    # torchrun starts one rank a machine when --nproc-per-node is absent
    assert _config("torchrun --standalone train.py").np == 1
    config = _config("torchrun --nproc-per-node 2 --max_restarts=3 --no-python ./a.out -x")
    assert (config.max_restarts, config.executable, config.program) == (3, True, "./a.out")
    module = _config("torchrun --nproc-per-node 2 -m pkg.train --lr 1")
    assert (module.module, module.program, module.args) == (True, "pkg.train", ("--lr", "1"))
    assert _config("torchrun --nproc-per-node 2 --run-path /abs/train.py").executable is False
    assert _config("torchrun --nproc-per-node 2 --role default -r 0 -t 0 x.py").np == 2


def test_flags_without_an_effect_are_accepted_with_a_note(capsys):
    config = _config("torchrun --nproc-per-node 2 --monitor-interval=1 --start-method spawn "
                     "--log-dir /tmp/logs x.py")
    assert config.np == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem run: note: ignored torchrun flag(s): --monitor-interval")
    assert "--start-method" in err and "--log-dir" in err


@pytest.mark.parametrize("line, message", [
    ("torchrun -np 2 --nproc-per-node 2 x.py", "received both -np and --nproc-per-node 2"),
    ("torchrun --nproc-per-node xpu x.py", "--nproc-per-node 'xpu': give a number of ranks"),
    ("torchrun --standalone --nnodes 2 --nproc-per-node 2 x.py",
     "--standalone is a job on this machine alone, but --nnodes asks for up to 2 machines"),
    ("torchrun --nnodes 2 --rdzv-backend etcd --rdzv-endpoint h:2379 x.py",
     "--rdzv-backend etcd: tandem needs no rendezvous server"),
    ("torchrun --nnodes 4 --nproc_per_node 1 --rdzv_id 9 --rdzv_backend c10d "
     "--rdzv_endpoint head:29500 multinode_torchrun.py 50 10",  # slurm/sbatch_run.sh
     "give each machine --node-rank R"),
    ("torchrun --nnodes 2 --node-rank 0 --master h:1 --rdzv-endpoint h:2 x.py",
     "received both --master and --rdzv-endpoint"),
    ("torchrun --nnodes=1:4 --nproc-per-node=2 --max-restarts=3 --rdzv-endpoint=h x.py",
     "drop it, or give --nnodes 4 for a fixed job restarted up to 3 times"),
    ("torchrun --nnodes=3:2 --nproc-per-node=2 x.py", "--nnodes 3:2: give MIN:MAX"),
    ("torchrun --nnodes=1:2 --min-np 2 x.py", "--nnodes 1:2 gives the job's range"),
    ("torchrun --nproc-per-node 2 --redirects 3 x.py", "pipe it: tandem run ... 2>&1 | tee"),
    ("torchrun --nproc-per-node 2 --tee 3 x.py", "-t/--tee 3: tandem run does not write"),
    ("torchrun --nproc-per-node 2 --role trainer x.py", "ROLE=trainer tandem run"),
    ("torchrun --nproc-per-node 2 --no-python -m pkg", "received both --no-python and -m"),
])
def test_what_tandem_cannot_honour_says_what_to_use(line, message):
    with pytest.raises(LaunchError) as raised:
        _config(line)
    assert message in str(raised.value)


def test_nproc_per_node_words_count_gpus_or_cores():
    def no_gpu():
        return 0

    def four_gpus():
        return 4

    def eight_cores():
        return 8

    assert processes_per_node("3", no_gpu, eight_cores) == 3
    assert processes_per_node("gpu", four_gpus, eight_cores) == 4
    assert processes_per_node("auto", four_gpus, eight_cores) == 4
    assert processes_per_node("auto", no_gpu, eight_cores) == 8
    assert processes_per_node("cpu", four_gpus, eight_cores) == 8
    with pytest.raises(ValueError, match="^--nproc-per-node gpu: this machine has no visible"):
        processes_per_node("gpu", no_gpu, eight_cores)
    assert _config("torchrun --nproc-per-node cpu x.py").np == cores()


# --- -np from the GPUs --------------------------------------------------------------------

UUIDS = ["GPU-aaaa-1", "GPU-bbbb-2", "GPU-bbbc-3", "GPU-dddd-4"]


@pytest.mark.parametrize("variable, count", [
    (None, 4), ("", 0), ("0,1", 2), ("3", 1), ("1,0,7,2", 2),  # 7 names no GPU: the list ends
    ("0,0", 0), ("-1", 0), ("0,-1,1", 1), ("1gpu,2", 2), ("nvidia", 0),
    ("GPU-aaaa,GPU-dddd", 2), ("GPU-bbb", 0),  # two GPUs start so: ambiguous, none
    ("GPU-dddd,GPU-zzzz,GPU-aaaa", 1), ("GPU-aaaa,GPU-aaaa-1", 0),
    ("MIG-x,MIG-y", 2), ("MIG-x,MIG-x", 0),
])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(variable, count):
    assert visible_count(variable, UUIDS) == count


def test_no_gpu_means_no_visible_one():
    assert visible_count(None, []) == 0 and visible_count("0,1", []) == 0
    assert visible_count("MIG-x", []) == 0


def test_without_np_one_rank_per_visible_gpu_or_what_to_give():
    assert ranks_without_np(8, 8, None, 64) == 8
    assert ranks_without_np(8, 2, "0,5", 64) == 2
    assert started_note(2, "0,5") == ("tandem run: no -np given: starting 2 rank(s), one per "
                                      "visible GPU (CUDA_VISIBLE_DEVICES=0,5); give -np N for "
                                      "another number")
    with pytest.raises(ValueError) as hidden:
        ranks_without_np(8, 0, "", 64)
    assert str(hidden.value) == (
        "how many processes? give -np N (or set TANDEM_NP): without it tandem run starts one "
        "rank per visible GPU, and CUDA_VISIBLE_DEVICES='' hides this machine's 8 GPU(s) (set "
        "it to the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1); on CPUs, -np 4 starts 4 ranks "
        "(this machine has 64 core(s))")
    with pytest.raises(ValueError, match="and this machine has no visible GPU; on CPUs, -np 2 "):
        ranks_without_np(0, 0, None, 2)


# --- real commands ------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def test_without_np_a_machine_without_gpus_is_told_what_to_give(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('no rank may start')\n")
    result = subprocess.run([sys.executable, "-m", "tandem", "run", str(script)], cwd=ROOT,
                            env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
                            timeout=JOB_TIMEOUT_S)
    assert result.returncode == 2, result.stderr
    assert ("tandem run: error: how many processes? give -np N (or set TANDEM_NP): without it "
            "tandem run starts one rank per visible GPU, and ") in result.stderr
    assert f"on CPUs, -np {min(cores(), 4)} starts" in result.stderr
    assert "no rank may start" not in result.stderr + result.stdout


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_a_readme_command_runs_under_python_m_tandem_run(tmp_path):
    # the torch tutorial's elastic_ddp.py line with `torchrun` replaced by `python -m tandem.run`;
    # the script is a plain torchrun DDP script (tests/scripts/torchrun_ddp.py), no tandem in it.
    # One job: the other lines differ in options only, checked above without processes.
    out = tmp_path / "model.pt"
    line = ("--nnodes=1 --nproc_per_node=2 --rdzv_id=100 --rdzv_backend=c10d "
            "--rdzv_endpoint=localhost:29400")
    script = [str(SCRIPTS / "torchrun_ddp.py"), "gloo", str(out)]
    result = subprocess.run([sys.executable, "-m", "tandem.run", *shlex.split(line), *script],
                            cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[{rank}] rank {rank} of 2 on gloo done" in result.stdout
    assert set(torch.load(out)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
