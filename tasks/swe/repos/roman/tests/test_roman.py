import unittest

import roman as m


class TestRoman(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.to_roman(4), "IV")
