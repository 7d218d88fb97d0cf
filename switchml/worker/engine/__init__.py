"""The worker's engine: the stream, the dense and the sparse call, loss recovery,
and their C twin (``_fastengine``)."""
