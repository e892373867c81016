"""``pydflash train``: the batched training forward, losses, resume, feature cache and export.

References: the reference drafter's own one-block ``forward`` (the batched training path must
equal it block by block), the reference selector's lattice (the selector loss scores), plain
greedy generation and a direct tap capture (the cache), and the native drafter (export ->
convert -> load must reproduce the torch model).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pydflash import Drafter, Target
from pydflash.reference import DFlashDrafter, TargetWeights, build_lattice
from pydflash.train.features import CapturedSequence, FeatureCache, capture_sequence, decode_features, encode_features
from pydflash.train.forward import forward_blocks
from pydflash.train.loss import selector_loss, slot_weights
from pydflash.train.pipeline import capture, export
from pydflash.train.prompts import HELD_OUT_HUMANEVAL, TrainPrompt
from pydflash.train.trainer import Trainer, TrainSettings, make_batch

from fixtures_tiny import random_target, smollm2_drafter_config, tiny_config

torch.set_num_threads(1)


def full_attention_config(**overrides):
    """The tiny DFlash2 shape with full, non-causal layers (what training supports)."""
    base = dict(layer_types=("full_attention",) * 2, num_hidden_layers=2, sliding_window=None)
    base.update(overrides)
    return tiny_config("dflash2", **base)


def random_sequences(cfg, n_seqs: int, length: int, seed: int = 0) -> list[CapturedSequence]:
    """Sequences whose labels are the next token (as on a greedy continuation)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_seqs):
        tokens = rng.integers(0, cfg.vocab_size - 1, size=length + 1).astype(np.int32)
        feats = rng.standard_normal((length, cfg.num_taps, cfg.hidden_size)).astype(np.float32)
        out.append(CapturedSequence(f"s{i}", tokens[:-1], 3, feats, tokens[1:]))
    return out


def test_batched_blocks_equal_reference_forward_per_block():
    cfg = full_attention_config()
    model = DFlashDrafter.from_config(cfg, seed=1, dtype=torch.float64)
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=2)
    seqs = random_sequences(cfg, 2, 17, seed=3)
    seqs[1] = CapturedSequence("short", seqs[1].tokens[:11], 3, seqs[1].features[:11], seqs[1].labels[:11])
    anchors = [np.array([1, 5, 15]), np.array([1, 4, 9])]
    batch = make_batch(seqs, anchors, cfg.block_size, cfg.mask_token_id)
    hidden, logits = forward_blocks(model, batch.features.double(), batch.block_tokens, batch.anchors, target)
    for i, seq in enumerate(seqs):
        feats = seq.features.reshape(len(seq.tokens), -1).astype(np.float64)
        for a, s in enumerate(anchors[i]):
            want_h, want_z = model.forward(feats[:s], np.arange(s), batch.block_tokens[i, a], int(s), target)
            torch.testing.assert_close(hidden[i, a], want_h, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(logits[i, a], want_z, rtol=1e-10, atol=1e-10)


def test_block_labels_follow_the_target_chain():
    cfg = full_attention_config(block_size=4)
    tokens = np.array([5, 6, 7, 8, 9, 10], dtype=np.int32)
    labels = np.array([6, 7, 99, 9, 10, 11], dtype=np.int32)  # the target disagrees with token 3 (8 vs 99)
    seq = CapturedSequence("x", tokens, 2, np.zeros((6, cfg.num_taps, cfg.hidden_size), np.float32), labels)
    b = make_batch([seq], [np.array([1, 3])], cfg.block_size, cfg.mask_token_id)
    assert b.block_tokens[0, 0].tolist() == [6, cfg.mask_token_id, cfg.mask_token_id, cfg.mask_token_id]
    # anchor 1: slots predict positions 2, 3, 4 = labels[1], labels[2]; after that the prompt left the chain
    assert b.labels[0, 0].tolist()[:2] == [7, 99] and b.valid[0, 0].tolist() == [True, True, False]
    assert b.prev_tokens[0, 0].tolist()[:2] == [6, 7]
    # anchor 3: positions 4, 5, 6 -> labels[3], labels[4], labels[5]
    assert b.labels[0, 1].tolist() == [9, 10, 11] and b.valid[0, 1].all()


def test_selector_loss_scores_are_lattice_entries():
    """The loss scores a candidate with the true predecessor: the reference lattice entry whose
    previous-slot candidate is that token."""
    cfg = full_attention_config()
    model = DFlashDrafter.from_config(cfg, seed=4, dtype=torch.float64)
    sel = model.candidate_selector
    rng = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 3, cfg.hidden_size, generator=rng, dtype=torch.float64)
    logits = torch.randn(1, 3, cfg.vocab_size, generator=rng, dtype=torch.float64)
    cands = torch.topk(logits[0], sel.top_k).indices
    anchor = 7
    labels = torch.stack([cands[0, 1], cands[1, 2], cands[2, 0]])[None]  # each true token is a candidate
    prev = torch.stack([torch.tensor(anchor), labels[0, 0], labels[0, 1]])[None]
    valid = torch.ones(1, 3, dtype=torch.bool)
    w = slot_weights(4, 4.0)
    got = selector_loss(sel, hidden, logits, prev, labels, valid, w)
    lattice = build_lattice(cands, torch.topk(logits[0], sel.top_k).values, sel.hidden_projection(hidden[0]), anchor,
                            sel.predecessor_codebook, sel.successor_codebook)
    rows = [lattice[0, 0], lattice[1, 1], lattice[2, 2]]  # prev candidates: anchor, cands[0,1], cands[1,2]
    targets = [1, 2, 0]
    ce = torch.stack([torch.nn.functional.cross_entropy(r[None].float(), torch.tensor([t])) for r, t in zip(rows, targets)])
    want = (ce * w).sum() / w.sum()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch(tmp_path):
    cfg = full_attention_config()
    model = DFlashDrafter.from_config(cfg, seed=0)
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=1, dtype=torch.float32)
    seqs = random_sequences(cfg, 4, 24)
    trainer = Trainer(model, target, seqs, [], TrainSettings(steps=40, lr=3e-3, warmup=1, selector_weight=1.0),
                      tmp_path)
    batch = trainer.sample_batch()
    with torch.no_grad():
        lm0, sel0 = trainer.losses(batch)
    for _ in range(40):
        trainer.train_step(batch)
    with torch.no_grad():
        lm1, sel1 = trainer.losses(batch)
    assert float(lm1) < 0.5 * float(lm0), (float(lm0), float(lm1))
    assert float(sel1) < float(sel0), (float(sel0), float(sel1))


