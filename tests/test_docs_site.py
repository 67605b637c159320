"""The documentation site (mkdocs.yml, docs/): it builds strictly, its links hold, every code
block on it runs, and a real browser shows it.

Code blocks. Every ```python and ```bash block of the site's pages carries a marker on the line
above it, an HTML comment the reader does not see:

- `<!-- run: ranks N -->`: the block runs on each rank of a shared world of N ranks (Gloo,
  `tandem.testing.run_distributed`), after `td.init()`, with the names a fragment leans on
  already defined (`PRELUDE`: model, Net, Block, loader, opt, loss_fn, x, y, ...), in a
  directory of its own shared by the ranks. `<!-- run: ranks N with NAME,NAME -->` runs the
  `SETUPS[NAME]` code after the prelude: another model (`sequential`, `tinylm`, a
  LightningModule), files the block reads (`checkpoints`), or `eager-compile`, which makes
  `torch.compile` trace with dynamo and run eagerly (no inductor: seconds, not minutes; the
  compiled runs are tests/test_compile*.py's);
- `<!-- run: tandem run -np N ... -->` or `<!-- run: python -->`: a complete script, started as a
  user starts it;
- `<!-- run: shell -->`: each command line of the block runs in bash, in a directory with a
  small `train.py`, with `tandem` on the PATH; `<!-- run: shell in the checkout -->` runs them
  in the repository's root (the suite's own commands: `.venv/bin/python -m pytest ...`);
- `<!-- run: pytest -->`: the block is a test file, run by pytest in a directory of its own;
- `<!-- run: in the test process -->`: the block runs in this pytest process, in the
  repository's root (it calls `run_distributed` itself, on the suite's shared worlds);
- `<!-- run: the site build -->`: `bash scripts/docs.sh`, which the `site` fixture runs (into a
  directory of its own) for every test of the build below;
- `<!-- skip: needs ... -->`: a block that needs a GPU, a cluster (several hosts, SLURM) or a
  network, or that sets up a venv, runs the whole suite or takes tens of minutes, with the reason.

docs/recipes.md's blocks are run by tests/test_recipes_doc.py (each names its launch on its
first line); they are not run twice.
"""

from __future__ import annotations

import functools
import gc
import http.server
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
from jobs_ahead import Ahead, Command, InOrder

from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).parent / "mkdocs"
BUILD_TIMEOUT_S = 240  # about 25 s alone; two shared cores and torch's import can stall it
JOB_TIMEOUT_S = 120
SHELL_LINES_MAX = 3  # command lines in one shell block (each gets JOB_TIMEOUT_S)
RUN_ELSEWHERE = {"recipes.md": "tests/test_recipes_doc.py"}
SHELL_LANGS = ("bash", "sh", "shell", "console")
NEEDS_MPI = re.compile(r'backend="mpi"|init_process_group\("mpi"\)')
MARKER = re.compile(r"<!-- (run|skip|shown): (.+?) -->")
SKIP_REASONS = ("needs a GPU", "needs a cluster", "needs SLURM", "needs several hosts", "needs a network",
                "sets up a venv", "runs the whole suite", "takes tens of minutes")

PRELUDE = '''
import torch, tandem as td
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)

class Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc = nn.Linear(width, width)
    def forward(self, x):
        return torch.relu(self.fc(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

dataset = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
loader = DataLoader(dataset, batch_size=8)
train_set = dataset
my_loader = loader
F = nn.functional
seed, acc, loss = 0, 0.5, torch.tensor(1.0)
def data_for(step):
    return x, y
x, y = next(iter(loader))
model = Net()
plain_model = Net()
loss_fn = nn.functional.cross_entropy
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
epochs, steps = 1, 2
def train_step(*args):
    opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
def contrastive_loss(logits):
    return logits.pow(2).mean()
td.init()
'''

