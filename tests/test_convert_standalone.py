"""convert_hf_to_gguf_dflash.py from a bare copy of the source tree: no native build, only numpy + gguf.

The child interpreters run in a fresh venv whose site-packages holds only numpy, gguf and what
those two require (linked from this interpreter's installs), next to a copy of ``pydflash/*.py``
and the script without any extension module. That venv sees neither this interpreter's
site-packages nor the ``.pth`` hook of pydflash's editable install (scikit-build-core's redirect
finder, which would otherwise send ``import pydflash`` to the real checkout). A
``sitecustomize`` in the venv refuses ``pydflash._native``, cffi, torch and safetensors, records
any attempt, and writes at exit which ``pydflash`` was imported. The reference output is the
installed ``pydflash convert`` command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest
from fixtures_tiny import tiny_config, write_checkpoint, write_hf_target_dir
from gguf import GGUFWriter

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "convert_hf_to_gguf_dflash.py"

SITECUSTOMIZE = '''
import atexit, json, os, sys

_BLOCKED_TOP = {"cffi", "_cffi_backend", "torch", "safetensors"}
_tried = []


class _Block:
    """Refuses the native extension and the heavy optional packages; remembers who asked."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pydflash._native" or name.split(".")[0] in _BLOCKED_TOP:
            _tried.append(name)
            raise ModuleNotFoundError(f"blocked by test_convert_standalone: {name}", name=name)
        return None


sys.meta_path.insert(0, _Block())


def _report():
    mod = sys.modules.get("pydflash")
    with open(os.environ["STANDALONE_REPORT"], "w") as f:
        json.dump({"pydflash": getattr(mod, "__file__", None), "tried": _tried,
                   "modules": sorted(m for m in sys.modules if m.startswith("pydflash"))}, f)


if os.environ.get("STANDALONE_REPORT"):
    atexit.register(_report)
