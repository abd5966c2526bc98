"""Integrations of shardmax into serving engines.

* :mod:`shardmax.integrations.vllm` - vLLM general plug-in (entry point
  ``vllm.general_plugins: shardmax``), active with ``SHARDMAX_VLLM=1``. Importable without vLLM.
"""
