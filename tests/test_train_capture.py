"""Training data captured while the target generates (``Scheduler.set_capture``, ``capture=True``).

References: a direct decode of the same tokens on a fresh target (the prompt as one chunk, then one
token at a time, as the scheduler decodes them) with the taps on, for the features and the argmax
labels; ``Target.generate`` of each prompt alone for the continuations (greedy and sampled with
the same seed). With the default kernels every row's bits do not depend on what else is in the
batch or the cache, so the comparison is exact. Also: continuous batching (more prompts than
sequences in flight), the cache written from it, and the API's refusals.
"""

from __future__ import annotations

import numpy as np
import pytest

from pydflash import Target, errors
from pydflash.runtime.generation import SamplingOptions
from pydflash.runtime.scheduler import Scheduler
from pydflash.train.features import Continuation, capture_continuations
from pydflash.train.pipeline import capture
from pydflash.train.prompts import TrainPrompt

TAPS = [1, 10, 19, 28]  # HF layer ids: the hidden states entering target layers 2, 11, 20, 29
N_CTX = 256
PROMPTS = ["def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n", "The capital of France is",
           "import os\n\ndef list_files(path):\n"]


def _direct(path, tokens: list[int], n_prompt: int) -> tuple[np.ndarray, list[int]]:
    """Features [n, L, H] and argmax of rows 0..n-1, decoded as the scheduler decodes them."""
    with Target(path, n_ctx=2 * N_CTX, n_threads=int(__import__("os").environ.get("NT","2"))) as target:
        target.set_taps([t + 1 for t in TAPS])
        feats, labels = [], []
        chunks = [tokens[:n_prompt]] + [[t] for t in tokens[n_prompt:]]
        for chunk in chunks:
            target.decode(chunk, all_logits=True)
            feats.append(np.stack([target.tap_rows(k) for k in range(len(TAPS))], axis=1))
            labels.extend(int(np.argmax(target.logits(r))) for r in range(len(chunk)))
        return np.concatenate(feats), labels


@pytest.fixture(scope="module")
def captured(smollm2_path):
    with Target(smollm2_path, n_ctx=2 * N_CTX, n_threads=2, n_seq_max=2) as target:
        jobs = [Continuation(f"p{i}", target.tokenize(p), 0.0, 0) for i, p in enumerate(PROMPTS)]
        jobs.append(Continuation("p0-sampled", jobs[0].prompt, 0.9, 7))
        seqs = {s.id: s for s in capture_continuations(target, jobs, TAPS, max_tokens=10, n_parallel=2)}
    return jobs, seqs


def test_capture_equals_a_direct_decode_and_plain_generation(captured, smollm2_path):
    jobs, seqs = captured
    assert sorted(seqs) == sorted(j.id for j in jobs)  # 4 sequences through 2 slots
    with Target(smollm2_path, n_ctx=2 * N_CTX, n_threads=2) as target:
        plain = {j.id: target.generate(list(j.prompt), max_tokens=10, temperature=j.temperature, seed=j.seed,
                                       top_k=0, top_p=1.0, min_p=0.0).tokens for j in jobs}
    for job in jobs:
        seq = seqs[job.id]
        n_prompt = len(job.prompt)
        generated = plain[job.id]
        # one row per decoded token: the prompt and every generated token but the last
        assert seq.prompt_len == n_prompt
        assert seq.tokens.tolist() == list(job.prompt) + list(generated[:-1])
        assert seq.features.shape == (n_prompt + len(generated) - 1, len(TAPS), 576)
        direct, argmax = _direct(smollm2_path, seq.tokens.tolist(), n_prompt)
        np.testing.assert_array_equal(seq.features, direct)
        # labels: -1 on the prompt but its last row, then the target's argmax at every row
        assert seq.labels[: n_prompt - 1].tolist() == [-1] * (n_prompt - 1)
        assert seq.labels[n_prompt - 1:].tolist() == argmax[n_prompt - 1:]
        if job.temperature == 0:
            assert seq.labels[n_prompt - 1:].tolist() == list(generated)[: len(seq.tokens) - n_prompt + 1]
    # the sampled continuation left the greedy chain somewhere, and its labels stayed greedy
    s = seqs["p0-sampled"]
    assert s.tokens.tolist() != seqs["p0"].tokens.tolist()