# What `<!-- run: ranks N with NAME -->` adds after the prelude.
SETUPS = {
    # an nn.Sequential for td.Pipeline, and a regression batch for it
    "sequential": """
model = seq = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
x, y = torch.randn(16, 16), torch.randn(16, 4)
""",
    # tests/test_tensor_parallel.py's small language model (sizes divisible by tp = 2 and 3)
    "tinylm": """
class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(12), nn.LayerNorm(12)
        self.attn = nn.MultiheadAttention(12, 6, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 12))
    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = nn.Embedding(12, 12), TinyBlock(), nn.Linear(12, 12)
    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))
ids, target = torch.randint(0, 12, (4, 5)), torch.randint(0, 12, (4, 5))
""",
    # a tandem checkpoint of 100 steps, and a directory torch's dcp.save wrote
    "checkpoints": """
import torch.distributed.checkpoint as _dcp
td.Checkpointer("checkpoints", every=100).save(99, model=model, optimizer=opt)
_dcp.save({"model": Net().state_dict()}, checkpoint_id="their_dcp_dir")
""",
    # a LightningModule and its optimizer (tests/scripts/lightning_train.py's, smaller)
    "lightning": """
import lightning as L
class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = Net()
    def forward(self, x):
        return self.net(x)
    def training_step(self, batch, _):
        return loss_fn(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
    def train_dataloader(self):
        return loader
model = Module()
optimizer = model.configure_optimizers()
""",
    # torch.compile traces with dynamo and runs the graphs eagerly (exec_block puts it back)
    "eager-compile": """
import functools as _functools
torch.compile = _functools.partial(torch.compile, backend="eager")
""",
}


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if not {"hooks", "_screenshots"} & set(p.parts))


