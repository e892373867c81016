"""A second held-out set for the drafter lineage: 32 code prompts from installed packages no capture has used.

HumanEval 132-163 measures one prompt shape; this set checks that a chunk which adds HumanEval-shaped data
does not lose code in general. 4 prompts from each of 8 packages (pydflash.train.prompts' pysrc: shapes:
header + docstring, a cut function body, a class header), spread evenly. Writes other-code-prompts.jsonl.
"""
import json
import sys

from pydflash.train import prompts

PACKAGES = ("hypothesis", "libcst", "trio", "tqdm", "jsonschema", "sortedcontainers", "cfnlint", "gguf")
rows = []
for pkg in PACKAGES:
    rows += [{"id": p.id, "prompt": p.text} for p in prompts.load(f"pysrc:{pkg}", limit=4)]
out = sys.argv[1] if len(sys.argv) > 1 else "other-code-prompts.jsonl"
with open(out, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
print(out, len(rows))
