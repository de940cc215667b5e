"""What the scheduler process sends SGLang's DetokenizerManager, and when, as SGLang's scheduler sends it
(`scheduler_components/output_streamer.py`).

After every pass of the engine loop (`EngineLoop(after_pass=...)`, on the engine thread) one `BatchTokenIDOutput`
goes out with every request that finished in the pass and, for each `stream` request still running, the tokens it
produced since its last message: the first at once, then whenever `stream_interval` tokens are unsent (the
request's own `sampling_params.stream_interval`, else `--stream-interval`), held back while the decoded tail ends
in the start of one of its stop strings (they may yet be trimmed). A request without `stream` gets one message,
when it finishes; SGLang's TokenizerManager answers it from that alone.

One message per pass, not per request: each message costs a ZMQ hop, an unpickling and a batch decode in the
DetokenizerManager and a dispatch in the TokenizerManager, processes that share the machine's cores with the engine.
"""

from __future__ import annotations

from typing import Any, Callable

from slime_spec.engine.managers.io_struct import OutputChunk, ends_in_stop_prefix, token_id_output


class OutputStream:
    """The outputs of one scheduler process. `add_stream` runs on the receiving thread before the request is posted
    to the engine; everything else on the engine thread, so the state needs no lock."""

    def __init__(self, send: Callable[[Any], None], spec_enabled: bool, stream_interval: int = 1):
        self._send = send
        self._spec_enabled = spec_enabled
        self._stream_interval = max(1, int(stream_interval or 1))
        self._finished: list[OutputChunk] = []
        self._streams: dict[str, Any] = {}  # rid -> TokenizedGenerateReqInput of a `stream` request
        self._sent: dict[str, int] = {}     # rid -> output tokens its earlier messages carried

    def add_stream(self, req) -> None:
        if req.stream:
            self._streams[req.rid] = req

    def finished(self, req, out) -> None:
        """A request's final Output; sent at the end of the pass."""
        self._streams.pop(req.rid, None)
        self._finished.append(OutputChunk(req, out, self._sent.pop(req.rid, 0)))

    def forget(self, rid: str) -> None:
        """A request that ended with an error (answered to the TokenizerManager by the caller)."""
        self._streams.pop(rid, None)
        self._sent.pop(rid, None)

    def flush(self, loop) -> None:
        """Send what the pass produced (engine thread, `EngineLoop.after_pass`)."""
        chunks, self._finished = self._finished, []
        if self._streams:
            chunks += self._stream_chunks(loop)
        if chunks:
            self._send(token_id_output(chunks, self._spec_enabled))

    def _stream_chunks(self, loop) -> list[OutputChunk]:
        chunks = []
        for out in loop.progress(self._streams):
            req = self._streams[out.rid]
            sent = self._sent.get(out.rid, 0)
            unsent = len(out.output_ids) - sent
            interval = req.sampling_params.stream_interval or self._stream_interval
            if unsent <= 0 or (sent and unsent < interval):
                continue
            stops = req.sampling_params.stop_strs
            if stops:
                window = getattr(req.sampling_params, "stop_str_max_len", 0) + 1
                if ends_in_stop_prefix(loop.core.tokenizer.decode(out.output_ids[-window:]), stops):
                    continue
            chunks.append(OutputChunk(req, out, sent))
            self._sent[out.rid] = len(out.output_ids)
        return chunks
