"""Training prompt sources, and the held-out HumanEval tasks training must never see.

``load(spec)`` accepts what ``pydflash.fetch.prompt_sets.load`` accepts (``humaneval``, ``gsm_symbolic``, a
``.jsonl`` file, comma-joined) plus Python source trees on this machine, which give code prompts
without any download:

* ``stdlib``: function headers with their docstrings from the Python standard library
  (HumanEval-shaped prompts);
* ``pysrc:PKG`` (an installed package, e.g. ``pysrc:numpy``) and ``pysrc:stdlib``: three prompt
  shapes per module, so the drafter sees code in general rather than one prompt format: a
  function header + docstring (``doc``), a function cut after the first lines of its body with
  the module's imports above it (``body``), and a class header + docstring (``class``).

* ``chat:SOURCE`` (e.g. ``chat:stdlib``, ``chat:humaneval``): each prompt of SOURCE as a user
  message asking for the code, rendered with the target's chat template, so the drafter also
  learns the answers an instruct model writes (prose, Markdown fences) to code requests.

Every prompt whose id is a held-out HumanEval task is dropped. The packages the shipped recipe
uses (docs/training.md) are permissively licensed: the standard library (PSF), numpy, networkx,
sympy, jinja2, torch, scipy, flask, click, werkzeug and pygments (BSD), requests and
sortedcontainers (Apache-2.0), rich and attrs (MIT), matplotlib (PSF-based); session 9 added
fsspec, mpmath, IPython and docutils (BSD / public domain), pip, setuptools, pytest,
urllib3, pyparsing, pydantic and anyio (MIT), huggingface_hub, aiohttp and openai (Apache-2.0),
packaging (Apache-2.0 / BSD) and Pillow (MIT-CMU).
"""

from __future__ import annotations

import ast
import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["HELD_OUT_HUMANEVAL", "TrainPrompt", "load", "held_out_humaneval"]

#: the last 32 HumanEval tasks: kept for tau measurements, never trained on
HELD_OUT_HUMANEVAL = frozenset(f"HumanEval/{i}" for i in range(132, 164))


@dataclass(frozen=True)
class TrainPrompt:
    id: str
    text: str = ""
    messages: tuple[dict, ...] = field(default=(), repr=False)

    def render(self, target) -> str:  # type: ignore[no-untyped-def]
        if self.messages:
            return target.apply_chat_template([dict(m) for m in self.messages])
        return self.text


