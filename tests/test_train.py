"""``pydflash train``: the batched training forward, losses, resume, feature cache and export.

References: the reference drafter's own one-block ``forward`` (the batched training path must
equal it block by block), the reference selector's lattice (the selector loss scores), and the
native drafter (export -> convert -> load must reproduce the torch model). The capture itself is
checked in test_train_capture.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pydflash import Drafter, Target
from pydflash.reference import DFlashDrafter, TargetWeights, build_lattice
from pydflash.train.features import CapturedSequence, FeatureCache, decode_features, encode_features
from pydflash.train.forward import forward_blocks
from pydflash.train.loss import drafter_loss, selector_loss, slot_weights
from pydflash.train.pipeline import capture, export
from pydflash.train.prompts import HELD_OUT_HUMANEVAL, TrainPrompt
from pydflash.train.trainer import Trainer, TrainSettings, export_draft_vocab, make_batch

from fixtures_tiny import random_target, smollm2_drafter_config, tiny_config

torch.set_num_threads(1)


def full_attention_config(**overrides):
    """The tiny DFlash2 shape with full, non-causal layers (what training supports)."""
    base = dict(layer_types=("full_attention",) * 2, num_hidden_layers=2, sliding_window=None)
    base.update(overrides)
    return tiny_config("dflash2", **base)


def _nmse(got: np.ndarray, want: torch.Tensor) -> float:
    """Normalised squared error of the engine's output against the float64 reference's."""
    return float(((got - want.numpy()) ** 2).sum() / (want.numpy() ** 2).sum())


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
    # a new-style cache: prompt rows (prompt_len 3) carry -1 except the last (unknown: the chain stops
    # there); a sampled token (9 where the target said 77) ends the chain; the last row's label
    # predicts a token past the end
    labels = np.array([-1, -1, 8, 77, 10, 11], dtype=np.int32)
    seq = CapturedSequence("y", tokens, 3, np.zeros((6, cfg.num_taps, cfg.hidden_size), np.float32), labels)
    b = make_batch([seq], [np.array([1, 2, 4])], cfg.block_size, cfg.mask_token_id)
    assert not b.valid[0, 0].any()
    assert b.valid[0, 1].tolist() == [True, True, False] and b.labels[0, 1].tolist()[:2] == [8, 77]
    assert b.prev_tokens[0, 1].tolist()[:2] == [7, 8]
    assert b.valid[0, 2].tolist() == [True, True, False] and b.labels[0, 2].tolist()[:2] == [10, 11]


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


def _chain_breaking_sequences(cfg, seed: int) -> list[CapturedSequence]:
    """Sequences with unknown prompt labels, a sampled token off the target's chain and a short one."""
    seqs = random_sequences(cfg, 3, 20, seed=seed)
    lab = seqs[0].labels.copy()
    lab[:2] = -1
    lab[9] = (lab[9] + 1) % (cfg.vocab_size - 1)  # the text continues with another token than the label
    seqs[0] = CapturedSequence("x", seqs[0].tokens, 3, seqs[0].features, lab)
    seqs[2] = CapturedSequence("short", seqs[2].tokens[:9], 3, seqs[2].features[:9], seqs[2].labels[:9])
    return seqs


