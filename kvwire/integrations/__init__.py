"""Adapters that plug kvwire into serving engines (each imports its engine lazily).

- :mod:`kvwire.integrations.vllm`: a vLLM ``KVConnectorBase_V1`` (``pip install kvwire[vllm]``).
- :mod:`kvwire.integrations.prefix`: a prompt's prefix blocks named with registry versions
  (engine-independent; used by the connectors when given a registry).
"""
