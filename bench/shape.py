"""The code's shape, in counts: long functions, large modules, EMBER_* environment variables.

    python bench/shape.py [PATH ...] [--limit 40 50] [--module-lines 600] [--json FILE]

For each PATH (default: ember/) it prints
  - Python functions and methods longer than each limit (lines from `def` to the last line of
    the body, decorators excluded; a nested function counts inside its parent and on its own),
  - C/C++/CUDA functions longer than each limit, found by layout: a signature starting at
    column 0 whose body closes with a `}` at column 0 (how every kernel file here is written),
  - modules over --module-lines lines, and the largest modules,
  - the EMBER_* environment variables the code reads (a literal name given to os.environ
    or getenv), how many other EMBER_* identifiers there are (C macros, header guards), and
    EMBER_* names only mentioned in Python text (docs, messages) that nothing reads,
  - and the line count of the project's README.md.
Not a speed benchmark: there is no peer to compare with, so nothing is run beside it.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

PY_SUFFIXES = (".py",)
C_SUFFIXES = (".c", ".h", ".cu", ".cuh", ".cpp", ".hpp")
README = Path(__file__).resolve().parent.parent / "README.md"
ENV_NAME = re.compile(r"\bEMBER_[A-Z0-9_]+")
LIB_NAME = re.compile(r"\blib\.(EMBER_[A-Z0-9_]+)")
C_GETENV = re.compile(r"getenv\(\s*\"(EMBER_[A-Z0-9_]+)\"")


@dataclass(slots=True)
class Function:
    path: str
    name: str
    line: int
    lines: int


def source_files(root: Path, suffixes: tuple) -> list[Path]:
    files = [root] if root.is_file() else sorted(root.rglob("*"))
    return [p for p in files if p.suffix in suffixes and p.is_file() and ".venv" not in p.parts]


def python_functions(path: Path) -> list[Function]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(Function(str(path), node.name, node.lineno, node.end_lineno - node.lineno + 1))
    return out


_C_NOT_A_SIGNATURE = re.compile(r"^(?:[\s#/*}]|typedef\b|struct\s+\w+\s*\{|enum\b|union\b|extern \"C\" \{|namespace\b)")


def c_functions(path: Path) -> list[Function]:
    """Functions by layout: a column-0 line with '(' that reaches '{' before ';', up to the
    next column-0 '}' (or the same line when the braces balance there)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    out, i = [], 0
    while i < len(lines):
        start = i
        if _C_NOT_A_SIGNATURE.match(lines[i] or " ") or "(" not in lines[i] or "=" in lines[i].split("(")[0]:
            i += 1
            continue
        while i < len(lines) and "{" not in lines[i] and ";" not in lines[i]:
            i += 1
        if i >= len(lines) or ";" in lines[i].split("{")[0]:
            i += 1
            continue
        end = i if lines[i].count("{") == lines[i].count("}") else _closing_brace(lines, i + 1)
        out.append(Function(str(path), _c_name(" ".join(lines[start:i + 1])), start + 1, end - start + 1))
        i = end + 1
    return out


def _c_name(signature: str) -> str:
    """The first called-looking word that is not an attribute (__launch_bounds__(...))."""
    names = [n for n in re.findall(r"(\w+)\s*\(", signature) if not n.startswith("__")]
    return names[0] if names else "?"


def _closing_brace(lines: list[str], i: int) -> int:
    while i < len(lines) and not lines[i].startswith("}"):
        i += 1
    return min(i, len(lines) - 1)


def env_names(py: list[Path], c: list[Path]) -> dict[str, list[str]]:
    """EMBER_* names: read from the environment; C identifiers (macros, header guards, and
    the constants Python reads from the extension as lib.EMBER_*); only mentioned in Python
    text (docs, messages) without being read anywhere."""
    read, in_c, seen = set(), set(), set()
    for p in py + c:
        text = p.read_text(encoding="utf-8", errors="replace")
        seen.update(ENV_NAME.findall(text))
        if p.suffix in C_SUFFIXES:
            read.update(C_GETENV.findall(text))
            in_c.update(ENV_NAME.findall(text))
        else:
            read.update(_python_env_reads(text))
            in_c.update(LIB_NAME.findall(text))
    in_c -= read
    return {"read": sorted(read), "c_identifiers": sorted(in_c), "mentioned_only": sorted(seen - read - in_c)}


