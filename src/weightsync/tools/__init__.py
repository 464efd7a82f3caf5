"""Tools over the core: torch glue for layouts, device placement, codecs, tiny models, checkpoint
comparison."""
