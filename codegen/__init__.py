"""Code generator: renders schema/canary.toml into the Python package and the C++ header."""
