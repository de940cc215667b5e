"""The embedded engine's scheduler process, scheduler thread and batching core (SGLang's managers/)."""
