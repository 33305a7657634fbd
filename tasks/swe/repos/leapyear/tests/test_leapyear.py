import unittest

import leapyear as m


class TestLeapyear(unittest.TestCase):
    def test_0(self):
        self.assertTrue(m.is_leap(2024))