def _python_env_reads(text: str) -> set[str]:
    """Literal names in os.environ.get/[...]/setdefault/pop and os.getenv calls."""
    names = set()
    for node in ast.walk(ast.parse(text)):
        target = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and (f.attr == "getenv" or _is_environ(f.value)):
                target = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            target = node.slice
        if isinstance(target, ast.Constant) and isinstance(target.value, str) and ENV_NAME.fullmatch(target.value):
            names.add(target.value)
    return names


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def measure(root: Path, limits: list[int], module_lines: int) -> dict:
    py, c = source_files(root, PY_SUFFIXES), source_files(root, C_SUFFIXES)
    py_funcs = [f for p in py for f in python_functions(p)]
    c_funcs = [f for p in c for f in c_functions(p)]
    sizes = {str(p): len(p.read_text(encoding="utf-8", errors="replace").splitlines()) for p in py + c}
    return {
        "root": str(root),
        "python": _function_stats(py_funcs, limits, len(py)),
        "c": _function_stats(c_funcs, limits, len(c)),
        "modules": {"count": len(sizes), "lines": sum(sizes.values()),
                    f"over_{module_lines}": {p: n for p, n in sorted(sizes.items(), key=lambda kv: -kv[1])
                                             if n > module_lines},
                    "largest": dict(sorted(sizes.items(), key=lambda kv: -kv[1])[:10])},
        "env_names": env_names(py, c),
    }


def _function_stats(funcs: list[Function], limits: list[int], n_files: int) -> dict:
    lengths = [f.lines for f in funcs]
    return {
        "files": n_files, "functions": len(funcs),
        "median_lines": statistics.median(lengths) if lengths else 0,
        "over": {str(k): sorted((asdict(f) for f in funcs if f.lines > k), key=lambda f: -f["lines"])
                 for k in limits},
    }


def report(m: dict, limits: list[int], module_lines: int) -> None:
    print(f"== {m['root']}")
    for kind, label in (("python", "Python"), ("c", "C/CUDA")):
        s = m[kind]
        over = ", ".join(f"{len(s['over'][str(k)])} over {k}" for k in limits)
        print(f"{label}: {s['files']} files, {s['functions']} functions, median {s['median_lines']:g} lines; {over}")
        for f in s["over"][str(limits[0])]:
            print(f"   {f['lines']:4d}  {f['path']}:{f['line']} {f['name']}")
    mods = m["modules"]
    big = mods[f"over_{module_lines}"]
    print(f"modules: {mods['count']} files, {mods['lines']} lines; {len(big)} over {module_lines} lines")
    for p, n in mods["largest"].items():
        print(f"   {n:5d}  {p}{'  (over)' if p in big else ''}")
    env = m["env_names"]
    print(f"EMBER_* environment variables read: {len(env['read'])}")
    if env["read"]:
        print("   " + " ".join(env["read"]))
    print(f"EMBER_* C identifiers (macros, header guards): {len(env['c_identifiers'])}")
    if env["mentioned_only"]:
        print(f"EMBER_* names only mentioned in Python text, never read: {len(env['mentioned_only'])}")
        print("   " + " ".join(env["mentioned_only"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", default=["ember"])
    ap.add_argument("--limit", type=int, nargs="+", default=[40, 50])
    ap.add_argument("--module-lines", type=int, default=600)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    limits = sorted(args.limit)
    results = {"paths": [measure(Path(p), limits, args.module_lines) for p in args.paths]}
    for m in results["paths"]:
        report(m, limits, args.module_lines)
    if README.exists():
        results["readme_lines"] = len(README.read_text(encoding="utf-8").splitlines())
        print(f"README.md: {results['readme_lines']} lines")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
