"""The user-facing roles: writer, reader, in-flight reader, tensor store."""