@torch.no_grad()
def test_draft_vocab_loss_equals_the_full_softmax_restricted_to_kept_rows(tmp_path):
    """Both losses over a draft vocabulary equal a slow float64 evaluation: per block the reference
    forward, the full-vocabulary logits restricted to the kept ids, slots with other labels dropped."""
    cfg = full_attention_config()
    model = DFlashDrafter.from_config(cfg, seed=1, dtype=torch.float64)
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=2)
    seqs = _chain_breaking_sequences(cfg, seed=4)
    eog = [cfg.vocab_size - 2]
    tr = Trainer(model, target, seqs, [], TrainSettings(draft_vocab=20), tmp_path, eog_ids=eog)
    ids = tr.draft_vocab.numpy()
    assert len(ids) == 20 and np.all(np.diff(ids) > 0) and eog[0] in ids
    counts = np.bincount(np.concatenate([s.labels[2:] for s in seqs]).clip(min=0), minlength=cfg.vocab_size)
    assert counts[ids].min() >= np.delete(counts, ids).max()  # the most frequent continuation labels
    anchors = [np.array([2, 5, 9, 16]), np.array([2, 7, 12, 17]), np.array([2, 3, 5, 7])]
    batch = make_batch(seqs, anchors, cfg.block_size, cfg.mask_token_id)
    lm, sel, _ = tr.losses(batch)

    sel_mod, w = model.candidate_selector, slot_weights(cfg.block_size, 4.0).double()
    kept = set(ids.tolist())
    lm_num = lm_den = sel_num = sel_den = 0.0
    n_dropped = 0
    for i, seq in enumerate(seqs):
        feats = seq.features.reshape(len(seq.tokens), -1).astype(np.float64)
        for a, s in enumerate(anchors[i]):
            h, z = model.forward_block(feats[:s], np.arange(s), batch.block_tokens[i, a], int(s), target)
            for j in range(1, cfg.block_size):
                if not batch.valid[i, a, j - 1]:
                    continue
                y, prev = int(batch.labels[i, a, j - 1]), int(batch.prev_tokens[i, a, j - 1])
                if y not in kept:
                    n_dropped += 1
                    continue
                zk = z[j][ids]
                lm_num += float(w[j - 1] * (torch.logsumexp(zk, 0) - z[j, y]))
                lm_den += float(w[j - 1])
                cands = ids[torch.topk(zk, sel_mod.top_k).indices.numpy()]
                if y in cands.tolist():
                    proj = sel_mod.hidden_projection(h[j])
                    score = z[j][cands] + (sel_mod.predecessor_codebook[prev] * proj * sel_mod.successor_codebook[cands]).sum(-1)
                    sel_num += float(w[j - 1] * (torch.logsumexp(score, 0) - score[cands.tolist().index(y)]))
                    sel_den += float(w[j - 1])
    assert n_dropped > 0 and lm_den > 0 and sel_den > 0
    assert float(lm) == pytest.approx(lm_num / lm_den, rel=1e-5)
    assert float(sel) == pytest.approx(sel_num / sel_den, rel=1e-5)


def test_head_on_counted_slots_equals_the_all_slots_loss(tmp_path):
    """Full head: the gathered-rows losses equal the old formulation (head on every slot, masked)."""
    cfg = full_attention_config()
    model = DFlashDrafter.from_config(cfg, seed=3, dtype=torch.float64)
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=5)
    seqs = _chain_breaking_sequences(cfg, seed=6)
    tr = Trainer(model, target, seqs, [], TrainSettings(draft_vocab=0), tmp_path)
    assert tr.draft_vocab is None
    batch = make_batch(seqs, [np.array([1, 5, 9, 17]), np.array([2, 7, 12, 18]), np.array([2, 3, 5, 7])],
                       cfg.block_size, cfg.mask_token_id)
    assert not batch.valid.all()
    lm, sel, _ = tr.losses(batch)
    hidden, logits = forward_blocks(model, batch.features, batch.block_tokens, batch.anchors, target)
    slots = cfg.block_size - 1
    h, z = hidden[:, :, 1:].reshape(-1, slots, cfg.hidden_size), logits[:, :, 1:].reshape(-1, slots, cfg.vocab_size)
    labels, valid = batch.labels.reshape(-1, slots), batch.valid.reshape(-1, slots)
    w = slot_weights(cfg.block_size, 4.0)
    torch.testing.assert_close(lm.float(), drafter_loss(z, labels, valid, w).float(), rtol=1e-6, atol=1e-7)
    want_sel = selector_loss(model.candidate_selector, h, z, batch.prev_tokens.reshape(-1, slots), labels, valid, w)
    torch.testing.assert_close(sel.float(), want_sel.float(), rtol=1e-6, atol=1e-7)


