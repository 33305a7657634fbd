import unittest

import csvline as m


class TestCsvline(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.split_csv('a,"b,c"'), ["a", "b,c"])

    def test_1(self):
        self.assertEqual(m.split_csv("a,b"), ["a", "b"])

    def test_2(self):
        self.assertEqual(m.split_csv('"x,y",z'), ["x,y", "z"])

    def test_3(self):
        self.assertEqual(m.split_csv("1,,2"), ["1", "", "2"])
