"""The switch's data plane as an XDP program, and its loader."""