def test_interrupted_training_resumes_exactly(tmp_path):
    cfg = full_attention_config()
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=1, dtype=torch.float32)
    seqs = random_sequences(cfg, 5, 20)
    settings = TrainSettings(steps=6, lr=1e-3, warmup=2, checkpoint_every=3, eval_every=3, seed=5)

    straight = Trainer(DFlashDrafter.from_config(cfg, seed=0), target, seqs, seqs[:1], settings, tmp_path / "a")
    straight.fit()

    first = Trainer(DFlashDrafter.from_config(cfg, seed=0), target, seqs, seqs[:1],
                    TrainSettings(**{**settings.__dict__, "steps": 3}), tmp_path / "b")
    first.fit()  # "interrupted" after 3 steps (checkpoint written)
    resumed = Trainer(DFlashDrafter.from_config(cfg, seed=9), target, seqs, seqs[:1], settings, tmp_path / "b")
    assert resumed.load_checkpoint() and resumed.step == 3
    resumed.fit()
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert [h["loss"] for h in straight.history if "loss" in h] == [h["loss"] for h in resumed.history if "loss" in h]


def test_feature_encoding_keeps_outliers():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 2, 64)).astype(np.float32)
    x[0, 0, 3] = 3.0e5  # a "massive activation": beyond float16's range
    x[1, 1] = 0.0
    back = decode_features(*encode_features(x))
    assert np.isfinite(back).all()
    err = np.abs(back - x).max(axis=-1) / np.maximum(np.abs(x).max(axis=-1), 1e-30)
    assert err.max() < 2.0**-11
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(3.0e5).astype(np.float16))  # what plain float16 would have stored


PROMPTS = [TrainPrompt("p/0", text="def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n"),
           TrainPrompt("p/1", text="The capital of France is")]
