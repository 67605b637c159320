"""Two lines of one file from which ranks reached the same collective: a skip, branches, or unknown.

    verdict(source, [3, 4])   # -> (SKIP, (3, 4)) for
                              #    3: if rank == 0: a = td.allreduce(x, op="sum")
                              #    4: b = td.allreduce(y, op="sum")

When every argument of a collective agrees but the ranks call it from different lines, the
argument check (`comm.agreement.checks`) asks this module what the lines are to each other, from the
file's syntax tree alone (a pure function: every rank reads the same text and decides alike):

* SKIP: the two calls are statements of one block, one after the other, the later one is made
  by every rank that reaches its place (nested in nothing but `with` or a `try` body), and no
  `return`, `raise`, `break` or `continue` leaves the block between them. A rank at the
  earlier line will reach the later one next, so a rank already at the later line went past
  the earlier collective without calling it: the pairing is off by one, and the values would
  be wrong. Refused in every mode, before anything is sent.
* BRANCHES: the lines are in different branches of one `if`/`elif`/`else` (or of one `match`,
  or two `except` clauses of one `try`): code that branches on the rank on purpose
  (`if rank == 0: td.broadcast(x) else: td.broadcast(y)`). Fine in every mode.
* UNKNOWN: anything else (two functions, two files, a call inside a loop the other line is
  outside of, `if rank == 0: A` followed by `if rank != 0: B`, an early `return` between the
  two). Both a deliberate branch and a skip could look like this, so the default check lets
  it run (it cannot refuse a correct program) and debug mode refuses it (it checks strictly).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator, Sequence
from itertools import combinations

SKIP, BRANCHES, UNKNOWN = "skip", "branches", "unknown"

# One step into the tree: (parent node, which statement list of it, index in that list, statement)
Step = tuple[ast.AST, str, int, ast.stmt]
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_TRY = (ast.Try, ast.TryStar) if hasattr(ast, "TryStar") else (ast.Try,)


def verdict(source: str, lines: Sequence[int]) -> tuple[str, tuple[int, int] | None]:
    """What the ranks' lines of one file are to each other: `(SKIP, (earlier, later))` if any
    two of them are a skip, `(BRANCHES, None)` if every two are branches, else `(UNKNOWN, None)`."""
    tree = _parse(source)
    if tree is None:
        return UNKNOWN, None
    found = [(_relation(tree, a, b), (a, b)) for a, b in combinations(sorted(set(lines)), 2)]
    for relation, pair in found:
        if relation == SKIP:
            return SKIP, pair
    if found and all(relation == BRANCHES for relation, _ in found):
        return BRANCHES, None
    return UNKNOWN, None


@functools.lru_cache(maxsize=8)
def _parse(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except (SyntaxError, ValueError):
        return None


def _lists(node: ast.AST) -> Iterator[tuple[str, list]]:
    for field in ("body", "orelse", "finalbody"):
        stmts = getattr(node, field, None)
        if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
            yield field, stmts
    for i, handler in enumerate(getattr(node, "handlers", None) or ()):
        yield f"handler{i}", handler.body
    for i, case in enumerate(getattr(node, "cases", None) or ()):
        yield f"case{i}", case.body


def _statements(parent: ast.AST, key: str) -> list:
    return dict(_lists(parent))[key]


def _path(tree: ast.Module, line: int) -> list[Step]:
    """The statements that hold `line`, outermost first (the first one where a line holds several)."""
    steps: list[Step] = []
    node: ast.AST = tree
    while True:
        found = next(((key, i, stmt) for key, stmts in _lists(node) for i, stmt in enumerate(stmts)
                      if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno)), None)
        if found is None:
            return steps
        steps.append((node, *found))
        node = found[2]


def _relation(tree: ast.Module, a: int, b: int) -> str:
    first, second = _path(tree, a), _path(tree, b)
    k = 0
    while k < min(len(first), len(second)) and first[k][3] is second[k][3]:
        k += 1
    if k == len(first) or k == len(second):
        return UNKNOWN  # one statement holds both lines
    parent, key_a, index_a, _ = first[k]
    _, key_b, index_b, _ = second[k]
    if key_a != key_b:  # two lists of one statement
        exclusive = (isinstance(parent, ast.If) or key_a.startswith(("case", "handler"))
                     and key_b.startswith(("case", "handler")))
        return BRANCHES if exclusive else UNKNOWN
    if index_b < index_a:
        first, second = second, first
    if not _made_by_all(second, k) or _leaves(first, k, second[k][2]):
        return UNKNOWN
    return SKIP


def _made_by_all(path: list[Step], k: int) -> bool:
    """Whether every run of `path[k]`'s statement reaches the line's call (nothing but `with`
    and `try` bodies around it)."""
    for parent, key, _, _ in path[k + 1:]:
        if isinstance(parent, (ast.With, ast.AsyncWith)):
            continue
        if isinstance(parent, _TRY) and key in ("body", "finalbody"):
            continue
        return False
    return True


def _leaves(path: list[Step], k: int, until: int) -> bool:
    """Whether code that runs after the line's call may leave `path[k]`'s block before index
    `until` of it (a return, a raise, a break or continue of a loop outside it), or whether
    the call is in another function or class than that block."""
    if any(isinstance(parent, _SCOPES) for parent, _, _, _ in path[k + 1:]):
        return True
    if _jumps([path[-1][3]], inside_loop=_in_loop(path, k, len(path) - 1)):
        return True
    for j in range(len(path) - 1, k - 1, -1):
        parent, key, index, _ = path[j]
        stmts = _statements(parent, key)
        after = stmts[index + 1:until] if j == k else stmts[index + 1:]
        if isinstance(parent, _TRY) and key == "body" and j > k:
            after = after + parent.orelse + parent.finalbody
        if _jumps(after, inside_loop=_in_loop(path, k, j)):
            return True
    return False


def _in_loop(path: list[Step], k: int, j: int) -> bool:
    """Whether level `j`'s list is inside a loop body that is itself inside `path[k]`."""
    return any(isinstance(path[m][3], _LOOPS) and path[m + 1][1] == "body" for m in range(k, j))


def _jumps(stmts: Sequence[ast.stmt], inside_loop: bool) -> bool:
    return any(_jump_in(stmt, inside_loop) for stmt in stmts)


def _jump_in(node: ast.AST, inside_loop: bool) -> bool:
    if isinstance(node, (ast.Return, ast.Raise)):
        return True
    if isinstance(node, (ast.Break, ast.Continue)):
        return not inside_loop
    if isinstance(node, _SCOPES):
        return False
    if isinstance(node, _LOOPS):
        return (any(_jump_in(child, True) for child in node.body)
                or any(_jump_in(child, inside_loop) for child in node.orelse))
    return any(_jump_in(child, inside_loop) for child in ast.iter_child_nodes(node))
