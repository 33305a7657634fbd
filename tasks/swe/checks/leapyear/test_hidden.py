import unittest

import leapyear as m


class TestLeapyear(unittest.TestCase):
    def test_0(self):
        self.assertTrue(m.is_leap(2024))

    def test_1(self):
        self.assertFalse(m.is_leap(1900))

    def test_2(self):
        self.assertTrue(m.is_leap(2000))

    def test_3(self):
        self.assertFalse(m.is_leap(2023))

    def test_4(self):
        self.assertFalse(m.is_leap(2100))
