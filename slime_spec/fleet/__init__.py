"""The fleet: everything about owning and talking to engine servers (SGLang or the embedded engine).

- process.py: one server process: start, wait while it lives, stop with its children.
- client.py: one HTTP client, sync and async: API keys per route, idle timeouts, one `EngineError`.
- actor.py: `Engine` / `EngineActor`: one server process and its control routes, as a Ray actor.
- fleet.py: `EngineFleet`: placement, least-loaded routing, restart, and the fence that keeps a restarted
  engine out of the rollout until the trainer has re-synced it.
"""
