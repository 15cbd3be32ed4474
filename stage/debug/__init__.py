"""Operator commands that read the stage's topics: ``inspect`` (one group, end to end) and
``dead-letters`` (list, and re-produce after a fix, each at most once)."""