def test_anchors_are_drawn_on_continuations_only(tmp_path):
    cfg = full_attention_config()
    rng = np.random.default_rng(0)
    seqs = []
    for i, (n, plen) in enumerate([(30, 12), (16, 14), (9, 9), (20, 1)]):  # (9, 9): no continuation
        tokens = rng.integers(0, cfg.vocab_size - 1, size=n + 1).astype(np.int32)
        labels = tokens[1:].copy()
        labels[: max(0, plen - 1)] = -1
        seqs.append(CapturedSequence(f"s{i}", tokens[:-1], plen, rng.standard_normal((n, cfg.num_taps, cfg.hidden_size))
                                     .astype(np.float32), labels))
    tr = Trainer(DFlashDrafter.from_config(cfg, seed=0), random_target(cfg.vocab_size, cfg.hidden_size, dtype=torch.float32),
                 seqs, [], TrainSettings(seqs_per_step=1, anchors_per_seq=8, draft_vocab=0), tmp_path)
    assert [s.id for s in tr.train_seqs] == ["s0", "s1", "s3"]
    seen = {s.id: set() for s in tr.train_seqs}
    by_first = {}
    for _ in range(60):
        b = tr.sample_batch()
        sid = next(s.id for s in tr.train_seqs if len(s.tokens) > int(b.anchors.max()) and
                   all(int(s.tokens[a]) == int(t) for a, t in zip(b.anchors[0], b.block_tokens[0, :, 0])))
        seen[sid].update(b.anchors[0].tolist())
        by_first[sid] = b
        assert b.valid[:, :, 0].all()  # slot 1's label (row s) is always known on a continuation
    assert seen["s0"] <= set(range(11, 29)) and seen["s1"] <= {13, 14} and seen["s3"] <= set(range(1, 19))
    assert 11 in seen["s0"] and 13 in seen["s1"] and 1 in seen["s3"]


def test_repeated_anchors_equal_a_brute_force_search():
    from pydflash.train.trainer import repeated_anchors

    rng = np.random.default_rng(3)
    for trial in range(40):
        tokens = rng.integers(0, 3, size=int(rng.integers(1, 60))).astype(np.int32)  # 3 ids: many repeats
        n = int(rng.integers(1, 6))
        lo = int(rng.integers(0, len(tokens)))
        hi = len(tokens) - 1 - int(rng.integers(0, 2))
        want = [s >= n - 1 and any(list(tokens[r - n + 1:r + 1]) == list(tokens[s - n + 1:s + 1])
                                   for r in range(n - 1, s)) for s in range(lo, hi + 1)]
        assert repeated_anchors(tokens, lo, hi, n).tolist() == want, (trial, tokens.tolist(), n, lo, hi)


