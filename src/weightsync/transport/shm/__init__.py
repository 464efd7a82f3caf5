"""The shared-memory transport: snapshot and zero-copy modes, segments, shared files."""
