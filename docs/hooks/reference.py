"""The site's reference, generated at build time from the code as it is (mkdocs hook).

Pages: reference/api.md (every name of `tandem.__all__`), reference/ns-<name>.md (every public
namespace `td.<name>` and its `__all__`), reference/errors.md (`td.errors`), reference/cli.md
(`tandem <command> --help` of each command) and reference/settings.md (every `TANDEM_*` variable
the sources read, with the line that describes it). Each object is rendered by mkdocstrings from
the module that defines it, so the reference follows whatever names land, with no list to keep.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

NS_PAGE = "reference/ns-{}.md"


def _tandem():
    import tandem

    return tandem


def namespaces() -> list[str]:
    """The public sub-namespaces `td.<name>` (tandem's own list of them; errors has its page)."""
    return [name for name in _tandem()._NAMESPACES if name != "errors"]


def _names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:  # a namespace without __all__: its public callables and classes
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and (inspect.isfunction(v) or inspect.isclass(v))
                 and getattr(v, "__module__", "").startswith("tandem")]
    return list(names)


_RENDERED: dict[str, str] = {}  # an object's full path -> the name it was rendered under


def _path(value: object) -> str | None:
    home = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if home and qualname and home.startswith("tandem") and "<" not in qualname:
        return f"{home}.{qualname}"
    return None


def _entry(prefix: str, name: str, value: object) -> str:
    """mkdocstrings' rendering of `value` the first time; a cross-reference to it after that
    (one object has one place, so autorefs finds one URL for it)."""
    path = _path(value)
    if path and path in _RENDERED:
        return f"## `{prefix}.{name}`\n\nThe same object as [`{_RENDERED[path]}`][{path}].\n"
    if path:
        _RENDERED[path] = f"{prefix}.{name}"
        return (f"::: {path}\n    options:\n      heading: \"{prefix}.{name}\"\n"
                f"      toc_label: \"{prefix}.{name}\"\n")
    return f"## `{prefix}.{name}`\n\n`{prefix}.{name} = {value!r}`\n"


def api_page() -> str:
    td = _tandem()
    out = ["# td: the top-level names\n",
           "Generated from `tandem.__all__` and each object's docstring when the site is built. "
           "`import tandem as td`; the namespaces are pages of their own: "
           + ", ".join(f"[td.{n}](ns-{n}.md)" for n in namespaces()) + ".\n"]
    for name in td.__all__:
        out.append(_entry("td", name, getattr(td, name)))
    return "\n".join(out)


def namespace_page(ns: str) -> str:
    module = importlib.import_module(f"tandem.{ns}")
    doc = inspect.getdoc(module) or ""
    first = doc.split("\n\n")[0] if doc else ""
    out = [f"# td.{ns}\n", f"{first}\n" if first else "",
           f"Generated from `tandem.{ns}`'s public names when the site is built.\n"]
    for name in _names(module):
        out.append(_entry(f"td.{ns}", name, getattr(module, name)))
    return "\n".join(out)


def errors_page() -> str:
    errors = importlib.import_module("tandem.errors")
    out = ["# Errors and warnings\n",
           "Every public error and warning, from `td.errors.__all__` (`td.errors.X`; the ones users "
           "catch most are also at the top: `td.CollectiveMismatchError`, ...). What each message "
           "means, with the fix: [Failures](../failures.md) and "
           "[Read a failure report](../how-to/failure-report.md).\n",
           "| name | is a | says |", "|---|---|---|"]
    for name in _names(errors):
        value = getattr(errors, name)
        bases = ", ".join(b.__name__ for b in getattr(value, "__bases__", ()))
        doc = (inspect.getdoc(value) or "").split("\n\n")[0].replace("\n", " ").replace("|", "\\|")
        path = _path(value)
        link = f"[`{name}`][{path}]" if path else f"`{name}`"
        out.append(f"| {link} | {bases} | {doc} |")
    out.append("")
    for name in _names(errors):
        out.append(_entry("td.errors", name, getattr(errors, name)))
    return "\n".join(out)


def cli_page() -> str:
    def helptext(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "tandem", *args, "--help"], capture_output=True,
                                text=True, timeout=120, env={"COLUMNS": "100", "PATH": "/usr/bin:/bin",
                                                               "PYTHONPATH": str(SRC)})
        if result.returncode != 0:
            raise RuntimeError(f"tandem {' '.join(args)} --help failed:\n{result.stderr}")
        return result.stdout.rstrip()

    top = helptext()
    commands = re.findall(r"^    (\w+)\s{2,}", top, re.MULTILINE)
    out = ["# The `tandem` command\n",
           "Generated from each command's `--help` when the site is built.\n",
           "```text\n$ tandem --help\n" + top + "\n```\n"]
    for command in commands:
        out.append(f"## tandem {command}\n\n```text\n$ tandem {command} --help\n{helptext(command)}\n```\n")
    return "\n".join(out)


def settings() -> dict[str, tuple[list[str], str]]:
    """Every TANDEM_* variable the sources name: (the modules naming it, a line describing it)."""
    found: dict[str, tuple[list[str], str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        for line in path.read_text().splitlines():
            for name in re.findall(r"\b(TANDEM_[A-Z0-9_]*[A-Z0-9])\b", line):
                modules, said = found.setdefault(name, ([], ""))
                if module not in modules:
                    modules.append(module)
                text = line.strip().lstrip("#").strip()
                if not said and len(text) > len(name) + 12:
                    found[name] = (modules, text)
    return found


def settings_page() -> str:
    out = ["# `TANDEM_*` settings\n",
           "Every `TANDEM_*` environment variable tandem's sources read, generated when the site is "
           "built: where it is read, and the line of the source that says what it is. The settings a "
           "rank reads are parsed and checked in one place, `tandem.job.settings` (a value that "
           "cannot be used is an error naming it); `tandem run`'s own options (`TANDEM_NP`, ...) "
           "are read with its flags (see [the tandem command](cli.md)).\n",
           "| variable | read in | the source says |", "|---|---|---|"]
    for name, (modules, said) in sorted(settings().items()):
        said = said.replace("|", "\\|").replace("`", "")
        out.append(f"| `{name}` | {', '.join(f'`{m}`' for m in modules[:4])} | {said[:200]} |")
    return "\n".join(out) + "\n"


def on_config(config, **kwargs):
    """The namespaces' pages join the navigation after the top-level names."""
    for section in config["nav"]:
        if isinstance(section, dict) and "Reference" in section:
            items = section["Reference"]
            at = next(i for i, item in enumerate(items)
                      if isinstance(item, dict) and "reference/api.md" in item.values()) + 1
            items[at:at] = [{f"td.{ns}": NS_PAGE.format(ns)} for ns in namespaces()]
    return config


def on_files(files, config, **kwargs):
    _RENDERED.clear()
    pages = {"reference/api.md": api_page(), "reference/errors.md": errors_page(),
             "reference/cli.md": cli_page(), "reference/settings.md": settings_page()}
    for ns in namespaces():
        pages[NS_PAGE.format(ns)] = namespace_page(ns)
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    return files
