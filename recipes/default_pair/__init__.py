"""The stages of recipes/build_default_pair.py, one job per module."""
