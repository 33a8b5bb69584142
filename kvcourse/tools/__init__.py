"""Maintenance tools for the book: executing notebooks, making student copies."""
