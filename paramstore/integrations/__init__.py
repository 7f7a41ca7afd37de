"""Adapters for the frameworks users run: verl, vLLM, SGLang (one module each).

Nothing here is imported by ``import paramstore``; each module imports its framework when it is
itself imported, so use the one for the framework you run:

- :mod:`paramstore.integrations.verl`: a verl checkpoint-engine backend named ``"paramstore"``.
- :mod:`paramstore.integrations.vllm`: a vLLM weight-transfer backend named ``"paramstore"``
  (registered in every vLLM process through the ``vllm.general_plugins`` entry point).
- :mod:`paramstore.integrations.sglang`: a custom weight loader for SGLang.
"""
