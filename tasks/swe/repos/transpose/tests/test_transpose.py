import unittest

import transpose as m


class TestTranspose(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.transpose([[1, 2], [3, 4]]), [[1, 3], [2, 4]])
