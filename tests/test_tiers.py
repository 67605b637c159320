"""The tiers of tests/conftest.py: every entry of SLOW still names a test and says why, so a
renamed file or test cannot slip back into the fast tier (or out of it) unnoticed."""

import ast
from pathlib import Path

from conftest import SLOW, slow_reason

ROOT = Path(__file__).resolve().parents[1]


def _tests_in(path: Path) -> set[str]:
    """The test functions of a file, as `test_y` and `Class::test_y`."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(f"{node.name}::{child.name}" for child in node.body
                         if isinstance(child, ast.FunctionDef) and child.name.startswith("test"))
    return names


def test_every_slow_entry_names_a_test_and_why():
    stale = []
    for key, reason in SLOW.items():
        assert reason.strip(), f"SLOW[{key!r}] gives no reason"
        path, _, test = key.partition("::")
        if not (ROOT / path).is_file():
            stale.append(f"{key}: no file {path}")
        elif test and test.split("[", 1)[0] not in _tests_in(ROOT / path):
            stale.append(f"{key}: no test {test.split('[', 1)[0]} in {path}")
    assert not stale, "tests/conftest.py's SLOW names tests that are gone (rename or drop them):\n" + (
        "\n".join(stale))


def test_an_entry_covers_its_file_its_test_or_one_parametrization(monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "SLOW", {"tests/test_a.py": "file", "tests/test_b.py::test_y": "test",
                                           "tests/test_b.py::test_z[mpi]": "one"})
    assert slow_reason("tests/test_a.py::test_anything[gloo]") == "file"
    assert slow_reason("tests/test_a.py::Class::test_anything") == "file"
    assert slow_reason("tests/test_b.py::test_y") == "test"
    assert slow_reason("tests/test_b.py::test_y[gloo-2]") == "test"
    assert slow_reason("tests/test_b.py::test_z[mpi]") == "one"
    assert slow_reason("tests/test_b.py::test_z[gloo]") is None
    assert slow_reason("tests/test_b.py::test_y_other") is None
