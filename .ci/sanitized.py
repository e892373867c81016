"""Run a module or script with ``pydflash`` imported from $PYDFLASH_PACKAGE_DIR (the sanitized
build of .ci/sanitize) instead of the installed package.

An editable install puts an import hook at the front of ``sys.meta_path`` that would win over
``sys.path``; it is removed here, then the import is checked to come from the staged folder.

    python .ci/sanitized.py -m pytest ARGS...  |  python .ci/sanitized.py SCRIPT ARGS...
"""

import os
import runpy
import sys

stage = os.environ["PYDFLASH_PACKAGE_DIR"]
sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
sys.path.insert(0, stage)

import pydflash._native  # noqa: E402

if not os.path.realpath(pydflash._native.__file__).startswith(os.path.realpath(stage)):
    sys.exit(f"pydflash._native came from {pydflash._native.__file__}, not the sanitized build in {stage}")

args = sys.argv[1:]
if args[:1] == ["-m"]:
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = args
    sys.path.insert(1, os.path.dirname(os.path.abspath(args[0])))
    runpy.run_path(args[0], run_name="__main__")
