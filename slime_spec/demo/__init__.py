"""`make demo`: the whole loop on the scratchpad task."""
