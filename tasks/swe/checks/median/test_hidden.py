import unittest

import median as m


class TestMedian(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.median([1, 2, 3, 4]), 2.5)

    def test_1(self):
        self.assertEqual(m.median([3, 1, 2]), 2)

    def test_2(self):
        self.assertEqual(m.median([4, 1]), 2.5)

    def test_3(self):
        v = [3, 1, 2]
        m.median(v)
        self.assertEqual(v, [3, 1, 2])
