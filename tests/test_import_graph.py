"""No import circles in the package, between files or between sub-packages: every import counts, also those inside
functions and under `if TYPE_CHECKING:` (a type-only back edge still ties two files together)."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "moebius"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules `path` imports (`name` is its module; a package's __init__ is not a file node)."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    mods = _modules()
    files = {m: {t for t in _imports(p, m, set(mods)) if mods[t].name != "__init__.py"}
             for m, p in mods.items() if p.name != "__init__.py"}
    packages: dict[str, set[str]] = {}
    for m, targets in files.items():
        for t in targets:
            a, b = ".".join(m.split(".")[:2]), ".".join(t.split(".")[:2])
            if a != b:
                packages.setdefault(a, set()).add(b)
    return files, packages


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        return list(e.args[1])
    return None


def test_no_import_circle_between_files() -> None:
    files, _ = _graphs()
    assert _circle(files) is None, f"import circle: {' -> '.join(_circle(files) or [])}"


def test_no_import_circle_between_subpackages() -> None:
    _, packages = _graphs()
    assert _circle(packages) is None, f"import circle: {' -> '.join(_circle(packages) or [])}"


def test_the_check_sees_a_circle() -> None:
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _circle({"a": {"b"}, "b": set()}) is None


def _one_letter_apart(a: str, b: str) -> bool:
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def test_no_two_module_names_differ_by_one_letter() -> None:
    """Names that differ by a letter (rank / ranks, request / requests) read as the same module: each role has its
    own word."""
    names = sorted({p.stem for p in ROOT.rglob("*.py") if p.stem != "__init__"}
                   | {p.name for p in ROOT.rglob("*") if p.is_dir() and not p.name.startswith("__")})
    close = [(a, b) for i, a in enumerate(names) for b in names[i + 1:] if _one_letter_apart(a, b)]
    assert not close, close
    assert _one_letter_apart("rank", "ranks") and _one_letter_apart("serve", "server")
    assert not _one_letter_apart("request", "handover")
