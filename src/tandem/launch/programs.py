"""What each rank runs (a script, a module, or a command), checked before anything starts.

`tandem run` takes torchrun's form (`train.py`, `-m pkg.train`: run by this Python) and
mpiexec's (`python train.py`, `./a.out`: any command, run as given). The mistakes of either
form are caught here, with the cause and the command that works, instead of each rank
failing on its own or, worse, exiting 0 having run nothing:

- `python` with no script reads its standard input, which a rank does not have: it exits 0.
- `-m x.py` makes Python import `x` (running the whole file) before it complains.
- An executable text file without a `#!` line cannot be run (`exec` says "Exec format error";
  only a shell falls back to `sh`), nor one whose `#!` names a missing interpreter.
- A file that is not executable is run by this Python, as torchrun does; that is refused when
  it is not Python (a shell script without `chmod +x`, a program, any other file).

Each check returns the problem as text (None when there is none); `config` raises it as a
`LaunchError`. Binary formats other than ELF are left to the system to judge (binfmt_misc
may know them); if it cannot run one, the ranks' start failure names the cause.
"""

from __future__ import annotations

import os
import re
import shutil
import zipfile

PYTHON_NAME = re.compile(r"(python|pypy)(\d+(\.\d+)*)?$")  # python, python3, python3.11, pypy3
_SHORT_WITH_VALUE = "WX"  # python -W arg, -X opt (also written -Wignore)
_LONG_WITH_VALUE = ("--check-hash-based-pycs",)
_HEAD_BYTES = 4096
_COMPILE_LIMIT = 1 << 20  # larger files are not compiled here: assume Python


def is_command(program: str) -> bool:
    """Whether `program` is a command to run as given (mpiexec's and horovodrun's form:
    `python train.py`, `/abs/python -m pkg`, `./a.out`) rather than a Python script.

    A `.py` file, or a file that is not executable, is a script (run by this Python); an
    executable file, or a name found on PATH that is no file here, is a command.
    """
    if program.endswith(".py"):
        return False
    if os.path.isfile(program):
        return os.access(program, os.X_OK)
    return os.sep not in program and shutil.which(program) is not None


def is_python(command: str) -> bool:
    """Whether `command` names a Python interpreter (`python`, `/opt/py/bin/python3.11`)."""
    return bool(PYTHON_NAME.match(os.path.basename(command)))


def python_target(args: tuple[str, ...] | list[str]) -> tuple[str, str] | None:
    """What a Python started with `args` runs: ("script", path), ("-m", module), ("-c", code),
    ("option", --help and the like), or None: nothing, it would read standard input."""
    args = list(args)
    while args:
        arg = args.pop(0)
        if arg == "-" or not arg.startswith("-"):
            return None if arg == "-" else ("script", arg)
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            if name in _LONG_WITH_VALUE:
                if "=" not in arg and args:
                    args.pop(0)
                continue
            return "option", arg  # --help, --version, or one Python itself will refuse
        for at, letter in enumerate(arg[1:], start=1):
            rest = arg[at + 1:]
            if letter in "cm":
                value = rest or (args.pop(0) if args else "")
                return f"-{letter}", value
            if letter in _SHORT_WITH_VALUE:
                if not rest and args:
                    args.pop(0)
                break
            if letter in "hV?":
                return "option", arg
    return None


def _did_you_mean(module: str) -> str:
    return module.removesuffix(".py").replace(os.sep, ".").strip(".")


def shape_problem(program: str, args: tuple[str, ...], module: bool, executable: bool,
                  np: int) -> str | None:
    """What is wrong with the command line itself (no file is read)."""
    if module and (program.endswith(".py") or os.sep in program):
        return (f"-m {program}: -m takes a module name, not a file (Python would import and run "
                f"it before it says so): did you mean `-m {_did_you_mean(program)}`? To run the "
                f"file, drop -m: `tandem run -np {np} {program}`")
    if not (executable and is_python(program)):
        return None
    target = python_target(args)
    if target is None:
        return (f"`{program}` with no script to run: each rank would start Python on an empty "
                f"standard input and exit 0 having done nothing. Name the script: `tandem run "
                f"-np {np} {program} train.py` (or just `tandem run -np {np} train.py`), or a "
                "module with -m")
    kind, value = target
    if kind == "-m" and (value.endswith(".py") or os.sep in value):
        return (f"{program} -m {value}: -m takes a module name, not a file: did you mean "
                f"`-m {_did_you_mean(value)}`? To run the file: `tandem run -np {np} {program} "
                f"{value}`")
    return None


def _head(path: str) -> bytes | None:
    try:
        with open(path, "rb") as file:
            return file.read(_HEAD_BYTES)
    except OSError:
        return None  # execute-only, or gone: the system has the last word


