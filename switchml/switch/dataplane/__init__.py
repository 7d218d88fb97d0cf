"""The switch's data plane: the sans-IO pipeline (the reference) and its C twin."""
