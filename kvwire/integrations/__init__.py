"""Adapters that plug kvwire into serving engines (each imports its engine lazily).

- :mod:`kvwire.integrations.vllm`: a vLLM ``KVConnectorBase_V1`` (``pip install kvwire[vllm]``).
"""
