"""The embedded engine's scheduler side (SGLang's managers/).

- scheduler_process.py: the process SGLang's launcher spawns in place of its Scheduler; io_struct.py: SGLang's
  messages <-> our requests (pure); output_stream.py: what goes to SGLang's DetokenizerManager, and when.
- scheduler.py: the engine thread (admission, pause, retract, control requests).
- engine_core.py: `EngineCore`, continuous batching over a static KV cache; request.py: a request and its row;
  finish.py: SGLang's stop rules and stop trimming; overlap.py: the overlap schedule for plain decoding.
"""
