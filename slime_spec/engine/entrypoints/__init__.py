"""The embedded engine's additions to SGLang's HTTP server."""
