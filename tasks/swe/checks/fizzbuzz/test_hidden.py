import unittest

import fizzbuzz as m


class TestFizzbuzz(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.fizzbuzz(3), "Fizz")

    def test_1(self):
        self.assertEqual(m.fizzbuzz(15), "FizzBuzz")

    def test_2(self):
        self.assertEqual(m.fizzbuzz(1), "1")

    def test_3(self):
        self.assertEqual(m.fizzbuzz(10), "Buzz")

    def test_4(self):
        self.assertEqual(m.fizzbuzz(30), "FizzBuzz")

    def test_5(self):
        self.assertEqual(m.fizzbuzz(45), "FizzBuzz")