def _stdlib(limit: int | None, min_doc: int = 40, max_chars: int = 1200) -> list[TrainPrompt]:
    """``def`` line(s) + docstring of documented public functions (``limit`` spread evenly)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[TrainPrompt] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in rel for part in ("test", "idlelib", "site-packages", "lib2to3", "turtledemo")):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < min_doc or not node.body:
                continue
            first = node.body[0]
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            text = "".join(lines[start - 1: first.end_lineno])
            indent = len(text) - len(text.lstrip(" "))
            text = "".join(line[indent:] if line.startswith(" " * indent) else line for line in text.splitlines(True))
            if len(text) > max_chars:
                continue
            out.append(TrainPrompt(id=f"stdlib/{rel}:{node.lineno}", text=text))
    if limit is not None and len(out) > limit:  # evenly spread over the library, not its first modules
        out = [out[round(i * (len(out) - 1) / max(1, limit - 1))] for i in range(limit)]
    return out


def _python_files(root: Path) -> list[Path]:
    skip = ("test", "idlelib", "site-packages", "lib2to3", "turtledemo", "_vendor", "vendored")
    return [p for p in sorted(root.rglob("*.py")) if not any(part in p.relative_to(root).as_posix() for part in skip)]


def _dedent(text: str) -> str:
    indent = len(text) - len(text.lstrip(" "))
    return "".join(line[indent:] if line.startswith(" " * indent) else line for line in text.splitlines(True))


def _source_prompts(root: Path, name: str, max_chars: int = 1500) -> list[TrainPrompt]:
    """``doc``, ``body`` and ``class`` prompts of every module under ``root`` (module docstring)."""
    out: list[TrainPrompt] = []
    for path in _python_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError, MemoryError):
            continue
        lines = source.splitlines(keepends=True)
        imports = "".join(lines[n.lineno - 1] for n in tree.body[:40] if isinstance(n, (ast.Import, ast.ImportFrom))
                          and n.lineno == n.end_lineno)[:600]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                first = node.body[0]
                if doc and len(doc) >= 40 and isinstance(first, ast.Expr):
                    start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                    text = _dedent("".join(lines[start - 1: first.end_lineno]))
                    if len(text) <= max_chars:
                        out.append(TrainPrompt(id=f"{name}/class/{rel}:{node.lineno}", text=text))
                continue
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            doc = ast.get_docstring(node)
            first = node.body[0]
            if doc and len(doc) >= 40 and not node.name.startswith("_"):
                text = _dedent("".join(lines[start - 1: first.end_lineno]))
                if len(text) <= max_chars:
                    out.append(TrainPrompt(id=f"{name}/doc/{rel}:{node.lineno}", text=text))
            # the body cut a third of the way in (at least one statement), imports on top
            body = node.body[1:] if doc else node.body
            if len(body) >= 3:
                cut = body[max(1, len(body) // 3) - 1].end_lineno
                text = _dedent("".join(lines[start - 1: cut]))
                if 80 <= len(text) <= max_chars and node.col_offset == 0:
                    out.append(TrainPrompt(id=f"{name}/body/{rel}:{node.lineno}", text=imports + "\n\n" + text))
    return out


def _package_root(name: str) -> Path:
    if name == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"pysrc:{name}: no installed package {name!r}")
    return Path(list(spec.submodule_search_locations)[0])


def _spread(items: list, limit: int | None) -> list:
    """``limit`` items spread evenly over the list (not its first modules)."""
    if limit is None or len(items) <= limit:
        return items
    return [items[round(i * (len(items) - 1) / max(1, limit - 1))] for i in range(limit)]


def _jsonl(path: Path) -> list[TrainPrompt]:
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            pid = str(row.get("id", f"{path.stem}/{lineno}"))
            if row.get("prompt"):
                out.append(TrainPrompt(pid, text=row["prompt"]))
            elif row.get("messages"):
                out.append(TrainPrompt(pid, messages=tuple(row["messages"])))
            else:
                raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'messages'")
    return out


#: the chat requests of ``chat:SOURCE``, picked per prompt (by its id) so the wording varies
_CHAT_ASKS = (
    "Complete the following Python code.\n\n```python\n{code}```",
    "Implement this function:\n\n```python\n{code}```",
    "{code}\nWrite the body of the code above.",
    "Can you finish this Python snippet and explain it briefly?\n\n```python\n{code}```",
)


def _as_chat(prompts: list[TrainPrompt]) -> list[TrainPrompt]:
    out = []
    for p in prompts:
        if p.messages or not p.text.strip():
            continue
        ask = _CHAT_ASKS[sum(p.id.encode()) % len(_CHAT_ASKS)]
        out.append(TrainPrompt(f"chat/{p.id}", messages=({"role": "user", "content": ask.format(code=p.text)},)))
    return out


def load(spec: str, *, limit: int | None = None) -> list[TrainPrompt]:
    """Prompts of comma-separated sources (``limit`` per source), held-out HumanEval removed."""
    out: list[TrainPrompt] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part.startswith("chat:"):
            inner = part.split(":", 1)[1]
            out.extend(_as_chat(load(inner, limit=limit)))  # the inner load drops the held-out tasks
            continue
        if part == "stdlib":
            got = _stdlib(limit)
        elif part.startswith("pysrc:"):
            name = part.split(":", 1)[1]
            got = _spread(_source_prompts(_package_root(name), name), limit)
        elif part.endswith(".jsonl") and Path(part).is_file():
            got = _jsonl(Path(part))
        else:
            try:
                from ..fetch import prompt_sets as shared  # the project's loaders (humaneval, gsm_symbolic, jsonl)
            except ImportError:  # pragma: no cover - older checkouts
                raise ValueError(f"unknown prompt source {part!r}: use stdlib or a .jsonl file") from None
            got = [TrainPrompt(p.id, text=p.text, messages=tuple(p.messages)) for p in shared.load(part)]
        got = [p for p in got if p.id not in HELD_OUT_HUMANEVAL]
        out.extend(got[:limit] if limit is not None else got)
    return out


def held_out_humaneval() -> list[TrainPrompt]:
    """The held-out HumanEval prompts (for tau measurements only)."""
    from ..fetch import prompt_sets as shared

    return [TrainPrompt(p.id, text=p.text) for p in shared.load("humaneval") if p.id in HELD_OUT_HUMANEVAL]
