import unittest

import roman as m


class TestRoman(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.to_roman(4), "IV")

    def test_1(self):
        self.assertEqual(m.to_roman(3), "III")

    def test_2(self):
        self.assertEqual(m.to_roman(1994), "MCMXCIV")

    def test_3(self):
        self.assertEqual(m.to_roman(2024), "MMXXIV")

    def test_4(self):
        self.assertEqual(m.to_roman(49), "XLIX")
