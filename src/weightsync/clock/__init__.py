"""The clock of every wait: one absolute deadline per operation (core: the standard library only)."""
