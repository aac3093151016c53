"""Infrastructure every layer may import: user errors, JSON schemas, paths in (ROOT) and out, progress."""
