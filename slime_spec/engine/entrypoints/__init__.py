"""The embedded engine's HTTP entry point (SGLang's entrypoints/).

- http_server.py: SGLang's own app with our one extension (`slime_history` on `/generate`) and
  `/abort_weight_update`.
"""
