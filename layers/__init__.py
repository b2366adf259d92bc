"""The transformer layer that models.py loops, and its parts."""