def _looping_sequences(cfg, n_seqs: int = 3) -> list[CapturedSequence]:
    """A prompt, then a continuation that falls into a 5-token loop halfway (what greedy captures do)."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(n_seqs):
        head = rng.integers(0, cfg.vocab_size - 1, size=30)
        tokens = np.concatenate([head, np.tile(rng.integers(0, cfg.vocab_size - 1, size=5), 6)]).astype(np.int32)
        labels = np.append(tokens[1:], tokens[0]).astype(np.int32)
        feats = rng.standard_normal((len(tokens), cfg.num_taps, cfg.hidden_size)).astype(np.float32)
        out.append(CapturedSequence(f"s{i}", tokens, 10, feats, labels))
    return out


def test_repeat_keep_draws_repeated_anchors_with_its_weight(tmp_path):
    from pydflash.train.trainer import _anchor_range, repeated_anchors

    cfg = full_attention_config()
    seqs = _looping_sequences(cfg)
    rep = {s.id: set((_anchor_range(s)[0] + np.flatnonzero(repeated_anchors(s.tokens, *_anchor_range(s), 4))).tolist())
           for s in seqs}
    assert all(len(r) > 5 for r in rep.values())

    def draws(keep: float, seed: int = 0) -> list[tuple[str, int]]:
        tr = Trainer(DFlashDrafter.from_config(cfg, seed=0), random_target(cfg.vocab_size, cfg.hidden_size,
                     dtype=torch.float32), seqs, [], TrainSettings(seqs_per_step=2, anchors_per_seq=16, draft_vocab=0,
                     repeat_keep=keep, repeat_ngram=4, seed=seed), tmp_path)
        out = []
        for _ in range(150):
            b = tr.sample_batch()
            for row in range(b.anchors.shape[0]):
                sid = next(s.id for s in seqs if all(int(s.tokens[a]) == int(t)
                                                     for a, t in zip(b.anchors[row], b.block_tokens[row, :, 0])))
                out += [(sid, int(a)) for a in b.anchors[row]]
        return out

    def share(d):
        return sum(a in rep[sid] for sid, a in d) / len(d)

    n_rep = {s.id: len(rep[s.id]) for s in seqs}
    n_all = {s.id: _anchor_range(s)[1] - _anchor_range(s)[0] + 1 for s in seqs}
    uniform = np.mean([n_rep[k] / n_all[k] for k in n_rep])
    weighted = np.mean([0.25 * n_rep[k] / (0.25 * n_rep[k] + n_all[k] - n_rep[k]) for k in n_rep])
    assert share(draws(0.0)) == 0.0
    assert abs(share(draws(0.25)) - weighted) < 0.03, (share(draws(0.25)), weighted)
    assert abs(share(draws(1.0)) - uniform) < 0.03, (share(draws(1.0)), uniform)


def test_a_few_steps_lower_the_loss_on_a_fixed_batch(tmp_path):
    cfg = full_attention_config()
    model = DFlashDrafter.from_config(cfg, seed=0)
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=1, dtype=torch.float32)
    seqs = random_sequences(cfg, 4, 24)
    trainer = Trainer(model, target, seqs, [], TrainSettings(steps=40, lr=3e-3, warmup=1, selector_weight=1.0),
                      tmp_path)
    batch = trainer.sample_batch()
    with torch.no_grad():
        lm0, sel0, _ = trainer.losses(batch)
    for _ in range(40):
        trainer.train_step(batch)
    with torch.no_grad():
        lm1, sel1, _ = trainer.losses(batch)
    assert float(lm1) < 0.5 * float(lm0), (float(lm0), float(lm1))
    assert float(sel1) < float(sel0), (float(sel0), float(sel1))


def test_interrupted_training_resumes_exactly(tmp_path):
    cfg = full_attention_config()
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=1, dtype=torch.float32)
    seqs = random_sequences(cfg, 5, 20)
    settings = TrainSettings(steps=6, lr=1e-3, warmup=2, checkpoint_every=3, eval_every=3, seed=5, draft_vocab=48)

    straight = Trainer(DFlashDrafter.from_config(cfg, seed=0), target, seqs, seqs[:1], settings, tmp_path / "a")
    straight.fit()

    first = Trainer(DFlashDrafter.from_config(cfg, seed=0), target, seqs, seqs[:1],
                    TrainSettings(**{**settings.__dict__, "steps": 3}), tmp_path / "b")
    first.fit()  # "interrupted" after 3 steps (checkpoint written)
    # the resumed run starts from other data (so another vocabulary would be chosen): it keeps the checkpoint's
    resumed = Trainer(DFlashDrafter.from_config(cfg, seed=9), target, seqs[1:], seqs[:1], settings, tmp_path / "b")
    assert resumed.load_checkpoint() and resumed.step == 3
    assert torch.equal(resumed.draft_vocab, first.draft_vocab) and len(first.draft_vocab) == 48
    resumed.train_seqs = straight.train_seqs
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


def test_cached_features_are_memory_mapped_and_equal_what_numpy_reads(tmp_path):
    # the trainer keeps every sequence's features encoded; mapped from the shard files, a cache
    # larger than RAM trains (4.3 M tokens of SmolLM2 taps are 20 GB; the machines have 24 GiB)
    import mmap
    import zipfile

    rng = np.random.default_rng(1)
    cache = FeatureCache(tmp_path / "cache", tap_layers=[1, 2])
    for shard in range(2):
        seqs = []
        for i in range(3):
            n = int(rng.integers(3, 9))
            feats = rng.standard_normal((n, 2, 16)).astype(np.float32) * 10.0 ** rng.integers(-3, 4)
            seqs.append(CapturedSequence(f"s{shard}/{i}", rng.integers(0, 100, n).astype(np.int32), 2, feats,
                                         rng.integers(0, 100, n).astype(np.int32)))
        cache.append(seqs)
    # a shard written compressed (not what append writes) is read, not mapped
    first = tmp_path / "cache" / cache.meta["shards"][0]["file"]
    with np.load(first) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez_compressed(first, **arrays)
    assert zipfile.ZipFile(first).getinfo("values.npy").compress_type == zipfile.ZIP_DEFLATED

    got = FeatureCache(tmp_path / "cache").sequences(decode=False)
    offset = 0
    for shard in cache.meta["shards"]:
        with np.load(tmp_path / "cache" / shard["file"]) as z:
            lengths, values, scales = z["lengths"], z["values"], z["scales"]
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for i, sid in enumerate(shard["ids"]):
            seq = got[offset + i]
            assert seq.id == sid
            v, s = seq.features
            np.testing.assert_array_equal(v, values[starts[i]:starts[i + 1]])
            np.testing.assert_array_equal(s, scales[starts[i]:starts[i + 1]])
            mapped = isinstance(v.base, mmap.mmap) or isinstance(getattr(v.base, "base", None), mmap.mmap)
            assert mapped == (shard is not cache.meta["shards"][0])
        offset += len(shard["ids"])
    decoded = FeatureCache(tmp_path / "cache").sequences()
    np.testing.assert_array_equal(decoded[4].features, decode_features(*got[4].features))


PROMPTS = [TrainPrompt("p/0", text="def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n"),
           TrainPrompt("p/1", text="The capital of France is")]
TAPS = [1, 10, 19, 28]


@pytest.fixture(scope="module")
def small_cache(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("cache")
    cache = capture(str(smollm2_path), PROMPTS, root / "cache", TAPS, max_new=12, threads=1, batch=2, log=lambda m: None)
    return cache


def test_held_out_humaneval_is_never_loaded(tmp_path):
    from pydflash.train import prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "HumanEval/131", "prompt": "a"}\n{"id": "HumanEval/140", "prompt": "b"}\n')
    assert [p.id for p in prompts.load(str(path))] == ["HumanEval/131"]
    assert "HumanEval/163" in HELD_OUT_HUMANEVAL and "HumanEval/131" not in HELD_OUT_HUMANEVAL
    # chat:SOURCE wraps the same prompts as user messages, held-out ones still dropped
    chat = prompts.load(f"chat:{path}")
    assert [p.id for p in chat] == ["chat/HumanEval/131"]
    assert chat[0].messages[0]["role"] == "user" and "a" in chat[0].messages[0]["content"]


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
    assert _nmse(hidden, want_h) < 1e-8 and _nmse(logits, want_z) < 1e-8
    want = ref.propose(want_h, want_z, int(seq.tokens[s]))
    assert prop.tokens.tolist() == want.tokens.tolist()

    # the same drafter with the draft vocabulary it was trained with (d2t): the engine drafts what the
    # float64 reference drafts on logits restricted to those ids (-inf elsewhere)
    ids = trainer.draft_vocab.numpy()
    assert len(ids) == 8192
    reduced = export_draft_vocab([files[0]], smollm2_path, ids, trainer.draft_vocab_report)[0]
    with Drafter(reduced, smollm2_path, n_ctx=128, n_threads=1, exact_head=True) as d:
        assert d.draft_vocab.tolist() == ids.tolist()
        d.inject(feats[:s], np.arange(s))
        hidden, logits = d.forward(int(seq.tokens[s]), s)
        prop = d.propose(int(seq.tokens[s]), s)
    assert _nmse(hidden, want_h) < 1e-8 and _nmse(logits, want_z[:, ids]) < 1e-8
    masked = torch.full_like(want_z, float("-inf"))
    masked[:, ids] = want_z[:, ids]
    want = ref.propose(want_h, masked, int(seq.tokens[s]))
    assert set(want.tokens.tolist()) <= set(ids.tolist())
    assert prop.tokens.tolist() == want.tokens.tolist()


def test_a_narrower_ffn_starts_from_the_target_s_strongest_neurons_and_loads_natively(small_cache, smollm2_path,
                                                                                       tmp_path):
    """--ffn: the drafter layer's SwiGLU keeps the target last layer's neurons with the largest
    |gate| * |up| * |down| norms (reference: gguf-py's own dequantizer), and the narrower drafter
    exports, converts and loads in the engine like any other (float64 reference forward)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from pydflash.formats.convert import read_gguf_header
    from pydflash.train.init import init_from_target, target_facts
    from pydflash.train.pipeline import build_config

    facts = target_facts(smollm2_path)
    with pytest.raises(ValueError, match="--ffn"):
        build_config(facts, ffn=facts["intermediate_size"] + 1)
    cfg = build_config(facts, layers=1, taps=TAPS, ffn=512)
    model = DFlashDrafter(cfg)
    notes = init_from_target(model, smollm2_path)
    last = facts["num_layers"] - 1
    assert f"layers.0.mlp <- blk.{last}.ffn_* (512 of {facts['intermediate_size']} neurons)" in notes

    tensors = {t.name: t for t in GGUFReader(smollm2_path).tensors}
    def weight(name):  # [rows, cols] as torch stores a Linear weight
        t = tensors[f"blk.{last}.{name}.weight"]
        return dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0])).astype(np.float64)
    gate, up, down = weight("ffn_gate"), weight("ffn_up"), weight("ffn_down")
    score = np.linalg.norm(gate, axis=1) * np.linalg.norm(up, axis=1) * np.linalg.norm(down, axis=0)
    keep = np.sort(np.argsort(-score, kind="stable")[:512])
    mlp = model.layers[0].mlp
    np.testing.assert_allclose(mlp.gate_proj.weight.detach().numpy(), gate[keep], rtol=0, atol=1e-6)
    np.testing.assert_allclose(mlp.up_proj.weight.detach().numpy(), up[keep], rtol=0, atol=1e-6)
    np.testing.assert_allclose(mlp.down_proj.weight.detach().numpy(), down[:, keep], rtol=0, atol=1e-6)

    # exported without the target's tokenizer (--no-tokenizer): the engine pairs it on tensor shapes
    files = export(model, tmp_path / "out", str(smollm2_path), name="narrow", quant=(), outtype="f32", tokenizer=False)
    kv = read_gguf_header(files[0]).kv
    assert not any(k.startswith("tokenizer.") for k in kv if k != "tokenizer.ggml.mask_token_id")
    assert kv["tokenizer.ggml.mask_token_id"].value == cfg.mask_token_id
    ref = DFlashDrafter(cfg).double()
    ref.load_state_dict(model.state_dict())
    seq = small_cache.sequences()[0]
    feats = seq.features.reshape(len(seq.tokens), -1)
    s = len(seq.tokens) - 3
    with Drafter(files[0], smollm2_path, n_ctx=128, n_threads=1, exact_head=True) as d:
        d.inject(feats[:s], np.arange(s))
        hidden, logits = d.forward(int(seq.tokens[s]), s)
    want_h, want_z = ref.forward_block(feats[:s].astype(np.float64), np.arange(s), [int(seq.tokens[s])] + [0] * 7, s,
                                       TargetWeights.from_gguf(smollm2_path).to(torch.float64))
    assert _nmse(hidden, want_h) < 1e-8 and _nmse(logits, want_z) < 1e-8


def test_pydflash_train_refuses_an_ffn_wider_than_the_target_s(smollm2_path, tmp_path, capsys):
    from pydflash.train.pipeline import main

    with pytest.raises(SystemExit) as exit_:
        main(["--target", str(smollm2_path), "--out", str(tmp_path / "run"), "--ffn", "99999", "--export-only"])
    assert exit_.value.code == 2 and "--ffn 99999 outside 1..1536" in capsys.readouterr().err
