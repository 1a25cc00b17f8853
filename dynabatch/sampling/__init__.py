"""Batch planning: pure planning functions over lengths and the thin torch samplers over them."""
