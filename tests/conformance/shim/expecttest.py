"""A stand-in for the ``expecttest`` package, used only where it is not installed.

torch's test helpers (``torch.testing._internal.common_utils``) import it for one
base class and the ``ACCEPT`` flag; ``DistributedTest`` uses none of its inline
expectations.  ``make test`` installs the real package (the ``test`` extra); the
runner puts this directory on the path only when ``import expecttest`` fails.
"""

import unittest

ACCEPT = False


class TestCase(unittest.TestCase):
    longMessage = True

    def assertExpectedInline(self, actual, expect, skip=0):  # noqa: N802 (unittest style)
        self.assertEqual(expect, actual)

    def assertExpectedRaisesInline(self, exc_type, callable, expect, *args, **kwargs):  # noqa: N802
        with self.assertRaises(exc_type) as ctx:
            callable(*args, **kwargs)
        self.assertEqual(expect, str(ctx.exception))
