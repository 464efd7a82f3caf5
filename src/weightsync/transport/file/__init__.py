"""The file transport: safetensors files per version, and the change file next to each."""
