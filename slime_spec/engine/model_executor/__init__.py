"""The embedded engine's model, its graphs and its sampling (SGLang's model_executor/)."""