def blocks() -> list:
    """(page, line, language, marker kind, marker text, code) for every Python and shell block."""
    found = []
    for page in pages():
        text = page.read_text()
        for block in re.finditer(r"^```(\w+)[^\n]*\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
            lang = block.group(1)
            if lang not in ("python", "py", *SHELL_LANGS):
                continue
            line = text.count("\n", 0, block.start()) + 1
            before = text[: block.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = MARKER.fullmatch(before.strip())
            name = str(page.relative_to(DOCS))
            kind, said = (marker.group(1), marker.group(2)) if marker else (None, None)
            found.append(pytest.param(name, line, lang, kind, said, block.group(2), id=f"{name}:{line}"))
    return found


BLOCKS = blocks()


def is_job(said: str | None) -> bool:
    """Whether a `run:` block is a job of its own (a script, shell commands, a pytest run), not
    a block on a shared world, in this process or the site build: those run in the full tier."""
    return bool(said) and said.split()[0] not in ("ranks", "in", "the")


def is_site_build(said: str | None) -> bool:
    """Whether a `run:` block is the site build (mkdocs, ~25 s alone): it runs in the full tier."""
    return said == "the site build"


IN_WORLDS = [p for p in BLOCKS if not (p.values[3] == "run" and (is_job(p.values[4])
                                                                 or is_site_build(p.values[4])))]
JOBS = [p for p in BLOCKS if p.values[3] == "run" and is_job(p.values[4])]
SITE_BUILDS = [p for p in BLOCKS if p.values[3] == "run" and is_site_build(p.values[4])]


def test_every_block_is_marked():
    """A block without a marker, or a skip without a reason the docs accept, fails here."""
    unmarked = [f"{p.values[0]}:{p.values[1]}" for p in BLOCKS
                if p.values[3] is None and p.values[0] not in RUN_ELSEWHERE]
    assert not unmarked, f"blocks with no '<!-- run: ... -->' or '<!-- skip: ... -->' above them: {unmarked}"
    shown = [f"{p.values[0]}:{p.values[1]}" for p in BLOCKS if p.values[3] == "shown"]
    assert not shown, (f"blocks marked 'shown' (run by nothing): {shown}; make each a block that "
                       "runs (split alternatives, 'with NAME' for what it leans on) or skip it with a reason")
    bad = [f"{p.values[0]}:{p.values[1]}: {p.values[4]!r}" for p in BLOCKS
           if p.values[3] == "skip" and not p.values[4].startswith(SKIP_REASONS)]
    assert not bad, f"a block is skipped only when it needs one of {SKIP_REASONS}: {bad}"
    # the recipes' blocks each name their launch on their first line (test_recipes_doc.py runs them)
    for p in BLOCKS:
        if p.values[0] in RUN_ELSEWHERE and p.values[3] is None:
            assert p.values[5].startswith("# run: "), f"{p.values[0]}:{p.values[1]} says not how to run it"


def _environment() -> dict[str, str]:
    hidden = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k not in hidden}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def exec_block(code: str, where: str, directory: str, setups: tuple[str, ...] = ()) -> str:
    """On every rank: the prelude, the setups named, then the block, in `directory`; what it printed."""
    import contextlib
    import io

    import torch

    compile_ = torch.compile
    os.makedirs(directory, exist_ok=True)
    before = os.getcwd()
    os.chdir(directory)
    out = io.StringIO()
    # a real module: torch.compile imports its globals'; a name of its own per block (dynamo
    # keeps the modules it saw by name)
    module = types.ModuleType(f"docs_block_{re.sub(r'[^0-9a-zA-Z]', '_', where)}")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
            for name in setups:
                exec(compile(SETUPS[name], f"<setup {name}>", "exec"), namespace)
            exec(compile(code, where, "exec"), namespace)
    finally:
        os.chdir(before)
        if torch.compile is not compile_:
            torch.compile = compile_
            torch._dynamo.reset()
        # The shared world runs other tests next: the block's models and optimizers must go
        # (a td.join of a later test would see two data-parallel optimizers alive).
        sys.modules.pop(module.__name__, None)
        for name in [n for n in namespace if not n.startswith("__")]:
            del namespace[name]
        gc.collect()
    return out.getvalue()


TRAIN_PY = """import torch, tandem as td
td.init()
total = td.allreduce(torch.tensor(float(td.rank())), op="sum").item()
print(f"rank {td.rank()} of {td.size()}: sum of ranks {total}")
"""


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("page, line, lang, kind, said, code", IN_WORLDS)
def test_block_runs(page, line, lang, kind, said, code, tmp_path, request):
    run_block(page, line, kind, said, code, tmp_path, request)


# A block that is a job of its own runs as a user runs it, in a directory of its own; the jobs
# run side by side, ahead of their tests (tests/jobs_ahead.py).
ahead = Ahead()
jobs = ahead.fixture()


def shell_lines(code: str) -> list[str]:
    """A shell block's commands: its lines, less blank ones and comments."""
    return [c for c in code.splitlines() if c.strip() and not c.lstrip().startswith("#")]


def job_commands(said: str, code: str, tmp: Path) -> list[Command | InOrder] | None:
    """The commands of a job block (`said`: its `run:` words), written out under `tmp`; None
    for a block that is not a job this file knows how to run."""
    words, env = shlex.split(said), _environment()
    if words[0] == "shell":
        if words[1:] not in ([], ["in", "the", "checkout"]):
            return None
        (tmp / "train.py").write_text(TRAIN_PY)
        return [InOrder([Command(["bash", "-c", c], env, ROOT if words[1:] else tmp, JOB_TIMEOUT_S)
                         for c in shell_lines(code)])]
    script = tmp / "script.py"
    script.write_text(code)
    if words[:2] == ["tandem", "run"]:
        command = [sys.executable, "-m", "tandem", "run", *words[2:], str(script)]
    elif words == ["python"]:
        command = [sys.executable, str(script)]
    elif words == ["pytest"]:
        script = script.rename(tmp / "test_block.py")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    else:
        return None
    return [Command(command, env, tmp, JOB_TIMEOUT_S)]


@ahead.plan("test_job_block_runs")
def _(tmp, page, kind, said, code):
    if kind != "run" or (NEEDS_MPI.search(code) and importlib.util.find_spec("mpi4py") is None):
        return []
    return job_commands(said, code, tmp) or []


@pytest.mark.timeout(SHELL_LINES_MAX * JOB_TIMEOUT_S + 60)  # each line of a shell block has its own
@pytest.mark.parametrize("page, line, lang, kind, said, code", JOBS)
def test_job_block_runs(page, line, lang, kind, said, code, jobs, request):
    assert kind == "run", f"{page}:{line} has no '<!-- run: ... -->' marker"
    where = f"docs/{page}:{line}"
    if NEEDS_MPI.search(code) and importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs MPI: pip install mpi4py mpich (scripts/setup.sh installs both)")
    words = shlex.split(said)
    if words[0] == "shell":
        assert words[1:] in ([], ["in", "the", "checkout"]), f"{where}: {said!r}"
    elif not (words[:2] == ["tandem", "run"] or words in (["python"], ["pytest"])):
        pytest.fail(f"{where}: cannot run {said!r}")
    [done], _ = jobs.take(request.node)
    if words[0] == "shell":
        commands = shell_lines(code)
        assert len(commands) <= SHELL_LINES_MAX, f"{where}: split a block of {len(commands)} commands"
        for command, result in zip(commands, done, strict=False):
            assert result.returncode == 0, f"{where}: `{command}` exited {result.returncode}:\n" \
                                           f"{result.stdout}{result.stderr}"
        assert len(done) == len(commands), (where, commands, done)
        return
    assert done.returncode == 0, f"{where}: exit code {done.returncode}\n{done.stdout}{done.stderr}"


@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
@pytest.mark.parametrize("page, line, lang, kind, said, code", SITE_BUILDS)
def test_site_build_block_runs(page, line, lang, kind, said, code, tmp_path, request):
    run_block(page, line, kind, said, code, tmp_path, request)


def run_block(page, line, kind, said, code, tmp_path, request):
    if page in RUN_ELSEWHERE and kind is None:
        pytest.skip(f"run by {RUN_ELSEWHERE[page]}")
    if kind == "skip":
        pytest.skip(said)
    assert kind == "run", f"{page}:{line} has no '<!-- run: ... -->' marker"
    where = f"docs/{page}:{line}"
    if NEEDS_MPI.search(code) and importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs MPI: pip install mpi4py mpich (scripts/setup.sh installs both)")
    words = shlex.split(said)
    if words[0] == "ranks":
        setups = tuple(words[3].split(",")) if words[2:3] == ["with"] else ()
        assert len(words) == (4 if setups else 2) and set(setups) <= set(SETUPS), f"{where}: {said!r}"
        results = run_distributed(exec_block, world_size=int(words[1]), backend="gloo",
                                  args=(code, where, str(tmp_path / "work"), setups), timeout=JOB_TIMEOUT_S)
        assert len(results) == int(words[1])
        return
    if said == "the site build":
        assert code.strip() == "bash scripts/docs.sh", f"{where}: the site fixture runs scripts/docs.sh only"
        built = request.getfixturevalue("site")
        assert (built / "index.html").exists()
        return
    if said == "in the test process":
        before, path = os.getcwd(), list(sys.path)
        os.chdir(ROOT)
        try:
            exec(compile(code, where, "exec"), {"__name__": "docs_block"})
        finally:
            os.chdir(before)
            sys.path[:] = path
        return
    pytest.fail(f"{where}: cannot run {said!r} (a job block runs in test_job_block_runs)")


# --- measured results: dated pages, not the guides -------------------------------------------

MEASURED_ROW = re.compile(r"^\s*\|.*(\bms\b|µs|\bus\b|samples/s|MiB|GB/s|Gb/s)", re.MULTILINE)


def test_measured_results_are_dated_pages_that_the_guides_link_to():
    """A measurement lives in docs/results/DATE-what.md (dated, its machine and command said,
    listed in results/index.md and the nav); a guide states what it means and links there."""
    results = DOCS / "results"
    index = (results / "index.md").read_text()
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p for p in results.glob("*.md") if p.name != "index.md")
    assert pages
    for page in pages:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", page.name), f"{page.name}: not DATE-what.md"
        assert "*Measured " in page.read_text()[:600], f"{page.name} says not when and where it was measured"
        assert f"]({page.name})" in index, f"results/index.md does not list {page.name}"
        assert f"results/{page.name}" in nav, f"mkdocs.yml's nav does not list results/{page.name}"
    linked = "\n".join(p.read_text() for p in pages_outside(results))
    unlinked = [p.name for p in pages if f"results/{p.name}" not in linked]
    assert not unlinked, f"no guide links to {unlinked}"
    tables = [f"{p.relative_to(DOCS)}: {m.group(0).strip()[:80]}" for p in pages_outside(results)
              for m in MEASURED_ROW.finditer(p.read_text())]
    assert not tables, f"measurement tables in the guides (move them to docs/results/): {tables}"


