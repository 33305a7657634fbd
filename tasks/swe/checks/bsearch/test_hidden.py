import unittest

import bsearch as m


class TestBsearch(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.search([1, 3, 5, 7], 3), 1)

    def test_1(self):
        self.assertEqual(m.search([1, 3, 5, 7], 7), 3)

    def test_2(self):
        self.assertEqual(m.search([2], 2), 0)

    def test_3(self):
        self.assertEqual(m.search([1, 3, 5], 4), -1)

    def test_4(self):
        self.assertEqual(m.search([1, 2, 3, 4, 5], 1), 0)