TAPS = [1, 10, 19, 28]


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("cache")
    cache = capture(str(smollm2_path), PROMPTS, root / "cache", TAPS, max_new=12, threads=1, batch=2, log=lambda m: None)
    return cache


def test_cached_features_equal_a_direct_capture(small_cache, smollm2_path):
    seqs = small_cache.sequences()
    assert [s.id for s in seqs] == ["p/0", "p/1"]
    with Target(smollm2_path, n_ctx=256, n_threads=1) as target:
        for seq, prompt in zip(seqs, PROMPTS):
            prompt_tokens = target.tokenize(prompt.text)
            assert seq.tokens[: seq.prompt_len].tolist() == prompt_tokens
            # the continuation is the target's own greedy output
            plain = target.generate(prompt_tokens, max_tokens=12, temperature=0)
            assert seq.tokens[seq.prompt_len:].tolist() == list(plain.tokens)
            # features: one direct decode of the whole sequence with the taps on
            target.rollback(0)
            target.set_taps([t + 1 for t in TAPS])
            target.decode(seq.tokens.tolist(), all_logits=True)
            direct = np.stack([target.tap_rows(k) for k in range(len(TAPS))], axis=1)
            argmax = [int(np.argmax(target.logits(r))) for r in range(len(seq.tokens))]
            target.set_taps([])
            target.rollback(0)
            # equal up to the cache's float16-per-row rounding: half an ulp of the row maximum
            scale = np.abs(direct).max(axis=-1, keepdims=True)
            assert np.all(np.abs(seq.features - direct) <= scale * 2.0**-11)
            assert seq.labels.tolist() == argmax
    # a second capture of the same prompts finds them cached and adds nothing
    again = capture(str(smollm2_path), PROMPTS, small_cache.dir, TAPS, max_new=12, threads=1, batch=2,
                    log=lambda m: None)
    assert len(again.meta["shards"]) == len(small_cache.meta["shards"])


def test_held_out_humaneval_is_never_loaded(tmp_path):
    from pydflash.train import prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "HumanEval/131", "prompt": "a"}\n{"id": "HumanEval/140", "prompt": "b"}\n')
    assert [p.id for p in prompts.load(str(path))] == ["HumanEval/131"]
    assert "HumanEval/163" in HELD_OUT_HUMANEVAL and "HumanEval/131" not in HELD_OUT_HUMANEVAL


def test_export_convert_load_matches_the_torch_model(small_cache, smollm2_path, tmp_path):
    cfg = smollm2_drafter_config(block_size=8, target_layer_ids=tuple(TAPS), mask_token_id=0)
    target32 = TargetWeights.from_gguf(smollm2_path)
    trainer = Trainer(DFlashDrafter.from_config(cfg, seed=0), target32, small_cache.sequences(), [],
                      TrainSettings(steps=2, warmup=1, seqs_per_step=2, anchors_per_seq=4), tmp_path / "run")
    trainer.fit()  # a trained (not freshly seeded) model is exported
    files = export(trainer.model, tmp_path / "out", str(smollm2_path), name="tiny-drafter", quant=(), outtype="f32")
    ref = DFlashDrafter(cfg).double()
    ref.load_state_dict(trainer.model.state_dict())
    target64 = target32.to(torch.float64)
    seq = small_cache.sequences()[0]
    feats = seq.features.reshape(len(seq.tokens), -1)
    s = len(seq.tokens) - 3
    with Drafter(files[0], smollm2_path, n_ctx=128, n_threads=1, exact_head=True) as d:
        assert d.target_layers == tuple(t + 1 for t in TAPS)
        d.inject(feats[:s], np.arange(s))
        hidden, logits = d.forward(int(seq.tokens[s]), s)
        prop = d.propose(int(seq.tokens[s]), s)
    blk = [int(seq.tokens[s])] + [0] * 7
    want_h, want_z = ref.forward_block(feats[:s].astype(np.float64), np.arange(s), blk, s, target64)
    nmse = lambda a, b: float(((a - b.numpy()) ** 2).sum() / (b.numpy() ** 2).sum())  # noqa: E731
    assert nmse(hidden, want_h) < 1e-8 and nmse(logits, want_z) < 1e-8
    want = ref.propose(want_h, want_z, int(seq.tokens[s]))
    assert prop.tokens.tolist() == want.tokens.tolist()
