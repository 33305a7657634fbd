import unittest

import fizzbuzz as m


class TestFizzbuzz(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.fizzbuzz(3), "Fizz")

    def test_1(self):
        self.assertEqual(m.fizzbuzz(15), "FizzBuzz")
