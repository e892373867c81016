"""Average the weights of portable checkpoints of one lineage (a "model soup" along the training path).

All inputs must share the drafter config and the draft vocabulary; the output is a portable checkpoint
(the last input's step, history and vocabulary) that `pydflash train --export-only --resume-from OUT` exports.

    python soup.py OUT.pt h10.pt h11.pt h12.pt h14.pt
"""

from __future__ import annotations

import sys

import torch


def main(out: str, inputs: list[str]) -> None:
    cks = [torch.load(p, map_location="cpu", weights_only=False) for p in inputs]
    first = cks[0]
    for path, ck in zip(inputs, cks):
        if ck.get("format") != "pydflash-train-portable-1":
            raise SystemExit(f"{path}: not a portable training checkpoint")
        if ck["config"] != first["config"] or not torch.equal(ck["draft_vocab"], first["draft_vocab"]):
            raise SystemExit(f"{path}: another drafter config or draft vocabulary than {inputs[0]}")
    soup = dict(cks[-1])
    # averaged in float32, stored in the inputs' dtype (bf16)
    soup["model"] = {k: (sum(ck["model"][k].float() for ck in cks) / len(cks)).to(first["model"][k].dtype)
                     for k in first["model"]}
    soup["soup"] = list(inputs)
    torch.save(soup, out)
    print(f"{out}: the mean of {len(cks)} checkpoints, step {soup['step']}")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])
