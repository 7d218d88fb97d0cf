import threading

import pytest

import switchml


def run_ranks(world, body, timeout=60.0):
    """Run body(rank) on one thread per rank; return results, re-raise the first error."""
    results = [None] * world
    errors = [None] * world

    def target(rank):
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # collected and re-raised below
            errors[rank] = exc

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank hung"
    for exc in errors:
        if exc is not None:
            raise exc
    return results


@pytest.fixture
def switch():
    with switchml.Switch(packet_elements=1024, slots=64, slots_per_job=16) as sw:
        yield sw
