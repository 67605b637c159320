"""Seconds an elastic job loses per change of world, and in-memory vs disk restore.

    python benchmarks/elastic.py                       # worlds of 2, 3 and 4 ranks
    python benchmarks/elastic.py --ranks 2 3 --params-mb 32
    python benchmarks/elastic.py --nodes               # across two --nnodes agents
    python benchmarks/elastic.py --state zero          # ZeroOptimizer (or fsdp), peer backup

For each N, one `tandem run -np N --min-np 1 --max-np N --host-discovery-script ...` job of
this file's worker (a data-parallel MLP of `--params-mb` MB of fp32 parameters, SGD with
momentum, `td.elastic.State` committed after every step):

- shrink: the last worker kills itself (SIGKILL) at step 5; the survivors go on with N - 1;
- grow: at step 10 the discovery script starts offering N slots again; a new worker starts,
  and once it has reached `td.init()` the job grows back to N at the next commit.

`--nodes`: each job runs as two `tandem run --nnodes 2` agents on this machine (node 0 with
N - 1 ranks, node 1 with one): at step 5 node 1's machine vanishes (the benchmark SIGKILLs its
agent and its rank; node 0 sees the connection close at once) and at step 10 a new agent for
node 1 joins; JSON to `results/elastic_nodes.json`.

Seconds lost are what rank 0 prints when it resumes ("... resumed from commit C, X s after
the event"): from the launcher's round (the death it saw, or the new worker being ready) to
the moment every rank holds the committed state again, ready for the next step. Target:
<= 5 s per transition on one machine.

After training, each job also times the ways a rank gets the committed state back, for the
same model and optimizer (max over ranks): in memory as a survivor does (`State.sync()` with
every rank at the same commit: each rolls back to its own snapshot, nothing is sent), in
memory as a newcomer does (the rank that holds the newest commit sends it), and from disk
(`td.Checkpointer.restore`, the fallback; the files were just written, so they are read from
the page cache: the best case for disk). JSON goes to `results/elastic.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESUMED = re.compile(r"tandem elastic: world (\d+) -> (\d+) .*resumed from commit \d+.*?, "
                     r"([\d.]+) s after the event")


def worker(out: str, offer: str, params_mb: float, lose: str | None, kind: str = "replicated",
           steps: int = 14) -> None:
    import torch

    import tandem as td

    td.init()
    size = int(os.environ["TANDEM_ELASTIC_RANGE"].split(":")[1])
    worker_id = int(os.environ["TANDEM_ELASTIC_WORKER"])
    width = 512
    layers = max(1, round(params_mb * 2**20 / 4 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    if kind == "fsdp":
        for layer in model:
            td.fully_shard(layer)
        td.fully_shard(model)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    optimizer = {"zero": td.ZeroOptimizer, "fsdp": lambda o: o}.get(
        kind, td.DistributedOptimizer)(inner)
    # Sharded state survives a lost rank in memory only with the peer backup.
    state = td.elastic.State(model=model, optimizer=optimizer, step=0,
                             peer_backup=kind != "replicated")

    @td.elastic.run
    def train(state):
        while state.step < steps:
            if state.step == 10 and td.size() < size:
                if td.rank() == 0:
                    Path(offer).touch()
                while td.size() < size:  # commits until the joining worker is in
                    state.commit()
            if state.step == 5 and lose and td.size() == size:
                if td.rank() == 0:
                    Path(lose).touch()  # the benchmark now takes node 1's machine away
                while td.size() == size:
                    state.commit()
            elif state.step == 5 and worker_id == size - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            x = torch.randn(24, width, generator=torch.Generator().manual_seed(state.step))
            optimizer.zero_grad()
            model(x[td.elastic.local_rows(24)]).square().mean().backward()
            optimizer.step()
            state.step += 1
            state.commit()

    train(state)

    # What a commit costs (the snapshot, the peer backup, the one small agreement).
    td.barrier()
    start = time.perf_counter()
    for _ in range(5):
        state.commit()
    commit_s = (time.perf_counter() - start) / 5
    # In memory, a survivor's path: every rank at the same commit rolls back to its own (with
    # sharded state: each takes its part of everyone's, as after a change of world).
    td.barrier()
    start = time.perf_counter()
    state.sync()
    survivor_s = time.perf_counter() - start
    # In memory, a newcomer's path: rank 0 holds one more commit; every other rank takes it
    # (replicated state only: a sharded commit held by one rank is not the whole state).
    memory_s = float("nan")
    if kind == "replicated":
        if td.rank() == 0:
            state.save()
        td.barrier()
        start = time.perf_counter()
        state.sync()
        memory_s = time.perf_counter() - start
    # From disk: the same model and optimizer, through the checkpointer.
    checkpointer = td.Checkpointer(os.path.join(os.path.dirname(out), "ckpt"), keep=1)
    checkpointer.save(0, model=model, optimizer=optimizer)
    td.barrier()
    start = time.perf_counter()
    checkpointer.restore(model=model, optimizer=optimizer)
    disk_s = time.perf_counter() - start
    slowest = td.allreduce(torch.tensor([survivor_s, memory_s, disk_s, commit_s],
                                        dtype=torch.float64), op="max")
    if td.rank() == 0:
        Path(out).write_text(json.dumps({"survivor_s": float(slowest[0]),
                                         "memory_s": float(slowest[1]),
                                         "disk_s": float(slowest[2]),
                                         "commit_s": float(slowest[3]),
                                         "state_mb": 2 * layers * (width * width + width) * 4
                                         / 2**20}))


def run_job(ranks: int, params_mb: float, folder: Path, kind: str = "replicated") -> dict:
    offer, out = folder / "offer", folder / "out.json"
    discovery = folder / "slots.sh"
    discovery.write_text(f"#!/bin/sh\nif [ -e {offer} ]; then echo localhost:{ranks}; "
                         f"else echo localhost:{ranks - 1}; fi\n")
    discovery.chmod(discovery.stat().st_mode | stat.S_IXUSR)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "run", "-np", str(ranks), "--min-np", "1", "--max-np",
         str(ranks), "--host-discovery-script", str(discovery), __file__, "--worker", str(out),
         "--offer", str(offer), "--params-mb", str(params_mb), "--state", kind],
        env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"the {ranks}-rank job failed:\n{done.stderr[-3000:]}")
    row = {"ranks": ranks, **json.loads(out.read_text())}
    for before, after, seconds in RESUMED.findall(done.stderr):
        row["shrink_s" if int(after) < int(before) else "grow_s"] = float(seconds)
    return row


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _kill_tree(pid: int) -> None:
    """SIGKILL an agent and its ranks (its children): a machine that vanished."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    for victim in [pid, *map(int, children.split())]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for(path: Path, agents: list[subprocess.Popen], deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        if any(agent.poll() is not None for agent in agents) or time.monotonic() > deadline:
            raise SystemExit(f"the job stopped before it reached {path.name}")
        time.sleep(0.05)


