"""On-disk records: the sidecar layout, the writer and the reader (format.md)."""
