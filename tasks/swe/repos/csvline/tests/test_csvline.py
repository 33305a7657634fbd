import unittest

import csvline as m


class TestCsvline(unittest.TestCase):
    def test_0(self):
        self.assertEqual(m.split_csv('a,"b,c"'), ["a", "b,c"])
