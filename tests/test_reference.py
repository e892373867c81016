"""The torch reference drafter against independent NumPy re-implementations of the spec.

Every numeric check here compares ``pydflash.reference`` with code written in this file
straight from the formulas (docs/dflash2-spec.md sections 1-2): loops over (row, tap,
channel) for the conv, per-head loops for attention, the selector recursion, and
chi-square tests for the two samplers.
"""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from fixtures_tiny import (
    REFERENCE_CONFIG,
    REFERENCE_HEADER,
    random_target,
    smollm2_drafter_config,
    tiny_config,
    with_changes,
    write_checkpoint,
)

from pydflash.formats.convert import read_gguf_header
from pydflash.reference import DFlashConfig, DFlashDrafter, TargetWeights
from pydflash.reference.model import grouped_dynamic_causal_conv, parameter_names
from pydflash.reference.selector import (
    greedy_verify,
    rejection_sample,
    sampled_walk,
    sampling_probs,
    top_k_candidates,
)

F64 = torch.float64


# --- statistics helpers -------------------------------------------------------------------


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.719 is the 1e-4 normal tail."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic over cells with non-zero expected probability; fails on mass in a zero cell."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "samples fell where the expected probability is zero"
    keep = probs > 0
    expected = n * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    stat, df = chi2_stat(counts, probs)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} >= critical {chi2_critical(df):.1f} (df {df})"


# --- 1. grouped dynamic causal conv ---------------------------------------------------------


