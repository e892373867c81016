"""Wall time and peak RSS of the converter and the Q4_K_M quantizer on a drafter of the
Qwen2.5-Coder-1.5B shape (random weights), as quoted in the format issue's closing note.

    python benchmarks/convert_quantize_1p5b.py [--layers 5] [--workdir /tmp/dflash-1p5b]

Each step runs in its own process under /usr/bin/time so peak RSS is that step's alone.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path


def make_checkpoint(out: Path, layers: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import torch
    from fixtures_tiny import write_checkpoint

    from pydflash.reference.config import DFlashConfig

    config = DFlashConfig(
        hidden_size=1536, num_hidden_layers=layers, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
        intermediate_size=8960, vocab_size=151936, target_layer_ids=tuple(range(1, 28, 27 // layers))[:layers],
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768, block_size=8,
        mask_token_id=151665, is_causal=False, num_target_layers=28, layer_types=("full_attention",) * layers,
        conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16,
    )
    write_checkpoint(out, config, dtype=torch.bfloat16)


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one command."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return wall, rss_kb / 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/dflash-1p5b"))
    args = p.parse_args()
    from pydflash.fetch import registry as models

    target = models.path("qwen2.5-coder-1.5b")
    hf = args.workdir / "hf"
    if not (hf / "model.safetensors").exists():
        make_checkpoint(hf, args.layers)
    f16 = args.workdir / "drafter-f16.gguf"
    q4 = args.workdir / "drafter-q4_k_m.gguf"
    conv = timed([sys.executable, "-m", "pydflash.cli", "convert", str(hf), "--target-gguf", str(target),
                  "--outtype", "f16", "--outfile", str(f16), "-q"])
    quant = timed([sys.executable, "-m", "pydflash.cli", "quantize", str(f16), str(q4), "Q4_K_M", "-q"])
    result = {
        "checkpoint_bytes": (hf / "model.safetensors").stat().st_size,
        "convert_f16": {"wall_s": round(conv[0], 1), "peak_rss_mib": round(conv[1])},
        "quantize_q4_k_m": {"wall_s": round(quant[0], 1), "peak_rss_mib": round(quant[1])},
        "f16_bytes": f16.stat().st_size,
        "q4_k_m_bytes": q4.stat().st_size,
        "q4_k_m_over_f16": round(q4.stat().st_size / f16.stat().st_size, 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
