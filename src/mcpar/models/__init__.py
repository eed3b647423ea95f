"""Models: one package per family, each a registry entry of ``MODEL_FAMILIES``
(``mcpar.registry.model_family``, keyed by ``model.kind``).

- ``gpt/``: dense GPT (``gpt``); ``moe/``: GPT with routed experts (``moe``); ``llama/``: Llama
  and its Mixtral-style MoE form (``llama``, ``llama_moe``). Each holds ``model.py`` (the
  module, readable in one file), ``plans.py`` (its pipeline pieces, tensor- and expert-parallel
  plans), ``hf.py`` where it has a Hugging Face counterpart, and ``family.py`` (its exact
  counts, its ``shape()`` for the simulator, its rules and the entry itself).
- ``spec.py``: the runtime half of an entry's contract (``ModelSpec``: build, pieces, plans,
  counts, Hugging Face names) and ``get_model_spec(kind)``; ``plan.py``: the vocabulary of the
  plans; ``hf.py``: the contract of a Hugging Face name map.

The built-in entries are registered on the first registry lookup
(``mcpar.controllers.registered``); a plug-in registers its own (docs/extending.md).
"""
