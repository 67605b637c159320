"""Data parallelism and fully_shard across hosts whose links are shaped, against the ring model.

    sudo python benchmarks/shaped_links.py                       # rates: as is, 10 and 1 Gbit/s
    sudo python benchmarks/shaped_links.py --rates 1000,200 --hosts 2,4 --steps 6

Needs root, iproute2 and openssh-server (scripts/netns-cluster.sh builds 4 hosts as network
namespaces on this machine). For each link rate (a tbf qdisc on every host's eth0: what a
host sends is limited to that rate) it first measures the link between h1 and h2: its latency
alpha (half the median round trip of 200 1-byte TCP ping-pongs) and its bandwidth beta (the
median of three 64 MiB TCP sends). Then, for each host count n, one `tandem run -np n -H h1:1,...,hn:1` job
(one rank per host, Gloo, one thread per rank) times, step by step in turn, each method on
the MLP 784-2048-2048-10 (5.8 M parameters, 23 MB of fp32 gradients), per-rank batch 64:

- `compute`: the same step without any communication (every rank at once, so it carries the
  same CPU contention as the others: the machine's cores are shared by all the hosts);
- `allreduce`: one all-reduce of the gradients' bytes, nothing else;
- `tandem`, `tandem-bf16`, `tandem-powersgd` (rank 4): td.DistributedOptimizer, plain and
  with its compression settings;
- `ddp`: torch's DistributedDataParallel on the same Gloo process group;
- `fully_shard`: td.fully_shard per layer and the root (parameters gathered for forward and
  backward, gradients reduce-scattered).

Reported per method: the median step time (of the slowest rank), the time it spends beyond
`compute` (communication, and compression's own work), its share of the step (1 - compute /
step) and the efficiency compute / step (weak scaling with the per-rank batch fixed, the compute
measured in the same job: what the network costs, apart from the shared cores), and the
model's communication time, from the measured alpha and beta: a ring all-reduce of B bytes
over n hosts takes 2(n-1)/n * B / beta + 2(n-1) * alpha; bf16 sends B/2; PowerSGD rank 4 sends
4 (rows + columns) floats per compressed matrix; fully_shard moves 3 (n-1)/n * B (two
all-gathers and one reduce-scatter) with 3 (n-1) * alpha per layer. The table is printed and
the numbers go to JSON (`results/shaped_links.json`).

What it is not: a cluster. Every host is a namespace on the same cores, so compute slows as
hosts are added, and the links' latency is the veth's own, tens of microseconds (this kernel
has no sch_netem; scripts/netem.py's user-space delay costs far more than it would add).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tandem.bench.results import write_json

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "netns-cluster.sh"
PROBE_PORT = 5999
BULK = 64 << 20


# --- the link probe: a server on h2, a client on h1 ------------------------------------------

def probe_serve() -> None:
    with socket.create_server(("0.0.0.0", PROBE_PORT)) as server:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        received = 0
        while data := conn.recv(1 << 20):
            if data == b"x":
                conn.sendall(b"y")
                continue
            received += len(data)
            if received >= BULK:
                conn.sendall(b"y")
                received = 0


def probe_client(host: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((host, PROBE_PORT), timeout=30)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(200):
        start = time.perf_counter()
        conn.sendall(b"x")
        conn.recv(1)
        rtts.append(time.perf_counter() - start)
    blob, seconds = b"\0" * BULK, []
    for _ in range(3):
        start = time.perf_counter()
        conn.sendall(blob)
        conn.recv(1)
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"alpha_s": statistics.median(rtts) / 2,
                      "beta_Bps": BULK / statistics.median(seconds)}))


# --- the job: every rank runs this -------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import tandem as td
    from tandem.parallel.data_parallel.compression import PowerSGD

    td.init()
    torch.set_num_threads(1)
    rank, size = td.rank(), td.size()

    def mlp() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                             nn.Linear(2048, 10))

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 784, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    steps = {}

    def add(name, net, opt) -> None:
        def step():
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        steps[name] = step

    net = mlp()
    add("compute", net, torch.optim.SGD(net.parameters(), lr=0.01))
    gradient_bytes = sum(p.numel() * 4 for p in net.parameters())
    flat = torch.zeros(gradient_bytes // 4)
    steps["allreduce"] = lambda: td.allreduce(flat, op="sum", inplace=True)
    for name, compression in (("tandem", None), ("tandem-bf16", "bf16"),
                              ("tandem-powersgd", PowerSGD(rank=4, start_iter=0))):
        net = mlp()
        add(name, net, td.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01),
                                               named_parameters=net.named_parameters(),
                                               compression=compression))
    net = torch.nn.parallel.DistributedDataParallel(mlp())
    add("ddp", net, torch.optim.SGD(net.parameters(), lr=0.01))
    net = mlp()
    for layer in net:
        if isinstance(layer, nn.Linear):
            td.fully_shard(layer)
    td.fully_shard(net)
    add("fully_shard", net, torch.optim.SGD(net.parameters(), lr=0.01))

    names = list(steps)
    for name in names:
        for _ in range(args.warmup):
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.steps):  # in turn, the order rotating: a busy moment slows all alike
        for name in names[i % len(names):] + names[: i % len(names)]:
            td.barrier()
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    slowest = td.allgather_object(medians)  # a step lasts as long as its slowest rank's
    if rank == 0:
        step = {name: max(m[name] for m in slowest) for name in names}
        matrices = [tuple(p.shape) for p in mlp().parameters() if p.dim() == 2]
        print("RESULT " + json.dumps({"n": size, "step_s": step, "gradient_bytes": gradient_bytes,
                                      "matrices": matrices, "layers": 3}), flush=True)
    td.shutdown()


# --- the model ---------------------------------------------------------------------------------

def ring_s(nbytes: float, n: int, alpha: float, beta: float, rounds: int = 1) -> float:
    """A ring all-reduce of `nbytes` over n: 2(n-1)/n * bytes / beta + 2(n-1) * alpha."""
    return 2 * (n - 1) / n * nbytes / beta + rounds * 2 * (n - 1) * alpha


def predicted(result: dict, alpha: float, beta: float, powersgd_rank: int = 4) -> dict[str, float]:
    n, nbytes = result["n"], result["gradient_bytes"]
    compressed, rest = 0, nbytes
    for rows, cols in result["matrices"]:
        if rows * cols / (powersgd_rank * (rows + cols)) >= 2:  # PowerSGD's min_compression
            compressed += 4 * powersgd_rank * (rows + cols)
            rest -= 4 * rows * cols
    gather = (n - 1) / n * nbytes / beta + (n - 1) * alpha * (result["layers"] + 1)
    return {
        "allreduce": ring_s(nbytes, n, alpha, beta),
        "tandem": ring_s(nbytes, n, alpha, beta),
        "ddp": ring_s(nbytes, n, alpha, beta),
        "tandem-bf16": ring_s(nbytes / 2, n, alpha, beta),
        "tandem-powersgd": ring_s(compressed + rest, n, alpha, beta, rounds=3),  # P, Q, rest
        "fully_shard": 3 * gather,
        "compute": 0.0,
    }


# --- the orchestration: build the cluster, shape, probe, run, tabulate -------------------------

def cluster(*args: str, timeout: float = 180) -> str:
    done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode:
        sys.exit(f"netns-cluster.sh {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def on(prefix: str, host: str, *argv: str) -> list[str]:
    return ["bash", str(SCRIPT), "exec", host, "--prefix", prefix, "--", *argv]


def measure_link(prefix: str) -> dict:
    server = subprocess.Popen(on(prefix, "h2", sys.executable, __file__, "--probe-serve"),
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        done = subprocess.run(on(prefix, "h1", sys.executable, __file__, "--probe-client", "h2"),
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        server.kill()
        server.wait(10)
    if done.returncode:
        sys.exit(f"the link probe failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def run_job(prefix: str, n: int, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["TANDEM_TIMEOUT"] = "300"
    hosts = ",".join(f"h{i}:1" for i in range(1, n + 1))
    command = on(prefix, "h1", sys.executable, "-m", "tandem", "run", "-np", str(n), "-H", hosts,
                 "--threads-per-rank", "1", __file__, "--worker", "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--batch", str(args.batch))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    sys.exit(f"the job on {n} hosts failed ({done.returncode}):\n{done.stderr[-3000:]}")


METHODS = ("compute", "allreduce", "tandem", "tandem-bf16", "tandem-powersgd", "ddp", "fully_shard")


def table(rows: list[dict]) -> str:
    lines = ["| link (set) | alpha us | beta Gbit/s | hosts | method | step ms | comm ms | "
             "comm share | efficiency | model comm ms |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        compute = row["step_s"]["compute"]
        for name in METHODS:
            step = row["step_s"][name]
            comm = share = effic = ""
            if name == "allreduce":
                comm = f"{step * 1e3:.1f}"
            elif name != "compute":
                comm = f"{max(0.0, step - compute) * 1e3:.1f}"
                share = f"{max(0.0, 1 - compute / step):.0%}"
                effic = f"{min(1.0, compute / step):.0%}"
            model = "" if name == "compute" else f"{row['model_s'][name] * 1e3:.1f}"
            lines.append(f"| {row['rate']} | {row['alpha_s'] * 1e6:.0f} | "
                         f"{row['beta_Bps'] * 8 / 1e9:.2f} | {row['n']} | {name} | "
                         f"{step * 1e3:.1f} | {comm} | {share} | {effic} | {model} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="none,10000,1000",
                        help="link rates in Mbit/s, comma-separated; none: unshaped")
    parser.add_argument("--hosts", default="2,4", help="host counts, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="per-rank batch")
    parser.add_argument("--out", default="results/shaped_links.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-client", metavar="HOST", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.probe_serve:
        probe_serve()
        return 0
    if args.probe_client:
        probe_client(args.probe_client)
        return 0
    if os.geteuid() != 0:
        sys.exit("needs root: it builds network namespaces and starts sshd (see the docstring)")
    counts = [int(n) for n in args.hosts.split(",")]
    prefix = f"b{os.getpid() % 100000}"
    cluster("up", str(max(counts)), "--prefix", prefix)
    rows = []
    try:
        for rate in args.rates.split(","):
            shaping = [] if rate == "none" else ["--rate-mbit", rate]
            for i in range(1, max(counts) + 1):
                cluster("shape", f"h{i}", "--prefix", prefix, *shaping)
            link = measure_link(prefix)
            label = "as is" if rate == "none" else f"{int(rate) / 1000:g} Gbit/s"
            print(f"link {label}: alpha {link['alpha_s'] * 1e6:.0f} us, beta "
                  f"{link['beta_Bps'] * 8 / 1e9:.2f} Gbit/s", flush=True)
            for n in counts:
                result = run_job(prefix, n, args)
                result.update(rate=label, **link)
                result["model_s"] = predicted(result, link["alpha_s"], link["beta_Bps"])
                rows.append(result)
                print(f"  {n} hosts: " + ", ".join(
                    f"{k} {v * 1e3:.0f} ms" for k, v in result["step_s"].items()), flush=True)
    finally:
        cluster("down", "--prefix", prefix)
    text = table(rows)
    print(text)
    out = write_json({"machine": {"cores": os.cpu_count(), "python": platform.python_version()},
                      "command": " ".join(sys.argv), "rows": rows, "table": text}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
