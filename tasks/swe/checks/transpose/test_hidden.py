import unittest

import transpose as m


class TestTranspose(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.transpose([[1, 2], [3, 4]]), [[1, 3], [2, 4]])

    def test_1(self):
        self.assertEqual(m.transpose([[1, 2, 3]]), [[1], [2], [3]])

    def test_2(self):
        self.assertEqual(m.transpose([[1], [2]]), [[1, 2]])

    def test_3(self):
        self.assertEqual(m.transpose([[5]]), [[5]])