def run_nodes_job(ranks: int, params_mb: float, folder: Path, kind: str = "replicated") -> dict:
    """The same job as two `--nnodes` agents on this machine: node 0 with ranks - 1 ranks and
    node 1 with one. At step 5 node 1's machine vanishes (its agent and rank SIGKILLed); at
    step 10 a new agent for node 1 joins."""
    offer, lose, out = folder / "offer", folder / "lose", folder / "out.json"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}

    def agent(node: int, np: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem", "run", "--nnodes", "2", "--node-rank", str(node),
             "--master", f"127.0.0.1:{port}", "--secret", "bench", "--min-np", "1", "--max-np",
             str(ranks), "-np", str(np), __file__, "--worker", str(out), "--offer", str(offer),
             "--lose", str(lose), "--params-mb", str(params_mb), "--state", kind],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    node0, node1 = agent(0, ranks - 1), agent(1, 1)
    _wait_for(lose, [node0, node1])
    _kill_tree(node1.pid)
    node1.wait()
    _wait_for(offer, [node0])
    node1 = agent(1, 1)
    try:
        _, err = node0.communicate(timeout=300)
        node1.communicate(timeout=60)
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
    if node0.returncode != 0:
        raise SystemExit(f"the {ranks}-rank job over 2 nodes failed:\n{err[-3000:]}")
    row = {"ranks": ranks, "nodes": 2, **json.loads(out.read_text())}
    for before, after, seconds in RESUMED.findall(err):
        row["shrink_s" if int(after) < int(before) else "grow_s"] = float(seconds)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--params-mb", type=float, default=16.0)
    parser.add_argument("--state", choices=("replicated", "zero", "fsdp"), default="replicated",
                        help="td.DistributedOptimizer (default), td.ZeroOptimizer, or "
                             "td.fully_shard per layer; sharded state with peer_backup=True")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", action="store_true",
                        help="each job as two --nnodes agents: node 1 vanishes, then rejoins")
    parser.add_argument("--offer", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lose", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.offer, args.params_mb, args.lose, args.state)
        return
    from tandem.bench.results import write_json

    rows = []
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory(prefix="tandem-elastic-bench-") as folder:
            job = run_nodes_job if args.nodes else run_job
            rows.append(job(ranks, args.params_mb, Path(folder), args.state))
    where = "; node 1 lost, then rejoined" if args.nodes else ""
    print(f"{'ranks':>5} {'shrink':>9} {'grow':>9} {'commit':>9} {'restore: survivor':>18} "
          f"{'newcomer':>9} {'disk':>9} {'newcomer/disk':>14}   (Gloo, {args.state}, "
          f"{rows[0]['state_mb']:.0f} MB of model + optimizer state{where})")
    for row in rows:
        print(f"{row['ranks']:>5} {row.get('shrink_s', float('nan')):>7.2f} s "
              f"{row.get('grow_s', float('nan')):>7.2f} s {row['commit_s'] * 1e3:>6.1f} ms "
              f"{row['survivor_s'] * 1e3:>15.0f} ms {row['memory_s'] * 1e3:>6.0f} ms "
              f"{row['disk_s'] * 1e3:>6.0f} ms {row['memory_s'] / row['disk_s']:>14.2f}")
    stem = "elastic_nodes" if args.nodes else "elastic"
    suffix = "" if args.state == "replicated" else f"_{args.state}"
    out = write_json({"params_mb": args.params_mb, "nodes": 2 if args.nodes else 1,
                      "state": args.state, "rows": rows}, f"results/{stem}{suffix}.json")
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