def np_conv(z: np.ndarray, delta_flat: np.ndarray, base: np.ndarray, side: int, group_size: int) -> np.ndarray:
    """out[i, c] = sum_t (beta[side, t, c] + delta[i, side*T*G + t*G + c//S]) * z[i-t, c], z[<0] = 0."""
    n_rows, hidden = z.shape
    taps = base.shape[1]
    groups = hidden // group_size
    out = np.zeros_like(z)
    for i in range(n_rows):
        for t in range(taps):
            if i - t < 0:
                continue
            for c in range(hidden):
                coeff = base[side, t, c] + delta_flat[i, side * taps * groups + t * groups + c // group_size]
                out[i, c] += coeff * z[i - t, c]
    return out


@pytest.mark.parametrize("rows,taps,hidden,group", [(1, 2, 8, 4), (3, 2, 12, 4), (2, 3, 8, 2), (5, 3, 16, 16)])
def test_conv_matches_triple_loop(rows: int, taps: int, hidden: int, group: int) -> None:
    rng = np.random.default_rng(rows * 100 + taps)
    groups = hidden // group
    z = rng.standard_normal((rows, hidden))
    base = rng.standard_normal((2, taps, hidden))
    delta = rng.standard_normal((rows, 2 * taps * groups))
    for side in (0, 1):
        coeff = torch.tensor(delta).view(rows, 2, taps, groups)[:, side]
        got = grouped_dynamic_causal_conv(torch.tensor(z), coeff, torch.tensor(base[side]), group).numpy()
        np.testing.assert_allclose(got, np_conv(z, delta, base, side, group), rtol=0, atol=1e-12)


def test_conv_module_uses_flat_coefficient_index() -> None:
    """The module's projection -> [side, t, g] reshape must follow side*T*G + t*G + g."""
    cfg = tiny_config(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      conv_kernel_size=3, conv_group_size=4)
    conv = DFlashDrafter.from_config(cfg, seed=3, dtype=F64).layers[0].attention_conv
    rng = np.random.default_rng(0)
    n = rng.standard_normal((5, 16))
    delta = n @ conv.kernel_projection.weight.detach().numpy().T
    base = conv.base_kernel.detach().numpy()
    with torch.no_grad():
        coeffs = conv.coefficients(torch.tensor(n))
        got_sides = [conv.conv(torch.tensor(n), coeffs, side).numpy() for side in (0, 1)]
    for side, got in enumerate(got_sides):
        np.testing.assert_allclose(got, np_conv(n, delta, base, side, 4), atol=1e-12)


# --- 2. the full block forward vs NumPy ------------------------------------------------------


def np_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def np_rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Rotate pairs (i, i + d/2) of every head by angle pos * theta^(-2i/d)."""
    d = x.shape[-1]
    half = d // 2
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        for i in range(half):
            ang = pos[r] * theta ** (-2.0 * i / d)
            a, b = x[r, :, i], x[r, :, i + half]
            out[r, :, i] = a * math.cos(ang) - b * math.sin(ang)
            out[r, :, i + half] = b * math.cos(ang) + a * math.sin(ang)
    return out


def np_visible(cfg: DFlashConfig, layer: int, q_pos: int, k_pos: int) -> bool:
    causal = cfg.is_causal if cfg.is_causal is not None else cfg.layer_types[layer] == "sliding_attention"
    if causal and k_pos > q_pos:
        return False
    window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else None
    if window is not None:
        if q_pos - k_pos >= window:
            return False
        if not causal and k_pos - q_pos >= window:
            return False
    return True


def np_attention(cfg, w, layer, a, g, ctx_pos, blk_pos):  # noqa: ANN001, ANN201
    p = f"layers.{layer}.self_attn."
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    src = np.concatenate([g, a])
    pos = np.concatenate([ctx_pos, blk_pos])
    q = np_rope(np_rms((a @ w[p + "q_proj.weight"].T).reshape(len(a), nh, d), w[p + "q_norm.weight"],
                       cfg.rms_norm_eps), blk_pos, cfg.rope_theta)
    k = np_rope(np_rms((src @ w[p + "k_proj.weight"].T).reshape(len(src), nkv, d), w[p + "k_norm.weight"],
                       cfg.rms_norm_eps), pos, cfg.rope_theta)
    v = (src @ w[p + "v_proj.weight"].T).reshape(len(src), nkv, d)
    out = np.zeros((len(a), nh, d))
    for h in range(nh):
        kv = h // (nh // nkv)
        for i in range(len(a)):
            keys = [j for j in range(len(src)) if np_visible(cfg, layer, blk_pos[i], pos[j])]
            s = np.array([q[i, h] @ k[j, kv] / math.sqrt(d) for j in keys])
            e = np.exp(s - s.max())
            out[i, h] = (e / e.sum()) @ v[keys, kv]
    return out.reshape(len(a), nh * d) @ w[p + "o_proj.weight"].T


def np_forward(cfg: DFlashConfig, w: dict, feats, ctx_pos, tokens, start, embed, head):  # noqa: ANN001, ANN201
    eps = cfg.rms_norm_eps
    g = np_rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    h = embed[tokens] * cfg.embedding_scale
    blk_pos = start + np.arange(len(tokens))
    s = cfg.conv_group_size
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        a = np_rms(h, w[p + "input_layernorm.weight"], eps)
        if cfg.is_dflash2:
            da, ba = a @ w[p + "attention_conv.kernel_projection.weight"].T, w[p + "attention_conv.base_kernel"]
            a = np_conv(a, da, ba, 0, s)
        o = np_attention(cfg, w, layer, a, g, ctx_pos, blk_pos)
        if cfg.is_dflash2:
            o = np_conv(o, da, ba, 1, s)
        h = h + o
        m = np_rms(h, w[p + "post_attention_layernorm.weight"], eps)
        if cfg.is_dflash2:
            dm, bm = m @ w[p + "mlp_conv.kernel_projection.weight"].T, w[p + "mlp_conv.base_kernel"]
            m = np_conv(m, dm, bm, 0, s)
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        f = (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        if cfg.is_dflash2:
            f = np_conv(f, dm, bm, 1, s)
        h = h + f
    hidden = np_rms(h, w["norm.weight"], eps)
    z = cfg.logit_scale * (hidden @ head.T)
    c = cfg.softcap
    return hidden, (c * np.tanh(z / c) if c > 0 else z)


FORWARD_CASES = {
    # non-causal, window 3 smaller than the context, non-contiguous committed positions
    "dflash2-swa3": dict(kind="dflash2", sliding_window=3, ctx_pos=[0, 1, 2, 3, 5, 6], start=7),
    "dflash2-causal-full": dict(kind="dflash2", is_causal=True, layer_types=("full_attention",) * 2,
                                sliding_window=None, ctx_pos=[0, 1, 2, 3], start=4),
    # is_causal unset: the reference makes sliding layers causal, full layers stay non-causal
    "dflash2-unset-mixed": dict(kind="dflash2", is_causal=None, sliding_window=2,
                                layer_types=("sliding_attention", "full_attention"), ctx_pos=[2, 3, 4], start=5),
    "dflash-v1-gqa4": dict(kind="dflash", num_key_value_heads=1, output_multiplier=None,
                           final_logit_softcapping=None, input_embedding_scale=None, ctx_pos=[0, 1, 2], start=3),
}


@pytest.mark.parametrize("case", sorted(FORWARD_CASES))
def test_forward_block_matches_numpy(case: str) -> None:
    spec = dict(FORWARD_CASES[case])
    kind, ctx_pos, start = spec.pop("kind"), np.array(spec.pop("ctx_pos")), spec.pop("start")
    cfg = tiny_config(kind, num_hidden_layers=2, **spec)
    model = DFlashDrafter.from_config(cfg, seed=11, dtype=F64)
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=5)
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((len(ctx_pos), cfg.num_taps * cfg.hidden_size))
    tokens = np.array([7] + [cfg.mask_token_id] * (cfg.block_size - 1))

    hidden, logits = model.forward_block(feats, ctx_pos, tokens, start, target)

    w = {k: v.numpy() for k, v in model.state_dict().items()}
    ref_h, ref_z = np_forward(cfg, w, feats, ctx_pos, tokens, start, target.embed_tokens.numpy(),
                              target.lm_head.numpy())
    np.testing.assert_allclose(hidden.numpy(), ref_h, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(logits.numpy(), ref_z, rtol=1e-10, atol=1e-10)


def test_forward_block_float32_close_to_float64() -> None:
    cfg = tiny_config(num_hidden_layers=2)
    m64, m32 = (DFlashDrafter.from_config(cfg, seed=2, dtype=d) for d in (F64, torch.float32))
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=1)
    feats = np.random.default_rng(0).standard_normal((6, cfg.num_taps * cfg.hidden_size)).astype(np.float32)
    args = (feats, np.arange(6), [3, 95, 95, 95], 6)
    h64, z64 = m64.forward_block(*args, target)
    h32, z32 = m32.forward_block(*args, target.to(torch.float32))
    assert h32.dtype == torch.float32
    np.testing.assert_allclose(h32.numpy(), h64.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(z32.numpy(), z64.numpy(), rtol=1e-4, atol=1e-4)


def test_identity_convs_reduce_dflash2_to_v1() -> None:
    cfg2 = tiny_config("dflash2", num_hidden_layers=2)
    cfg1 = tiny_config("dflash", num_hidden_layers=2)
    v2 = DFlashDrafter.from_config(cfg2, seed=4, dtype=F64)
    v2.set_identity_convs()
    v1 = DFlashDrafter(cfg1).to(F64)
    shared = {k: v for k, v in v2.state_dict().items() if "conv" not in k and "candidate_selector" not in k}
    v1.load_state_dict(shared, strict=True)
    target = random_target(cfg2.vocab_size, cfg2.hidden_size, seed=9)
    feats = np.random.default_rng(3).standard_normal((5, cfg2.num_taps * cfg2.hidden_size))
    args = (feats, np.arange(5), [1, 95, 95, 95], 5, target)
    for a, b in zip(v2.forward_block(*args), v1.forward_block(*args)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-12)
    # and the identity is not vacuous: random convs change the output
    v2r = DFlashDrafter.from_config(cfg2, seed=4, dtype=F64)
    assert not torch.allclose(v2r.forward_block(*args)[0], v1.forward_block(*args)[0])


def test_empty_context_is_allowed() -> None:
    cfg = tiny_config(num_hidden_layers=1)
    model = DFlashDrafter.from_config(cfg, seed=0, dtype=F64)
    target = random_target(cfg.vocab_size, cfg.hidden_size)
    hidden, logits = model.forward_block(np.zeros((0, cfg.num_taps * cfg.hidden_size)), [], [5, 95], 0, target)
    assert hidden.shape == (2, cfg.hidden_size) and logits.shape == (2, cfg.vocab_size)
    assert torch.isfinite(logits).all()


# --- 3. selector: lattice and greedy walk vs the formula ---------------------------------------


def np_top_k(z: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((np.arange(z.shape[-1]), -z))[:k]  # by value desc, then id asc
    return order, z[order]


def np_score(unary_k: float, prev: int, cand: int, hh: np.ndarray, P: np.ndarray, Q: np.ndarray) -> float:
    s = unary_k
    for r in range(len(hh)):
        s += P[prev, r] * hh[r] * Q[cand, r]
    return s


def test_selector_lattice_and_greedy_path_match_formula() -> None:
    cfg = tiny_config(num_hidden_layers=1, selector_top_k=4, block_size=4)
    model = DFlashDrafter.from_config(cfg, seed=21, dtype=F64)
    target = random_target(cfg.vocab_size, cfg.hidden_size, seed=22)
    feats = np.random.default_rng(23).standard_normal((4, cfg.num_taps * cfg.hidden_size))
    anchor = 17
    hidden, logits = model.forward_block(feats, np.arange(4), [anchor] + [95] * 3, 4, target)
    prop = model.propose(hidden, logits, anchor, temperature=0.0)

    sel = model.candidate_selector
    P, Q = sel.predecessor_codebook.detach().numpy(), sel.successor_codebook.detach().numpy()
    hh = hidden[1:].numpy() @ sel.hidden_projection.weight.detach().numpy().T
    z = logits[1:].numpy()
    n, k = z.shape[0], cfg.selector_top_k
    cands = np.stack([np_top_k(z[j], k)[0] for j in range(n)])
    unary = np.stack([np_top_k(z[j], k)[1] for j in range(n)])
    np.testing.assert_array_equal(prop.candidates.numpy(), cands)

    lattice = np.zeros((n, k, k))
    for j in range(n):
        for p in range(k):
            prev = anchor if j == 0 else cands[j - 1, p]
            for c in range(k):
                lattice[j, p, c] = np_score(unary[j, c], prev, cands[j, c], hh[j], P, Q)
    np.testing.assert_allclose(prop.lattice.numpy(), lattice, rtol=1e-12, atol=1e-12)

    # greedy recursion straight from the formula (no lattice)
    prev, path = anchor, []
    for j in range(n):
        scores = [np_score(unary[j, c], prev, cands[j, c], hh[j], P, Q) for c in range(k)]
        prev = int(cands[j, int(np.argmax(scores))])
        path.append(prev)
    assert prop.tokens.tolist() == path

    # brute force over all K^(B-1) paths: the greedy walk is the lexicographic max of step scores
    def step_scores(idx: tuple[int, ...]) -> tuple[float, ...]:
        return tuple(lattice[j, 0 if j == 0 else idx[j - 1], idx[j]] for j in range(n))

    best = max(itertools.product(range(k), repeat=n), key=step_scores)
    assert [int(cands[j, best[j]]) for j in range(n)] == path


def test_top_k_is_taken_on_transformed_logits_consistently() -> None:
    """mu/softcap are monotone: candidates from transformed logits equal those from raw logits."""
    raw = torch.randn(3, 50, generator=torch.Generator().manual_seed(0), dtype=F64) * 10
    transformed = 3.0 * torch.tanh(0.5 * raw / 3.0)
    ids_raw, _ = top_k_candidates(raw, 6)
    ids_t, unary = top_k_candidates(transformed, 6)
    assert torch.equal(ids_raw, ids_t)
    assert torch.equal(unary, transformed.gather(1, ids_t))


# --- 4. sampled walk: frequencies vs softmax(score / T) ----------------------------------------


def test_sampled_walk_frequencies_match_softmax() -> None:
    k, temperature, n_samples = 3, 0.7, 20000
    gen = torch.Generator().manual_seed(1234)
    lattice = torch.randn(2, k, k, generator=gen, dtype=F64)
    lattice[0] = lattice[0, 0]  # slot 1: every row is the anchor row
    candidates = torch.tensor([[10, 11, 12], [20, 21, 22]])

    def softmax(x: np.ndarray) -> np.ndarray:
        e = np.exp((x - x.max()) / temperature)
        return e / e.sum()

    L = lattice.numpy()
    joint = np.array([[softmax(L[0, 0])[a] * softmax(L[1, a])[b] for b in range(k)] for a in range(k)]).ravel()
    counts = np.zeros(k * k)
    for _ in range(n_samples):
        tokens, idx, q = sampled_walk(lattice, candidates, temperature, gen)
        counts[idx[0] * k + idx[1]] += 1
    assert_matches(counts, joint)
    # q is the distribution each slot was sampled from, conditional on the realised path
    np.testing.assert_allclose(q[0].numpy(), softmax(L[0, 0]), rtol=1e-12)
    np.testing.assert_allclose(q[1].numpy(), softmax(L[1, int(idx[0])]), rtol=1e-12)
    assert tokens.tolist() == [10 + int(idx[0]), 20 + int(idx[1])]
    # the test has power: ignoring the conditioning on the previous slot is rejected
    wrong = np.array([[softmax(L[0, 0])[a] * softmax(L[1, 0])[b] for b in range(k)] for a in range(k)]).ravel()
    assert chi2_stat(counts, wrong)[0] > 10 * chi2_critical(k * k - 1)


# --- 5. rejection sampling preserves the target distribution -----------------------------------


P_TARGET = np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
P_BONUS = np.array([0.40, 0.10, 0.10, 0.10, 0.10, 0.20])

REJECTION_CASES = {
    "full-concentrated": (np.array([0.90, 0.02, 0.02, 0.02, 0.02, 0.02]), None),
    "full-spread": (np.array([0.15, 0.20, 0.15, 0.20, 0.15, 0.15]), None),
    "candidates-concentrated": (np.array([0.95, 0.03, 0.02]), np.array([4, 0, 5])),
    "candidates-spread": (np.array([0.30, 0.40, 0.30]), np.array([1, 2, 3])),
}


@pytest.mark.parametrize("case", sorted(REJECTION_CASES))
def test_rejection_sampling_preserves_target(case: str) -> None:
    q, cands = REJECTION_CASES[case]
    n_trials = 12000
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(8)
    target = torch.tensor(np.stack([P_TARGET, P_BONUS]))
    q_t = torch.tensor(q)[None]
    c_t = None if cands is None else torch.tensor(cands)[None]
    counts = np.zeros(len(P_TARGET))
    accepted = 0
    for _ in range(n_trials):
        j = rng.choice(len(q), p=q)  # the drafter's draw, from an independent RNG
        y = int(j if cands is None else cands[j])
        n_acc, token = rejection_sample(torch.tensor([y]), target, q_t, c_t, gen)
        first = y if n_acc == 1 else token
        counts[first] += 1
        accepted += n_acc
    assert_matches(counts, P_TARGET)
    # the acceptance rate is sum_y min(p, q) (standard speculative sampling identity)
    q_full = np.zeros(len(P_TARGET))
    np.add.at(q_full, np.arange(len(q)) if cands is None else cands, q)
    expected_rate = np.minimum(P_TARGET, q_full).sum()
    assert abs(accepted / n_trials - expected_rate) < 4 * math.sqrt(expected_rate * (1 - expected_rate) / n_trials)


def test_rejection_sampling_bonus_after_full_acceptance() -> None:
    """With q == p every draft is accepted and the bonus comes from the last target row."""
    gen = torch.Generator().manual_seed(3)
    target = torch.tensor(np.stack([P_TARGET, P_BONUS]))
    counts = np.zeros(len(P_BONUS))
    rng = np.random.default_rng(4)
    for _ in range(8000):
        y = int(rng.choice(6, p=P_TARGET))
        n_acc, token = rejection_sample(torch.tensor([y]), target, torch.tensor(P_TARGET)[None], None, gen)
        assert n_acc == 1
        counts[token] += 1
    assert_matches(counts, P_BONUS)


def test_greedy_verify() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert greedy_verify(torch.tensor([1, 0]), logits) == (2, 2)
    assert greedy_verify(torch.tensor([1, 2]), logits) == (1, 0)
    assert greedy_verify(torch.tensor([0, 0]), logits) == (0, 1)


def test_propose_v1_and_dflash2_sampled_rows() -> None:
    cfg1 = tiny_config("dflash", num_hidden_layers=1)
    m1 = DFlashDrafter.from_config(cfg1, seed=0, dtype=F64)
    target = random_target(cfg1.vocab_size, cfg1.hidden_size)
    feats = np.random.default_rng(0).standard_normal((3, cfg1.num_taps * cfg1.hidden_size))
    hidden, logits = m1.forward_block(feats, [0, 1, 2], [4, 95, 95, 95], 3, target)
    greedy = m1.propose(hidden, logits, 4)
    assert greedy.tokens.tolist() == torch.argmax(logits[1:], -1).tolist() and greedy.q is None
    sampled = m1.propose(hidden, logits, 4, temperature=0.8, generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(sampled.q.numpy(), sampling_probs(logits[1:], 0.8).numpy())

    cfg2 = tiny_config("dflash2", num_hidden_layers=1)
    m2 = DFlashDrafter.from_config(cfg2, seed=0, dtype=F64)
    prop = m2.draft(feats, [0, 1, 2], 4, 3, target, temperature=0.8, generator=torch.Generator().manual_seed(1))
    assert prop.tokens.shape == (cfg2.block_size - 1,) and prop.q.shape == (cfg2.block_size - 1, 4)
    for j in range(cfg2.block_size - 1):
        assert int(prop.tokens[j]) == int(prop.candidates[j, prop.indices[j]])
    np.testing.assert_allclose(prop.q.sum(-1).numpy(), 1.0)


# --- 6. loading checkpoints and configs ----------------------------------------------------------


def test_reference_config_parses() -> None:
    cfg = DFlashConfig.from_hf(json.loads(REFERENCE_CONFIG.read_text()))
    assert cfg.is_dflash2 and cfg.architecture == "DFlash2DraftModel"
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 201818, (1, 13, 25, 37, 49))
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 256, 16)
    assert cfg.num_target_layers == 52 and cfg.is_causal is False and cfg.rope_theta == 500000.0
    assert cfg.conv_groups == 416 and cfg.head_dim == 128
    assert [cfg.layer_window(i) for i in range(5)] == [2048] * 5
    assert not any(cfg.layer_is_causal(i) for i in range(5))
    assert cfg.logit_scale == pytest.approx(1 / math.sqrt(26)) and cfg.softcap == 20.0 and cfg.embedding_scale == 1.0


def test_reference_header_names_are_the_model_parameters() -> None:
    cfg = DFlashConfig.from_hf(json.loads(REFERENCE_CONFIG.read_text()))
    header = json.loads(REFERENCE_HEADER.read_text())
    assert set(parameter_names(cfg)) == set(header)
    meta = DFlashDrafter.from_config(cfg, device="meta").state_dict()
    assert {k: list(v.shape) for k, v in meta.items()} == {k: v["shape"] for k, v in header.items()}


def test_v1_style_config_variants() -> None:
    hf = {
        "architectures": ["DFlashDraftModel"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 96,
        "rope_theta": 1234.0, "block_size": 8, "max_window_layers": 1, "use_sliding_window": True,
        "sliding_window": 16, "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 1]},
    }
    cfg = DFlashConfig.from_hf(hf)
    assert not cfg.is_dflash2 and cfg.block_size == 8 and cfg.rope_theta == 1234.0 and cfg.head_dim == 16
    assert cfg.layer_types == ("full_attention", "sliding_attention")  # derived like transformers' Qwen3
    assert [cfg.layer_is_causal(i) for i in range(2)] == [False, True]
    assert DFlashConfig.from_hf({**hf, "use_sliding_window": False}).layer_types == ("full_attention",) * 2
    hf2 = {**hf, "dflash_config": {**hf["dflash_config"], "block_size": 4}}
    assert DFlashConfig.from_hf(hf2).block_size == 4  # dflash_config wins over the top level
    with pytest.raises(ValueError, match="missing"):
        DFlashConfig.from_hf({**hf, "dflash_config": {**hf["dflash_config"], "conv_kernel_size": 2}})
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig.from_hf({**hf, "dflash_config": {"mask_token_id": 3}})
    with pytest.raises(ValueError, match="conv_group_size"):
        tiny_config(conv_group_size=7)


def test_from_pretrained_roundtrip(tmp_path) -> None:  # noqa: ANN001
    cfg = tiny_config(num_hidden_layers=2)
    written = write_checkpoint(tmp_path / "a", cfg, seed=5, dtype=torch.float32)
    assert "candidate_selector.predecessor_codebook" in written  # no ".weight", like the published files
    model = DFlashDrafter.from_pretrained(tmp_path / "a", dtype=F64)
    assert model.config == cfg
    for name, value in model.state_dict().items():
        assert torch.equal(value, written[name].to(F64)), name

    # "model." prefixes and ".weight" on the codebooks load to the same model
    renames = {k: "model." + k for k in written}
    renames["candidate_selector.successor_codebook"] = "model.candidate_selector.successor_codebook.weight"
    write_checkpoint(tmp_path / "b", cfg, seed=5, dtype=torch.float32, rename=renames)
    other = DFlashDrafter.from_pretrained(tmp_path / "b", dtype=F64)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))

    write_checkpoint(tmp_path / "c", cfg, dtype=torch.float32, drop=["layers.1.mlp_conv.base_kernel"])
    with pytest.raises(ValueError, match="layers.1.mlp_conv.base_kernel"):
        DFlashDrafter.from_pretrained(tmp_path / "c")


# --- 7. a real target: SmolLM2-135M embeddings -----------------------------------------------------


def test_target_weights_from_smollm2_gguf() -> None:
    import gguf

    from pydflash.fetch import registry as models

    path = models.path("smollm2-135m")
    target = TargetWeights.from_gguf(path, dtype=torch.float32)
    assert tuple(target.embed_tokens.shape) == (49152, 576)
    assert target.lm_head is target.embed_tokens or torch.equal(target.lm_head, target.embed_tokens)  # tied

    # decode one row by hand (18 blocks of f16 scale + 32 x int8); offsets are checked against
    # gguf.GGUFReader in test_convert.py
    info = read_gguf_header(path).tensors["token_embd.weight"]
    assert info.type == gguf.GGMLQuantizationType.Q8_0 and info.ne == (576, 49152)
    row, row_bytes = 1234, 576 // 32 * 34
    with open(path, "rb") as f:
        f.seek(info.offset + row * row_bytes)
        raw = f.read(row_bytes)
    expected = []
    for b in range(576 // 32):
        block = raw[b * 34:(b + 1) * 34]
        scale = np.frombuffer(block[:2], dtype=np.float16)[0].astype(np.float32)
        expected.extend(scale * np.frombuffer(block[2:], dtype=np.int8).astype(np.float32))
    np.testing.assert_array_equal(target.embed_tokens[row].numpy(), np.array(expected, dtype=np.float32))

    cfg = smollm2_drafter_config()
    drafter = DFlashDrafter.from_config(cfg, seed=0)
    feats = np.random.default_rng(0).standard_normal((5, cfg.num_taps * cfg.hidden_size)).astype(np.float32)
    prop = drafter.draft(feats, np.arange(5), 1, 5, target)
    assert prop.tokens.shape == (cfg.block_size - 1,)
    assert all(int(t) in prop.candidates[j].tolist() for j, t in enumerate(prop.tokens))
    assert torch.isfinite(prop.lattice).all()


def test_mixed_config_validation() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_config(mask_token_id=96)
    assert with_changes(tiny_config(), block_size=8).block_size == 8