def _python_error(path: str) -> str | None:
    """Why Python cannot compile the file (None: it can, or it is too large to check here)."""
    try:
        if os.path.getsize(path) > _COMPILE_LIMIT:
            return None
        with open(path, "rb") as file:
            compile(file.read(), path, "exec", dont_inherit=True)
    except SyntaxError as error:
        return f"{error.msg} at line {error.lineno}"
    except (ValueError, UnicodeDecodeError) as error:  # null bytes, not text
        return str(error)
    except OSError:
        return None
    return None


def _interpreter(head: bytes) -> tuple[str, str]:
    """(the `#!` line, its interpreter's path) of a file that starts with `#!`."""
    line = head[2:].split(b"\n", 1)[0].decode(errors="replace").strip()
    return line, (line.split() or [""])[0]


def _command_problem(path: str, shown: str, np: int) -> str | None:
    """An executable file that the system may still be unable to run."""
    head = _head(path)
    if head is None or head.startswith(b"\x7fELF") or b"\0" in head:
        return None
    if head.startswith(b"#!"):
        line, interpreter = _interpreter(head)
        if head.split(b"\n", 1)[0].endswith(b"\r"):
            return (f"{shown} cannot be run: its first line `#!{line}` ends in a carriage return "
                    f"(Windows line endings), so the system looks for `{interpreter}\\r`, which "
                    f"does not exist. Convert the file: `sed -i 's/\\r$//' {shown}` (or dos2unix)")
        if os.path.isfile(interpreter) and os.access(interpreter, os.X_OK):
            return None
        why = "names no interpreter" if not interpreter else (
            f"names {interpreter}, which is not executable" if os.path.isfile(interpreter)
            else f"names {interpreter}, which does not exist")
        found = shutil.which(os.path.basename(interpreter)) if interpreter else None
        return (f"{shown} cannot be run: its first line `#!{line}` {why}. Fix that line "
                f"(`#!/usr/bin/env python3`, `#!/bin/sh`), or name the interpreter: "
                f"`tandem run -np {np} {found or 'INTERPRETER'} {shown}`")
    python = _python_error(path) is None
    first, second = ("python", "sh") if python else ("sh", "python")
    return (f"{shown} is executable but has no #! line, so the system cannot run it as a "
            f"command (only a shell would guess `sh`). Name its interpreter: `tandem run -np "
            f"{np} {first} {shown}`{' (it compiles as Python)' if python else ''} or `... "
            f"{second} {shown}`; or make its first line `#!/usr/bin/env python3` or `#!/bin/sh`")


def _script_problem(path: str, np: int) -> str | None:
    """A file this Python will run (a `.py`, or any file that is not executable)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "__main__.py")):
            return None  # Python runs a directory's __main__.py
        return f"{path} is a directory without __main__.py: give the script inside it"
    if path.endswith(".py") or zipfile.is_zipfile(path):
        return None  # Python reports a .py file's own errors, with the line
    head = _head(path)
    if head is None:
        return f"{path} cannot be read: check its permissions"
    if head.startswith(b"#!"):
        line, interpreter = _interpreter(head)
        if any(is_python(word) for word in line.split()):  # `#!/usr/bin/env -S python3 -u`
            return None  # a Python script without `chmod +x`: this Python runs it
        return (f"{path} is a `#!{line}` script, not Python, and it is not executable: "
                f"`chmod +x {path}`, or name its interpreter: `tandem run -np {np} "
                f"{interpreter or 'sh'} {path}`")
    if head.startswith(b"\x7fELF"):
        return f"{path} is a program (ELF) but it is not executable: `chmod +x {path}`"
    error = _python_error(path)
    if error is None:
        return None
    return (f"{path} is not a Python file (Python cannot compile it: {error}), it is not "
            f"executable and it has no #! line, so tandem run cannot run it. If it is a "
            f"shell script, `chmod +x` it and start it with `#!/bin/sh`, or run `tandem run "
            f"-np {np} sh {path}`")


def file_problem(program: str, args: tuple[str, ...], module: bool, executable: bool,
                 np: int) -> str | None:
    """What is wrong with the file each rank would run (None: nothing we can see)."""
    if module:
        return None  # importable only in the ranks' environment: they say so
    if not executable:
        return _script_problem(program, np)
    path = program if os.sep in program else (shutil.which(program) or program)
    if is_python(program):
        target = python_target(args)
        if target is not None and target[0] == "script" and not os.path.exists(target[1]):
            return (f"the script {target[1]!r} does not exist ({os.path.abspath(target[1])})")
        return None
    return _command_problem(path, program, np)
