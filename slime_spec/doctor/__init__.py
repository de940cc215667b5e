"""`slime-spec doctor`: every check of a configuration before launch, and the code registry."""
