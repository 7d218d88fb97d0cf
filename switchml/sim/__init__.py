"""The deterministic simulator: a network, racks, a TCP-like flow."""
