import unittest

import celsius as m


class TestCelsius(unittest.TestCase):
    def test_0(self):
        self.assertAlmostEqual(m.c_to_f(100), 212)
