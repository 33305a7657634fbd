import unittest

import median as m


class TestMedian(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.median([1, 2, 3, 4]), 2.5)