def test_capture_refusals(smollm2_path):
    with Target(smollm2_path, n_ctx=N_CTX, n_threads=1) as target:
        sched = Scheduler(target, None, n_max=0)
        opts = SamplingOptions(max_tokens=2, temperature=0)
        with pytest.raises(errors.InvalidArgumentError, match="capture layers"):
            sched.add(target.tokenize("hi"), opts, capture=True)
        with pytest.raises(errors.InvalidArgumentError, match="tap layer"):
            sched.set_capture([0])
        with pytest.raises(errors.InvalidArgumentError, match="tap layer"):
            sched.set_capture([target.info.n_layer])
        sched.set_capture([2, 11])
        sid = sched.add(target.tokenize("hi"), opts, capture=True)
        with pytest.raises(errors.BusyError):
            sched.set_capture([3])
        result = sched.run([sid])[0]
        assert result.capture.features.shape[1:] == (2, 576)
        # a request without capture carries none
        assert sched.run([sched.add(target.tokenize("hi"), opts)])[0].capture is None
        sched.close()


def test_feature_cache_from_a_capture_resumes(tmp_path, smollm2_path):
    prompts = [TrainPrompt(f"q/{i}", text=t) for i, t in enumerate(PROMPTS)]
    cache = capture(str(smollm2_path), prompts, tmp_path / "cache", TAPS, max_new=6, threads=2, batch=2,
                    samples=1, shard_size=2, log=lambda m: None)
    ids = sorted(s.id for s in cache.sequences())
    assert ids == sorted([f"q/{i}" for i in range(3)] + [f"q/{i}#s1" for i in range(3)])
    n_shards = len(cache.meta["shards"])
    again = capture(str(smollm2_path), prompts, tmp_path / "cache", TAPS, max_new=6, threads=2, batch=2,
                    samples=1, log=lambda m: None)
    assert len(again.meta["shards"]) == n_shards  # everything was cached: nothing decoded again


def test_capture_skips_excluded_ids_as_if_cached(tmp_path, smollm2_path):
    """``--exclude-ids``: a fresh machine continuing a drafter leaves out what it was trained on."""
    import gzip

    from pydflash.train.pipeline import read_ids

    prompts = [TrainPrompt(f"q/{i}", text=t) for i, t in enumerate(PROMPTS)]
    ids_file = tmp_path / "trained-ids.txt.gz"
    with gzip.open(ids_file, "wt", encoding="utf-8") as f:
        f.write("q/1\n\nq/not-a-prompt\n")
    assert read_ids(ids_file) == {"q/1", "q/not-a-prompt"}
    cache = capture(str(smollm2_path), prompts, tmp_path / "cache", TAPS, max_new=4, threads=2, batch=2,
                    exclude=read_ids(ids_file), log=lambda m: None)
    assert sorted(s.id for s in cache.sequences()) == ["q/0", "q/2"]
    # nothing left to capture: the target is not even loaded (a path with the same name that does not exist)
    again = capture(str(tmp_path / "gone" / smollm2_path.name), prompts, tmp_path / "cache", TAPS, exclude={"q/1"},
                    log=lambda m: None)
    assert len(again.meta["shards"]) == len(cache.meta["shards"])


@pytest.mark.parametrize("content", [None, b"\x1f\x8b\x08\x00broken"])
def test_pydflash_train_refuses_an_unreadable_exclude_ids_file(content, tmp_path, capsys):
    from pydflash.train.pipeline import main

    ids_file = tmp_path / "ids.txt.gz"
    if content is not None:
        ids_file.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        main(["--target", "smollm2-135m", "--out", str(tmp_path / "run"), "--prompts", "stdlib", "--limit", "1",
              "--capture-only", "--exclude-ids", str(ids_file)])
    assert e.value.code == 2 and "--exclude-ids:" in capsys.readouterr().err.splitlines()[-1]
