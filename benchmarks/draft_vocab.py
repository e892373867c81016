"""Full- vs reduced-vocabulary drafter against plain decoding, one interleaved run per target.

For each target (Qwen2.5-Coder-0.5B / 1.5B Q4_K_M) a random-weight DFlash2 drafter of the
target's shape (5 layers, Q4_K_M, as benchmarks/convert_quantize_1p5b.py makes) is calibrated
into a reduced-vocabulary drafter (`pydflash.formats.draft_vocab`: the target's own greedy outputs on
calibration prompts, N most frequent tokens), then every benchmark prompt runs plain ->
speculative(full) -> speculative(reduced). Random weights mean acceptance ~0, so what this
measures is the cost side: milliseconds of drafting per cycle, its share of a cycle, and the
resulting tokens/s against plain decoding.

Coverage is reported on the calibration prompts and on held-out prompts (the benchmark's own).

    python benchmarks/draft_vocab.py -m qwen2.5-coder-1.5b --n-vocab 16384 -n 32 -t 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pydflash import Engine, Target
from pydflash.fetch import registry as models
from pydflash.formats.draft_vocab import calibrate, choose, coverage, write_reduced_drafter

CALIBRATION = [  # code-completion prompts, disjoint from BENCH
    "def fibonacci(n):", "def merge_sort(xs):", "def read_csv(path):", "class LinkedList:\n    def __init__(self):",
    "def binary_search(arr, x):", "import os\n\ndef list_files(root):", "def gcd(a, b):",
    "def parse_args():\n    import argparse", "def flatten(nested):", "def word_count(text):",
    "def transpose(matrix):", "def is_palindrome(s: str) -> bool:", "async def fetch(session, url):",
    "def dijkstra(graph, start):", "def to_snake_case(name):", "def matrix_multiply(a, b):",
]
BENCH = [
    "def quicksort(arr):",
    "def is_prime(n: int) -> bool:",
    "import numpy as np\n\ndef normalize(x):",
    "class Stack:\n    def __init__(self):",
]

SHAPES = {  # target arch -> drafter shape (heads, kv heads, head_dim, ffn)
    896: dict(num_attention_heads=14, num_key_value_heads=2, head_dim=64, intermediate_size=4864),
    1536: dict(num_attention_heads=12, num_key_value_heads=2, head_dim=128, intermediate_size=8960),
}


def make_drafter(target_path: Path, workdir: Path, layers: int = 5) -> Path:
    """A random DFlash2 drafter of the target's shape, converted and quantized to Q4_K_M."""
    out = workdir / "drafter-q4_k_m.gguf"
    if out.exists():
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import torch
    from fixtures_tiny import write_checkpoint

    from pydflash.formats.convert import convert, read_target_gguf
    from pydflash.formats.quantize import quantize
    from pydflash.reference.config import DFlashConfig

    info = read_target_gguf(target_path)
    n_tl = info.n_layers
    config = DFlashConfig(
        hidden_size=info.hidden_size, num_hidden_layers=layers, vocab_size=info.vocab_size,
        target_layer_ids=tuple(range(1, n_tl, (n_tl - 1) // layers))[:layers], rms_norm_eps=1e-6,
        rope_theta=1000000.0, max_position_embeddings=32768, block_size=8, mask_token_id=151665, is_causal=False,
        num_target_layers=n_tl, layer_types=("full_attention",) * layers, conv_kernel_size=2, conv_group_size=16,
        selector_rank=256, selector_top_k=16, **SHAPES[info.hidden_size],
    )
    workdir.mkdir(parents=True, exist_ok=True)
    write_checkpoint(workdir / "hf", config, dtype=torch.bfloat16)
    f16 = convert(workdir / "hf", workdir / "drafter-f16.gguf", target_gguf=target_path, outtype="f16", progress=False)
    quantize(f16, out, "Q4_K_M")
    return out


def held_out_coverage(ids: np.ndarray, tokens: list[int]) -> float:
    return float(np.isin(np.asarray(tokens), ids).mean()) if tokens else 0.0


def run(args: argparse.Namespace, model: str) -> dict:
    target_path = models.path(model)
    workdir = args.workdir / model
    full = make_drafter(target_path, workdir)
    reduced = workdir / f"drafter-q4_k_m-v{args.n_vocab}.gguf"
    with Target(target_path, n_ctx=2048, n_threads=args.t) as target:
        t0 = time.perf_counter()
        counts = calibrate(target, CALIBRATION, max_tokens=args.calib_tokens)
        calib_s = time.perf_counter() - t0
        eog = [t for t in range(target.info.n_vocab) if target.is_eog(t)]
    ids = choose(counts, args.n_vocab, always=eog)
    write_reduced_drafter(full, reduced, target_path, ids)
    sizes = [2048, 4096, 8192, 16384, 32768]
    report: dict = {"model": model, "n_vocab_draft": args.n_vocab, "n_max": args.n_max, "tokens": args.n,
                    "calibration": {"prompts": counts.n_prompts, "tokens": counts.n_output, "seconds": round(calib_s, 1),
                                    "distinct": int(np.count_nonzero(counts.output)),
                                    "coverage": {str(k): round(v, 4) for k, v in coverage(counts, sizes).items()}}}
    rows: dict[str, list[dict]] = {"plain": [], "full": [], "reduced": []}
    held_out: list[int] = []
    with Engine(target_path, full, n_ctx=2048, n_threads=args.t, n_max=args.n_max) as e_full, \
            Engine(target_path, reduced, n_ctx=2048, n_threads=args.t, n_max=args.n_max) as e_red:
        for e in (e_full, e_red):
            e.generate("warm up", max_tokens=4, temperature=0)
        for prompt in BENCH:  # interleaved per prompt: plain, full, reduced
            plain = e_full.target.generate(prompt, max_tokens=args.n, temperature=0, ignore_eos=True)
            held_out += plain.tokens
            rows["plain"].append({"tok_s": plain.stats.tokens_per_second})
            for name, e in (("full", e_full), ("reduced", e_red)):
                r = e.generate(prompt, max_tokens=args.n, temperature=0, ignore_eos=True)
                s = r.stats
                cycle = s.t_draft_ms + s.t_verify_ms + s.t_accept_ms
                rows[name].append({
                    "tok_s": s.tokens_per_second,
                    "draft_ms_per_cycle": s.t_draft_ms / max(s.n_verify_steps, 1),
                    "verify_ms_per_cycle": s.t_verify_ms / max(s.n_verify_steps, 1),
                    "draft_share": s.t_draft_ms / cycle if cycle else 0.0,
                    "tau": s.tau,
                    "same_tokens": r.tokens == plain.tokens,
                })
    report["held_out_coverage"] = round(held_out_coverage(ids, held_out), 4)
    med = {name: {k: (round(statistics.median(r[k] for r in rs), 3) if k != "same_tokens" else sum(r[k] for r in rs))
                  for k in rs[0]} for name, rs in rows.items()}
    plain_ms = 1000.0 / med["plain"]["tok_s"]
    for name in ("full", "reduced"):
        med[name]["speedup_vs_plain"] = round(med[name]["tok_s"] / med["plain"]["tok_s"], 3)
        med[name]["draft_in_target_steps"] = round(med[name]["draft_ms_per_cycle"] / plain_ms, 2)
    report["median"] = med
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", action="append", help="target(s); default both Qwen2.5-Coder 0.5B and 1.5B")
    ap.add_argument("--n-vocab", type=int, default=16384)
    ap.add_argument("-n", type=int, default=32, help="tokens per benchmark prompt")
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("--n-max", type=int, default=7)
    ap.add_argument("--calib-tokens", type=int, default=64)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/pydflash-draft-vocab"))
    args = ap.parse_args()
    for model in args.model or ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]:
        print(json.dumps(run(args, model)), flush=True)


if __name__ == "__main__":
    main()
