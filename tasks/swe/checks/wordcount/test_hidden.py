import unittest

import wordcount as m


class TestWordcount(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.count_words("a b a"), {"a": 2, "b": 1})

    def test_1(self):
        self.assertEqual(m.count_words("x"), {"x": 1})

    def test_2(self):
        self.assertEqual(m.count_words("The the THE"), {"the": 3})

    def test_3(self):
        self.assertEqual(m.count_words("go, go!\nstop."), {"go": 2, "stop": 1})
