import unittest

import bsearch as m


class TestBsearch(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.search([1, 3, 5, 7], 3), 1)
