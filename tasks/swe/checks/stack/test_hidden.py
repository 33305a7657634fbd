import unittest

import stack as m


class TestStack(unittest.TestCase):
    def test_0(self):
        s = m.Stack()
        s.push(1)
        self.assertEqual(s.pop(), 1)

    def test_1(self):
        s = m.Stack()
        with self.assertRaises(IndexError):
            s.pop()

    def test_2(self):
        s = m.Stack()
        s.push(1)
        s.push(2)
        self.assertEqual(s.peek(), 2)
        self.assertEqual(s.pop(), 2)

    def test_3(self):
        s = m.Stack()
        s.push(5)
        self.assertEqual(s.pop(), 5)
