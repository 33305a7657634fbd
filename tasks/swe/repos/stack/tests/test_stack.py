import unittest

import stack as m


class TestStack(unittest.TestCase):
    def test_0(self):
        s = m.Stack()
        s.push(1)
        self.assertEqual(s.pop(), 1)