def pages_outside(folder: Path) -> list[Path]:
    return [p for p in pages() if folder not in p.parents]


# --- the build --------------------------------------------------------------------------------


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**_environment(), "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "--clean", "-f", str(config), "-d", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this module: strict (a warning is an error), every link checked."""
    if not MKDOCS.exists():
        pytest.skip("mkdocs is not installed: bash scripts/setup.sh installs the docs extra")
    out = tmp_path_factory.mktemp("site") / "site"
    env = {**_environment(), "DOCS_SITE_DIR": str(out)}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "docs.sh")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert result.returncode == 0, f"the site does not build strictly:\n{result.stderr[-6000:]}"
    assert f"docs: open file://{out}/index.html" in result.stdout, result.stdout
    return out


def test_site_builds_with_every_part_and_the_generated_reference(site):
    for part in ("tutorials", "how-to", "concepts", "reference", "results"):
        assert (site / part / "index.html").exists(), part
    api = (site / "reference" / "api.html").read_text()
    assert 'id="tandem.runtime.init"' in api and "backend" in api  # td.init, with its arguments
    settings = (site / "reference" / "settings.html").read_text()
    assert "TANDEM_TIMEOUT" in settings
    cli = (site / "reference" / "cli.html").read_text()
    assert "--nnodes" in cli and "tandem memory" in cli
    errors = (site / "reference" / "errors.html").read_text()
    assert "CollectiveMismatchError" in errors and "WatchdogTimeout" in errors


