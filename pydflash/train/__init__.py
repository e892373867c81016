"""``pydflash train``: DFlash2 drafters trained from a GGUF target alone (torch extra).

Pipeline: prompts -> the target's own greedy continuations (native engine) -> tap features and
labels captured natively and cached on disk -> training of the reference drafter
(``pydflash.reference``) with random anchors, position-decayed CE and the selector loss ->
export to the HF layout -> ``pydflash convert`` -> GGUF (+ quantized variants).
"""