'''

DECOY_INIT = 'raise ImportError("the installed pydflash was imported instead of the checkout next to the script")\n'


def _closure(names: list[str]) -> list[metadata.Distribution]:
    """The installed distributions ``names`` and everything they require (extras left out)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if name in names:
                raise
            continue  # a requirement behind a marker that does not apply here
        seen[key] = dist
        for req in dist.requires or []:
            spec, _, marker = req.partition(";")
            if "extra" not in marker:
                todo.append(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.strip()).group(0))
    return list(seen.values())


def _link_dists(site: Path, names: list[str]) -> list[str]:
    """Symlink the top-level files of the distributions into ``site``; returns what was linked."""
    linked = []
    for dist in _closure(names):
        assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD"
        for top in sorted({f.parts[0] for f in dist.files}):
            if top.startswith("..") or top == "__pycache__" or top.endswith(".pth"):
                continue
            src, dst = Path(dist.locate_file(top)), site / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src, target_is_directory=src.is_dir())
                linked.append(top)
    return linked


@pytest.fixture(scope="module")
def standalone(tmp_path_factory) -> dict:  # noqa: ANN001
    """A source copy without native files, a numpy+gguf venv, and a tiny checkpoint + targets."""
    base = tmp_path_factory.mktemp("standalone")
    tree = base / "checkout"
    shutil.copytree(ROOT / "pydflash", tree / "pydflash",
                    ignore=lambda d, names: [n for n in names if not (n.endswith(".py") or Path(d, n).is_dir())
                                             or n == "__pycache__"])
    shutil.copy2(ROOT / SCRIPT, tree / SCRIPT)
    leftovers = [p for p in (tree / "pydflash").rglob("*") if p.is_file() and p.suffix != ".py"]
    assert not leftovers, leftovers
    assert not list((tree / "pydflash").glob("_native*"))

    env_dir = base / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(env_dir)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    linked = _link_dists(site, ["numpy", "gguf"])
    assert {"numpy", "gguf"} <= set(linked)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)

    cfg = tiny_config("dflash2")
    write_checkpoint(base / "draft", cfg, seed=3)
    tokens = write_hf_target_dir(base / "target", vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                 n_layers=cfg.num_target_layers)
    target_gguf = base / "target.gguf"
    w = GGUFWriter(str(target_gguf), arch="qwen3")
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_target_layers)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_token_merges(["t 0", "t 1"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"base": base, "tree": tree, "python": python, "site": site, "linked": linked,
            "draft": base / "draft", "target_hf": base / "target", "target_gguf": target_gguf}


def _child_env(report: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # no PYTHONPATH / SAFEPATH / HOME
    if report is not None:
        env["STANDALONE_REPORT"] = str(report)
    return env


def _installed_cli() -> str:
    exe = Path(sys.executable).with_name("pydflash")
    found = str(exe) if exe.is_file() else shutil.which("pydflash")
    assert found, "the installed `pydflash` command is missing (pip install -e .)"
    return found


def _target_args(s: dict, target: str) -> list[str]:
    return ["--target-gguf", str(s["target_gguf"])] if target == "gguf" else ["--target-model-dir", str(s["target_hf"])]


def _run_script(s: dict, args: list[str], out: Path, *, flags: tuple[str, ...] = ()) -> dict:
    report = out.with_suffix(".report.json")
    proc = subprocess.run([str(s["python"]), *flags, str(s["tree"] / SCRIPT), *args, "-o", str(out), "-q"],
                          cwd=s["base"], env=_child_env(report), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    got = json.loads(report.read_text())
    assert got["pydflash"] == str(s["tree"] / "pydflash" / "__init__.py"), got  # the copy, not the install
    assert got["tried"] == [], f"the converter tried to import {got['tried']}"
    assert "pydflash.runtime._bindings" not in got["modules"] and "pydflash._native" not in got["modules"]
    return got


@pytest.mark.parametrize(("target", "outtype"), [("hf", "f16"), ("gguf", "q8_0"), ("gguf", "bf16")])
def test_script_matches_installed_cli(standalone, tmp_path: Path, target: str, outtype: str) -> None:  # noqa: ANN001
    s = standalone
    args = [str(s["draft"]), *_target_args(s, target), "--outtype", outtype]

    ref = tmp_path / "installed.gguf"
    proc = subprocess.run([_installed_cli(), "convert", *args, "-o", str(ref), "-q"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr

    plain = tmp_path / "plain.gguf"  # python convert_hf_to_gguf_dflash.py in a plain checkout
    _run_script(s, args, plain)
    assert plain.read_bytes() == ref.read_bytes()


def test_script_beats_an_installed_package(standalone, tmp_path: Path) -> None:  # noqa: ANN001
    """Next to an installed pydflash, and in isolated mode (-I: no script dir, no PYTHON* variables)."""
    s = standalone
    args = [str(s["draft"]), *_target_args(s, "gguf"), "--outtype", "f16"]
    ref = tmp_path / "installed.gguf"
    proc = subprocess.run([_installed_cli(), "convert", *args, "-o", str(ref), "-q"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr

    decoy = s["site"] / "pydflash"
    decoy.mkdir()
    try:
        (decoy / "__init__.py").write_text(DECOY_INIT)
        for flags in [(), ("-I",)]:
            out = tmp_path / f"script{''.join(flags)}.gguf"
            _run_script(s, args, out, flags=flags)
            assert out.read_bytes() == ref.read_bytes(), flags
    finally:
        shutil.rmtree(decoy)


def test_import_without_extension(standalone) -> None:  # noqa: ANN001
    s = standalone
    proc = subprocess.run([str(s["python"]), "-c", "import pydflash; print(pydflash.__version__)"],
                          cwd=s["tree"], env=_child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == metadata.version("pydflash")

    probe = (
        "import json, sys, pydflash\n"
        "out = {'file': pydflash.__file__, 'loaded': sorted(m for m in sys.modules if m.startswith('pydflash'))}\n"
        "try:\n"
        "    pydflash.Target\n"
        "except ImportError as e:\n"
        "    out.update(type=type(e).__name__, pydflash_error=isinstance(e, pydflash.PydflashError), msg=str(e),\n"
        "               name=e.name)\n"
        "try:\n"
        "    from pydflash import Engine\n"
        "except ImportError as e:\n"
        "    out['engine'] = type(e).__name__\n"
        "out['errors'] = [pydflash.ModelFormatError.__name__, issubclass(pydflash.ModelFormatError, ValueError)]\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([str(s["python"]), "-c", probe], cwd=s["tree"], env=_child_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["file"] == str(s["tree"] / "pydflash" / "__init__.py")
    assert got["loaded"] == ["pydflash", "pydflash.errors"]  # nothing native until something native is used
    assert got["type"] == "NativeExtensionError" and got["pydflash_error"] and got["name"] == "pydflash._native"
    assert "pip install ." in got["msg"] and "pip install -e ." in got["msg"]
    assert got["engine"] == "NativeExtensionError"
    assert got["errors"] == ["ModelFormatError", True]


def test_missing_numpy_or_gguf_is_named(standalone, tmp_path: Path) -> None:  # noqa: ANN001
    """Without gguf in the venv the script says what to install (and still loads nothing native)."""
    s = standalone
    hidden = s["site"] / "gguf"
    moved = tmp_path / "gguf-hidden"
    hidden.rename(moved)
    try:
        proc = subprocess.run([str(s["python"]), str(s["tree"] / SCRIPT), "--help"], cwd=s["base"],
                              env=_child_env(), capture_output=True, text=True, timeout=60)
    finally:
        moved.rename(hidden)
    assert proc.returncode == 1
    assert "pip install numpy gguf" in proc.stderr and "Traceback" not in proc.stderr
