"""The built-in configs (YAML, one folder per model family); this package only lets the wheel carry them."""
