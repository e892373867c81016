"""Real seed files for the fuzzers: a tiny target GGUF and tiny drafters made by our converter.

The target has only what the drafter loader reads (arch, hidden size, layer count, tokenizer
list, token embedding, head), 4 layers x 64 wide with 96 tokens, so one load takes about a
millisecond. The drafters are ``tests/fixtures_tiny.tiny_config`` checkpoints converted with
``pydflash.formats.convert`` in several storage types, exactly as a user would make them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

VOCAB, HIDDEN, N_LAYER = 96, 64, 4


def write_tiny_target(path: Path) -> Path:
    """A `llama` GGUF with a real token list and F32/Q8_0 embedding + head (no layers needed)."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(N_LAYER)
    w.add_embedding_length(HIDDEN)
    w.add_context_length(256)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32))
    w.add_tensor("output.weight", (rng.standard_normal((VOCAB, HIDDEN)) / 8).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build(directory: Path) -> tuple[Path, list[Path], list[Path]]:
    """(target GGUF, drafter GGUFs, HF checkpoint dirs) under ``directory`` (reused if present)."""
    import torch

    from fixtures_tiny import tiny_config, write_checkpoint
    from pydflash.formats.convert import convert

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "tiny-target.gguf"
    if not target.exists():
        write_tiny_target(target)
    variants = [("dflash2", "f32", torch.float32), ("dflash2", "q8_0", torch.bfloat16),
                ("dflash2", "bf16", torch.bfloat16), ("dflash", "f16", torch.float16)]
    drafters, checkpoints = [], []
    for kind, outtype, dtype in variants:
        ckpt = directory / f"{kind}-{outtype}-hf"
        out = directory / f"{kind}-{outtype}.gguf"
        if not out.exists():
            write_checkpoint(ckpt, tiny_config(kind), dtype=dtype)
            convert(ckpt, out, target_gguf=target, outtype=outtype, progress=False)
        drafters.append(out)
        checkpoints.append(ckpt)
    return target, drafters, checkpoints
