"""What a GPU changes for DFlash2, measured on one target (run by benchmarks/gpu/run, or alone).

On the target (all layers on --device; CPU = the rehearsal):
  c_verify(k), k = 1..16: one decode of k rows with every row's logits and the drafter's taps on,
      over one plain step (1 row, last logits, no taps), after --n-context tokens of context;
  taps: decode time of 1, 4 and 16 rows with taps off and on, for both tap sources (the
      layer-input API, and the eval callback that makes ggml's scheduler stop after every tapped
      node: no CUDA graphs, a sync per tap);
  drafter: one block of a random DFlash2 drafter of the target's width (5 layers, the published
      shape), n_block 4 / 8 / 16, context --n-context;
  tok/s: plain decoding, the replay drafter (drafts are plain decoding's own continuation: always
      right, the ceiling for each n_max) and the random DFlash2 drafter (always wrong: the floor),
      greedy, --n-gen tokens.
Times are medians of --rounds, modes interleaved. Writes one JSON (--out) and prints a summary.

    python benchmarks/gpu/bench.py --target t.gguf --device CUDA0 --out res.json [--drafter d.gguf]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    a = time.perf_counter()
    fn()
    return time.perf_counter() - a


def tap_layers(n_layer: int, n: int = 5) -> list[int]:
    return sorted({max(1, round(1 + i * (n_layer - 3) / (n - 1))) for i in range(n)})


def make_drafter(target_path: Path, out: Path, n_layers: int, quant: str, threads: int) -> Path:
    """A random DFlash2 drafter for the target (published shape: 5 layers, block 16, rank 256)."""
    import torch

    sys.path.insert(0, str(HERE.parent.parent / "tests"))
    from fixtures_tiny import write_checkpoint  # noqa: E402

    from pydflash import Target
    from pydflash.formats.convert import convert
    from pydflash.reference.config import DFlashConfig

    import gguf

    with Target(target_path, n_ctx=64, n_threads=1) as t:
        info = t.info

    r = gguf.GGUFReader(str(target_path))
    kv = {f.name: f.contents() for f in r.fields.values() if f.name.startswith("llama.")}
    n_head, n_head_kv, n_ff = kv["llama.attention.head_count"], kv["llama.attention.head_count_kv"], kv["llama.feed_forward_length"]
    cfg = DFlashConfig(
        hidden_size=info.n_embd, num_hidden_layers=n_layers, num_attention_heads=n_head,
        num_key_value_heads=n_head_kv, head_dim=info.n_embd // n_head, intermediate_size=n_ff,
        vocab_size=info.n_vocab, target_layer_ids=tuple(tap_layers(info.n_layer)), rms_norm_eps=1e-5,
        rope_theta=float(kv.get("llama.rope.freq_base", 10000.0)), max_position_embeddings=8192, block_size=16,
        mask_token_id=info.n_vocab - 1, is_causal=False, conv_kernel_size=2, conv_group_size=16,
        selector_rank=256, selector_top_k=16, num_target_layers=info.n_layer, sliding_window=2048,
        layer_types=("sliding_attention",) * n_layers)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        ckpt = Path(tmp) / "ckpt"
        write_checkpoint(ckpt, cfg, seed=1, dtype=torch.bfloat16)
        f16 = convert(ckpt, Path(tmp) / "d-f16.gguf", target_gguf=target_path, outtype="f16", progress=False)
        if quant.upper() == "F16":
            os.replace(f16, out)
        else:
            from pydflash.formats.quantize import quantize

            quantize(f16, out, quant.upper(), n_threads=threads, progress=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--drafter", type=Path, help="a DFlash2 GGUF for the target (default: make a random one)")
    ap.add_argument("--drafter-layers", type=int, default=5)
    ap.add_argument("--drafter-type", default="Q4_K_M")
    ap.add_argument("--device", default="CPU", help="CPU, CUDA0, Vulkan0, ...")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--n-context", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parts", default="verify,taps,drafter,tok_s,tok_s_dflash2",
                    help="tok_s = plain and replay drafter; tok_s_dflash2 = the random DFlash2 drafter")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if unknown := parts - {"verify", "taps", "drafter", "tok_s", "tok_s_dflash2"}:
        ap.error(f"unknown --parts {sorted(unknown)}")
    if args.k_max < 1 or args.rounds < 1 or args.n_context < 1 or args.n_gen < 1:
        ap.error("--k-max, --rounds, --n-context and --n-gen must be >= 1")
    if not args.target.is_file():
        ap.error(f"--target {args.target} does not exist")

    from pydflash import Drafter, Engine, Target
    from pydflash.runtime import devices

    names = [d.name for d in devices.devices()]
    if args.device not in names:
        raise SystemExit(f"bench: no device {args.device!r} in this build (devices: {', '.join(names)})")
    ngl = 0 if args.device == "CPU" else -1
    n_ctx = args.n_context + args.n_gen + 64
    res: dict = {"target": args.target.name, "device": args.device, "threads": args.threads,
                 "n_context": args.n_context, "rounds": args.rounds, "host": platform.node(),
                 "loadavg_start": os.getloadavg()[0], "seconds": {}}
    rng = np.random.default_rng(0)

    def out() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")

    def load(tap_source: str) -> Target:
        return Target(args.target, n_ctx=n_ctx, n_threads=args.threads, n_gpu_layers=ngl, tap_source=tap_source)

    ks = list(range(1, args.k_max + 1))
    with load("layer_input") as t:
        info = t.info
        taps = tap_layers(info.n_layer)
        res.update(n_layer=info.n_layer, n_embd=info.n_embd, n_vocab=info.n_vocab, taps=taps)
        prompt = [int(x) for x in rng.integers(259, info.n_vocab, size=args.n_context)]
        probe = [int(x) for x in rng.integers(259, info.n_vocab, size=args.k_max)]
        t.decode(prompt)

        def step(tt: Target, k: int, tapped: bool, all_logits: bool) -> float:
            tt.set_taps(taps if tapped else [])
            dt = timed(lambda: tt.decode(probe[:k], all_logits=all_logits))
            tt.rollback(args.n_context)
            return dt

        if "verify" in parts:
            a = time.perf_counter()
            step(t, 1, False, False)
            for k in ks:
                step(t, k, True, True)  # warm every shape
            tm: dict[str, list[float]] = {"plain": [], **{str(k): [] for k in ks}}
            for _ in range(args.rounds):
                tm["plain"].append(step(t, 1, False, False))
                for k in ks:
                    tm[str(k)].append(step(t, k, True, True))
            med = {k: statistics.median(v) for k, v in tm.items()}
            res["t1_ms"] = round(1000 * med["plain"], 3)
            res["verify_ms"] = {k: round(1000 * med[str(k)], 3) for k in ks}
            res["c_verify"] = {k: round(med[str(k)] / med["plain"], 3) for k in ks}
            res["seconds"]["verify"] = round(time.perf_counter() - a, 1)
            out()

        if "taps" in parts:
            a = time.perf_counter()
            res["taps_ms"] = {}
            with load("eval") as te:
                te.decode(prompt)
                for tt in (t, te):
                    for k in (1, 4, 16):
                        step(tt, k, False, True), step(tt, k, True, True)
                for src, tt in (("layer_input", t), ("eval", te)):
                    row = {}
                    for k in (1, 4, 16):
                        off, on = [], []
                        for _ in range(args.rounds):
                            off.append(step(tt, min(k, args.k_max), False, True))
                            on.append(step(tt, min(k, args.k_max), True, True))
                        row[k] = {"off": round(1000 * statistics.median(off), 3),
                                  "on": round(1000 * statistics.median(on), 3)}
                    res["taps_ms"][src] = row
            res["seconds"]["taps"] = round(time.perf_counter() - a, 1)
            out()

        if "tok_s" in parts:
            a = time.perf_counter()
            plain_tokens = None
            rows: dict[str, float] = {}
            for rnd in range(2):
                r = t.generate(prompt, max_tokens=args.n_gen, temperature=0, ignore_eos=True)
                plain_tokens = r.tokens
                rows.setdefault("plain", 0.0)
                rows["plain"] = max(rows["plain"], r.stats.n_generated / (r.stats.t_total_ms - r.stats.t_prefill_ms) * 1000)
                for n_max in (2, 4, 8, 15):
                    r = t._generate_replay(prompt, plain_tokens, offset=0, n_max=n_max, max_tokens=args.n_gen,
                                           temperature=0, ignore_eos=True)
                    key = f"replay_nmax{n_max}"
                    rows[key] = max(rows.get(key, 0.0),
                                    r.stats.n_generated / (r.stats.t_total_ms - r.stats.t_prefill_ms) * 1000)
            res["tok_s"] = {k: round(v, 2) for k, v in rows.items()}
            res["seconds"]["tok_s_replay"] = round(time.perf_counter() - a, 1)
            out()

    drafter = args.drafter
    if ("drafter" in parts or "tok_s_dflash2" in parts) and drafter is None:
        a = time.perf_counter()
        # beside the target (the work folder), not beside the results: $OUT comes back over the wire
        drafter = make_drafter(args.target, args.target.with_name(args.target.stem + "-dflash2-random.gguf"),
                               args.drafter_layers, args.drafter_type, args.threads)
        res["seconds"]["make_drafter"] = round(time.perf_counter() - a, 1)

    if "drafter" in parts:
        a = time.perf_counter()
        with Drafter(drafter, args.target, n_ctx=n_ctx, n_threads=args.threads, device=args.device) as d:
            feats = rng.standard_normal((args.n_context, d.info.n_target_layers * d.info.n_embd)).astype(np.float32)
            d.inject(feats, np.arange(args.n_context))
            blocks: dict[int, list[float]] = {4: [], 8: [], 16: []}
            for nb in blocks:
                d.propose(5, args.n_context, nb)
            for _ in range(args.rounds):
                for nb in blocks:
                    blocks[nb].append(timed(lambda: d.propose(5, args.n_context, nb)))
            res["drafter_block_ms"] = {nb: round(1000 * statistics.median(v), 3) for nb, v in blocks.items()}
            res["drafter_device"] = d.info.device
        res["seconds"]["drafter"] = round(time.perf_counter() - a, 1)
        out()

    if "tok_s_dflash2" in parts:
        a = time.perf_counter()
        res.setdefault("tok_s", {})
        prompt_s = [int(x) for x in np.random.default_rng(0).integers(259, res["n_vocab"], size=args.n_context)]
        with Engine(args.target, drafter, n_ctx=n_ctx, n_threads=args.threads, n_gpu_layers=ngl, n_max=4,
                    drafter_device=args.device) as e:
            for n_max in (4, 15):
                best = 0.0
                for _ in range(2):
                    r = e.generate(prompt_s, max_tokens=args.n_gen, temperature=0, ignore_eos=True, n_max=n_max)
                    best = max(best, r.stats.n_generated / (r.stats.t_total_ms - r.stats.t_prefill_ms) * 1000)
                res["tok_s"][f"dflash2_random_nmax{n_max}"] = round(best, 2)
                res["tok_s"][f"dflash2_random_nmax{n_max}_accepted"] = r.stats.n_accepted
        res["seconds"]["tok_s_dflash2"] = round(time.perf_counter() - a, 1)
        out()

    print(json.dumps({k: res[k] for k in res if k in ("t1_ms", "c_verify", "taps_ms", "drafter_block_ms", "tok_s",
                                                      "seconds")}, indent=None))


if __name__ == "__main__":
    main()
