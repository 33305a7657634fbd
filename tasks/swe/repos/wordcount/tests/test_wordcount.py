import unittest

import wordcount as m


class TestWordcount(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.count_words("a b a"), {"a": 2, "b": 1})
