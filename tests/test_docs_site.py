"""The documentation site (mkdocs.yml, docs/): it builds strictly, its links hold, every code
block on it runs, and a real browser shows it.

Code blocks. Every ```python and ```bash block of the site's pages carries a marker on the line
above it, an HTML comment the reader does not see:

- `<!-- run: ranks N -->`: the block runs on each rank of a shared world of N ranks (Gloo,
  `tandem.testing.run_distributed`), after `td.init()`, with the names a fragment leans on
  already defined (`PRELUDE`: model, Net, Block, loader, opt, loss_fn, x, y, ...), in a
  directory of its own shared by the ranks;
- `<!-- run: tandem run -np N -->` or `<!-- run: python -->`: a complete script, started as a
  user starts it;
- `<!-- run: shell -->`: each command line of the block runs in bash, in a directory with a
  small `train.py`, with `tandem` on the PATH;
- `<!-- skip: needs ... -->`: a block that needs a GPU, a cluster (several hosts, SLURM) or a
  network, with the reason;
- `<!-- shown: why -->`: not a program of its own (alternatives side by side, the suite's own
  commands), with the test that runs what it shows.

docs/recipes.md's blocks are run by tests/test_recipes_doc.py (each names its launch on its
first line); they are not run twice.
"""

from __future__ import annotations

import functools
import gc
import http.server
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

from tandem.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MKDOCS = Path(sys.executable).parent / "mkdocs"
BUILD_TIMEOUT_S = 240  # about 25 s alone; two shared cores and torch's import can stall it
JOB_TIMEOUT_S = 120
RUN_ELSEWHERE = {"recipes.md": "tests/test_recipes_doc.py"}
SHELL_LANGS = ("bash", "sh", "shell", "console")
MARKER = re.compile(r"<!-- (run|skip|shown): (.+?) -->")
SKIP_REASONS = ("needs a GPU", "needs a cluster", "needs SLURM", "needs several hosts", "needs a network")

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


def test_every_block_is_marked():
    """A block without a marker, or a skip without a reason the docs accept, fails here."""
    unmarked = [f"{p.values[0]}:{p.values[1]}" for p in BLOCKS
                if p.values[3] is None and p.values[0] not in RUN_ELSEWHERE]
    assert not unmarked, f"blocks with no '<!-- run: ... -->' or '<!-- skip: ... -->' above them: {unmarked}"
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


def exec_block(code: str, where: str, directory: str) -> str:
    """On every rank: the prelude, then the block, in `directory`; what it printed."""
    import contextlib
    import io

    os.makedirs(directory, exist_ok=True)
    before = os.getcwd()
    os.chdir(directory)
    out = io.StringIO()
    module = types.ModuleType("docs_block")  # a real module: torch.compile imports its globals'
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
            exec(compile(code, where, "exec"), namespace)
    finally:
        os.chdir(before)
        # The shared world runs other tests next: the block's models and optimizers must go
        # (a td.join of a later test would see two data-parallel optimizers alive).
        sys.modules.pop(module.__name__, None)
        namespace.clear()
        gc.collect()
    return out.getvalue()


TRAIN_PY = """import torch, tandem as td
td.init()
total = td.allreduce(torch.tensor(float(td.rank())), op="sum").item()
print(f"rank {td.rank()} of {td.size()}: sum of ranks {total}")
"""


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
@pytest.mark.parametrize("page, line, lang, kind, said, code", BLOCKS)
def test_block_runs(page, line, lang, kind, said, code, tmp_path):
    if page in RUN_ELSEWHERE and kind is None:
        pytest.skip(f"run by {RUN_ELSEWHERE[page]}")
    if kind in ("skip", "shown"):
        pytest.skip(said)
    assert kind == "run", f"{page}:{line} has no marker"
    where = f"docs/{page}:{line}"
    words = shlex.split(said)
    if words[0] == "ranks":
        results = run_distributed(exec_block, world_size=int(words[1]), backend="gloo",
                                  args=(code, where, str(tmp_path / "work")), timeout=JOB_TIMEOUT_S)
        assert len(results) == int(words[1])
        return
    env = _environment()
    if words == ["shell"]:
        (tmp_path / "train.py").write_text(TRAIN_PY)
        commands = [c for c in code.splitlines() if c.strip() and not c.lstrip().startswith("#")]
        for command in commands:
            result = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                                    text=True, timeout=JOB_TIMEOUT_S)
            assert result.returncode == 0, f"{where}: `{command}` exited {result.returncode}:\n" \
                                           f"{result.stdout}{result.stderr}"
        return
    script = tmp_path / "script.py"
    script.write_text(code)
    if words[:2] == ["tandem", "run"]:
        command = [sys.executable, "-m", "tandem", "run", *words[2:], str(script)]
    elif words == ["python"]:
        command = [sys.executable, str(script)]
    else:
        pytest.fail(f"{where}: cannot run {said!r}")
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=JOB_TIMEOUT_S)
    assert result.returncode == 0, f"{where}: exit code {result.returncode}\n{result.stdout}{result.stderr}"


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
    result = build(ROOT / "mkdocs.yml", out)
    assert result.returncode == 0, f"the site does not build strictly:\n{result.stderr[-6000:]}"
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
    """The README's sections of before the site each have their page (the front door links in)."""
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
