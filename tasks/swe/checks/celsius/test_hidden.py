import unittest

import celsius as m


class TestCelsius(unittest.TestCase):
    def test_0(self):
        self.assertAlmostEqual(m.c_to_f(100), 212)

    def test_1(self):
        self.assertAlmostEqual(m.c_to_f(0), 32)

    def test_2(self):
        self.assertAlmostEqual(m.f_to_c(212), 100)

    def test_3(self):
        self.assertAlmostEqual(m.f_to_c(32), 0)

    def test_4(self):
        self.assertAlmostEqual(m.c_to_f(-40), -40)
