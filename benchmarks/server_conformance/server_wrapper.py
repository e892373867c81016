#!/usr/bin/env python3
"""Stand-in for llama-server that upstream's test suite starts (via LLAMA_SERVER_BIN_PATH).

Translates the model-selecting arguments upstream's ``utils.py`` passes (``--hf-repo``, ``--hf-file``,
``--model-url``, ``--offline``, ``--model``) into ``-m <local gguf>`` and execs either the shipped
llama-server (``CONFORMANCE_TARGET=llama``) or ``pydflash serve`` (``CONFORMANCE_TARGET=pydflash``,
with the shipped DFlash2 drafter when the target is SmolLM2-135M: speculative decoding on).
Every other argument is passed through unchanged, in order.

A model that has no local substitute (vision, reranker, router mode, big HF models, ...) is
recorded in ``$CONFORMANCE_NOTRUN`` (JSON lines, keyed by ``$PYTEST_CURRENT_TEST``) and the
wrapper exits 3, so the runner counts the test as "not runnable" instead of failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MODELS = Path(os.environ.get("PYDFLASH_MODELS_DIR", Path.home() / ".cache/pydflash/models"))
SMOL = MODELS / "SmolLM2-135M-Instruct-Q4_1.gguf"
QWEN05 = MODELS / "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"
QWEN15 = MODELS / "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"

# (hf repo, hf file) -> local model. hf file None: the repo's default file.
MODEL_MAP: dict[tuple[str, str | None], Path] = {
    ("ggml-org/test-model-stories260K", None): SMOL,           # ServerPreset.tinyllama2
    ("ggml-org/models", "tinyllamas/stories260K.gguf"): SMOL,  # ServerProcess default
    ("ggml-org/models", "bert-bge-small/ggml-model-f16.gguf"): SMOL,  # embeddings: + --pooling mean
    ("ggml-org/test-model-stories260K-infill", None): QWEN05,  # infill: Qwen2.5-Coder has FIM tokens
    ("ggml-org/stories15M_MOE", "stories15M_MOE-F16.gguf"): SMOL,  # speculative / lora presets
    ("ggml-org/Qwen2.5-Coder-1.5B-IQ3_XXS-GGUF", "qwen2.5-coder-1.5b-iq3_xxs-imat.gguf"): QWEN15,
}

# arguments (with one value) that select the model; consumed here
MODEL_VALUE_ARGS = {"--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model-url", "-mu", "--model", "-m"}


def not_runnable(reason: str) -> None:
    path = os.environ.get("CONFORMANCE_NOTRUN")
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "reason": reason}) + "\n")
    print(f"server_wrapper: NOT-RUNNABLE: {reason}", file=sys.stderr, flush=True)
    sys.exit(3)


def main(argv: list[str]) -> None:
    target = os.environ.get("CONFORMANCE_TARGET", "llama")
    vals: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in MODEL_VALUE_ARGS and i + 1 < len(argv):
            vals[a] = argv[i + 1]
            i += 2
            continue
        if a == "--offline":
            i += 1
            continue
        rest.append(a)
        i += 1

    repo = vals.get("--hf-repo") or vals.get("-hf") or vals.get("-hfr")
    hf_file = vals.get("--hf-file") or vals.get("-hff")
    local = vals.get("--model") or vals.get("-m")
    url = vals.get("--model-url") or vals.get("-mu")
    if local and Path(local).is_file():
        model = Path(local)
    elif repo is not None:
        model = MODEL_MAP.get((repo, hf_file))
        if model is None:
            not_runnable(f"no local substitute for --hf-repo {repo}" + (f" --hf-file {hf_file}" if hf_file else ""))
    elif url:
        not_runnable(f"no local substitute for --model-url {url}")
    elif local:
        not_runnable(f"model file {local} does not exist")
    else:
        not_runnable("no model (router mode)")
    if "--mmproj-url" in rest or "--lora" in rest:
        not_runnable("multimodal projector / LoRA adapter")
    if not model.is_file():
        not_runnable(f"local model {model} is not cached (pydflash models pull)")

    if "--embedding" in rest and "--pooling" not in rest:
        rest += ["--pooling", "mean"]  # SmolLM2 is a decoder without a pooling type of its own

    if target == "llama":
        from pydflash.tools.upstream_binaries import tool_path
        exe = str(tool_path("llama-server"))
        cmd = [exe, "-m", str(model), *rest]
    elif target == "pydflash":
        out: list[str] = []
        j = 0
        while j < len(rest):  # the test's own speculative settings give way to DFlash
            if rest[j] in ("--model-draft", "-md", "--spec-draft-model", "--spec-type") and j + 1 < len(rest):
                j += 2
                continue
            out.append(rest[j])
            j += 1
        if model == SMOL:
            from pydflash import drafters
            out += ["-md", str(drafters.SHIPPED[0].path), "--spec-type", "draft-dflash"]
        cmd = [sys.executable, "-m", "pydflash.server", "-m", str(model), *out]
    else:
        sys.exit(f"server_wrapper: unknown CONFORMANCE_TARGET {target!r}")

    log = os.environ.get("CONFORMANCE_CMDLOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), "cmd": cmd}) + "\n")
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
