"""The pi2 sidecar GGUF (docs/FORMAT.md): its declared format, reading and writing it, and its summary."""