def test_every_readme_section_of_before_is_reachable(site):
    """The README's sections of before the site each have their page (the front door links in):
    every `## ` heading of the last long README (`git show 1573741:README.md`, 1,957 lines)."""
    text = "\n".join(p.read_text() for p in (site).rglob("*.html"))
    for title in ("Two commands", "The five-line change", "Running a job", "Logging and progress",
                  "Notebooks", "Clusters (SLURM)", "API", "Which wrapper?", "How much memory per rank?",
                  "Data parallelism", "Uneven shards", "Models larger than one rank",
                  "Checkpoints between any two layouts", "Pipelines", "Tensor parallelism and branches",
                  "Long sequences: context parallelism", "torch.compile and activation checkpointing",
                  "MPI", "torch.distributed scripts on tandem", "Coming from torchrun",
                  "Lightning, Accelerate and the HF Trainer", "Elastic jobs",
                  "Jobs that outlive their allocation", "Scaling", "When things go wrong",
                  "Horovod scripts", "Tests and benchmarks", "GPU check", "Layout"):
        assert re.search(r"<h[12][^>]*>" + re.escape(title.replace("&", "&amp;")), text), title


def test_a_broken_link_fails_the_build(tmp_path):
    """A page linking to a page or an anchor that is not there is an error, not a 404 for a reader."""
    if not MKDOCS.exists():
        pytest.skip("mkdocs is not installed: bash scripts/setup.sh installs the docs extra")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the guide](guide.md#no-such-section).\n")
    (docs / "guide.md").write_text("# Guide\n\n## A section\n\nSee [gone](gone.md).\n")
    config = tmp_path / "mkdocs.yml"
    lines = (ROOT / "mkdocs.yml").read_text().split("\nnav:")[0]
    lines = re.sub(r"hooks:\n  - .*\n", "", lines).replace("docs_dir: docs", f"docs_dir: {docs}")
    config.write_text(lines + "\nnav:\n  - index.md\n  - guide.md\n")
    result = build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "gone.md" in result.stderr and "no-such-section" in result.stderr, result.stderr[-3000:]


# --- in a real browser --------------------------------------------------------------------------


def _browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no chromium/chromedriver: scripts/setup.sh installs Debian's chromium and "
                    "chromium-driver when it runs as root with apt-get")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: bash scripts/setup.sh installs the docs extra")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,900"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


@pytest.fixture(scope="module")
def served(site):
    """The built site on a local HTTP server (the search index is fetched, as from any host)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


@pytest.mark.timeout(240)
def test_the_site_in_a_browser(served):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _browser()
    try:
        browser.set_page_load_timeout(60)
        wait = WebDriverWait(browser, 60)
        browser.get(f"{served}/index.html")
        wait.until(lambda b: b.find_element(By.CSS_SELECTOR, "article h1").text == "tandem")
        assert "k ranks give one process's numbers" in browser.find_element(By.TAG_NAME, "article").text
        shots = DOCS / "_screenshots"
        shots.mkdir(exist_ok=True)
        (shots / ".gitignore").write_text("*\n")
        assert browser.save_screenshot(str(shots / "landing.png"))

        # the navigation reaches each of the four parts
        for tab, heading in (("Tutorials", "Tutorials"), ("How-to guides", "How-to guides"),
                             ("Concepts", "Concepts"), ("Reference", "Reference")):
            browser.get(f"{served}/index.html")
            link = wait.until(lambda b, tab=tab: next(
                (a for a in b.find_elements(By.CSS_SELECTOR, ".md-tabs__link") if a.text.strip() == tab),
                None))
            link.click()
            wait.until(lambda b, h=heading: b.find_element(By.CSS_SELECTOR, "article h1").text == h)

        # the search finds the words a newcomer types
        for word, expected in (("elastic", "Elastic"), ("fully_shard", "fully_shard")):
            browser.get(f"{served}/index.html?q={word}")
            results = wait.until(lambda b: [
                r.text for r in b.find_elements(By.CSS_SELECTOR, ".md-search-result__item") if r.text.strip()
            ] or None)
            assert any(expected.lower() in r.lower() for r in results), (word, results[:5])

        # the generated reference shows td.init and its arguments
        browser.get(f"{served}/reference/api.html")
        init = wait.until(lambda b: b.find_element(By.ID, "tandem.runtime.init"))
        section = init.find_element(By.XPATH, "./..")
        text = section.text
        assert "td.init" in text and "backend" in text and "rank" in text, text[:2000]
    finally:
        browser.quit()
