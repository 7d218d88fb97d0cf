"""The local stage: a host's ranks combine their arrays in shared memory."""
